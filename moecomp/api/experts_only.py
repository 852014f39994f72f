"""The experts-only rewrite of ``moecomp.optimize``: a block that cannot be rewritten whole but holds a standard
``@use_experts_implementation`` experts module gets just that module switched to ``moe_experts`` (routing stays
HF's), when a probe shows them equal."""

from __future__ import annotations

from torch import nn

from ..core.reject import RejectCode
from ..core.status import BlockStatus
from .report import BlockReport, expert_style
from ..core.spec import MoESpec
from ..bind import bind as _bind
from ..recognise import fallback as _fb
from ..core.names import TOPK_NAMES, read_attr
from ..core.parts import BlockParts
from ..core.derived import get_path


def try_experts_only(name: str, block: nn.Module, parts: BlockParts | None, rep: BlockReport, bind_it: bool):
    """Switch just the block's experts module to ``moe_experts`` (routing stays HF's), when proven equal."""
    from ..hf import experts_interface as _ei
    from ..recognise.structure import experts_child

    path = parts.experts if parts is not None else experts_child(block)
    if not path:
        return
    experts = get_path(block, path)
    if not _ei.is_hf_experts(experts):
        rep.notes.append("experts only: not a @use_experts_implementation experts module")
        return
    full = f"{name}.{path}" if name else path
    if getattr(experts, "_moecomp_experts", None) is not None and bind_it:
        changed = _bind.experts_stale(experts)
        if changed:  # checked against other attributes: check and bind again
            _bind.unbind_experts(experts)
            rep.notes.append(f"experts only: re-detected ({changed} since the last optimize)")
    if getattr(experts, "_moecomp_experts", None) is not None:
        st = experts._moecomp_experts
        if bind_it:
            _bind.claim(st, [experts])  # an experts implementation named since: moecomp's op again
        _fill_experts(rep, st.spec, full)
        rep.status, rep.method = BlockStatus.EXPERTS_ONLY, "experts interface"
        return
    if any(p.device.type == "meta" for p in experts.parameters()):  # nothing can run: say what would be tried
        rep.reason += (f"; {full!r} is a standard experts module: with weights loaded, optimize can run it on "
                       f"moecomp's experts path (experts only; not checkable on the meta device)")
        return
    k = _experts_top_k(block, parts, experts)
    try:
        spec, err = _checked_spec(experts, k)
    except _ei.Unsupported as e:
        rep.notes.append(f"experts only not possible either: {e}")
        rep.reason += f"; experts only not possible either: {e}"
        rep.codes.append(e.code)
        return
    except Exception as e:  # the module's forward failed on the probe
        rep.notes.append(f"experts only: check failed: {type(e).__name__}: {str(e)[:120]}")
        rep.codes.append(RejectCode.CHECK_ERROR)
        return
    _fill_experts(rep, spec, full)
    rep.max_rel_err = err
    rep.notes.append(f"experts module {path!r} checked against moe_experts: max rel. err {err:.1e}")
    rep.method = "experts interface"
    if bind_it:
        _bind.bind_experts(experts, full, spec, rep.reason)
        _ei.cache_spec(experts, k, spec)
        rep.status = BlockStatus.EXPERTS_ONLY
    else:
        rep.status = BlockStatus.EXPERTS_ONLY_SUPPORTED


def _experts_top_k(block: nn.Module, parts: BlockParts | None, experts: nn.Module) -> int:
    """top-k read from the block's (or the experts module's config's) attributes; 2 when none reads as one."""
    srcs = _fb.attr_sources(block, parts) if parts is not None else [block, experts]
    cfg = getattr(experts, "config", None)
    top_k = read_attr(srcs + ([cfg] if cfg is not None and not isinstance(cfg, nn.Module) else []),
                          TOPK_NAMES, (int,))
    return int(top_k) if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else 2


def _checked_spec(experts: nn.Module, k: int) -> tuple[MoESpec, float]:
    """The experts module's spec and ``moe_experts``' error against its forward on a probe; ``Unsupported`` when
    the spec cannot describe it or the error is over the tolerance."""
    from ..hf import experts_interface as _ei

    spec = _ei.experts_spec(experts, k, verify=False)
    err, tol = _ei.verify_experts(experts, spec)
    if not err <= tol:
        raise _ei.Unsupported(f"{type(experts).__name__}'s forward differs from moe_experts on a probe: max rel. "
                              f"err {err:.2e} > {tol:g}", RejectCode.VERIFICATION_FAILED)
    return spec, err


def _fill_experts(rep: BlockReport, spec: MoESpec, path: str) -> None:
    rep.spec = spec
    rep.num_experts, rep.hidden, rep.intermediate = spec.num_experts, spec.hidden_size, spec.intermediate_size
    rep.router = "HF (unchanged)"
    rep.experts = expert_style(spec) + f" ({path})"
