"""Skinny routed experts for decode: each (token, slot) pair is one row against its expert's weights, so at a few
tokens the experts are GEMVs bound by the weight bytes; these run them without tensor cores (``skinny.py``'s K
loop: wide [BN, BK] weight tiles, dequantized once in fp32, times the row).

    skinny_gemm1_kernel   one program per (pair p, BLOCK_N columns of I):
                              e = ids[p], t = p // k
                              g[n] = x[t] . w1_e[n],  u[n] = x[t] . w3_e[n]        [BN] each, fp32
                              h[p, n] = act(g (+ b1)) * (u (+ b3))                 h: [P, I] pair order, x's dtype
    skinny_down_kernel    one program per (token t, BLOCK_N columns of H):
                              for slot j < k:  p = t * k + j,  e = ids[p]
                                  r_j[n] = h[p] . w2_e[n] (+ b2_e)                  [BN] fp32
                              out[t, n] = sum_j weight[p] * r_j (+ sigmoid(gate[t]) * shared[t, n])     one store

    weights [E, rows, K] with unit stride along K; 16-bit (W_SCALE 0) or e4m3 with block / channel / tensor scales
    (1 / 2 / 3, ``fp8.scale_ptrs``: a gated w13's up rows read the second half of the block-scale rows); weight-only
    (the row stays 16-bit: the op runs a "dynamic" FP8 spec so where this path is chosen; "static" specs never come
    here). Gate / up concatenated (UP_OFFSET = I, GATE_STRIDE 1) or interleaved (0 / 1 and GATE_STRIDE 2, 16-bit).

    W_ON_INPUT (``MoESpec.weight_on_input``): g and u times weight[p] before the bias; WEIGHTED off sums the slots
    unweighted. ZERO_EXPERTS (``MoESpec.zero_experts``): a pair with e >= n_experts writes no h and adds
    weight[p] * x[t] in the down kernel.

The MMA decode path (``grouped_gemm.moe_gemm1_kernel`` DIRECT + ``decode.moe_down_combine_kernel``) pads each pair
to a 16-row tile and runs one program per (pair, 2 x BLOCK_N columns), too few to keep every SM streaming at T=1;
here narrow tiles give P * I / BLOCK_N programs, each with a few KiB of weights in flight per step. The launcher
(``ops/skinny_moe.py``) picks the tiles and where this path runs (measured).
"""

import triton
import triton.language as tl

from . import fp8, pdl
from .activations import act as _act
from .activations import gated as _gated
from .skinny import accumulate, dequant, reduce


@triton.jit
def _final_scale(r, ws_ptrs, n_ok, W_SCALE: tl.constexpr, UE8M0: tl.constexpr):
    """Channel / tensor weight scales (W_SCALE 2 / 3) multiply the sums once; block scales were applied per step."""
    if W_SCALE >= 2:
        r = r * fp8.load_scale(ws_ptrs, n_ok, UE8M0)
    return r


