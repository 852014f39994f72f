"""Activations measured, not read: call a block's own activation code on probe inputs and name what it computes.

Used by the attribute reader (:mod:`moecomp.recognise.fallback`: which activation the experts / shared expert / a
ModuleList expert compute), by the experts interface (:mod:`moecomp.hf.experts_interface`: the same for a
transformers experts module), and by the verify stage (:func:`activation_mismatch`: a spec's activations against
the block's modules on inputs wide enough to reach the clamps of clamped SwiGLU variants, which random hidden
states rarely do). Probe inputs and tolerances: :mod:`moecomp.core.policy`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core import policy
from ..oracle import reference
from ..core import quant as q8
from ..core.spec import MoESpec
from ..formats import fp8
from . import softcap as softcap_probe
from ..core import names
from ..core.names import read_attr
from ..core.parts import BlockParts, MLPParts
from ..core.derived import get_path
from ..core.reject import raise_if_oom

_PROBE = policy.activation_probe_input()


_ELEMENTWISE = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


def _act_ref(name: str, t: torch.Tensor) -> torch.Tensor:
    return reference.activation(t, name)


def probe_activation(fn) -> str | None:
    """Which elementwise activation ``fn`` computes (checked on [-12, 12]), or None."""
    if fn is None:
        return None
    try:
        y = fn(_PROBE.clone())
    except Exception as e:
        raise_if_oom(e)
        return None
    if not isinstance(y, torch.Tensor) or y.shape != _PROBE.shape:
        return None
    for name in _ELEMENTWISE:
        ref = _act_ref(name, _PROBE)
        if torch.allclose(y.float(), ref, rtol=policy.ACT_MATCH_RTOL,
                          atol=policy.ACT_MATCH_ATOL_REL * max(1.0, float(ref.abs().max()))):
            return name
    return None


def _gate_ref(h: torch.Tensor, activation: str, gate_up: str, alpha: float, limit: float,
              clamp: bool = False, gate_softcap: float = 0.0, up_softcap: float = 0.0,
              clamp_after: bool = False) -> torch.Tensor:
    I = h.shape[-1] // 2
    if gate_up == "concat":
        gate, up = h[..., :I], h[..., I:]
    else:
        gate, up = h[..., 0::2], h[..., 1::2]
    return reference.gated_activation(gate, up, activation, alpha, limit, clamp, gate_softcap, up_softcap,
                                      clamp_after)


class GateReading(NamedTuple):
    """What a gate function computes, as spec fields (``probe_gate``)."""
    activation: str
    gate_up: str
    alpha: float
    limit: float
    clamp: bool  # activation_clamp: the gate clamped before its activation
    gate_softcap: float = 0.0
    up_softcap: float = 0.0
    clamp_after: bool = False  # activation_clamp_after: the activation's output clamped


class MlpReading(NamedTuple):
    """What a dense MLP module computes, as spec fields (``probe_mlp``)."""
    activation: str
    clamp: bool
    alpha: float
    limit: float
    clamp_after: bool = False


# the clamp forms a gated activation is tried with once a limit is read: (activation_clamp, activation_clamp_after)
_CLAMPED = ((True, False), (False, True))


def clamp_limits(objs) -> tuple[float | None, float | None]:
    """(alpha, limit) of a clamped / gpt-oss SwiGLU, read from the given modules and their configs."""
    srcs = []
    for o in objs:
        if o is None:
            continue
        srcs.append(o)
        cfg = getattr(o, "config", None)
        if cfg is not None and not isinstance(cfg, nn.Module):
            srcs.append(cfg)
    alpha = read_attr(srcs, names.ALPHA_NAMES, (int, float))
    limit = read_attr(srcs, names.LIMIT_NAMES, (int, float))
    alpha = None if alpha is None or isinstance(alpha, bool) else float(alpha)
    limit = None if limit is None or isinstance(limit, bool) or not limit > 0 else float(limit)
    return alpha, limit


def probe_gate(experts: nn.Module, concat_hint: bool | None) -> GateReading | None:
    """What ``experts._apply_gate`` computes (a ``GateReading``), or None.

    Checked on gate / up values spread over about +-20, so that clamps at 7-10 are reached: plain act(gate) * up,
    the clamped SwiGLUs (``clamp``: gate <= limit before the activation; ``clamp_after``: the activation's output
    <= limit; |up| <= limit with either; limit from ``limit`` / ``swiglu_limit``) and gpt-oss's ``swiglu_oai``
    (alpha, limit) are told apart. Failing those, a softcapped silu: its caps fitted from the function's values
    (``softcap_probe``), then checked on the same wide probe.
    """
    fn = getattr(experts, "_apply_gate", None)
    if fn is None:
        return None
    h = policy.gate_probe_input()  # wide enough to hit clamps at 7-10
    try:
        y = fn(h.clone())
    except Exception as e:
        raise_if_oom(e)
        return None
    if not isinstance(y, torch.Tensor) or y.shape != (h.shape[0], h.shape[1] // 2):
        return None
    alpha, limit = clamp_limits([experts])
    layouts = ["concat", "interleaved"] if concat_hint in (None, True) else ["interleaved", "concat"]
    cands = [(a, False, False) for a in _ELEMENTWISE]
    if limit is not None:
        cands += [(a, *c) for c in _CLAMPED for a in _ELEMENTWISE]
        if alpha is not None:
            cands.insert(0, ("swiglu_oai", False, False))
    a0, l0 = float(alpha if alpha is not None else 1.702), float(limit if limit is not None else 7.0)
    for lay in layouts:
        for act, clamp, after in cands:
            ref = _gate_ref(h, act, lay, a0, l0, clamp, clamp_after=after)
            if torch.allclose(y.float(), ref, rtol=policy.ACT_MATCH_RTOL, atol=policy.ACT_MATCH_ATOL):
                return GateReading(act, lay, *_canonical(act, clamp or after, a0, l0), clamp, clamp_after=after)
    caps = softcap_probe.fit_softcaps(fn)
    if caps is None or not any(caps):
        return None
    for lay in layouts:
        ref = _gate_ref(h, "silu", lay, 1.702, 7.0, False, *caps)
        if torch.allclose(y.float(), ref, rtol=policy.ACT_MATCH_RTOL, atol=policy.ACT_MATCH_ATOL):
            return GateReading("silu", lay, 1.702, 7.0, False, *caps)
    return None


def _canonical(act: str, clamp: bool, alpha: float, limit: float) -> tuple[float, float]:
    """(alpha, limit) as the spec stores them: the defaults unless the activation uses them (``clamp``: either
    clamp)."""
    return (alpha if act == "swiglu_oai" else 1.702), (limit if (clamp or act == "swiglu_oai") else 7.0)


# gated forms the spec lacks, near the ones it has, named for the report: (what, act(g) * u from (act, g, u, L))
_UNKNOWN_GATES = (
    ("the activation's output clamped, min({act}(gate), {L}), but up not clamped (activation_clamp_after clamps up "
     "to +-{L} too)", lambda a, g, u, L: _act_ref(a, g).clamp(max=L) * u),
    ("the gate clamped before its activation, {act}(min(gate, {L})), but up not clamped (activation_clamp clamps up "
     "to +-{L} too)", lambda a, g, u, L: _act_ref(a, g.clamp(max=L)) * u),
    ("only up clamped, {act}(gate) * clamp(up, +-{L}) (the spec's clamps bound the gate side too)",
     lambda a, g, u, L: _act_ref(a, g) * u.clamp(-L, L)),
)


def describe_unknown_gate(experts: nn.Module) -> str:
    """Name a gate the spec lacks, when it is a known near variant of one it has (for the report)."""
    limit = read_attr([experts, getattr(experts, "config", None)], names.LIMIT_NAMES, (int, float))
    if limit is None or isinstance(limit, bool) or not limit > 0:
        return ""
    h = policy.gate_probe_input()
    half = h.shape[1] // 2
    try:
        y = experts._apply_gate(h.clone())
    except Exception as e:
        raise_if_oom(e)
        return ""
    if not isinstance(y, torch.Tensor) or y.shape != (h.shape[0], half):
        return ""
    for lay in ("concat", "interleaved"):
        gate, up = (h[:, :half], h[:, half:]) if lay == "concat" else (h[:, 0::2], h[:, 1::2])
        for act in ("silu", "gelu"):
            for what, fn in _UNKNOWN_GATES:
                if torch.allclose(y.float(), fn(act, gate, up, float(limit)), rtol=policy.ACT_MATCH_RTOL,
                                  atol=policy.ACT_MATCH_ATOL):
                    return what.format(act=act, L=f"{limit:g}") + " (no MoESpec field for it)"
    return ""


def _quantized(block: nn.Module, p: str):
    """(fp8 weight, its scale, QuantSpec) when the weight at ``p`` is an FP8 linear's (``formats/fp8.py``), else None."""
    t = get_path(block, p)
    if not fp8.is_fp8(t) or "." not in p:
        return None
    mod = get_path(block, p.rsplit(".", 1)[0])
    lq = fp8.linear_fp8(mod)
    return None if lq is None else (t.detach(), getattr(mod, lq.scale).detach(), lq.quant)


