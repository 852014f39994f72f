"""The oracle's activation quantization of a quantized GEMM's input (``QuantSpec.activation``; docs/FP8.md).

Per-token dynamic activations (``act_group`` 0, ``QuantSpec.per_token``: compressed-tensors' FP8-dynamic "token"
strategy) are written out here on their own, apart from the codecs the op shares (``moecomp.core.quant``), so that
the op's per-token path is checked against a second implementation:

    s_a[t]   = max(max_k |x[t, k]|, 1e-10) / 448            one fp32 scale per row (an IEEE division)
    x_q[t]   = e4m3(clamp(x[t] * (1 / s_a[t]), +-448)) * s_a[t]

Every other scheme (groups of 128 columns, static, weight-only) is ``moecomp.core.quant.fake_quant_act``.
"""

from __future__ import annotations

import torch

from ..core import quant as q8
from ..core.spec import FP8_MAX, QuantSpec

PER_TOKEN_EPS = 1e-10  # the smallest row amax a per-token scale is taken from (an all-zero row)


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
