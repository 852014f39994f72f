"""transformers' experts interface: ``experts_implementation="moecomp"``.

Importing moecomp registers ``"moecomp"`` in ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` (when
transformers is installed and has that interface), so that

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moecomp")
    model.set_experts_implementation("moecomp")

route every ``@use_experts_implementation`` experts module through ``torch.ops.moecomp.moe_experts``. Through this
door only the routed experts are replaced (transformers runs the router first); ``moecomp.optimize`` replaces the
whole block (routing, experts and shared experts in one op).

The spec comes from the experts module: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated`` (the
decorator's flags), the weight shapes, and the activation measured by calling ``act_fn`` / ``_apply_gate`` on a
probe tensor (so gpt-oss' clamped SwiGLU with its ``alpha`` / ``limit`` is recognised, and gates the spec cannot
express are refused). Unsupported modules (post-expert norm, expert parallel, unknown gates) and calls that need
gradients (the op has no backward: training with grad mode on, or grad mode on and the hidden states, routing
weights or expert weights requiring grad) run transformers' ``grouped_mm`` path, or eager, with a one-time warning.

FP8 experts (transformers' ``FP8Experts``, dispatching through ``FP8ExpertsInterface``, where ``"moecomp"`` is
registered too when ``transformers.integrations.finegrained_fp8`` is imported): the quantization is read from the
module (``formats/fp8.py``), the scales are passed to ``moe_experts``, and the module's plain-PyTorch FP8 forward is both
what the probe checks against and the fallback (transformers' own FP8 paths need the hub's kernel).

Checked specs are cached per module and top-k together with a snapshot of the module's attributes
(``snapshot.take_snapshot``: scalars, callables such as ``act_fn`` / ``_apply_gate``, child modules). When the snapshot
no longer matches (``experts.act_fn`` replaced, ``limit`` changed, ...), the cache is dropped and the spec derived
and checked again on the next eager call, so the change is followed (or refused with the fallback's warning).
Under ``torch.compile`` the comparison is traced (Dynamo guards on the attributes) and a changed module runs the
fallback path.
"""

from __future__ import annotations

import warnings

import torch

from .import_hooks import RegisterOnImport, uninstall
from ..core import quant as q8
from ..ops.moe_op import EXPERT_QUANT_ARGS, call_moe_experts
from ..core.reject import Refused, RejectCode
from ..core.spec import MoESpec, SpecError, expert_bias_fields
from ..formats import fp8
from ..probe.activations import probe_activation, probe_gate
from ..core.snapshot import snapshot_changed, snapshot_changed_traced, take_snapshot

NAME = "moecomp"
_warned: set = set()


class Unsupported(Refused):
    """Why an experts module cannot run on ``moe_experts``: ``code`` (a ``RejectCode``) for control flow and
    reports, the message for people."""


def is_hf_experts(m) -> bool:
    """True for an instance of a transformers ``@use_experts_implementation`` experts class."""
    co = getattr(getattr(type(m), "forward", None), "__code__", None)
    return co is not None and co.co_filename.replace("\\", "/").endswith("integrations/moe.py")


