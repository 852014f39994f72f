"""Skinny linear: a few rows (decode, M <= 4) against a wide weight, bound by the weight's bytes.

    y[m, n] = sum_k x[m, k] * w[n, k] * s_w(n, k)  (+ bias[n])     m < ROWS <= 4
              x [M, K] 16-bit or fp32 (unit stride along K); w [N, K] 16-bit (no scales) or e4m3 with block
              [ceil(N / Q_BLOCK_N), ceil(K / Q_BLOCK_K)], channel [N] or tensor [] scales; y [M, N] in x's dtype

One program per BLOCK_N weight rows, all rows of x (no tensor cores: at M <= 4 a 16-row MMA tile would be 3/4
padding). Each K step loads a [BLOCK_N, BLOCK_K] weight tile, dequantizes it once in fp32 (block scales multiply
each Q_BLOCK_K-column group; channel / tensor scales the final sums) and multiplies it with every row of x:

    K steps:   w_tile [BN, BK] ---> (* s [BN, BK / Q_BLOCK_K] per group) ---> * x[m, k0:k0+BK] for m < ROWS
    REDUCE_END 1: acc_m [BN, BK] += products, summed over K once at the end (no reduction in the loop; registers
                  grow with ROWS * BN * BK)
    REDUCE_END 0: acc_m [BN] += sum over the step's BK columns (a reduction every step, small accumulators)

Narrow BLOCK_N gives N / BLOCK_N programs, so that even a 512-row projection keeps the SMs streaming, where an MMA
form's tiles of 16 x 64 leave most of them idle. The launcher (``ops/skinny.py``) picks the tiles.
"""

import triton
import triton.language as tl

from . import fp8


@triton.jit
def _dequant(w, ws_row, n_ok, k0, K, stride_sk, W_SCALE: tl.constexpr, Q_BLOCK_K: tl.constexpr,
             UE8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BN, BK] weight tile of K step k0 in fp32, its block scales applied (W_SCALE 1)."""
    wf = w.to(tl.float32)
    if W_SCALE == 1:
        if BLOCK_K <= Q_BLOCK_K:  # one scale column for the whole step
            s = fp8.load_scale(ws_row + (k0 // Q_BLOCK_K) * stride_sk, n_ok, UE8M0)  # [BN]
            wf = wf * s[:, None]
        else:
            G: tl.constexpr = BLOCK_K // Q_BLOCK_K
            cols = k0 // Q_BLOCK_K + tl.arange(0, G)
            s = fp8.load_scale(ws_row[:, None] + cols[None, :] * stride_sk,
                               n_ok[:, None] & (cols * Q_BLOCK_K < K)[None, :], UE8M0)  # [BN, G]
            wf = tl.reshape(tl.reshape(wf, [BLOCK_N, G, Q_BLOCK_K]) * s[:, :, None], [BLOCK_N, BLOCK_K])
    return wf


@triton.jit
def _row_step(acc, wf, x_row, k0, offs_k, k_ok, REDUCE_END: tl.constexpr):
    """One row's accumulator after K step k0: x_row points at the row's first element."""
    x = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    if REDUCE_END:
        acc += wf * x[None, :]
    else:
        acc += tl.sum(wf * x[None, :], axis=1)
    return acc


@triton.jit
def _row_store(acc, y_row, offs_n, n_ok, s_fin, bias, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
               REDUCE_END: tl.constexpr):
    if REDUCE_END:
        r = tl.sum(acc, axis=1)
    else:
        r = acc
    if W_SCALE >= 2:
        r = r * s_fin
    if HAS_BIAS:
        r = r + bias
    tl.store(y_row + offs_n, r.to(y_row.dtype.element_ty), mask=n_ok)


@triton.jit
def skinny_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    ws_ptr,  # weight scales (W_SCALE 1-3; see the module docstring) or None
    b_ptr,  # [N] bias or None
    y_ptr,  # [M, N]
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_ym,
    ROWS: tl.constexpr,  # M, 1..4
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,  # 0 none (16-bit weights), 1 block, 2 channel, 3 tensor
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    ws_row = ws_ptr
    if W_SCALE == 1:
        ws_row = ws_ptr + (rows_n // Q_BLOCK_N) * stride_sn  # [BN]
    if REDUCE_END:
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        wf = _dequant(w, ws_row, n_ok, k0, K, stride_sk, W_SCALE, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K)
        acc0 = _row_step(acc0, wf, x_ptr, k0, offs_k, k_ok, REDUCE_END)
        if ROWS > 1:
            acc1 = _row_step(acc1, wf, x_ptr + stride_xm, k0, offs_k, k_ok, REDUCE_END)
        if ROWS > 2:
            acc2 = _row_step(acc2, wf, x_ptr + 2 * stride_xm, k0, offs_k, k_ok, REDUCE_END)
        if ROWS > 3:
            acc3 = _row_step(acc3, wf, x_ptr + 3 * stride_xm, k0, offs_k, k_ok, REDUCE_END)
        w_ptrs += BLOCK_K
    s_fin = 1.0
    if W_SCALE == 2:
        s_fin = fp8.load_scale(ws_ptr + rows_n * stride_sn, n_ok, UE8M0)
    elif W_SCALE == 3:
        s_fin = fp8.load_scale(ws_ptr + rows_n * 0, n_ok, UE8M0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    _row_store(acc0, y_ptr, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 1:
        _row_store(acc1, y_ptr + stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 2:
        _row_store(acc2, y_ptr + 2 * stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 3:
        _row_store(acc3, y_ptr + 3 * stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