@triton.jit
def skinny_gemm1_kernel(
    x_ptr,  # [T, K] (unit stride along K)
    w_ptr,  # [E, rows, K] (unit stride along K)
    b_ptr,  # [E, rows] bias or None
    h_ptr,  # [P, N_OUT] out, pair order
    ids_ptr,  # [P] int32 expert of each pair
    ws_ptr,  # weight scales or None
    N_OUT,  # I
    K,  # H
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    stride_se,
    stride_sn,
    stride_sk,
    UP_OFFSET,  # row of up[n] = n * GATE_STRIDE + UP_OFFSET
    alpha,
    limit,
    TOP_K: tl.constexpr,
    GATE_STRIDE: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    topk_w_ptr=None, W_ON_INPUT: tl.constexpr = False,
    ZERO_EXPERTS: tl.constexpr = False, n_experts=0,
):
    pdl.enter(USE_PDL)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    p = tl.program_id(0) // num_n
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    expert = tl.load(ids_ptr + p).to(tl.int64)
    if ZERO_EXPERTS:
        if expert >= n_experts:  # a zero expert: no h row (the down kernel adds weight * x)
            return
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    g_rows = offs_n.to(tl.int64) * GATE_STRIDE  # [BN]
    u_rows = g_rows + UP_OFFSET
    g_ptrs = w_ptr + expert * stride_we + g_rows[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptrs = w_ptr + expert * stride_we + u_rows[:, None] * stride_wn + offs_k[None, :]
    if W_SCALE == 0:  # 16-bit weights: no scale pointers
        gs = g_rows
        us = u_rows
    else:
        gs = fp8.scale_ptrs(ws_ptr, expert * stride_se, g_rows, 0, N_OUT, stride_sn, W_SCALE, Q_BLOCK_N)
        us = fp8.scale_ptrs(ws_ptr, expert * stride_se, u_rows, 1, N_OUT, stride_sn, W_SCALE, Q_BLOCK_N)
    if REDUCE_END:
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = acc_g
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        m = n_ok[:, None] & k_ok[None, :]
        xk = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        wg = dequant(tl.load(g_ptrs, mask=m, other=0.0), gs, n_ok, k0, K, stride_sk, W_SCALE, Q_BLOCK_K, UE8M0,
                     BLOCK_N, BLOCK_K)
        acc_g = accumulate(acc_g, wg, xk, REDUCE_END)
        if GATED:
            wu = dequant(tl.load(u_ptrs, mask=m, other=0.0), us, n_ok, k0, K, stride_sk, W_SCALE, Q_BLOCK_K, UE8M0,
                         BLOCK_N, BLOCK_K)
            acc_u = accumulate(acc_u, wu, xk, REDUCE_END)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    pdl.release(USE_PDL)
    g = _final_scale(reduce(acc_g, REDUCE_END), gs, n_ok, W_SCALE, UE8M0)
    if W_ON_INPUT:  # (weight * x) . w
        g = g * tl.load(topk_w_ptr + p)
    if HAS_BIAS:
        g += tl.load(b_ptr + expert * stride_be + g_rows, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        u = _final_scale(reduce(acc_u, REDUCE_END), us, n_ok, W_SCALE, UE8M0)
        if W_ON_INPUT:
            u = u * tl.load(topk_w_ptr + p)
        if HAS_BIAS:
            u += tl.load(b_ptr + expert * stride_be + u_rows, mask=n_ok, other=0.0).to(tl.float32)
        h = _gated(g, u, alpha, limit, ACT, CLAMP)
    else:
        h = _act(g, ACT)
    tl.store(h_ptr + p.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _slot(h_row, w_e, b_ptr, b_off, ws_ptr, s_base, w_p, rows, n_ok, N, K, stride_wn, stride_sn, stride_sk,
          HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr, Q_BLOCK_N: tl.constexpr, Q_BLOCK_K: tl.constexpr,
          UE8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr,
          WEIGHTED: tl.constexpr):
    """One slot's [BN] contribution: weight[p] * (h[p] . w2_e[rows] (+ b2_e)) (unweighted when not WEIGHTED)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_e + rows[:, None] * stride_wn + offs_k[None, :]
    if W_SCALE == 0:
        ws = rows
    else:
        ws = fp8.scale_ptrs(ws_ptr, s_base, rows, 0, N, stride_sn, W_SCALE, Q_BLOCK_N)
    if REDUCE_END:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        hk = tl.load(h_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wf = dequant(tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0), ws, n_ok, k0, K, stride_sk,
                     W_SCALE, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K)
        acc = accumulate(acc, wf, hk, REDUCE_END)
        w_ptrs += BLOCK_K
    r = _final_scale(reduce(acc, REDUCE_END), ws, n_ok, W_SCALE, UE8M0)
    if HAS_BIAS:
        r += tl.load(b_ptr + b_off + rows, mask=n_ok, other=0.0).to(tl.float32)
    if WEIGHTED:
        r = r * tl.load(w_p)
    return r


@triton.jit
def skinny_down_kernel(
    h_ptr,  # [P, K] pair order (unit stride along K)
    w_ptr,  # [E, N, K] (unit stride along K)
    b_ptr,  # [E, N] bias or None
    ids_ptr,  # [P] int32
    topk_w_ptr,  # [P] fp32 routing weights
    shared_ptr,  # [T, N] shared-expert output or None
    gate_ptr,  # [T] shared-expert gate logits (strided) or None
    out_ptr,  # [T, N]
    ws_ptr,  # weight scales or None
    N,  # H
    K,  # I
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_se,
    stride_sn,
    stride_sk,
    stride_s,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    W_SCALE: tl.constexpr,
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    WEIGHTED: tl.constexpr = True,
    x_ptr=None, stride_xm=0, n_experts=0, ZERO_EXPERTS: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    num_n = tl.cdiv(N, BLOCK_N)
    t = (tl.program_id(0) // num_n).to(tl.int64)
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        p = t * TOP_K + j
        expert = tl.load(ids_ptr + p).to(tl.int64)
        if ZERO_EXPERTS:  # (nested: the runtime branch only where zero experts exist)
            if expert >= n_experts:  # weight * x[t]
                total += tl.load(topk_w_ptr + p) * tl.load(x_ptr + t * stride_xm + offs_n, mask=n_ok,
                                                           other=0.0).to(tl.float32)
            else:
                total += _slot(h_ptr + p * stride_hm, w_ptr + expert * stride_we, b_ptr, expert * stride_be,
                               ws_ptr, expert * stride_se, topk_w_ptr + p, rows, n_ok, N, K, stride_wn, stride_sn,
                               stride_sk, HAS_BIAS, W_SCALE, Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K,
                               REDUCE_END, WEIGHTED)
        else:
            total += _slot(h_ptr + p * stride_hm, w_ptr + expert * stride_we, b_ptr, expert * stride_be, ws_ptr,
                           expert * stride_se, topk_w_ptr + p, rows, n_ok, N, K, stride_wn, stride_sn, stride_sk,
                           HAS_BIAS, W_SCALE, Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, WEIGHTED)
    pdl.release(USE_PDL)
    if HAS_SHARED:
        s = tl.load(shared_ptr + t * stride_s + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            s = s * tl.sigmoid(tl.load(gate_ptr + t * stride_g).to(tl.float32))
        total += s
    tl.store(out_ptr + t * stride_o + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
