"""Grouped GEMMs for many tokens on Hopper: tensor-memory-accelerator (TMA) loads, persistent programs, and Triton's
warp specialisation (a producer warp group issues the TMA loads while the others run the MMAs).

    gemm2:  y[p(s), n] = (h[s] . w2_e[n] + b2) * weight[p(s)]     h: [S, I] in sorted order -> y: [P, H] in pair order
    gemm1:  h[s, n] = act(x[tok(s)] . w1_e[n] + b1) * (x[tok(s)] . w3_e[n] + b3)                 h: [S, I] sorted
            (gather_rows_kernel first copies x's rows into sorted order when A is read by TMA too)

Same data and layout contract as ``grouped_gemm.py`` (sorted_ids, block_expert, num_padded from the alignment),
with limits the launchers check (``ops/tma.tma_ok`` / ``tma1_ok``): weights in the [E, out, in] layout and
contiguous (w2 reads as one 2-D [E * H, I] matrix, w13 with concatenated gate/up as [E, 2, I, H]); 16-bit dtypes;
rows of whole 16-byte units. gemm2's h is already in sorted order, so both its operands are plain TMA tiles, and
its epilogue scatters rows to pair order with pointer stores.

A gemm2 tile straddling the end of an expert's H rows reads the next expert's first rows (or zeros past the last):
those are output columns >= H, which are never stored. gemm1's box has the expert and the gate/up half as their own
dimensions, so past I it reads zeros. Past K the descriptors read zeros. The persistent loops run over the tiles of
the padded rows only (num_padded, read on the device), in ``kloop.block_ids`` order, so the grid is static
(capturable) and padding costs no tile.

Measured on an H200 (2026-11-30 / 12-01, ``benchmarks/NOTES.md``): gemm2 on TMA is 1.06-1.33x faster than the
pointer kernel from T=1024 (the tuner takes it there). Two earlier gemm1 forms lost (gate and up as two boxes in
two dots: 6-29% slower; the two boxes joined in registers into one operand: 2.1-2.7x slower). This gemm1 (one box
holding both halves, one dot per K step) is not yet measured, and only a config that asks for it runs it.
"""

import triton
import triton.language as tl

from . import pdl
from .activations import act as _act
from .activations import gated as _gated
from .kloop import block_ids


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
    WEIGHTED: tl.constexpr = True,  # off: MoESpec.weight_on_input (gemm1 applied the weights), as in grouped_gemm
):
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = block_ids(tile, N, n_m, BLOCK_N, GROUP_M)
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
        if WEIGHTED:
            acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    pdl.release(USE_PDL)


@triton.jit
def gather_rows_kernel(
    x_ptr,  # [T, K]
    sorted_ptr,  # [S] pair of each sorted row (P on padding rows)
    num_padded_ptr,
    xs_ptr,  # [S, K] out: x's row of each sorted row, 0 on padding rows
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
    if tl.program_id(0) * BLOCK_R >= tl.load(num_padded_ptr):
        return
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
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
    x_ptr,  # [T, K] (rows gathered by pointer loads) when not A_TMA
    xs_desc,  # [S, K] x's rows in sorted order (gather_rows_kernel), block [BLOCK_M, BLOCK_K], when A_TMA
    w_desc,  # gated: w13 as [E, 2, N_OUT, K], box [1, 2, BLOCK_N, BLOCK_K]; else [E, N_OUT, K], [1, BLOCK_N, BLOCK_K]
    b_ptr,  # [E, 2 * N_OUT] (gated) or [E, N_OUT] bias, or None
    h_ptr,  # [S, N_OUT] out, sorted order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    TOP_K,
    N_OUT,  # I
    K,  # H
    stride_xm,
    stride_be,
    stride_hm,
    alpha,
    limit,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    A_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TILE_N: tl.constexpr,  # 2 * BLOCK_N when gated, else BLOCK_N
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    topk_w_ptr=None, W_ON_INPUT: tl.constexpr = False,  # MoESpec.weight_on_input, as in grouped_gemm
):
    """gemm1 on TMA weight boxes. Gated: one box holds the gate rows [n0, n0 + BLOCK_N) and the up rows of the same
    columns (the [E, 2, I, K] view of concatenated gate/up), read as one [2 BLOCK_N, BLOCK_K] operand: a single
    [BM, 2 BN] dot per K step, whose halves are split once per tile. A: TMA tiles of the gathered copy (A_TMA), or
    x's rows by pointer loads."""
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = block_ids(tile, N_OUT, n_m, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < P
        a_ptrs = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a, b = gemm1_tiles(xs_desc, a_ptrs, w_desc, row_ok, offs_k, expert, pid_m * BLOCK_M, pid_n * BLOCK_N, k0,
                               K, A_TMA, GATED, TILE_N, BLOCK_K)
            if not A_TMA:
                a_ptrs += BLOCK_K
            acc = tl.dot(a, b.T, acc)  # [BM, TILE_N]: gated, gate columns then up columns
        if W_ON_INPUT:  # (weight * x) . w, before the bias and the activation
            acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_OUT
        h = act_epilogue(acc, b_ptr, expert, stride_be, offs_n, n_ok, N_OUT, alpha, limit, GATED, ACT, CLAMP, HAS_BIAS,
                         BLOCK_M, BLOCK_N)
        h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    pdl.release(USE_PDL)


@triton.jit
def gemm1_tiles(xs_desc, a_ptrs, w_desc, row_ok, offs_k, expert, row0, n0, k0, K, A_TMA: tl.constexpr,
                GATED: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step's tiles of a TMA gemm1: A [BM, BK] (a TMA box of x gathered into sorted order, or x's rows by
    pointer loads at ``a_ptrs``) and the weights [TILE_N, BK] (gated: the box of gate and up rows of columns n0..)."""
    if A_TMA:
        a = xs_desc.load([row0, k0])
    else:
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
    if GATED:
        b = tl.reshape(w_desc.load([expert, 0, n0, k0]), [TILE_N, BLOCK_K])
    else:
        b = tl.reshape(w_desc.load([expert, n0, k0]), [TILE_N, BLOCK_K])
    return a, b


@triton.jit
def act_epilogue(acc, b_ptr, expert, stride_be, offs_n, n_ok, N_OUT, alpha, limit, GATED: tl.constexpr,
                 ACT: tl.constexpr, CLAMP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """A TMA gemm1 tile's fp32 accumulator [BM, TILE_N] -> h [BM, BN] (fp32): gated, the gate columns then the up
    columns of output columns ``offs_n`` split apart, their biases added (b [E, 2 * N_OUT]: gate then up), then
    act(gate) * up; else bias and act. Shared by the 16-bit and FP8 TMA gemm1s."""
    if GATED:
        g, u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
        if HAS_BIAS:
            bias = b_ptr + expert.to(tl.int64) * stride_be + offs_n
            g += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            u += tl.load(bias + N_OUT, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        h = _gated(g, u, alpha, limit, ACT, CLAMP)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[
                None, :]
        h = _act(acc, ACT)
    return h