def _weight(block: nn.Module, p: str) -> torch.Tensor:
    """The fp32 weight at ``p`` (dequantized when it is an FP8 linear's)."""
    qw = _quantized(block, p)
    return get_path(block, p).detach().float() if qw is None else q8.dequantize(*qw)


def _mlp_quantized(block: nn.Module, mp: MLPParts) -> bool:
    return _quantized(block, mp.down) is not None


def _mlp_ref(block: nn.Module, mp: MLPParts, x: torch.Tensor, act: str, clamp: bool, alpha: float,
             limit: float, caps: tuple[float, float] = (0.0, 0.0), clamp_after: bool = False) -> torch.Tensor:
    def lin(h, p, bp):
        qw = _quantized(block, p)
        b = None if bp is None else get_path(block, bp).detach().float()
        if qw is None:
            return F.linear(h, get_path(block, p).detach().float(), b)
        y = reference.quantized_linear(h, *qw)  # x quantized as the module does (FP8Linear)
        return y if b is None else y + b

    if mp.gated:
        if mp.concat:
            gate, up = lin(x, mp.gate, mp.gate_bias).chunk(2, dim=-1)
        else:
            gate, up = lin(x, mp.gate, mp.gate_bias), lin(x, mp.up, mp.up_bias)
        h = reference.gated_activation(gate, up, act, alpha, limit, clamp, *caps, clamp_after)
    else:
        h = reference.activation(lin(x, mp.up, mp.up_bias), act)
    return lin(h, mp.down, mp.down_bias)


