"""Decode down projection with the combine fused: one program per (token, BLOCK_N output columns).

    for slot j < k:   p = t * k + j,  e = ids[p]
        r_j = h[p] . w2_e[n0:n0+BLOCK_N]  (+ b2_e)              h: [P, I] in pair order (gemm1, DIRECT)
    out[t, n] = sum_j weight[p] * r_j  (+ sigmoid(gate[t]) * shared[t, n])      fp32 sum, one store
    (WEIGHTED off, ``MoESpec.weight_on_input``: sum_j r_j, gemm1 applied the weights to its input)
    (ZERO_EXPERTS, ``MoESpec.zero_experts``: a slot whose e >= n_experts is a zero expert, r_j = x[t] and weighted
     whatever WEIGHTED says: no weights read, h[p] (never written by gemm1 DIRECT) not read)

At a few tokens the routed path is bound by the experts' weight bytes and its launches; this drops the [P, H]
per-pair buffer and the combine launch (``moecomp.ops.triton_moe.decode_down``'s "fused" mode). Each slot's dot runs
on a BLOCK_M tile whose row 0 is the pair (the other rows are masked to 0). A program walks the k slots in turn, so
there are only T * H / BLOCK_N programs: at T = 1 and a small H that is under one per SM, and the "pairs" mode
(gemm2 DIRECT + combine) can win; the tuner measures both.

FP8 w2 (W_SCALE > 0): each slot's K loop is ``fp8.dot_loop`` with that slot's expert's scales (weight-only, or h
quantized per 128-column group in the A loads), as in ``moe_gemm2_kernel``; 16-bit launches compile as before.
4-bit w2 (W4 > 0): ``quant4.dot_loop4``, as in ``moe_gemm2_kernel``; W4_FORM 4 (the opt-in "mma" form): w_ptr holds
the mma layout (``ops/w4_layout.py``) and each slot runs ``quant4_mma.mma_loop`` (swap-AB: the BLOCK_N weight rows
are the dot's M side, the slot's BLOCK_M-row tile, row 0 the pair, its N side), as ``moe_gemm2_kernel`` does.
"""

import triton
import triton.language as tl

from . import fp8, kloop, pdl, quant4, quant4_mma
from .combine import store_with_shared


