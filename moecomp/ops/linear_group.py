"""``torch.ops.moecomp.skinny_group``: sibling linears that read the same input, in one launch of the skinny kernel.

    [y_0, .., y_{G-1}] = [linear(x, w_i, b_i) for i < G]        x [..., K], w_i [N_i, K], 2 <= G <= 4

The generate engine's decode-step pass (``generate/fuse_linears.py``) puts one call where the decoder layer called
``moecomp::skinny_linear`` (16-bit weights) or ``moecomp::fp8_linear`` (e4m3) G times on one input node:
q / k / v, a dense MLP's gate / up. Each weight is read through its own pointer (``ops/skinny.skinny_group``: nothing
concatenated, nothing copied), and each member's result is what its own op returns, computed by the same tile.

``quant`` "" means 16-bit weights (each of x's dtype), else the ``QuantSpec`` key of every member's e4m3 weight
(``scales`` their scales; activation "none", or "dynamic", which the FP8 linear runs weight-only at decode rows:
``tuning.fp8_mode``; a static activation scale is not taken). One launch where every member would take the skinny
kernel on its own (``linear16.takes`` / the FP8 linear's rule: weight-only mode and ``skinny.use_skinny``;
``MOECOMP_SKINNY``); otherwise each member runs what its own op runs (``F.linear`` / cuBLAS, the FP8 linear's other
forms; on CPU the torch paths), so a call never changes which computation a member gets, only how many launches it
takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import quant as q8
from ..core.spec import QuantSpec
from . import linear16
from .common import backend_name as _backend
from .fp8_linear import call_fp8_linear, check_fp8_linear

MAX_GROUP = 4


def group_quant(quant: str) -> QuantSpec | None:
    if not quant:
        return None
    q = QuantSpec.from_key(quant)
    if q.activation == "static":
        raise ValueError("skinny_group: quant must be a QuantSpec key without a static activation scale (activation "
                         "'none' or 'dynamic') or '' for 16-bit weights, got activation 'static'")
    return q


def _check(x, weights, biases, scales, q: QuantSpec | None) -> None:
    check_members("skinny_group", 2, x, weights, biases, scales, q)


def check_members(name: str, g_min: int, x, weights, biases, scales, q: QuantSpec | None) -> None:
    """g_min..MAX_GROUP members, each a valid call of its own op on x (ValueErrors prefixed with ``name``)."""
    G = len(weights)
    if not g_min <= G <= MAX_GROUP:
        raise ValueError(f"{name}: weights must hold {g_min}..{MAX_GROUP} matrices, got {G}")
    if len(biases) != G or len(scales) != G:
        raise ValueError(f"{name}: biases and scales must have one entry per weight ({G}), got {len(biases)} "
                         f"and {len(scales)}")
    for i, (w, b, s) in enumerate(zip(weights, biases, scales)):
        if q is None:
            if s is not None:
                raise ValueError(f"{name}: scales[{i}] must be None for 16-bit weights (quant '')")
            try:
                linear16.check_linear(x, w, b)
            except ValueError as e:
                raise ValueError(f"{name}: member {i}: {e}") from None
        else:
            if s is None:
                raise ValueError(f"{name}: scales[{i}] is None; e4m3 weights need their scales")
            check_fp8_linear(x, w, s, b, None, q)


def one_launch(x: torch.Tensor, weights, q: QuantSpec | None) -> bool:
    """Whether every member would take the skinny kernel on its own (decided on shapes, dtypes and the device)."""
    if not linear16.enabled():
        return False
    if q is None:
        return all(linear16.takes(x, w) for w in weights)
    from . import skinny, tuning

    K = x.shape[-1]
    M = x.numel() // max(K, 1)
    return (_backend(x.device) == "triton" and tuning.fp8_mode(q, M) == "w8a16"
            and all(skinny.use_skinny(M, w.shape[0], K, True) for w in weights))


def run_member(x, w, b, s, q: QuantSpec | None) -> torch.Tensor:
    if q is None:
        return linear16.run(x, w, b)
    return call_fp8_linear(x, w, s, b, None, q)


@torch.library.custom_op("moecomp::skinny_group", mutates_args=())
def skinny_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                 scales: list[torch.Tensor | None], quant: str) -> list[torch.Tensor]:
    q = group_quant(quant)
    _check(x, weights, biases, scales, q)
    if not one_launch(x, weights, q):
        return [run_member(x, w, b, s, q) for w, b, s in zip(weights, biases, scales)]
    from . import skinny

    K = x.shape[-1]
    ys = skinny.skinny_group(x.reshape(-1, K), list(weights), list(biases), list(scales), q)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


@skinny_group.register_fake
def _(x, weights, biases, scales, quant):
    _check(x, weights, biases, scales, group_quant(quant))
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]


def _setup(ctx, inputs, output):
    x, weights, biases, scales, quant = inputs
    ctx.save_for_backward(x, *weights, *[s for s in scales if s is not None])
    ctx.G, ctx.quant, ctx.has_bias = len(weights), quant, [b is not None for b in biases]
    # torch differentiates a list argument only when it holds tensors alone: a list with a None is one constant
    ctx.lists = (all(b is not None for b in biases), all(s is not None for s in scales))


def _backward(ctx, grads):
    """A linear's gradients per member (16-bit); for e4m3 members x's gradient through the dequantized weight (as
    ``formats/fp8.fp8_linear_forward`` gives it), none for the quantized tensors. Biases get gradients where every
    member has one (torch treats a list holding a None as a constant)."""
    saved = ctx.saved_tensors
    x, weights, scales = saved[0], saved[1:1 + ctx.G], saved[1 + ctx.G:]
    q = group_quant(ctx.quant)
    K = x.shape[-1]
    gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
    gws, gbs = [], []
    for i, (w, g) in enumerate(zip(weights, grads)):
        g2 = g.reshape(-1, w.shape[0])
        W = w if q is None else q8.dequantize(w, scales[i], q).to(x.dtype)
        if gx is not None:
            gx = gx + (g2 @ W).reshape(x.shape)
        gws.append(g2.T @ x.reshape(-1, K) if q is None else None)
        gbs.append(g2.sum(0) if ctx.has_bias[i] else None)
    return gx, gws, gbs if ctx.lists[0] else None, [None] * ctx.G if ctx.lists[1] else None, None


skinny_group.register_autograd(_backward, setup_context=_setup)


def reference(x, weights, biases, scales, quant: str) -> list[torch.Tensor]:
    """The members one by one in plain torch (tests): ``F.linear`` on x and each (dequantized) weight."""
    q = group_quant(quant)
    out = []
    for w, b, s in zip(weights, biases, scales):
        W = w if q is None else q8.dequantize(w, s, q)
        y = F.linear(x.float(), W.float(), None if b is None else b.float())
        out.append(y.to(x.dtype))
    return out