def _mlp_probe_input(block: nn.Module, mp: MLPParts):
    """A [MLP_PROBE_TOKENS, H] input (the MLP's dtype; fp32 for FP8 linears) whose first-layer outputs spread over
    about +-25 (clamps at 7-10 hit); see :mod:`moecomp.core.policy`."""
    p = mp.gate if mp.gated else mp.up
    W = get_path(block, p).detach()
    g = torch.Generator().manual_seed(policy.MLP_PROBE_SEED)
    x = torch.randn(policy.MLP_PROBE_TOKENS, W.shape[1], generator=g)
    pre = x @ _weight(block, p).cpu().T
    x = x * (policy.CLAMP_REACH_STD / float(pre.std().clamp_min(1e-12)))
    return x.to(device=W.device, dtype=torch.float32 if fp8.is_fp8(W) else W.dtype)


def probe_mlp(block: nn.Module, mp: MLPParts, first: str | None = None) -> MlpReading | None:
    """What the dense MLP module at ``mp`` computes (an ``MlpReading``), measured by calling it.

    Candidates: every elementwise activation the spec knows, the same with either clamped-SwiGLU form (gated, limit
    read from the module: the gate clamped before the activation, or the activation's output clamped after it), and
    gpt-oss's ``swiglu_oai`` (gated, alpha / limit read from the module); the closest one within the tolerance is
    taken (``first``, the activation its ``act_fn`` probes as, on a tie). None when nothing matches or the module
    cannot run.
    """
    mod = get_path(block, mp.path)
    if any(p.device.type == "meta" for p in mod.parameters()):
        return None
    x = _mlp_probe_input(block, mp)
    try:
        with torch.no_grad():
            y = mod(x)
    except Exception as e:
        raise_if_oom(e)
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    y = y.float()
    alpha, limit = clamp_limits([mod])
    a0, l0 = float(alpha if alpha is not None else 1.702), float(limit if limit is not None else 7.0)
    acts = list(dict.fromkeys(([first] if first else []) + list(_ELEMENTWISE)))
    cands = [(a, False, False) for a in acts]
    if mp.gated and limit is not None:
        cands += [(a, *c) for c in _CLAMPED for a in acts] + (
            [("swiglu_oai", False, False)] if alpha is not None else [])
    tol = policy.mlp_match_tolerance(x.dtype, _mlp_quantized(block, mp))
    xf = x.float()
    best = None  # the closest within the tolerance: in 16-bit, silu can pass for relu within it
    for act, clamp, after in cands:
        ref = _mlp_ref(block, mp, xf, act, clamp, a0, l0, clamp_after=after)
        err = float((y - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
        if err <= tol and (best is None or err < best[0]):
            best = (err, act, clamp, after)
    if best is None:
        return None
    _, act, clamp, after = best
    return MlpReading(act, clamp, *_canonical(act, clamp or after, a0, l0), clamp_after=after)


def activation_mismatch(block: nn.Module, parts: BlockParts, spec: MoESpec) -> str | None:
    """Check ``spec``'s activations against the block's own modules on inputs that reach the clamps.

    A check on random hidden states rarely reaches the clamps of clamped SwiGLU variants (limit 7-10); this one
    does: the experts' ``_apply_gate`` / ``act_fn`` over about +-20, and the shared expert (and ModuleList expert 0)
    called as a whole on inputs whose first-layer outputs spread over about +-25. Returns why they differ, or None
    (also when the block has nothing to call).
    """
    experts = get_path(block, parts.experts)
    if parts.kind == "fused" and spec.gated and getattr(experts, "_apply_gate", None) is not None:
        h = policy.gate_probe_input()
        try:
            y = experts._apply_gate(h.clone())
        except Exception as e:
            raise_if_oom(e)
            y = None
        if isinstance(y, torch.Tensor) and y.shape == (h.shape[0], h.shape[1] // 2):
            ref = _gate_ref(h, spec.activation, spec.gate_up, spec.activation_alpha, spec.activation_limit,
                            spec.activation_clamp, spec.gate_softcap, spec.up_softcap, spec.activation_clamp_after)
            if not torch.allclose(y.float(), ref, rtol=policy.ACT_MATCH_RTOL, atol=policy.ACT_MATCH_ATOL):
                return (f"{type(experts).__name__}._apply_gate differs from the spec's "
                        f"{_clamped(spec)}{spec.activation}/{spec.gate_up} gate on "
                        f"inputs up to +-20 (clamped or other variant)")
    if parts.kind == "fused" and not spec.gated:
        fn = getattr(experts, "act_fn", None)
        if fn is not None and callable(fn):
            try:
                y = fn(_PROBE.clone())
            except Exception as e:
                raise_if_oom(e)
                y = None
            if isinstance(y, torch.Tensor) and y.shape == _PROBE.shape:
                ref = _act_ref(spec.activation, _PROBE)
                if not torch.allclose(y.float(), ref, rtol=policy.ACT_MATCH_RTOL,
                                      atol=policy.ACT_MATCH_ATOL_REL * float(ref.abs().max())):
                    return f"experts.act_fn ({type(fn).__name__}) differs from {spec.activation} on [-12, 12]"
    mlps = []
    if parts.kind == "modulelist" and spec.activation != "swiglu_oai":
        mlps.append((parts.expert_mlps[0], spec, "expert 0"))
    if parts.shared is not None and spec.shared is not None:
        mlps.append((parts.shared, spec.shared, "shared expert"))
    for mp, s, where in mlps:
        mod = get_path(block, mp.path)
        if any(p.device.type == "meta" for p in mod.parameters()) or getattr(mp, "stacked", 0):
            continue  # (stacked shared experts take their gammas as an argument: the block-level check covers them)
        x = _mlp_probe_input(block, mp)
        try:
            with torch.no_grad():
                y = mod(x)
        except Exception as e:
            raise_if_oom(e)
            continue
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            continue
        caps = (s.gate_softcap, s.up_softcap)
        ref = _mlp_ref(block, mp, x.float(), s.activation, s.activation_clamp, s.activation_alpha, s.activation_limit,
                       caps, s.activation_clamp_after)
        tol = policy.mlp_match_tolerance(x.dtype, _mlp_quantized(block, mp))
        err = float((y.float() - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
        if not err <= tol:
            return (f"{where} ({type(mod).__name__}) differs from the spec's {_clamped(s)}"
                    f"{'softcapped ' if any(caps) else ''}{s.activation} on "
                    f"inputs whose pre-activations reach +-25 (rel. err {err:.1e})")
    return None


def _clamped(s) -> str:
    """'clamped ' / 'clamped-after-activation ' / '' for a MoESpec or SharedExpertSpec (messages)."""
    return "clamped " if s.activation_clamp else "clamped-after-activation " if s.activation_clamp_after else ""