@triton.jit
def _slot(h_ptr, w_ptr, b_ptr, ws_ptr, as_ptr, topk_w_ptr, p, expert, offs_n, n_ok, offs_k, row0, N, K,
          stride_hm, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn, stride_sk, stride_am,
          HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_SCALE: tl.constexpr, A_QUANT: tl.constexpr,
          Q_BLOCK_N: tl.constexpr, Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, EXACT_CAST: tl.constexpr,
          FOLD: tl.constexpr, WEIGHTED: tl.constexpr, zp_ptr, W4: tl.constexpr, W4_FOLD: tl.constexpr,
          W4_FORM: tl.constexpr, W4_K32: tl.constexpr):
    """One slot's [BLOCK_N] term: weight[p] * (h[p] . w2_e[offs_n] (+ b2_e)), unweighted when not WEIGHTED."""
    b_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if W4 != 0 and W4_FORM == 4:  # 4-bit w2, the mma form: the mma layout's rows (ops/w4_layout.py)
        rows = offs_n.to(tl.int64)
        ws_ptrs = ws_ptr + expert * stride_se + rows * stride_sn
        zp_ptrs = (zp_ptr + expert * stride_se + rows * stride_sn) if W4 == 3 else ws_ptrs
        acc = quant4_mma.mma_loop(h_ptr + p * stride_hm + tl.arange(0, BLOCK_M) * 0, row0,
                                  w_ptr + expert * stride_we + rows * stride_wn, n_ok, K, ws_ptrs, zp_ptrs, stride_sk,
                                  W4, Q_BLOCK_K, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, W4_K32)
    elif W4 != 0:  # 4-bit w2: packed bytes (BLOCK_K / 2 a step), group scales (and zero points) of the rows
        rows = offs_n.to(tl.int64)
        b_ptrs = (w_ptr + expert * stride_we + rows[None, :] * stride_wn
                  + tl.arange(0, BLOCK_K // 2)[:, None] * stride_wk)
        ws_ptrs = ws_ptr + expert * stride_se + rows * stride_sn
        zp_ptrs = (zp_ptr + expert * stride_se + rows * stride_sn) if W4 == 3 else ws_ptrs
        acc = quant4.dot_loop4(h_ptr + p * stride_hm + tl.arange(0, BLOCK_M) * 0, row0, b_ptrs, n_ok, K, stride_wk,
                               ws_ptrs, zp_ptrs, stride_sk, W4, Q_BLOCK_K, UE8M0, UPCAST, DOT_PRECISION, BLOCK_M,
                               BLOCK_N, BLOCK_K, W4_FOLD, W4_FORM)
    elif W_SCALE == 0:
        a_ptrs = h_ptr + p * stride_hm + tl.arange(0, BLOCK_M)[:, None] * 0 + offs_k[None, :]
        acc = kloop.dense_loop(a_ptrs, row0, b_ptrs, n_ok, K, stride_wk, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_K)
    else:
        a_scale = 1.0
        if A_QUANT == 2:
            a_scale = tl.load(as_ptr + expert)
        if A_QUANT == 3:
            a_scale = as_ptr + p * stride_am + tl.arange(0, BLOCK_M) * 0
        ws_ptrs = fp8.scale_ptrs(ws_ptr, expert * stride_se, offs_n.to(tl.int64), 0, N, stride_sn, W_SCALE, Q_BLOCK_N)
        acc = fp8.dot_loop(h_ptr + p * stride_hm + tl.arange(0, BLOCK_M) * 0, row0, b_ptrs, n_ok, K, stride_wk,
                           ws_ptrs, stride_sk, a_scale, A_QUANT, W_SCALE, Q_BLOCK_K, UE8M0, EXACT_CAST, UPCAST,
                           DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    r = tl.sum(acc, axis=0)  # [BLOCK_N]: rows other than 0 are zero
    if HAS_BIAS:
        r += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if WEIGHTED:
        r = r * tl.load(topk_w_ptr + p)
    return r


@triton.jit
def moe_down_combine_kernel(
    h_ptr,  # [P, K] pair order
    w_ptr,  # expert weights, element (e, row n, col k) at e*stride_we + n*stride_wn + k*stride_wk
    b_ptr,  # [E, N] bias or None
    ids_ptr,  # [P] int32 expert of each pair
    topk_w_ptr,  # [P] fp32 routing weights
    shared_ptr,  # [T, N] shared-expert output or None
    gate_ptr,  # [T] shared-expert gate logits (strided) or None
    out_ptr,  # [T, N]
    N,  # H
    K,  # I
    stride_hm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_s,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    ws_ptr=None, as_ptr=None, stride_se=0, stride_sn=0, stride_sk=0,  # FP8: as in grouped_gemm.moe_gemm2_kernel
    W_SCALE: tl.constexpr = 0, A_QUANT: tl.constexpr = 0, Q_BLOCK_N: tl.constexpr = 1, Q_BLOCK_K: tl.constexpr = 1,
    UE8M0: tl.constexpr = False, EXACT_CAST: tl.constexpr = False,
    stride_am=None, FOLD: tl.constexpr = 0,  # A_QUANT 3: h_ptr e4m3 h, as_ptr its group scales [P, cdiv(K, 128)]
    WEIGHTED: tl.constexpr = True,
    x_ptr=None, stride_xm=0, n_experts=0, ZERO_EXPERTS: tl.constexpr = False,  # x [T, N]: the zero experts' input
    zp_ptr=None, W4: tl.constexpr = 0, W4_FOLD: tl.constexpr = 0, W4_FORM: tl.constexpr = 0,  # 4-bit w2
    W4_K32: tl.constexpr = 0,  # the mma form: K % 32 == 0 (quant4_mma.mma_loop's K32)
):
    pdl.enter(USE_PDL)
    num_n = tl.cdiv(N, BLOCK_N)
    t = (tl.program_id(0) // num_n).to(tl.int64)
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    row0 = tl.arange(0, BLOCK_M) == 0

    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        p = t * TOP_K + j
        expert = tl.load(ids_ptr + p).to(tl.int64)
        if ZERO_EXPERTS:  # nested under the constexpr: a zero expert adds weight * x[t] (one pair per slot)
            if expert >= n_experts:
                xr = tl.load(x_ptr + t * stride_xm + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                total += tl.load(topk_w_ptr + p) * xr
            else:
                total += _slot(h_ptr, w_ptr, b_ptr, ws_ptr, as_ptr, topk_w_ptr, p, expert, offs_n, n_ok, offs_k, row0,
                               N, K, stride_hm, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn,
                               stride_sk, stride_am, HAS_BIAS, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                               W_SCALE, A_QUANT, Q_BLOCK_N, Q_BLOCK_K, UE8M0, EXACT_CAST, FOLD, WEIGHTED, zp_ptr, W4,
                               W4_FOLD, W4_FORM, W4_K32)
        else:
            total += _slot(h_ptr, w_ptr, b_ptr, ws_ptr, as_ptr, topk_w_ptr, p, expert, offs_n, n_ok, offs_k, row0, N,
                           K, stride_hm, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn, stride_sk,
                           stride_am, HAS_BIAS, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, W_SCALE, A_QUANT,
                           Q_BLOCK_N, Q_BLOCK_K, UE8M0, EXACT_CAST, FOLD, WEIGHTED, zp_ptr, W4, W4_FOLD, W4_FORM,
                           W4_K32)
    pdl.release(USE_PDL)

    store_with_shared(total, t, offs_n, n_ok, shared_ptr, stride_s, gate_ptr, stride_g, out_ptr, stride_o, HAS_SHARED,
                      HAS_GATE)
