"""The pair rewrite of ``moecomp.optimize``: a candidate block that cannot be rewritten whole because it is a parent
of more than the MoE (a decoder layer: attention, norms, a dense MLP beside its router and experts) gets its router
and experts siblings rewritten together as one ``moe_forward`` call (``bind/bind_pair.py``); the parent's forward
stays. Recognised by ``recognise/pair_reader.py`` (structure, then one observed call), verified by ``verify/pair_verify.py`` on
the parent's own output, bound only then; otherwise left alone (the experts-only rewrite may still apply) with the
reason.

The parent's call arguments (position embeddings, masks, ...) cannot be made up: they are recorded from one forward
of the model on its ``dummy_inputs`` (transformers' models have them), run once per ``optimize`` when the first pair
needs them, in eval mode under ``no_grad``; a parent that no recorded call reaches is called with its hidden states
alone (a hand-written layer whose forward needs nothing else).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..core import policy
from ..bind import bind_pair as _bp
from ..recognise import pair_reader as _pr
from ..core.parts import BlockParts
from ..core.derived import get_path
from ..core.match import PairMatch
from ..verify.pair_verify import fresh_call, verify_pair
from ..core.reject import Refused, RejectCode
from ..core.status import BlockStatus
from .report import BlockReport, fill_from_spec as _fill_from_spec

_RX_NONE = ("router_x",)


class ParentCalls:
    """One recorded call per candidate parent, from one forward of the model on its dummy inputs (lazily)."""

    def __init__(self, model: nn.Module, parents: list[nn.Module]):
        self.model, self.parents, self.calls, self.done, self.error = model, parents, {}, False, ""

    def of(self, parent: nn.Module, H: int, device, dtype) -> tuple | None:
        if not self.done:
            self.done = True
            self._record()
        got = self.calls.get(id(parent))
        if got is not None:
            return got
        x = policy.probe_input(H, device, dtype, shape=(2, 8))
        return (x,), {}

    def _record(self) -> None:
        inputs = getattr(self.model, "dummy_inputs", None) if self.model is not None else None
        if not isinstance(inputs, dict) or not inputs:
            return
        try:
            params = inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        kwargs = dict(inputs)
        dev = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if "use_cache" in params:
            kwargs["use_cache"] = False
        targets = {id(p) for p in self.parents}

        def pre(mod, args, kw):  # copied as it is now: the forward goes on writing the caches it holds
            if id(mod) in targets and id(mod) not in self.calls:
                self.calls[id(mod)] = fresh_call((tuple(args), dict(kw)), self.model)

        hs = [p.register_forward_pre_hook(pre, with_kwargs=True) for p in self.parents]
        modes = {m: m.training for m in self.model.modules()}
        try:
            self.model.eval()
            with torch.no_grad():
                self.model(**kwargs)
        except Exception as e:  # the model cannot run its dummy inputs: parents get called with x alone
            self.error = f"{type(e).__name__}: {str(e)[:120]}"
        finally:
            for h in hs:
                h.remove()
            for m, t in modes.items():
                m.train(t)


def read_pair(parent: nn.Module, parts: BlockParts, call: tuple) -> PairMatch:
    """The pair's match (``recognise/pair_reader.py``); raises ``Refused``."""
    rpath, xpath = parts.router_module, parts.experts
    if not rpath or not xpath or rpath == xpath or rpath.startswith(xpath + ".") or xpath.startswith(rpath + "."):
        raise _pr.PairError("router and experts are not two separate modules under the block",
                            RejectCode.UNSUPPORTED_STRUCTURE)
    router, experts = get_path(parent, rpath), get_path(parent, xpath)
    E, H = parts.num_experts, parts.hidden_size
    obs = _pr.observe(parent, fresh_call(call, parent), router, experts)
    lay, k = _pr.layout_of(obs, E, H)
    W = get_path(parent, parts.router_weight)
    dtype, device = obs.x_args[lay.x_h].dtype, W.device
    efields, ebinds, eerr = _pr.fit_experts(experts, lay, parts, xpath, E, H, k, dtype, device)
    spec, rbinds, perturb, notes = _pr.fit_router(router, rpath, lay, parts, efields, E, H, k, dtype, device)
    bindings = {a: None for a in _bp.OP_ARGS}
    bindings.update(ebinds)
    bindings.update(rbinds)
    notes.append(f"pair experts: {efields['activation']} (rel. err {eerr:.1e} on probes of the experts module)")
    return PairMatch(spec=spec, bindings=bindings, router=rpath, experts=xpath, layout=lay, perturb=perturb,
                         notes=notes)


def try_pair(name: str, block: nn.Module, parts: BlockParts | None, rep: BlockReport, bind_it: bool,
             calls: ParentCalls | None) -> None:
    """Rewrite the block's router / experts pair when read and verified (module docstring); notes why not."""
    if parts is None or calls is None or not parts.router_module or any(
            p.device.type == "meta" for p in block.parameters()):
        return
    w = next((p for p in get_path(block, parts.experts).parameters()), None) if parts.experts else None
    if w is None:
        return
    call = calls.of(block, parts.hidden_size, w.device, w.dtype)
    try:
        m = read_pair(block, parts, call)
        err = verify_pair(block, m, call, name)
    except Refused as e:
        rep.notes.append(f"pair rewrite: {e.reason}")
        rep.codes.append(e.code)
        return
    except Exception as e:  # the parent's forward failed on the recorded call / probe, or the op did
        rep.notes.append(f"pair rewrite: check failed: {type(e).__name__}: {str(e)[:160]}")
        rep.codes.append(RejectCode.CHECK_ERROR)
        return
    rep.notes += m.notes + [f"pair {m.router!r} + {m.experts!r} verified on the parent's output: max rel. err "
                            f"{err:.1e}"]
    rep.reason, rep.method, rep.max_rel_err = "", "pair", err
    if bind_it:
        _bp.bind_pair(block, name, m.spec, m.bindings, m.router, m.experts, m.layout)
        rep.status = BlockStatus.REWRITTEN
    else:
        rep.status = BlockStatus.SUPPORTED
    _fill_from_spec(rep, m.spec, block, m.bindings, [])


def report_bound(block: nn.Module, rep: BlockReport, bind_it: bool) -> bool:
    """A parent whose pair an earlier ``optimize`` bound: reported as "already"; False for anything else. One whose
    router / experts attributes changed since is unbound (``optimize``) to be read again."""
    from ..core.snapshot import snapshot_changed

    st = block.__dict__.get("_moecomp")
    if not isinstance(st, _bp.PairState):
        return False
    if snapshot_changed(st.snapshot) or snapshot_changed(st.experts_snapshot):
        if bind_it:
            _bp.unbind_pair(block)
            rep.notes.append("re-detected: the pair's attributes changed since the last optimize")
            return False
        rep.notes.append("stale: the pair's attributes changed since optimize; its original forwards run")
    rep.status, rep.method, rep.reason = BlockStatus.ALREADY, st.method, ""
    _fill_from_spec(rep, st.spec, block, st.bindings, [])
    return True