def _weights(m):
    has_gate = bool(getattr(m, "has_gate", True))
    w13 = getattr(m, "gate_up_proj" if has_gate else "up_proj", None)
    w2 = getattr(m, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        raise Unsupported("expert weights are not 3-D gate_up_proj / up_proj and down_proj tensors")
    b13 = b2 = None
    if getattr(m, "has_bias", False):
        b13 = getattr(m, "gate_up_proj_bias" if has_gate else "up_proj_bias", None)
        b2 = getattr(m, "down_proj_bias", None)
        if b13 is None and b2 is None:  # one of them alone: MoESpec.expert_bias
            raise Unsupported("has_bias is set but the bias tensors are missing")
    return w13, b13, w2, b2


def _fp8(m):
    """The experts' FP8 layout (``formats/fp8.py``), None when not quantized; ``Unsupported`` when the scales do not fit
    (the message names both tensors)."""
    if fp8.fp8_kind(m) != "experts":
        return None
    try:
        ex = fp8.experts_fp8(m)
    except fp8.FP8LayoutError as e:
        raise Unsupported(str(e), RejectCode.SPEC_INVALID) from None
    if ex is None:
        raise Unsupported("FP8 expert weights in a layout moecomp does not read", RejectCode.UNSUPPORTED_STRUCTURE)
    return ex


def scales(m) -> dict:
    """``moe_experts``' scale arguments of a quantized experts module ({} when not quantized)."""
    ex = _fp8(m)
    return {} if ex is None else {k: getattr(m, n) for k, n in ex.names().items()}


def experts_spec(m: torch.nn.Module, top_k: int, verify: bool = True) -> MoESpec:
    """The MoESpec (routing fields unused) of a ``@use_experts_implementation`` experts module.

    With ``verify`` (and real tensors), the module's own eager forward and ``moe_experts`` are also run on a probe
    (:func:`verify_experts`); a module whose forward computes something else is refused.
    """
    if getattr(m, "has_post_expert_norm", False):
        raise Unsupported("has_post_expert_norm (a norm after each expert)")
    w13, b13, w2, b2 = _weights(m)
    has_gate = bool(getattr(m, "has_gate", True))
    transposed = bool(getattr(m, "is_transposed", False))
    E = w13.shape[0]
    if transposed:  # [E, H, N], [E, I, H]
        H, N = w13.shape[1:]
        I = w2.shape[1]
    else:  # [E, N, H], [E, H, I]
        N, H = w13.shape[1:]
        I = w2.shape[2]
    if N != (2 * I if has_gate else I):
        raise Unsupported(f"weight shapes {tuple(w13.shape)} / {tuple(w2.shape)} do not fit")
    alpha, limit, gate_up, clamp, caps, after = 1.702, 7.0, "concat", False, (0.0, 0.0), False
    if has_gate:
        r = probe_gate(m, getattr(m, "is_concatenated", True))
        if r is None:
            raise Unsupported(f"{type(m).__name__}._apply_gate is not a gate the spec knows")
        act, gate_up, alpha, limit, clamp = r[:5]
        caps, after = (r.gate_softcap, r.up_softcap), r.clamp_after
    else:
        act = probe_activation(getattr(m, "act_fn", None))
        if act is None:
            raise Unsupported(f"activation {type(getattr(m, 'act_fn', None)).__name__} is not one the spec knows")
    ex = _fp8(m)
    try:
        spec = MoESpec(num_experts=E, top_k=min(top_k, E), hidden_size=H, intermediate_size=I, activation=act,
                       gated=has_gate, activation_alpha=alpha, activation_limit=limit, activation_clamp=clamp,
                       w_layout="in_out" if transposed else "out_in", gate_up=gate_up,
                       quant=None if ex is None else ex.quant, **expert_bias_fields(b13 is not None, b2 is not None),
                       gate_softcap=caps[0], up_softcap=caps[1], activation_clamp_after=after)
    except SpecError as e:
        raise Unsupported(str(e), RejectCode.SPEC_INVALID) from None
    if verify and w13.device.type != "meta":
        err, tol = verify_experts(m, spec)
        if not err <= tol:
            raise Unsupported(f"{type(m).__name__}'s forward differs from moe_experts on a probe: max rel. err "
                              f"{err:.2e} > {tol:g}", RejectCode.VERIFICATION_FAILED)
    return spec


def eager_forward(m):
    """The experts module's own forward (what ``experts_implementation="eager"`` runs); FP8 experts: their
    plain-PyTorch forward (``formats/fp8.py``; transformers' needs the hub's kernel)."""
    if fp8.fp8_kind(m) == "experts":
        return fp8.plain_experts_forward
    fwd = type(m).forward
    while is_hf_experts_forward(fwd) and getattr(fwd, "__wrapped__", None) is not None:
        fwd = fwd.__wrapped__  # (transformers decorates FP8Experts once per load: wrappers nest)
    return fwd


def is_hf_experts_forward(fwd) -> bool:
    co = getattr(fwd, "__code__", None)
    return co is not None and co.co_filename.replace("\\", "/").endswith("integrations/moe.py")


def _pre_activations(x: torch.Tensor, w13: torch.Tensor, w13_scale, spec: MoESpec) -> torch.Tensor:
    """x [T, H] (CPU) through every expert's w13: [T, E, N] fp32 on the CPU, w13 dequantized (or made fp32) a chunk of
    experts at a time (``policy.expert_chunks``): never the whole stack in fp32."""
    from ..core import policy

    E = w13.shape[0]
    out = None
    for e0, e1 in policy.expert_chunks(E, w13[0].numel() * 4):
        w = w13[e0:e1].float() if spec.quant is None else q8.dequantize(
            w13[e0:e1], w13_scale[e0:e1].detach(), spec.quant, 2 if spec.gated else 1)
        h = torch.einsum("th,enh->ten", x, w.cpu()) if spec.w_layout == "out_in" else \
            torch.einsum("th,ehn->ten", x, w.cpu())
        del w
        if out is None:
            out = torch.empty(x.shape[0], E, h.shape[-1])
        out[:, e0:e1] = h
    return out


def verify_experts(m: torch.nn.Module, spec: MoESpec, tokens: int | None = None) -> tuple[float, float]:
    """(max rel. err, tolerance) of ``moe_experts`` against the module's eager forward on random probes.

    Two probes: hidden states of unit scale, and scaled so that the first GEMM's outputs reach about +-25 (the
    clamps of clamped SwiGLU / gpt-oss variants at 7-10). Ids are distinct per token, weights random positive.
    Token count, seed, scale and tolerance: :mod:`moecomp.core.policy`.
    """
    from ..core import policy

    if tokens is None:
        tokens = policy.EXPERTS_PROBE_TOKENS
    w13, b13, w2, b2 = _weights(m)
    sc = scales(m)
    dt = torch.float32 if spec.quant is not None else w13.dtype  # (FP8 experts: probed in fp32)
    E, H, k = spec.num_experts, spec.hidden_size, min(spec.top_k, spec.num_experts)
    g = torch.Generator().manual_seed(policy.EXPERTS_PROBE_SEED)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(w13.device)
    wts = (torch.rand(tokens, k, generator=g) + 0.1).to(device=w13.device, dtype=dt)
    x = torch.randn(tokens, H, generator=g)
    pre = _pre_activations(x, w13.detach(), sc.get("w13_scale"), spec)
    big = policy.CLAMP_REACH_STD / float(pre.std().clamp_min(1e-12))
    tol = policy.verify_tolerance(dt, spec)
    err = 0.0
    eager = eager_forward(m)
    from torch.utils._python_dispatch import _disable_current_modes

    # an internal check: invisible to dispatch modes that count or trace the model's own ops
    with torch.no_grad(), _disable_current_modes():
        for scale in (1.0, big):
            xs = (x * scale).to(device=w13.device, dtype=dt)
            ref = eager(m, xs, ids, wts).float()
            out = torch.ops.moecomp.moe_experts(xs, ids, wts, w13, b13, w2, b2, spec.key, *(
                sc.get(n) for n in EXPERT_QUANT_ARGS)).float()
            if not torch.isfinite(out).all():
                return float("inf"), tol
            err = max(err, float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return err, tol


def _cache_key(m, top_k: int):
    w13, _, w2, _ = _weights(m)
    return (top_k, tuple(w13.shape), tuple(w2.shape))


def cache_spec(m, top_k: int, spec: MoESpec) -> None:
    """Remember a spec already checked (``verify_experts``) for calls with ``top_k`` experts per token."""
    _check_snapshot(m)
    m.__dict__.setdefault("_moecomp_experts_specs", {})[_cache_key(m, top_k)] = spec


def _check_snapshot(m) -> None:
    """Eager: drop the cached specs when the module's attributes changed since they were checked."""

    snap = m.__dict__.get("_moecomp_experts_snap")
    if snap is None or snapshot_changed(snap):
        m.__dict__["_moecomp_experts_specs"] = {}
        m.__dict__["_moecomp_experts_snap"] = take_snapshot(m)


def _spec_cached(m, top_k: int) -> MoESpec:
    if torch.compiler.is_compiling():

        snap = m.__dict__.get("_moecomp_experts_snap")
        if snap is not None and snapshot_changed_traced(m, snap):
            raise Unsupported("attributes changed since the spec was checked (an eager call checks it again)")
    else:
        _check_snapshot(m)
    key = _cache_key(m, top_k)
    cache = m.__dict__.setdefault("_moecomp_experts_specs", {})
    hit = cache.get(key)
    if hit is None:
        try:
            hit = experts_spec(m, top_k)
        except Unsupported as e:
            hit = e
        cache[key] = hit
    if isinstance(hit, Exception):
        raise hit
    return hit


def _fallback(m, hidden_states, top_k_index, top_k_weights, why: str):
    key = (type(m).__name__, why)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"moecomp experts: {type(m).__name__} runs transformers' own experts path ({why})",
                      stacklevel=3)
    if fp8.fp8_kind(m) == "experts":  # transformers' FP8 paths need the hub's kernel: the plain-PyTorch one
        return fp8.plain_experts_forward(m, hidden_states, top_k_index, top_k_weights)
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(m, hidden_states, top_k_index, top_k_weights)
    except ImportError:
        pass
    eager = getattr(type(m).forward, "__wrapped__", None)
    if eager is None:
        raise RuntimeError(f"moecomp experts: no fallback path for {type(m).__name__} ({why})")
    return eager(m, hidden_states, top_k_index, top_k_weights)


def experts_grad_needed(m, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> str:
    """What requires grad among ``moe_experts``'s inputs ("" when nothing does); asked with grad mode on."""
    if hidden_states.requires_grad:
        return "the hidden states"
    if top_k_weights.requires_grad:
        return "the routing weights"
    try:
        ws = _weights(m)
    except Unsupported:
        return ""
    if any(w is not None and w.requires_grad for w in ws):
        return "the expert weights"
    return ""


def moecomp_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts_implementation="moecomp"``: routed experts through ``torch.ops.moecomp.moe_experts``."""
    if getattr(self, "_is_expert_parallel", False):
        return _fallback(self, hidden_states, top_k_index, top_k_weights, "expert parallel")
    if torch.is_grad_enabled():
        if self.training:
            return _fallback(self, hidden_states, top_k_index, top_k_weights, "training with gradients: no backward")
        what = experts_grad_needed(self, hidden_states, top_k_weights)
        if what:
            return _fallback(self, hidden_states, top_k_index, top_k_weights,
                             f"{what} requires grad with grad mode on: no backward; use torch.no_grad() / "
                             f"torch.inference_mode() for inference")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2:
        return _fallback(self, hidden_states, top_k_index, top_k_weights, "inputs not [T, H] / [T, k]")
    try:
        spec = _spec_cached(self, int(top_k_index.shape[-1]))
    except Unsupported as e:
        return _fallback(self, hidden_states, top_k_index, top_k_weights, str(e))
    w13, b13, w2, b2 = _weights(self)
    return call_moe_experts(hidden_states, top_k_index, top_k_weights, w13, b13, w2, b2, spec, ids_from_topk=True,
                            **(scales(self) if spec.quant is not None else {}))


def register() -> bool:
    """Register ``"moecomp"`` with transformers' experts interface. False when transformers (or it) is missing.

    Only our own name is registered: transformers' entries (``"eager"``, ``"grouped_mm"``, ...) are left alone."""
    global REGISTERED
    try:
        from transformers.integrations import moe as hf_moe
    except Exception:
        return False
    if not _register_in(getattr(hf_moe, "ALL_EXPERTS_FUNCTIONS", None)):
        return False
    REGISTERED = True
    return True


def register_fp8() -> bool:
    """Register ``"moecomp"`` with transformers' FP8 experts interface (``FP8ExpertsInterface``: ``FP8Experts``
    modules dispatch there), the same function: it reads the scales of quantized experts. False when missing."""
    global FP8_REGISTERED
    try:
        from transformers.integrations import finegrained_fp8 as hf_fp8
    except Exception:
        return False
    if not _register_in(getattr(hf_fp8, "ALL_FP8_EXPERTS_FUNCTIONS", None)):
        return False
    FP8_REGISTERED = True
    for fn in _ON_FP8:
        fn()
    return True


_ON_FP8: list = []  # called once transformers' FP8 integration is loaded (the compile backend's trace forwards)


def on_fp8_import(fn) -> None:
    """Call ``fn()`` now if transformers' FP8 integration is loaded, else right after it is imported."""
    import sys

    _ON_FP8.append(fn)
    if _fp8_finder.target in sys.modules:
        if FP8_REGISTERED:
            fn()
        else:
            register_fp8()


def _register_in(iface) -> bool:
    if iface is None:
        return False
    reg = getattr(type(iface), "register", None)
    if reg is not None:
        reg(NAME, moecomp_experts_forward)
    else:  # pragma: no cover - older interface
        iface[NAME] = moecomp_experts_forward
    return True


class _RegisterOnImport(RegisterOnImport):
    """``import_hooks.RegisterOnImport`` for transformers' integrations: registers "moecomp" right after ``target``
    is imported (``transformers.integrations.moe``, or ``transformers.integrations.finegrained_fp8`` for the FP8
    interface).

    Importing transformers' MoE integration costs ~2 s; ``import moecomp`` should not pay it when transformers is
    not in use. Every model class with ``@use_experts_implementation`` imports that module before
    ``from_pretrained(..., experts_implementation=...)`` can look the name up, so registering then is in time (the
    FP8 integration is imported by the FP8 quantizer before it builds ``FP8Experts``). If the hook fails, the name
    gets registered by ``ensure_registered``.
    """

    TARGET = "transformers.integrations.moe"

    def __init__(self, target: str | None = None, fn=None):
        super().__init__(target or self.TARGET, fn or register)


_finder = _RegisterOnImport()
_fp8_finder = _RegisterOnImport("transformers.integrations.finegrained_fp8", register_fp8)


def _uninstall(finder=None) -> None:
    uninstall(_finder if finder is None else finder)


def _install() -> bool:
    """Register now if transformers' MoE integration is loaded, else when it is imported (the FP8 interface the
    same way). True if registered now."""
    import sys

    if _fp8_finder.target in sys.modules:
        _uninstall(_fp8_finder)
        register_fp8()
    elif _fp8_finder not in sys.meta_path and not FP8_REGISTERED:
        sys.meta_path.insert(0, _fp8_finder)
    if _finder.target in sys.modules:
        _uninstall()
        return register()
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return False


def ensure_registered() -> bool:
    """``"moecomp"`` in transformers' experts interface now if ``transformers.integrations.moe`` is loaded (True),
    else armed to be registered when it is (False). For entry points that hand ``"moecomp"`` to transformers."""
    return REGISTERED or _install()


REGISTERED = False  # set by register()
FP8_REGISTERED = False  # set by register_fp8()
_install()
