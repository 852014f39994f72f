"""Dense linear over e4m3 weights (transformers' ``FP8Linear``; ``torch.ops.moecomp.fp8_linear``).

    y[m, n] = sum_k x_q[m, k] * w_q[n, k] * s_a[m, k // 128] * s_w[n // Q_BLOCK_N, k // Q_BLOCK_K]  (+ bias[n])
              x [M, K] (16-bit or fp32, rows of unit stride), w [N, K] e4m3, y [M, N] in x's dtype

One program per [BLOCK_M, BLOCK_N] output tile (grouped order: GROUP_M row blocks sweep the columns together); the
K loop is ``fp8.dot_loop`` (weight-only, dynamic or static activations; block, channel or tensor weight scales),
accumulated in fp32. At a few rows (decode: BLOCK_M = 16) the kernel is bound by the weight bytes, so the launcher
picks BLOCK_N for enough programs to keep every SM streaming.

Up to 4 rows, weight-only calls take the skinny kernel instead (``kernels/skinny.py``).
"""

import triton
import triton.language as tl

from . import fp8, kloop


@triton.jit
def fp8_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] e4m3, element (n, k) at n * stride_wn + k * stride_wk
    ws_ptr,  # weight scales: block [ceil(N / Q_BLOCK_N), ceil(K / Q_BLOCK_K)], channel [N], tensor [] (fp32 or uint8)
    as_ptr,  # static activation scale (one fp32) or None
    b_ptr,  # [N] bias or None
    y_ptr,  # [M, N] out
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,  # 1 block, 2 channel, 3 tensor
    A_QUANT: tl.constexpr,  # 0 weight-only, 1 dynamic, 2 static
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    stride_am=None,  # A_QUANT 3 (prequant): x_ptr e4m3 x, as_ptr its group scales [M, cdiv(K, 128)]
    FOLD: tl.constexpr = 0,  # w8a16 block scales folded into the weight tile (fp8.dot_loop)
):
    pid_m, pid_n = kloop.block_ids(tl.program_id(0), N, tl.cdiv(M, BLOCK_M), BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    n_ok = offs_n < N
    rows_n = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    b_ptrs = w_ptr + rows_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    a_scale = 1.0
    if A_QUANT == 2:
        a_scale = tl.load(as_ptr)
    if A_QUANT == 3:
        a_scale = as_ptr + offs_m.to(tl.int64) * stride_am
    ws_ptrs = fp8.scale_ptrs(ws_ptr, 0, rows_n, 0, N, stride_sn, W_SCALE, Q_BLOCK_N)
    acc = fp8.dot_loop(x_ptr + offs_m.to(tl.int64) * stride_xm, row_ok, b_ptrs, n_ok, K, stride_wk, ws_ptrs, stride_sk,
                       a_scale, A_QUANT, W_SCALE, Q_BLOCK_K, UE8M0, EXACT_CAST, UPCAST, DOT_PRECISION, BLOCK_M,
                       BLOCK_N, BLOCK_K, FOLD)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
