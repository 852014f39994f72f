"""Quantized weights and activations in plain PyTorch: the oracle of ``MoESpec.quant`` (``moecomp.spec.QuantSpec``).

    dequantize(q, scale)      w = q * s_w             s_w per [block_n, block_k] block, per row, or per matrix
    quantize(w)               (q, s_w) from a float weight (tests, benchmarks, checkpoint writers)
    quantize_act(x)           (x_q e4m3, s_a): s_a = max|x| / 448 per token and group of 128 columns ("dynamic"),
                              or the given static scale; x_q = e4m3(clamp(x * (1 / s_a), +-448))
    fake_quant_act(x)         x_q * s_a in fp32: what a w8a8 GEMM multiplies

The kernels (``kernels/fp8.py``) compute the same numbers: the same scale (an IEEE division by 448, then a
reciprocal), the same product x * (1 / s), the same round-to-nearest-even cast. Weights are [..., rows, cols]
(a leading expert dim or none); a gated w13 [E, 2I, H] holds gate and up blocks apart (``halves=2``: rows
``[0, I)`` use scale rows ``[0, ceil(I / block_n))``, rows ``[I, 2I)`` the next ``ceil(I / block_n)``).
"""

from __future__ import annotations

import dataclasses

import torch

from .spec import FP8_MAX, QuantSpec

FP8 = torch.float8_e4m3fn
E8M0 = getattr(torch, "float8_e8m0fnu", None)
ACT_EPS = 1e-10  # the smallest activation amax a dynamic scale is taken from (an all-zero group)


def scale_dtype(quant: QuantSpec) -> torch.dtype:
    if quant.scale_dtype == "ue8m0":
        if E8M0 is None:
            raise ValueError("quant.scale_dtype='ue8m0' needs torch.float8_e8m0fnu (torch >= 2.7)")
        return E8M0
    return torch.float32


def scales_float(scale: torch.Tensor) -> torch.Tensor:
    """Weight scales as fp32 (ue8m0 bytes decoded: 2 ** (e - 127))."""
    return scale.float()


def _row_blocks(rows: int, quant: QuantSpec, halves: int, device) -> torch.Tensor:
    """[rows] -> the scale row each weight row reads."""
    per = rows // halves
    nb = -(-per // quant.block_n)
    r = torch.arange(rows, device=device)
    return (r // per) * nb + (r % per) // quant.block_n


def expand_scales(scale: torch.Tensor, rows: int, cols: int, quant: QuantSpec, halves: int = 1) -> torch.Tensor:
    """The scale of every weight element, [..., rows, cols] fp32 (broadcastable for "channel" / "tensor")."""
    s = scales_float(scale)
    if quant.scale == "tensor":
        return s[..., None, None]
    if quant.scale == "channel":
        return s[..., :, None]
    rb = _row_blocks(rows, quant, halves, s.device)
    cb = torch.arange(cols, device=s.device) // quant.block_k
    return s[..., rb, :][..., :, cb]


def dequantize(q: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, halves: int = 1) -> torch.Tensor:
    """[..., rows, cols] fp8 + scales -> fp32 weights."""
    rows, cols = q.shape[-2:]
    return q.float() * expand_scales(scale, rows, cols, quant, halves)


QUANTIZE_CHUNK_BYTES = 1 << 30  # fp32 working set of one ``quantize`` step over stacked experts


def quantize(w: torch.Tensor, quant: QuantSpec, halves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., rows, cols] -> (q e4m3, scale in the spec's layout and dtype): each block (row, matrix)
    scaled so its largest magnitude maps to 448 (ue8m0: rounded up to a power of two, so nothing saturates).
    Stacked experts [E, rows, cols] go a few matrices at a time (``QUANTIZE_CHUNK_BYTES`` of fp32 working set): a
    DeepSeek-V3 layer's w13 would otherwise take 30 GB of fp32 temporaries at once."""
    per = w[0].numel() * 4 if w.dim() > 2 else 0
    if per and w.numel() * 4 > QUANTIZE_CHUNK_BYTES:
        n = max(1, QUANTIZE_CHUNK_BYTES // per)
        parts = [_quantize(w[i:i + n], quant, halves) for i in range(0, w.shape[0], n)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return _quantize(w, quant, halves)


def _quantize(w: torch.Tensor, quant: QuantSpec, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape[-2:]
    w = w.float()
    lead = w.shape[:-2]
    if quant.scale == "tensor":
        amax = w.abs().amax(dim=(-2, -1))
    elif quant.scale == "channel":
        amax = w.abs().amax(dim=-1)
    else:
        nb = -(-(rows // halves) // quant.block_n)
        kb = -(-cols // quant.block_k)
        rb = _row_blocks(rows, quant, halves, w.device)
        cb = torch.arange(cols, device=w.device) // quant.block_k
        flat = (rb[:, None] * kb + cb[None, :]).expand(rows, cols).reshape(-1)
        amax = torch.zeros(*lead, halves * nb * kb, device=w.device)
        amax = amax.scatter_reduce(-1, flat.expand(*lead, -1), w.abs().reshape(*lead, -1), "amax")
        amax = amax.reshape(*lead, halves * nb, kb)
    s = amax.clamp(min=1e-12) / FP8_MAX
    if quant.scale_dtype == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    s = s.to(scale_dtype(quant))
    q = (w / expand_scales(s, rows, cols, quant, halves)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def act_scales(x: torch.Tensor, quant: QuantSpec) -> torch.Tensor:
    """Dynamic scales of x [T, K]: [T, ceil(K / act_group)] fp32, max|x| / 448 per token and group."""
    T, K = x.shape
    g = quant.act_group
    G = -(-K // g)
    xf = torch.nn.functional.pad(x.float().abs(), (0, G * g - K)).view(T, G, g)
    amax = xf.amax(-1).clamp(min=ACT_EPS)
    # an IEEE division, as the kernels do (on CUDA, dividing by a Python scalar multiplies by its fp32 reciprocal)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_act(x: torch.Tensor, quant: QuantSpec, static_scale: torch.Tensor | None = None):
    """x [T, K] -> (x_q e4m3 [T, K], s_a): s_a [T, G] ("dynamic") or the static scale (0-d / [1])."""
    T, K = x.shape
    if quant.activation == "static":
        s = static_scale.float().reshape(())
        inv = torch.ones((), device=x.device) / s
        return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8), s
    s = act_scales(x, quant)  # [T, G]
    inv = torch.ones((), device=x.device) / s
    cols = torch.arange(K, device=x.device) // quant.act_group
    return (x.float() * inv[:, cols]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fake_quant_act(x: torch.Tensor, quant: QuantSpec, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> fp32 x_q * s_a (x itself, in fp32, for activation "none")."""
    if quant.activation == "none":
        return x.float()
    q, s = quantize_act(x, quant, static_scale)
    if quant.activation == "static":
        return q.float() * s
    cols = torch.arange(x.shape[1], device=x.device) // quant.act_group
    return q.float() * s[:, cols]


def weight_only(quant: QuantSpec | None) -> QuantSpec | None:
    """The spec's quantization with 16-bit activations (what the op's weight-only kernels compute)."""
    return None if quant is None else dataclasses.replace(quant, activation="none")
