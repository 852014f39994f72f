"""The oracle's activation quantization of a quantized GEMM's input (``QuantSpec.activation``; docs/FP8.md).

Per-token dynamic activations (``act_group`` 0, ``QuantSpec.per_token``: compressed-tensors' FP8-dynamic "token"
strategy) are written out here on their own, apart from the codecs the op shares (``moecomp.core.quant``), so that
the op's per-token path is checked against a second implementation:

    s_a[t]   = max(max_k |x[t, k]|, 1e-10) / 448            one fp32 scale per row (an IEEE division)
    x_q[t]   = e4m3(clamp(x[t] * (1 / s_a[t]), +-448)) * s_a[t]

Every other scheme (groups of 128 columns, static, weight-only) is ``moecomp.core.quant.fake_quant_act``.

4-bit weights in the "mma" layout (``QuantSpec.layout``) are read back to the packed bytes here, by a decode of the
oracle's own (not the ops' ``w4_layout.restore``), re-derived from the layout's definition: a row is 32-bit words
(4 bytes, little-endian); packed, column 8w + c of word w sits at bits 4c .. 4c + 3 (the nibble  s e1 e0 m  of an
e2m1 code, or the int4 code); mma (mxfp4), column 8w + 4L + j (lane L = 0, 1; slot j = 0..3) has its bits e1 e0 m
at word bits 16L + 3j .. 16L + 3j + 2 and its sign s at bit 16L + 15 - j; mma (int4) is the packed layout itself.
The decode is one gather of bits: ``MMA_BIT_OF[p]`` is the mma bit that packed bit p came from.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import quant as q8
from ..core.spec import FP8_MAX, QuantSpec

PER_TOKEN_EPS = 1e-10  # the smallest row amax a per-token scale is taken from (an all-zero row)


def _mma_bit_of() -> list[int]:
    """For each bit p of a packed word (column p // 4, its bit p % 4: 0, 1, 2 = m, e0, e1 (em's bits), 3 = the
    sign), the bit of the mxfp4 mma word that holds it (the module docstring)."""
    out = []
    for p in range(32):
        lane, j = divmod(p // 4, 4)
        out.append(16 * lane + 15 - j if p % 4 == 3 else 16 * lane + 3 * j + p % 4)
    return out


MMA_BIT_OF = _mma_bit_of()


def packed_codes(q: torch.Tensor, quant: QuantSpec) -> torch.Tensor:
    """4-bit weight bytes [..., rows, K / 2] in ``quant.layout`` -> the packed bytes (the same tensor when packed)."""
    if not quant.packed or quant.layout == "packed" or quant.weight == "int4":
        return q
    if q.shape[-1] % 4:
        raise ValueError(f"q: the mma layout holds rows of whole 32-bit words; got {q.shape[-1]} bytes a row")
    shifts = torch.arange(8, device=q.device, dtype=torch.uint8)
    bits = (q.unsqueeze(-1) >> shifts) & 1  # [..., K / 2, 8]: byte b's bit i = word bit 8 (b % 4) + i
    words = bits.reshape(*q.shape[:-1], q.shape[-1] // 4, 32)
    picked = words[..., torch.tensor(MMA_BIT_OF, device=q.device)]  # packed bit p <- mma bit MMA_BIT_OF[p]
    return (picked.reshape(*q.shape, 8) << shifts).sum(-1, dtype=torch.uint8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, halves: int = 1,
                      zero: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 weights of ``q`` in ``quant``'s layout: the mma layout read back to packed bytes (``packed_codes``),
    then the shared codec (``moecomp.core.quant.dequantize``) on the packed spec."""
    if quant.packed and quant.layout != "packed":
        q, quant = packed_codes(q, quant), dataclasses.replace(quant, layout="packed")
    return q8.dequantize(q, scale, quant, halves, zero)


def per_token_scales(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> [T, 1] fp32: the row's largest magnitude over 448 (at least 1e-10 / 448)."""
    amax = x.float().abs().max(dim=1, keepdim=True).values.clamp(min=PER_TOKEN_EPS)
    return amax / torch.full_like(amax, FP8_MAX)


def fake_quant_act(x: torch.Tensor, quant: QuantSpec, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] as the quantized GEMM multiplies it, fp32 (x itself for weight-only specs)."""
    if not quant.per_token:
        return q8.fake_quant_act(x, quant, static_scale)
    s = per_token_scales(x)
    inv = torch.ones_like(s) / s
    codes = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.float() * s
