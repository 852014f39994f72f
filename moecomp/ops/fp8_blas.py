"""The dense FP8 linear through torch's own block-scaled GEMM (``torch.nn.functional.scaled_mm``: BlockWise1x128
activations x BlockWise128x128 weights, cuBLAS on CUDA >= 12.9), for prefill-sized calls where it beats our Triton
kernel (``kernels/fp8_linear.py``).

    x [M, K] 16-bit --quantize_act (ours, one launch; scales column-major)--> x_q e4m3 [M, K], s_x [M, K / 128]
    y = scaled_mm(x_q, w.T, s_x, s_w.T)  (+ bias)          w [N, K] e4m3 row-major, s_w [N / 128, K / 128] fp32

The same codes and scales as our kernel's w8a8 path with activations quantized once, so the same numbers up to the
order of the fp32 sums. Measured on an H200 (``benchmarks/diag_fp8_linear.py``, 2026-12-02; its timings include a
column-major copy of the scales that the quantizer now writes directly): 0.58-0.78x our best tile's time where
M * N * K >= 2^32, 0.99x at the threshold itself (Qwen3-30B-A3B's o_proj at 512 rows), slower below (a 512-column
projection at 512 rows: 12.8 against 9.2 us). Hence ``MIN_MNK``.

A shape class (N, K, whether M is a multiple of 16) is tried once outside CUDA-graph capture; a refusal of the stack
(an older torch, an older CUDA, a layout it does not take) is remembered and that class keeps our kernel. Under
capture only classes already proven run here. MOECOMP_FP8_BLAS=0 turns the path off.
"""

from __future__ import annotations

import os

import torch

MIN_MNK = 1 << 32
_proven: dict = {}  # (device index, N, K, M % 16 == 0) -> True (ran) / False (refused)
stats = {"calls": 0, "refused": 0}
last_error: str | None = None


def available() -> bool:
    F = torch.nn.functional
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and os.environ.get("MOECOMP_FP8_BLAS", "1") != "0"


def takes(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, q) -> bool:
    """Whether a dynamic w8a8 call x2 [M, K] x weight [N, K] goes to torch's GEMM: 128 x 128 fp32 block scales,
    16-bit activations, row-major weight and scales, M * N * K >= MIN_MNK, and a shape class not refused."""
    M, K = x2.shape
    N = weight.shape[0]
    if not (x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16) and q.scale == "block"
            and (q.block_n, q.block_k) == (128, 128) and q.scale_dtype == "fp32" and M * N * K >= MIN_MNK
            and N % 16 == 0 and K % 16 == 0 and weight.is_contiguous() and weight_scale.is_contiguous()
            and available()):
        return False
    ok = _proven.get((x2.device.index, N, K, M % 16 == 0))
    if ok is None:  # untried: only outside a capture (a refusal inside one would end it)
        return not torch.cuda.is_current_stream_capturing()
    return ok


def linear(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias,
           dtype: torch.dtype) -> torch.Tensor | None:
    """xq [M, K] e4m3 and xs [M, K / 128] fp32 column-major (``triton_fp8.quantize_act(x2, col_major=True)``) ->
    y [M, N] in ``dtype``; None on a first refusal of this shape class (remembered: the caller runs our kernel)."""
    global last_error
    F = torch.nn.functional
    M, K = xq.shape
    key = (xq.device.index, weight.shape[0], K, M % 16 == 0)
    try:
        y = F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, weight_scale.t(),
                        F.ScalingType.BlockWise128x128, output_dtype=dtype)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        if key in _proven:  # a class that ran before: not the stack's refusal
            raise
        _proven[key] = False
        stats["refused"] += 1
        last_error = f"{type(e).__name__}: {str(e)[:300]}"
        return None
    _proven[key] = True
    stats["calls"] += 1
    return y if bias is None else y.add_(bias)
