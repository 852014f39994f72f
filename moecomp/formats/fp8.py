"""FP8 modules of transformers (``FP8Experts``, ``FP8Linear``) read by meaning, and run in plain PyTorch.

A weight is *quantized* when it is a ``float8_e4m3fn`` tensor with a scale tensor next to it (``<name>_scale_inv``,
or ``<name>_scale``) whose shape is the blocked shape of that weight (``moecomp.core.spec.QuantSpec.scale_shape``): class
names are not read. What the tensors cannot say comes from the module's attributes: ``block_size`` (the scale
blocks; 128 x 128 when absent and the shapes fit it) and ``activation_scheme`` ("dynamic" / "static", with
``*_activation_scale`` tensors), or the compressed-tensors scheme a module carries (``formats/compressed.py``:
dynamic activations per token or per 128 columns).

transformers runs these modules only through the hub's ``finegrained-fp8`` kernel, which is never available here;
moecomp runs them in plain PyTorch instead (:func:`plain_fp8`: a context in which every FP8 module under a root
computes the dequantized reference, activations quantized as the module's scheme says, ``moecomp.core.quant``):

* ``FP8Linear``: ``y = fake_quant_act(x) @ dequantize(weight, weight_scale_inv).T (+ bias)``, in x's dtype;
* ``FP8Experts``: per expert the two GEMMs the same way, the module's own gate (``_apply_gate`` / ``act_fn``)
  between them, the routing weights applied and summed in fp32. Eagerly a loop over the experts hit (nothing
  dequantized beyond one expert at a time); while Dynamo traces, one batched spelling (``w[ids]`` gathered, then
  ``bmm``) that traces into one graph.

Both spellings go through two small custom ops, ``torch.ops.moecomp.dequant_fp8(q, scale, quant, halves)`` and
``torch.ops.moecomp.fake_quant_act(x, quant, scale)`` (fp32 results, ``quant`` a ``QuantSpec.key``), so that the
FX pass sees a quantized weight as one node whose inputs are the fp8 placeholder and its scale placeholder (and the
activation quantization as one node on the GEMM's input): ``recognise/fx/moe_quant.py`` reads them. They are moecomp's
tracing vocabulary, not what the bound op runs (``moe_forward`` / ``fp8_linear`` read the fp8 tensors as stored).

``optimize`` also binds every ``FP8Linear``-like module's forward to ``moecomp.ops.fp8_linear.call_fp8_linear``
(:func:`bind_linear`; the weights are the module's own tensors, read on every call), so that an FP8 model runs a
forward at all offline; ``unbind_linear`` restores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import quant as q8
from ..ops.fp8_linear import call_fp8_linear
from ..core.spec import FP8_MAX, QuantSpec, SpecError
from .compressed import CTUnsupported, scheme_of as ct_scheme_of

FP8 = torch.float8_e4m3fn
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default (and every FP8 block checkpoint's)
SCALE_SUFFIXES = ("_scale_inv", "_scale")


class FP8LayoutError(SpecError):
    """A quantized weight whose scale tensor does not fit it (a ValueError naming both tensors)."""


# ------------------------------------------------------------------------------------------------ tracing ops
@torch.library.custom_op("moecomp::dequant_fp8", mutates_args=())
def dequant_fp8(q: torch.Tensor, scale: torch.Tensor, quant: str, halves: int) -> torch.Tensor:
    """[..., rows, cols] fp8 + scales -> fp32 weights (``moecomp.core.quant.dequantize``)."""
    return q8.dequantize(q, scale, QuantSpec.from_key(quant), halves)


@dequant_fp8.register_fake
def _(q, scale, quant, halves):
    return q.new_empty(q.shape, dtype=torch.float32)


@torch.library.custom_op("moecomp::fake_quant_act", mutates_args=())
def fake_quant_act(x: torch.Tensor, quant: str, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] as a w8a8 GEMM multiplies it, fp32: dynamic per token and 128 columns, static with ``scale`` (one
    value, or one per row), or x itself for activation "none" (``moecomp.core.quant.fake_quant_act``)."""
    q = QuantSpec.from_key(quant)
    x2 = x.reshape(-1, x.shape[-1])
    if q.activation == "static" and scale is not None and scale.numel() > 1:
        s = scale.float().reshape(-1, 1)  # one static scale per row (the rows' experts' scales)
        inv = torch.ones((), device=x.device) / s
        out = (x2.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
    else:
        out = q8.fake_quant_act(x2, q, scale)
    return out.reshape(x.shape)


@fake_quant_act.register_fake
def _(x, quant, scale):
    return x.new_empty(x.shape, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ reading
def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == FP8


def _own(m: nn.Module, name: str):
    t = m._parameters.get(name)
    return t if t is not None else m._buffers.get(name)


def scale_name(m: nn.Module, weight: str) -> str | None:
    """The name of ``weight``'s scale tensor on ``m`` (``<weight>_scale_inv`` or ``<weight>_scale``)."""
    for suf in SCALE_SUFFIXES:
        if isinstance(_own(m, weight + suf), torch.Tensor):
            return weight + suf
    return None


def _scale_dtype(t: torch.Tensor, who: str) -> str:
    if t.dtype == torch.float32:
        return "fp32"
    if q8.E8M0 is not None and t.dtype == q8.E8M0:
        return "ue8m0"
    raise FP8LayoutError(f"{who} has dtype {t.dtype}; FP8 weight scales are float32 or float8_e8m0fnu")


def _activation(m: nn.Module) -> dict:
    """QuantSpec's activation fields of module ``m``: a compressed-tensors scheme's input activations (per token:
    ``act_group`` 0), else transformers' ``activation_scheme`` attribute (groups of 128)."""
    ct = ct_scheme_of(m)
    if ct is not None:
        try:
            q = ct.quant()
        except CTUnsupported as e:
            raise FP8LayoutError(str(e)) from None
        return dict(activation=q.activation, act_group=q.act_group)
    scheme = getattr(m, "activation_scheme", "dynamic")
    if scheme in (None, "none"):
        return dict(activation="none")
    if scheme not in ("dynamic", "static"):
        raise FP8LayoutError(f"activation_scheme={scheme!r} is not one moecomp knows (dynamic, static)")
    return dict(activation=scheme)


def _block(m: nn.Module):
    bs = getattr(m, "block_size", None)
    if bs is None:
        bs = getattr(m, "weight_block_size", None)
    return None if bs is None else (int(bs[0]), int(bs[1]))


_CANON: dict = {}  # QuantSpec fields -> one instance whose ``key`` is computed (see _canonical)


def _canonical(q: QuantSpec) -> QuantSpec:
    """One instance per QuantSpec value, its ``key`` computed outside any trace: Dynamo cannot trace the first read
    of a cached property (Python 3.11's takes a lock), and the plain forwards read ``key`` while it traces."""
    k = dataclasses.astuple(q)
    hit = _CANON.get(k)
    if hit is None:
        q.key  # noqa: B018  (computed now)
        hit = _CANON[k] = q
    return hit


for _sc in ("block", "channel", "tensor"):  # the ones FP8 checkpoints use, ready before any trace
    for _dt in ("fp32", "ue8m0"):
        for _act in ("dynamic", "static", "none"):
            _canonical(QuantSpec(scale=_sc, scale_dtype=_dt, activation=_act))
        _canonical(QuantSpec(scale=_sc, scale_dtype=_dt, act_group=0))  # per token (compressed-tensors)


def quant_for(m: nn.Module, w: torch.Tensor, s: torch.Tensor, halves: int, who_w: str, who_s: str) -> QuantSpec:
    """The QuantSpec of quantized weight ``w`` [(E,) rows, cols] with scales ``s``, read from the shapes and ``m``'s
    ``block_size`` / ``activation_scheme``; ``FP8LayoutError`` naming both tensors when the scale does not fit."""
    lead = w.dim() - 2
    rows, cols = w.shape[-2:]
    block = _block(m)
    base = dict(scale_dtype=_scale_dtype(s, who_s), **_activation(m))
    cands = []
    if block is not None:
        cands.append(QuantSpec(scale="block", block_n=block[0], block_k=block[1], **base))
    else:  # no attribute: the scale's shape says per-tensor / per-channel, else the checkpoints' default blocks
        cands += [QuantSpec(scale="tensor", **base), QuantSpec(scale="channel", **base),
                  QuantSpec(scale="block", block_n=DEFAULT_BLOCK[0], block_k=DEFAULT_BLOCK[1], **base)]
    want = None
    for q in cands:
        want = tuple(w.shape[:lead]) + q.scale_shape(rows, cols, halves)
        if tuple(s.shape) == want:
            try:
                q.validate()
            except SpecError as e:
                raise FP8LayoutError(f"{who_w}: {e}") from None
            return _canonical(q)
    lay = f"{block[0]}x{block[1]} block" if block is not None else "per-tensor, per-channel or 128x128 block"
    half = " (gate and up blocked apart)" if halves == 2 else ""
    raise FP8LayoutError(f"{who_s} has shape {tuple(s.shape)}; {lay} scales of {who_w} {tuple(w.shape)}{half} "
                         f"need {want}")


@dataclass
class LinearFP8:
    """A quantized 2-D linear weight: its tensors' names on the module and its QuantSpec."""

    quant: QuantSpec
    weight: str = "weight"
    scale: str = "weight_scale_inv"
    act_scale: str | None = None  # static activation scale (one value)
    key: str = ""  # quant.key

    def __post_init__(self):
        self.key = self.quant.key


def linear_fp8(m: nn.Module, who: str = "") -> LinearFP8 | None:
    """``m``'s quantized 2-D ``weight`` (an FP8Linear-like module), or None when ``m`` holds none.
    ``FP8LayoutError`` (naming both tensors) when the scale does not fit the weight."""
    if isinstance(m, nn.Embedding):
        return None
    w = _own(m, "weight")
    if not is_fp8(w) or w.dim() != 2:
        return None
    sn = scale_name(m, "weight")
    pre = f"{who}." if who else ""
    if sn is None:
        raise FP8LayoutError(f"{pre}weight is {FP8} but {pre}weight_scale_inv (its scales) is missing")
    s = _own(m, sn)
    if ct_scheme_of(m) is not None and s.shape == (w.shape[0], 1):
        raise FP8LayoutError(CTUnsupported("ct_transformers_layout", f"{pre}weight: a compressed-tensors linear as "
                                           f"transformers loads it ({pre}{sn} {s.dtype} [N, 1], decompressed by the "
                                           f"model's first forward); moecomp.load(path) keeps it FP8").args[0])
    q = quant_for(m, w, s, 1, f"{pre}weight", f"{pre}{sn}")
    act = None
    if q.activation == "static":
        a = _own(m, "activation_scale")
        if not isinstance(a, torch.Tensor) or a.numel() != 1:
            raise FP8LayoutError(f"{pre}activation_scheme is 'static' but {pre}activation_scale is not one value")
        act = "activation_scale"
    return LinearFP8(q, "weight", sn, act)


@dataclass
class ExpertsFP8:
    """Quantized 3-D expert weights: names on the experts module (w13 / w2 and their scales) and the QuantSpec."""

    quant: QuantSpec
    w13: str
    w13_scale: str
    w2: str
    w2_scale: str
    gated: bool
    a13_scale: str | None = None
    a2_scale: str | None = None
    key: str = ""  # quant.key

    def __post_init__(self):
        self.key = self.quant.key

    def names(self) -> dict:
        """{op argument: tensor name on the experts module} of the scales."""
        out = {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale}
        if self.a13_scale is not None:
            out.update(a13_scale=self.a13_scale, a2_scale=self.a2_scale)
        return out


def experts_fp8(m: nn.Module, who: str = "") -> ExpertsFP8 | None:
    """``m``'s quantized 3-D expert weights (an FP8Experts-like module: e4m3 ``gate_up_proj`` / ``up_proj`` and
    ``down_proj`` [E, ., .] with block scales), or None when it holds none. ``FP8LayoutError`` (naming both
    tensors) when a scale does not fit its weight."""
    gated = bool(getattr(m, "has_gate", True))
    w13n = "gate_up_proj" if gated and is_fp8(_own(m, "gate_up_proj")) else "up_proj"
    w13, w2 = _own(m, w13n), _own(m, "down_proj")
    if not (is_fp8(w13) and w13.dim() == 3) or not (is_fp8(w2) and w2.dim() == 3):
        return None
    gated = w13n == "gate_up_proj"
    pre = f"{who}." if who else ""
    names = []
    for wn in (w13n, "down_proj"):
        sn = scale_name(m, wn)
        if sn is None:
            raise FP8LayoutError(f"{pre}{wn} is {FP8} but {pre}{wn}_scale_inv (its scales) is missing")
        names.append(sn)
    q13 = quant_for(m, w13, _own(m, names[0]), 2 if gated else 1, f"{pre}{w13n}", f"{pre}{names[0]}")
    q2 = quant_for(m, w2, _own(m, names[1]), 1, f"{pre}down_proj", f"{pre}{names[1]}")
    if q13 is not q2:
        raise FP8LayoutError(f"{pre}{w13n} and {pre}down_proj are quantized differently ({q13} / {q2})")
    out = ExpertsFP8(q13, w13n, names[0], "down_proj", names[1], gated)
    if q13.activation == "static":
        E = w13.shape[0]
        a13n, a2n = f"{w13n}_activation_scale", "down_proj_activation_scale"
        for an in (a13n, a2n):
            a = _own(m, an)
            if not isinstance(a, torch.Tensor) or a.shape != (E,) or a.dtype != torch.float32:
                raise FP8LayoutError(f"{pre}activation_scheme is 'static' but {pre}{an} is not float32 [{E}]")
        out.a13_scale, out.a2_scale = a13n, a2n
    return out


def fp8_kind(m: nn.Module) -> str | None:
    """"experts", "linear" or None: what kind of FP8 module ``m`` is (by its tensors; a bad scale still counts)."""
    w = _own(m, "weight")
    if is_fp8(w) and w.dim() == 2 and not isinstance(m, nn.Embedding):
        return "linear"
    if any(is_fp8(_own(m, n)) and _own(m, n).dim() == 3 for n in ("gate_up_proj", "up_proj", "down_proj")):
        return "experts"
    return None


# ------------------------------------------------------------------------------------------------ plain forwards
# (QuantSpec keys are passed as strings: Dynamo cannot trace the first read of a cached property, ``QuantSpec.key``)
def _act_q(x: torch.Tensor, activation: str, key: str, scale) -> torch.Tensor:
    if activation == "none":
        return x.float()
    return torch.ops.moecomp.fake_quant_act(x, key, scale)


def qlinear(x: torch.Tensor, w, s, q: QuantSpec, halves: int = 1, act_scale=None, key: str | None = None):
    """x [..., K] through the quantized weight w [N, K]: fp32 GEMM of the quantized x and the dequantized weight,
    returned in x's dtype (what the FP8 kernels return)."""
    key = q.key if key is None else key
    W = torch.ops.moecomp.dequant_fp8(w, s, key, halves)
    return F.linear(_act_q(x, q.activation, key, act_scale), W).to(x.dtype)


def plain_linear_forward(m: nn.Module, x: torch.Tensor, lq: LinearFP8 | None = None) -> torch.Tensor:
    """An FP8Linear's forward in plain PyTorch (the dequantized reference, x quantized as the module says)."""
    lq = linear_fp8(m) if lq is None else lq
    a = getattr(m, lq.act_scale) if lq.act_scale else None
    y = qlinear(x, getattr(m, lq.weight), getattr(m, lq.scale), lq.quant, 1, a, lq.key)
    b = getattr(m, "bias", None)
    return y if b is None else y + b.to(y.dtype)


def _gate(m: nn.Module, h: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return m.act_fn(h)
    fn = getattr(m, "_apply_gate", None)
    if fn is not None:
        return fn(h)
    gate, up = h.chunk(2, dim=-1)
    return m.act_fn(gate) * up


def _experts_tensors(m: nn.Module, ex: ExpertsFP8):
    g = lambda n: None if n is None else getattr(m, n)  # noqa: E731
    return g(ex.w13), g(ex.w13_scale), g(ex.w2), g(ex.w2_scale), g(ex.a13_scale), g(ex.a2_scale)


def plain_experts_forward(m: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, ex: ExpertsFP8 | None = None) -> torch.Tensor:
    """An FP8Experts' forward in plain PyTorch: eagerly a loop over the experts hit, under Dynamo one batched
    spelling (see the module docstring); both the dequantized reference with the module's own gate."""
    ex = experts_fp8(m) if ex is None else ex
    if torch.compiler.is_compiling():
        return _experts_traced(m, ex, hidden_states, top_k_index, top_k_weights)
    return _experts_eager(m, ex, hidden_states, top_k_index, top_k_weights)


def _experts_eager(m, ex: ExpertsFP8, x, ids, wts):
    w13, s13, w2, s2, a13, a2 = _experts_tensors(m, ex)
    E, q, halves = w13.shape[0], ex.quant, 2 if ex.gated else 1
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < E:  # expert-parallel sentinels (ids of other ranks' experts)
            continue
        tok, slot = torch.where(ids == e)
        h = qlinear(x[tok], w13[e], s13[e], q, halves, None if a13 is None else a13[e], ex.key)
        h = _gate(m, h, ex.gated)
        y = qlinear(h, w2[e], s2[e], q, 1, None if a2 is None else a2[e], ex.key)
        out.index_add_(0, tok, (y * wts[tok, slot, None].to(y.dtype)).float())
    return out.to(x.dtype)


def _bqlinear(xs, wq, ws, ex: ExpertsFP8, halves: int, act_scale):
    """Per pair: xs [S, K] through its gathered weight wq [S, N, K] -> [S, N] in xs's dtype."""
    W = torch.ops.moecomp.dequant_fp8(wq, ws, ex.key, halves)
    xq = _act_q(xs, ex.quant.activation, ex.key, act_scale)
    return torch.bmm(W, xq.unsqueeze(-1)).squeeze(-1).to(xs.dtype)


def _experts_traced(m, ex: ExpertsFP8, x, ids, wts):
    w13, s13, w2, s2, a13, a2 = _experts_tensors(m, ex)
    T, k = ids.shape
    H = x.shape[-1]
    eid = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    h = _bqlinear(xs, w13[eid], s13[eid], ex, 2 if ex.gated else 1, None if a13 is None else a13[eid])
    h = _gate(m, h, ex.gated)
    y = _bqlinear(h, w2[eid], s2[eid], ex, 1, None if a2 is None else a2[eid])
    y = y * wts.reshape(-1, 1).to(y.dtype)
    return y.float().view(T, k, H).sum(dim=1).to(x.dtype)


# ------------------------------------------------------------------------------------------------ the context
_MISSING = object()


def _plain_forward(kind: str, m: nn.Module, activations: str = "stored"):
    """The plain forward of FP8 module ``m``, its layout read now (outside any trace); a module whose scales do not
    fit gets a forward that raises that ``FP8LayoutError``. ``activations="none"``: weight-only (activations left
    in 16 bits, as the kernels run a dynamic spec where the table says so)."""
    try:
        lay = experts_fp8(m) if kind == "experts" else linear_fp8(m)
        err = None
    except FP8LayoutError as e:
        lay, err = None, e
    if lay is not None and activations == "none" and lay.quant.activation != "none":
        lay = dataclasses.replace(lay, quant=dataclasses.replace(lay.quant, activation="none"))
    if kind == "experts":
        def forward(hidden_states, top_k_index, top_k_weights):
            if err is not None:
                raise err
            return plain_experts_forward(m, hidden_states, top_k_index, top_k_weights, lay)
    else:
        def forward(x):
            if err is not None:
                raise err
            return plain_linear_forward(m, x, lay)
    forward._moecomp_plain = activations
    return forward


@contextlib.contextmanager
def plain_fp8(root: nn.Module | None, kinds: tuple = ("experts", "linear"), activations: str = "stored"):
    """While active, every FP8 module under ``root`` (``FP8Experts``-like, ``FP8Linear``-like: :func:`fp8_kind`;
    ``kinds`` which of them) runs its plain-PyTorch forward (an instance attribute, removed on exit; contexts nest).
    Nothing else changes: modules without fp8 weights are left alone. ``activations``: "stored" (quantized as the
    module's scheme says: the dequantized reference) or "none" (weight-only: the reference of a dynamic scheme run
    weight-only, which the kernel table picks at small T)."""
    if activations not in ("stored", "none"):
        raise ValueError(f"activations must be 'stored' or 'none', got {activations!r}")
    patched = []
    if root is not None:
        for m in root.modules():
            kind = fp8_kind(m)
            if kind is None or kind not in kinds:
                continue
            cur = m.__dict__.get("forward", _MISSING)
            if getattr(cur, "_moecomp_plain", None) == activations:
                continue  # an outer context already did
            m.forward = _plain_forward(kind, m, activations)
            patched.append((m, cur))
    try:
        yield patched
    finally:
        for m, cur in reversed(patched):
            if cur is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.forward = cur


# ------------------------------------------------------------------------------------------------ compile backend
def install_trace_forwards(predicate) -> bool:
    """While Dynamo traces and ``predicate()`` (the compile backend's "tracing for moecomp") holds, transformers'
    FP8 experts (every entry of ``FP8ExpertsInterface``, and "eager") and ``FP8Linear`` trace as the plain forwards
    above; otherwise they run as before. False when transformers has no FP8 integration."""
    try:
        from transformers.integrations import finegrained_fp8 as hf
    except Exception:
        return False
    iface = getattr(hf, "ALL_FP8_EXPERTS_FUNCTIONS", None)
    if iface is not None and hasattr(iface, "_local_mapping"):
        for key in list(getattr(type(iface), "_global_mapping", {})) + ["eager"]:
            cur = iface._local_mapping.get(key) or type(iface)._global_mapping.get(key)
            if not getattr(cur, "_moecomp_trace", False):
                iface._local_mapping[key] = _traced_or(cur, predicate)
    lin = getattr(hf, "FP8Linear", None)
    if lin is not None and not getattr(lin.forward, "_moecomp_trace", False):
        lin.forward = _traced_or(lin.forward, predicate, linear=True)
    return True


def _traced_or(orig, predicate, linear: bool = False):
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() and predicate():
            if linear:
                return plain_linear_forward(self, *args, **kwargs)
            return plain_experts_forward(self, *args, **kwargs)
        if orig is None:  # "eager": the class's own forward under the decorator's wrappers
            fwd = type(self).forward
            while getattr(fwd, "__wrapped__", None) is not None:
                fwd = fwd.__wrapped__
            return fwd(self, *args, **kwargs)
        return orig(self, *args, **kwargs)

    forward._moecomp_trace = True
    forward.__wrapped__ = orig
    return forward


def has_fp8(root: nn.Module) -> bool:
    return any(fp8_kind(m) is not None for m in root.modules())


# ------------------------------------------------------------------------------------------------ linear binding
@dataclass
class LinearState:
    """An FP8Linear-like module bound to ``moecomp.ops.fp8_linear`` by ``optimize``."""

    name: str
    quant: QuantSpec
    layout: LinearFP8
    original: object  # the instance-level forward replaced, or None (the class's)
    calls: int = 0


class LinearForward:
    """``module.forward`` after binding (a small picklable callable, like ``bind.bind.BoundForward``)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x, *args, **kwargs):
        return fp8_linear_forward(self.module, x)

    def __getstate__(self):
        return {"module": self.module}

    def __setstate__(self, state):
        self.module = state["module"]


def fp8_linear_forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A bound FP8 linear: ``call_fp8_linear`` on the module's own tensors (read on every call). With gradients to
    compute for x (the op has no backward), the same value with the gradient of the dequantized dense linear
    (straight through the quantization)."""
    st: LinearState = m._moecomp_fp8
    lq = st.layout
    w, s, b = getattr(m, lq.weight), getattr(m, lq.scale), getattr(m, "bias", None)
    a = getattr(m, lq.act_scale) if lq.act_scale else None
    if not torch.compiler.is_compiling():
        st.calls += 1
    if torch.is_grad_enabled() and x.requires_grad:
        with torch.no_grad():
            y_op = call_fp8_linear(x.detach(), w, s, None if b is None else b.detach(), a, st.quant)
            W = q8.dequantize(w, s, st.quant).to(x.dtype)
        y = F.linear(x, W, b)
        return y + (y_op - y).detach()
    return call_fp8_linear(x, w, s, b, a, st.quant)


def bind_linear(m: nn.Module, name: str) -> LinearState | None:
    """Bind an FP8Linear-like module's forward to ``moecomp.ops.fp8_linear`` (None when ``m`` holds no quantized
    2-D weight or is bound already); ``FP8LayoutError`` when its scale does not fit."""
    if m.__dict__.get("_moecomp_fp8") is not None:
        return None
    lq = linear_fp8(m, name)
    if lq is None:
        return None
    if lq.quant.activation == "static" and lq.act_scale is None:
        raise FP8LayoutError(f"{name}: static activation scheme without activation_scale")
    st = LinearState(name, lq.quant, lq, m.__dict__.get("forward"))
    m._moecomp_fp8 = st
    m.forward = LinearForward(m)
    return st


def unbind_linear(m: nn.Module) -> bool:
    st = m.__dict__.get("_moecomp_fp8")
    if st is None:
        return False
    if st.original is not None:
        m.forward = st.original
    else:
        m.__dict__.pop("forward", None)
    del m._moecomp_fp8
    return True


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every FP8Linear-like module of ``model`` (a quantized 2-D ``weight``), bound or not."""
    return [(n, m) for n, m in model.named_modules() if fp8_kind(m) == "linear"]


def fallback_context(root: nn.Module):
    """The context a bound block's (or experts module's) original forward runs in: its FP8 experts in plain PyTorch
    (transformers' FP8 experts forward needs the hub's kernel, which is never available here: without this a hook
    or gradient fallback would raise ``ImportError: finegrained-fp8 kernel unavailable``). FP8 linears keep their
    bound forward (moecomp's kernel). A no-op context for modules without FP8 experts, and under torch.compile (the
    compile backend traces FP8 modules as plain forwards already: ``install_trace_forwards``)."""
    if torch.compiler.is_compiling() or not any(fp8_kind(m) == "experts" for m in root.modules()):
        return contextlib.nullcontext()
    return plain_fp8(root, kinds=("experts",))


def plain_experts_call(m: nn.Module):
    """For an experts module bound on its own whose weights are FP8: its plain-PyTorch forward (what its fallback
    runs instead of transformers' hub-kernel forward); None for other modules or under torch.compile."""
    if torch.compiler.is_compiling() or fp8_kind(m) != "experts":
        return None
    return _plain_forward("experts", m)

