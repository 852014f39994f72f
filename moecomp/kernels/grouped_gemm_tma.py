"""Grouped GEMMs for many tokens on Hopper: tensor-memory-accelerator (TMA) loads, persistent programs, and Triton's
warp specialisation (a producer warp group issues the TMA loads while the others run the MMAs).

    gather_rows:  xs[s] = x[sorted_ids[s] // k]  (0 on padding rows)                  xs: [S, K] in sorted order
    gemm1:        h[s, n]    = act(xs[s] . w1_e[n] + b1) * (xs[s] . w3_e[n] + b3)      h:  [S, I]
    gemm2:        y[p(s), n] = (h[s] . w2_e[n] + b2) * weight[p(s)]                    y:  [P, H] in pair order

Same data and layout contract as ``grouped_gemm.py`` (sorted_ids, block_expert, num_padded from the alignment),
with these limits, which the launcher checks: weights in the [E, out, in] layout, contiguous, so that they read as
one 2-D [E * out, in] matrix (gate rows e * 2I + n and up rows e * 2I + I + n when gated: concatenated gate/up);
16-bit dtypes; row strides of 16-byte multiples. TMA needs rows it can copy whole, so gemm1 reads x through the
gathered copy xs, and gemm2 reads h as it is (already in sorted order).

A tile (BLOCK_M rows of one expert, BLOCK_N output columns) straddling the end of an expert's weight rows reads the
next expert's first rows (or zeros past the last): those are output columns >= I (or H), which are never stored.
Past K the descriptors read zeros. The persistent loop runs over the tiles of the padded rows only (num_padded,
read on the device), in ``grouped_gemm._block_ids`` order, so the grid is static (capturable) and padding costs no
tile.
"""

import triton
import triton.language as tl

from . import pdl
from .activations import act as _act
from .activations import gated as _gated
from .grouped_gemm import _block_ids


@triton.jit
def gather_rows_kernel(
    x_ptr,  # [T, K]
    sorted_ptr,  # [S] pair of each sorted row (P on padding rows)
    num_padded_ptr,
    xs_ptr,  # [S, K] out
    P,
    TOP_K,
    K,
    stride_xm,
    stride_sm,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ptr + offs_r)
    row_ok = pair < P
    tok = (pair // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        v = tl.load(x_ptr + tok[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        tl.store(xs_ptr + offs_r.to(tl.int64)[:, None] * stride_sm + (k0 + offs_k)[None, :], v, mask=k_ok[None, :])


@triton.jit
def moe_gemm1_tma_kernel(
    xs_desc,  # [S, K] gathered rows, block [BLOCK_M, BLOCK_K]
    w_desc,  # [E * W_ROWS, K], block [BLOCK_N, BLOCK_K]
    b_ptr,  # [E, W_ROWS] bias or None
    h_desc,  # [S, N_OUT] out, block [BLOCK_M, BLOCK_N]
    block_expert_ptr,
    num_padded_ptr,
    N_OUT,  # I
    K,  # H
    stride_be,
    alpha,
    limit,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,  # the grid: tiles are dealt out round-robin
    WARP_SPECIALIZE: tl.constexpr,
    JOIN_B: tl.constexpr = False,  # gated: one dot on the interleaved gate/up tile instead of two
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    w_rows = 2 * N_OUT if GATED else N_OUT
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _block_ids(tile, N_OUT, n_m, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        row0 = pid_m * BLOCK_M
        wr = expert * w_rows + pid_n * BLOCK_N  # gate (or only) rows; up rows N_OUT further
        if GATED and JOIN_B:
            # one [BM, 2 BN] dot per K step: gate and up tiles interleaved (row 2c gate c, row 2c + 1 up c)
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                gu = tl.join(w_desc.load([wr, k0]), w_desc.load([wr + N_OUT, k0]))  # [BN, BK, 2]
                b = tl.reshape(tl.permute(gu, (0, 2, 1)), [2 * BLOCK_N, BLOCK_K])
                acc = tl.dot(xs_desc.load([row0, k0]), b.T, acc)
            acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = xs_desc.load([row0, k0])  # [BM, BK]
                acc_g = tl.dot(a, w_desc.load([wr, k0]).T, acc_g)  # [BM, BN]
                if GATED:
                    acc_u = tl.dot(a, w_desc.load([wr + N_OUT, k0]).T, acc_u)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = b_ptr + expert.to(tl.int64) * stride_be + offs_n
            n_ok = offs_n < N_OUT
            acc_g += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(bias + N_OUT, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            h = _gated(acc_g, acc_u, alpha, limit, ACT, CLAMP)
        else:
            h = _act(acc_g, ACT)
        h_desc.store([row0, pid_n * BLOCK_N], h.to(h_desc.dtype))  # columns >= N_OUT are clipped by the descriptor
    pdl.release(USE_PDL)


@triton.jit
def moe_gemm2_tma_kernel(
    h_desc,  # [S, K] sorted order, block [BLOCK_M, BLOCK_K]
    w_desc,  # [E * N, K], block [BLOCK_N, BLOCK_K]
    b_ptr,  # [E, N] bias or None
    topk_w_ptr,  # [P] fp32 routing weights (pair order)
    y_ptr,  # [P, N] out, pair order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,  # H
    K,  # I
    stride_be,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _block_ids(tile, N, n_m, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        row0 = pid_m * BLOCK_M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(h_desc.load([row0, k0]), w_desc.load([expert * N + pid_n * BLOCK_N, k0]).T, acc)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        pair = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
        row_ok = pair < P
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    pdl.release(USE_PDL)
