"""FP8 grouped GEMMs on Hopper's tensor memory accelerator: the TMA kernels of ``grouped_gemm_tma.py`` with e4m3
operands on both sides (w8a8 on activations quantized once, "prequant": docs/FP8.md) and the scales applied per
K step (fp32 accumulation, one 128-column group of K per step).

    gemm2:  y[p(s), n] = (sum_g (h_q[s, g] . w2_q[n, g]) * s_h[s, g] * s_w[n, g] + b2) * weight[p(s)]
                h_q: [S, I] e4m3 in sorted order (gemm1's Q_OUT epilogue, or ``quant_act_kernel``), s_h [S, I/128]
    gemm1:  acc[s, j] = sum_g (x_q[row(s), g] . w13_q[j, g]) * s_x[row(s), g] * s_w[j, g]      j over gate | up
            h[s, n]   = act(acc[s, n] + b1) * (acc[s, I + n] + b3)      stored in x's dtype, or (Q_OUT) as e4m3 codes
                        and 128-column group scales that gemm2 reads: ``fp8.quant_groups`` of h rounded to x's dtype
            A_TMA: x_q [S, H] gathered into sorted order and quantized in one pass (``quant_act_kernel`` GATHER),
            read by TMA; else x_q [T, H] (quantized once per token) read by pointer loads of each row's token

    tiles:  A [BLOCK_M, BLOCK_K] e4m3 (TMA box, or rows by pointer), B [BLOCK_N, BLOCK_K] e4m3 (TMA box; gemm1's
            gated box [1, 2, BLOCK_N, BLOCK_K] of w13 read as [E, 2, I, H]: gate rows then up rows), one fp8 x fp8
            dot per K step (B K-major, as wgmma's fp8 form needs), its [BM, BN] fp32 product promoted to the
            accumulator times s_a[:, None] * s_w[None, :] (block scales; channel / tensor weight scales multiply
            once after the loop).

Weight-scale rows (``fp8.scale_ptrs``): block [E, cdiv(rows, Q_BLOCK_N), cdiv(K, Q_BLOCK_K)] (a gated w13's up rows
read the second half of the scale rows), channel [E, rows], tensor [E]; fp32, or ue8m0 exponent bytes (UE8M0).
BLOCK_K divides 128 and Q_BLOCK_K. Rows past num_padded are never visited; padding rows inside a tile (sentinel
pair P) compute from whatever their A rows hold and are never stored. Same data contract as the 16-bit TMA kernels
otherwise (sorted_ids, block_expert, num_padded from the alignment; persistent programs over the padded rows'
tiles in ``kloop.block_ids`` order; optional warp specialisation).
"""

import triton
import triton.language as tl

from . import fp8, pdl
from .kloop import block_ids
from .grouped_gemm_tma import act_epilogue, gemm1_tiles


