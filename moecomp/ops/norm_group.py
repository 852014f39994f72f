"""``torch.ops.moecomp.norm_group``: an RMSNorm (and the residual add before it) folded into the skinny linears that
read its output, in one launch.

    h = x + residual (or x)                                          x [..., K], 1 <= G <= 4 linears
    n = h / sqrt(mean(h^2, -1) + eps) * gw,   gw = norm_weight or 1 + norm_weight (``offset``, Gemma-style)
    returns [linear(n, w_i, b_i) for i < G] + [h, only with a residual]

The generate engine's decode-step pass (``generate/fuse_norm.py``) puts one call where a decoder layer's RMSNorm fed
only ``moecomp::skinny_linear`` / ``fp8_linear`` / ``skinny_group`` calls (the pre-attention norm before q / k / v,
a dense MLP's norm before gate / up): the norm's small kernel, and the residual add's, disappear into the GEMV.
Weights, biases, scales and ``quant`` are ``moecomp::skinny_group``'s (16-bit of x's dtype, or e4m3 of one
QuantSpec without a static activation scale), with G from 1.

Two paths, chosen as ``skinny_group`` chooses (``linear_group.one_launch``: where every member would take the skinny
kernel on its own):

- one launch (``ops/skinny.skinny_norm_group``): the norm's scale is computed in the GEMV's K loop and applied to
  each output row; ``h * gw`` goes into the products in fp32, never rounded.
- otherwise (CPU, more rows, ``MOECOMP_SKINNY=0``): n in fp32, rounded once to x's dtype, then each member's own op.

Rounding against transformers' RMSNorm (Llama / Qwen form: ``w * (h32 * rsqrt(..)).to(dt)``, then the linear on that
dt tensor): transformers rounds the normalized row to dt twice (after the rsqrt scale, and after the weight
multiply); the fallback path rounds it once (after both), the fused kernel never. With u the unit roundoff of dt
(2^-8 bf16, 2^-11 fp16, 2^-24 fp32) and a = h * gw / rms(h) exactly, each output differs from transformers' by at
most about 2u * sum_k |a_k W_nk| (the dropped input roundings) + u |y_n| (each rounds its output once) + fp32 terms;
``tests/kernels/test_skinny_norm.py`` checks that bound. Gemma's form (``(h32 * rsqrt * (1 + w32)).to(dt)``) rounds
once, as the fallback does.

No autograd: a decode-step op (a call with inputs that need gradients fails in torch's autograd check).
"""

from __future__ import annotations

import math

import torch

from ..core.spec import QuantSpec
from .linear_group import check_members, group_quant, one_launch, run_member


def _quant(quant: str) -> QuantSpec | None:
    try:
        return group_quant(quant)
    except ValueError as e:
        raise ValueError(f"norm_group: {e}") from None


def _check(x, residual, norm_weight, eps, weights, biases, scales, q) -> None:
    if x.dim() < 1 or not x.dtype.is_floating_point:
        raise ValueError(f"norm_group: x must be a floating tensor [..., K], got {tuple(x.shape)} of {x.dtype}")
    K = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_group: residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"{tuple(residual.shape)} of {residual.dtype}")
    if norm_weight.shape != (K,) or not norm_weight.dtype.is_floating_point:
        raise ValueError(f"norm_group: norm_weight must be a floating [{K}] (K = x.shape[-1]), got "
                         f"{tuple(norm_weight.shape)} of {norm_weight.dtype}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"norm_group: eps must be a finite number >= 0, got {eps}")
    check_members("norm_group", 1, x, weights, biases, scales, q)


def normalized(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """The fallback path's norm: h / rms(h) * gw in fp32, rounded once to h's dtype."""
    hf = h.float()
    gw = norm_weight.float() + 1.0 if offset else norm_weight.float()
    return (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps) * gw).to(h.dtype)


@torch.library.custom_op("moecomp::norm_group", mutates_args=())
def norm_group(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, offset: bool,
               weights: list[torch.Tensor], biases: list[torch.Tensor | None], scales: list[torch.Tensor | None],
               quant: str) -> list[torch.Tensor]:
    q = _quant(quant)
    _check(x, residual, norm_weight, eps, weights, biases, scales, q)
    if not one_launch(x, weights, q):
        h = x + residual if residual is not None else x
        n = normalized(h, norm_weight, eps, offset)
        ys = [run_member(n, w, b, s, q) for w, b, s in zip(weights, biases, scales)]
        return ys + ([h] if residual is not None else [])
    from . import skinny

    K = x.shape[-1]
    r2 = residual.reshape(-1, K) if residual is not None else None
    ys, h = skinny.skinny_norm_group(x.reshape(-1, K), r2, norm_weight, eps, offset, list(weights), list(biases),
                                     list(scales), q)
    out = [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]
    return out + ([h.reshape(x.shape)] if h is not None else [])


@norm_group.register_fake
def _(x, residual, norm_weight, eps, offset, weights, biases, scales, quant):
    _check(x, residual, norm_weight, eps, weights, biases, scales, _quant(quant))
    ys = [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]
    return ys + ([x.new_empty(x.shape)] if residual is not None else [])

