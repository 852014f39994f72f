"""FP8 launch helpers of the Triton path (docs/FP8.md): the quantized GEMMs' extra kernel arguments, their tile
rules, and the dense ``fp8_linear`` (``torch.ops.moecomp.fp8_linear``'s CUDA path, through ``triton_moe.fp8_linear``).

    quant_kwargs(quant, scale, act_scale, mode)   -> the trailing arguments of moe_gemm1/2_kernel and
                                                     fp8_linear_kernel: scale pointer and strides, W_SCALE,
                                                     A_QUANT, block sizes, UE8M0, EXACT_CAST (the interpreter)
    fp8_tile(c, kw)                                -> c with a BLOCK_K the quantization allows
    fp8_linear(x, weight, weight_scale, bias, act_scale, q)   y = x_q @ (q_w * s_w).T (+ bias), x's dtype

The mode ("w8a8" | "w8a16") of a call: ``tuning.fp8_mode``. ue8m0 scales reach the kernels as their bytes
(``.view(torch.uint8)``); the kernels decode them.
"""

from __future__ import annotations

import torch
import triton

from ..kernels import fp8_linear as fp8_linear_k
from . import tuning
from .common import _interpret, _precision, _sm_count, _upcast

W_SCALE = {"block": 1, "channel": 2, "tensor": 3}
ACT_GROUP = 128


def quant_kwargs(quant, scale: torch.Tensor, act_scale: torch.Tensor | None, mode: str, experts: bool = True) -> dict:
    """Kernel arguments of one quantized GEMM. ``scale``: the weight scales (per expert [E, ...] when ``experts``,
    else a 2-D weight's); ``act_scale``: static activation scales ([E], or one value), used in "w8a8" mode of a
    "static" spec; ``mode``: ``tuning.fp8_mode``'s answer."""
    if quant.scale_dtype == "ue8m0":
        scale = scale.view(torch.uint8)
    strides = list(scale.stride()) if experts else [0, *scale.stride()]
    strides += [0] * (3 - len(strides))
    a_quant = 0
    if mode == "w8a8":
        a_quant = 2 if quant.activation == "static" else 1
    if a_quant == 2:
        act_scale = act_scale.reshape(-1)
        if act_scale.numel() > 1 and act_scale.stride(0) != 1:
            act_scale = act_scale.contiguous()
    return dict(ws_ptr=scale, as_ptr=act_scale if a_quant == 2 else None, stride_se=strides[0],
                stride_sn=strides[1], stride_sk=strides[2], W_SCALE=W_SCALE[quant.scale], A_QUANT=a_quant,
                Q_BLOCK_N=quant.block_n, Q_BLOCK_K=quant.block_k, UE8M0=quant.scale_dtype == "ue8m0",
                EXACT_CAST=_interpret())


def fp8_tile(c: dict, kw: dict | None) -> dict:
    """``c`` with its BLOCK_K halved until it divides the weight blocks' block_k (block scales) and the 128-column
    activation group (dynamic activations); a tuned or heuristic FP8 tile has 128 already."""
    if kw is None:
        return c
    bk = c["BLOCK_K"]
    while bk > 16 and ((kw["W_SCALE"] == 1 and kw["Q_BLOCK_K"] % bk) or (kw["A_QUANT"] == 1 and ACT_GROUP % bk)):
        bk //= 2
    return c if bk == c["BLOCK_K"] else dict(c, BLOCK_K=bk)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, act_scale, q,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] x weight [N, K] e4m3 -> [..., N] in x's dtype (``kernels/fp8_linear.py``). ``out``: a [M, N] view
    with unit column stride to write into (the shared experts' gate / up halves), returned as is."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if M:
        kw = quant_kwargs(q, weight_scale, act_scale, tuning.fp8_mode(q, M), experts=False)
        c = fp8_tile(tuning.fp8_linear_config(M, N, K, x.device, _sm_count(x.device)), kw)
        del kw["stride_se"]
        if bias is not None and bias.stride(-1) != 1:
            bias = bias.contiguous()
        grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)
        fp8_linear_k.fp8_linear_kernel[grid](
            x2, weight, kw.pop("ws_ptr"), kw.pop("as_ptr"), bias, y, M, N, K, x2.stride(0), weight.stride(0),
            weight.stride(1), kw.pop("stride_sn"), kw.pop("stride_sk"), y.stride(0),
            HAS_BIAS=bias is not None, UPCAST=_upcast(x2), DOT_PRECISION=_precision(x2), BLOCK_M=c["BLOCK_M"],
            BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"], num_warps=c["num_warps"],
            num_stages=c["num_stages"], **kw,
        )
    return y if out is not None else y.reshape(*x.shape[:-1], N)