@triton.jit
def _scaled_step(acc, a, b, s_a, ws, ws_hi, n_ok, k0, stride_sk, W_SCALE: tl.constexpr, Q_BLOCK_K: tl.constexpr,
                 UE8M0: tl.constexpr, WS_SCALAR: tl.constexpr, SPLIT: tl.constexpr):
    """acc + (a . b^T) * s_a[:, None] (* the step's block weight scales [None, :]): one K step, promoted in fp32.
    Block scales: ``ws`` the tile columns' [N] scale pointers, or (WS_SCALAR: the tile lies in one block of rows, or
    gemm1's gate and up halves each do) one scalar pointer for columns < SPLIT and ``ws_hi`` for the rest (SPLIT 0:
    ``ws`` for every column). Scalars keep a [N] pointer vector out of the registers the accumulator needs."""
    part = tl.dot(a, b.T)
    if W_SCALE == 1:
        kb = (k0 // Q_BLOCK_K) * stride_sk
        if WS_SCALAR:
            lo = fp8.load_scale(ws + kb, True, UE8M0)
            if SPLIT:
                s_w = tl.where(tl.arange(0, part.shape[1]) < SPLIT, lo, fp8.load_scale(ws_hi + kb, True, UE8M0))
                acc += part * (s_a[:, None] * s_w[None, :])
            else:
                acc += part * (s_a * lo)[:, None]
        else:
            s_w = fp8.load_scale(ws + kb, n_ok, UE8M0)
            acc += part * (s_a[:, None] * s_w[None, :])
    else:
        acc += part * s_a[:, None]
    return acc


@triton.jit
def moe_gemm2_tma_fp8_kernel(
    h_desc,  # e4m3 [S, K] sorted order, box [BLOCK_M, BLOCK_K]
    hs_ptr,  # fp32 [S, cdiv(K, 128)] h's group scales (row stride stride_hsm)
    w_desc,  # e4m3 [E * N, K], box [BLOCK_N, BLOCK_K]
    ws_ptr,  # weight scales (see the module docstring)
    b_ptr,  # [E, N] bias or None
    topk_w_ptr,  # [P] fp32 routing weights (pair order)
    y_ptr,  # [P, N] out, pair order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,  # H
    K,  # I
    stride_hsm,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_ym,
    W_SCALE: tl.constexpr,
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    WS_SCALAR: tl.constexpr = False,  # block scales, Q_BLOCK_N a multiple of BLOCK_N: one weight scale per step
    USE_PDL: tl.constexpr = 0,
    WEIGHTED: tl.constexpr = True,  # off: MoESpec.weight_on_input (gemm1 applied the weights)
):
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = block_ids(tile, N, n_m, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        row0 = pid_m * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if WS_SCALAR:  # the tile's one row of block scales
            ws = ws_ptr + expert.to(tl.int64) * stride_se + (pid_n * BLOCK_N // Q_BLOCK_N) * stride_sn
        else:
            ws = fp8.scale_ptrs(ws_ptr, expert.to(tl.int64) * stride_se, offs_n.to(tl.int64), 0, N, stride_sn,
                                W_SCALE, Q_BLOCK_N)  # [BN]
        hs = hs_ptr + offs_m.to(tl.int64) * stride_hsm  # [BM]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = h_desc.load([row0, k0])
            b = w_desc.load([expert * N + pid_n * BLOCK_N, k0])
            acc = _scaled_step(acc, a, b, tl.load(hs + k0 // 128), ws, ws, n_ok, k0, stride_sk, W_SCALE, Q_BLOCK_K,
                               UE8M0, WS_SCALAR, 0)
        if W_SCALE != 1:
            acc = acc * fp8.load_scale(ws, n_ok, UE8M0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok,
                           other=0.0).to(tl.float32)[None, :]
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < P
        if WEIGHTED:
            acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    pdl.release(USE_PDL)


@triton.jit
def moe_gemm1_tma_fp8_kernel(
    xq_ptr,  # e4m3 [T, K] x quantized once (rows by pointer loads) when not A_TMA
    xs_desc,  # e4m3 [S, K] x gathered into sorted order and quantized, box [BLOCK_M, BLOCK_K], when A_TMA
    as_ptr,  # fp32 A group scales: [S, cdiv(K, 128)] (A_TMA) or [T, cdiv(K, 128)], row stride stride_am
    w_desc,  # gated: w13 as [E, 2, N_OUT, K], box [1, 2, BLOCK_N, BLOCK_K]; else [E, N_OUT, K], [1, BLOCK_N, BLOCK_K]
    ws_ptr,  # weight scales (see the module docstring)
    b_ptr,  # [E, 2 * N_OUT] (gated) or [E, N_OUT] bias, or None
    h_ptr,  # [S, N_OUT] out, sorted order: x's dtype, or e4m3 codes (Q_OUT)
    hs_ptr,  # Q_OUT: fp32 [S, cdiv(N_OUT, 128)] h's group scales (row stride stride_hsm), else None
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    TOP_K,
    N_OUT,  # I
    K,  # H
    stride_xm,
    stride_am,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_hm,
    stride_hsm,
    alpha,
    limit,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    A_TMA: tl.constexpr,
    W_SCALE: tl.constexpr,
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    Q_OUT: tl.constexpr,  # 0: h in h_ptr's dtype; 1 / 2 / 3: e4m3 codes of h rounded to fp32 / bf16 / fp16 first
    EXACT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TILE_N: tl.constexpr,  # 2 * BLOCK_N when gated, else BLOCK_N
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    WS_SCALAR: tl.constexpr = False,  # block scales, Q_BLOCK_N a multiple of BLOCK_N: one scale per step and half
    USE_PDL: tl.constexpr = 0,
    topk_w_ptr=None, W_ON_INPUT: tl.constexpr = False,  # MoESpec.weight_on_input, as in grouped_gemm
):
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, TILE_N)
    if GATED:  # tile column j: the gate (0) or up (1) row of output column n0 + j % BLOCK_N
        half = offs_j // BLOCK_N
    else:
        half = offs_j * 0
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = block_ids(tile, N_OUT, n_m, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < P
        col_n = pid_n * BLOCK_N + offs_j % BLOCK_N  # [TILE_N]
        col_ok = col_n < N_OUT
        if WS_SCALAR:  # the gate half's row of block scales, and the up half's (gate and up blocked apart)
            ws = ws_ptr + expert.to(tl.int64) * stride_se + (pid_n * BLOCK_N // Q_BLOCK_N) * stride_sn
            ws_hi = ws + tl.cdiv(N_OUT, Q_BLOCK_N) * stride_sn
        else:
            ws = fp8.scale_ptrs(ws_ptr, expert.to(tl.int64) * stride_se, (col_n + half * N_OUT).to(tl.int64), half,
                                N_OUT, stride_sn, W_SCALE, Q_BLOCK_N)  # [TILE_N]
            ws_hi = ws
        tok = (pair // TOP_K).to(tl.int64)
        a_ptrs = xq_ptr + tok[:, None] * stride_xm + offs_k[None, :]  # (A_TMA: unused)
        if A_TMA:
            a_scale = as_ptr + offs_m.to(tl.int64) * stride_am
        else:
            a_scale = as_ptr + tok * stride_am
        acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a, b = gemm1_tiles(xs_desc, a_ptrs, w_desc, row_ok, offs_k, expert, pid_m * BLOCK_M, pid_n * BLOCK_N, k0,
                               K, A_TMA, GATED, TILE_N, BLOCK_K)
            if not A_TMA:
                a_ptrs += BLOCK_K
            s_a = tl.load(a_scale + k0 // 128, mask=row_ok, other=0.0)
            acc = _scaled_step(acc, a, b, s_a, ws, ws_hi, col_ok, k0, stride_sk, W_SCALE, Q_BLOCK_K, UE8M0, WS_SCALAR,
                               BLOCK_N if GATED else 0)
        if W_SCALE != 1:
            acc = acc * fp8.load_scale(ws, col_ok, UE8M0)[None, :]
        if W_ON_INPUT:  # (weight * x) . w, before the bias and the activation
            acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_OUT
        h = act_epilogue(acc, b_ptr, expert, stride_be, offs_n, n_ok, N_OUT, alpha, limit, GATED, ACT, CLAMP, HAS_BIAS,
                         BLOCK_M, BLOCK_N)
        h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
        if Q_OUT:  # h as gemm2 reads it: rounded to x's dtype, then quantized per 128-column group
            hq, hsc = fp8.quant_groups(tl.where(n_ok[None, :], fp8.round_to(h, Q_OUT), 0.0), BLOCK_M, BLOCK_N,
                                       EXACT_CAST)
            tl.store(h_ptrs, hq, mask=row_ok[:, None] & n_ok[None, :])
            offs_g = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
            tl.store(hs_ptr + offs_m.to(tl.int64)[:, None] * stride_hsm + offs_g[None, :], hsc,
                     mask=row_ok[:, None] & (offs_g < tl.cdiv(N_OUT, 128))[None, :])
        else:
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    pdl.release(USE_PDL)
