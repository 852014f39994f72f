"""Grouped GEMMs over expert-sorted token blocks.

    sorted_ids [S]  (pair p = token * k + slot, or the sentinel P on padding rows), block_expert [S / BLOCK_M]

    gemm1 (gate+up, activation fused):
        h[s, n] = act(x[tok(s)] . w1_e[n] + b1) * (x[tok(s)] . w3_e[n] + b3)          h: [S, I] in sorted order
    gemm2 (down, routing weight fused):
        y[p(s), n] = (h[s] . w2_e[n] + b2) * weight[p(s)]                              y: [P, H] in pair order

W_ON_INPUT (``MoESpec.weight_on_input``, Llama 4: each expert runs on weight * x): gemm1 multiplies its fp32
accumulator rows by their pair's weight before the bias and the activation (x . w * weight = (weight * x) . w, one
multiply per output element instead of one per loaded A element, and the same for the FP8 K loops), and gemm2 runs
with WEIGHTED off (no weight multiply). Both default to the plain form, which compiles as before.

A program owns one BLOCK_M block of sorted rows (one expert) and BLOCK_N output columns; blocks past the number
of padded rows (read on the device) return at once, so the grid is static and capturable. Weight matrices are
addressed through strides, so [out, in] and [in, out] layouts and concatenated or interleaved gate/up all run
without copies. Offsets that can pass 2**31 (expert base, token row, pair row) are computed in int64.

DIRECT (decode, a few tokens): no alignment. ``sorted_ptr`` is the flat top-k ids [P] and a program owns one pair p
(row 0 of its BLOCK_M tile; the other rows are masked): expert = ids[p]; gemm1 writes h[p] ([P, I], pair order)
and gemm2 reads it. ZERO_EXPERTS (``MoESpec.zero_experts``): a pair whose id is >= n_experts (a zero expert) has
nothing to compute and returns at once; its h / y rows stay unwritten (the combine adds weight * x for it). The
aligned form never sees such pairs (the alignment leaves them out). The tile's spare rows cost tensor-core slots, not memory traffic, and decode is bound by the
weight bytes; but pairs that share an expert read its weights once each, so this pays only at a few tokens.

FP8 (W_SCALE > 0: e4m3 weights, ``MoESpec.quant``): the same kernels, routing, alignment, DIRECT and epilogues; only
the K loop differs (``fp8.dot_loop``), as constexpr branches, so 16-bit launches compile to what they did before:

    w8a16 (A_QUANT 0):  h[s, n] = act(sum_k x[k] * q_w1[n, k] * s_w1[n, k]) * (...)      e4m3 -> x's dtype in registers
    w8a8  (A_QUANT 1):  each K step quantizes its A tile per row (one 128-column group): x_q, s_a = quant_rows(x)
                        acc += (x_q . q_w) * s_a[:, None] * s_w[None, :]                   fp8 x fp8 dot, fp32 sum
          (A_QUANT 2):  x_q = e4m3(x / s_static[e]); acc = s_static[e] * sum_k (x_q . q_w) * s_w
    s_w of tile column j (gemm1: col_n = n0 + j // 2, gate for even j, up for odd): block scales read row
    col_n // block_n + (j % 2) * ceil(I / block_n) (gate and up blocked apart), column k0 // block_k; channel scales
    row col_n + (j % 2) * I; tensor scales the expert's one value. h is stored in x's dtype and quantized again by
    gemm2's A loads.

    Speed candidates (opt-in, docs/FP8.md): A_QUANT 3 reads A already quantized (e4m3 codes + per-row group scales,
    the same formula: "prequant"), gemm1's Q_OUT writes h that way itself, FOLD folds w8a16 block scales into B.

4-bit (W4 > 0: mxfp4 / int4 weight-only, two codes a byte along K): another constexpr branch of the K loop,
``quant4.dot_loop4`` (unpacked and scaled in registers, fp32 accumulation); w_ptr addresses the packed bytes [E, rows,
K / 2] (stride_wk: the bytes' stride), ws_ptr the group scales [E, rows, groups] and zp_ptr (W4 3) the int4 zero
points of the same shape and strides. A tile column reads the scale row of its own weight row (group scales have
block_n 1), so concatenated and interleaved gate / up, biases, the activations (swiglu_oai's clamp) and DIRECT run
unchanged; W4 0 (the default) compiles the 16-bit / FP8 loops as before. W4_FORM 4 (the opt-in "mma" form): w_ptr
holds the mma layout (``ops/w4_layout.py``) and ``quant4_mma.mma_loop`` runs the K loop (swap-AB: the weight rows are
the dot's M side, BLOCK_M tokens its N side: 16 on the DIRECT decode path, row 0 the pair); the launchers take it on
the aligned and the DIRECT path.
"""

import triton
import triton.language as tl

from . import fp8, kloop, pdl, quant4, quant4_mma
from .activations import act as _act
from .activations import gated as _gated



@triton.jit
def _rows(sorted_ptr, block_expert_ptr, num_padded_ptr, P, n_cols, MAX_BLOCKS, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, DIRECT: tl.constexpr, ZERO_EXPERTS: tl.constexpr, n_experts):
    """(pid_m, pid_n, expert, offs_m = the tile's rows of h, pair [BLOCK_M], row_ok, dead = nothing to do)."""
    if DIRECT:
        num_n = tl.cdiv(n_cols, BLOCK_N)
        pid_m = tl.program_id(0) // num_n  # the pair
        pid_n = tl.program_id(0) % num_n
        expert = tl.load(sorted_ptr + pid_m).to(tl.int64)
        offs_m = pid_m + tl.arange(0, BLOCK_M) * 0
        pair = offs_m
        row_ok = tl.arange(0, BLOCK_M) == 0
        dead = pid_m >= P
        if ZERO_EXPERTS:  # a zero expert's pair: no weights to read (see the module docstring)
            dead = dead | (expert >= n_experts)
    else:
        pid_m, pid_n = kloop.block_ids(tl.program_id(0), n_cols, MAX_BLOCKS, BLOCK_N, GROUP_M)
        dead = pid_m * BLOCK_M >= tl.load(num_padded_ptr)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # in bounds (pid_m < MAX_BLOCKS); unused if dead
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < P
    return pid_m, pid_n, expert, offs_m, pair, row_ok, dead


@triton.jit
def moe_gemm1_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # expert weights, element (e, row n, col k) at e*stride_we + n*stride_wn + k*stride_wk
    b_ptr,  # [E, N_total] bias or None
    h_ptr,  # [S, N_OUT] out, sorted order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    TOP_K,
    N_OUT,  # I
    K,  # H
    MAX_BLOCKS,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_hm,
    UP_OFFSET,  # row of up[n] = n * GATE_STRIDE + UP_OFFSET
    alpha,
    limit,
    GATE_STRIDE: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    CLAMP: tl.constexpr,  # activations.gated: 0 none, 1 gate clamped before act, 2 act(gate) clamped after it
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter bf16 workaround)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (ignored for 16-bit)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TILE_N: tl.constexpr,  # 2 * BLOCK_N when gated, else BLOCK_N
    DIRECT: tl.constexpr = False,  # one pair per program, expert = sorted_ptr[pair] (see the module docstring)
    USE_PDL: tl.constexpr = 0,
    # FP8 (see the module docstring): weight scales [E, ...] (fp32, or uint8 ue8m0 exponents) and their strides,
    # static activation scales [E] (A_QUANT 2); W_SCALE 0: 16-bit weights, 1 block, 2 channel, 3 tensor scales;
    # A_QUANT 0 weight-only, 1 dynamic, 2 static; EXACT_CAST: the interpreter's e4m3 rounding (kernels/fp8.py)
    ws_ptr=None, as_ptr=None, stride_se=0, stride_sn=0, stride_sk=0,
    W_SCALE: tl.constexpr = 0, A_QUANT: tl.constexpr = 0, Q_BLOCK_N: tl.constexpr = 1, Q_BLOCK_K: tl.constexpr = 1,
    UE8M0: tl.constexpr = False, EXACT_CAST: tl.constexpr = False,
    # speed candidates (docs/FP8.md; None / off unless asked for): A_QUANT 3: x_ptr is e4m3 x, as_ptr its group
    # scales [T, cdiv(K, 128)] (row stride stride_am); Q_OUT (BLOCK_N % 128 == 0): h_ptr is e4m3 h, hs_ptr its group
    # scales [S, cdiv(N_OUT, 128)], h rounded to x's dtype first (Q_OUT 1 fp32, 2 bf16, 3 fp16); FOLD: fp8.dot_loop
    stride_am=None, hs_ptr=None, stride_hsm=None, Q_OUT: tl.constexpr = 0, FOLD: tl.constexpr = 0,
    topk_w_ptr=None, W_ON_INPUT: tl.constexpr = False,  # [P] fp32 routing weights (pair order), see the docstring
    ZERO_EXPERTS: tl.constexpr = False, n_experts=0,  # DIRECT: pairs of ids >= n_experts skipped (docstring)
    PAIR_LOAD: tl.constexpr = False,  # gated concat, columns of unit stride (in_out): kloop.pair_loop
    # 4-bit weights (W4 1 mxfp4, 2 int4, 3 int4 with zero points zp_ptr; w_ptr: packed bytes, stride_wk their
    # stride; ws_ptr / stride_s*: group scales; Q_BLOCK_K, UE8M0 as for FP8): quant4.dot_loop4 (module docstring)
    zp_ptr=None, W4: tl.constexpr = 0, W4_FOLD: tl.constexpr = 0, W4_FORM: tl.constexpr = 0,
    W4_K32: tl.constexpr = 0,  # the mma form: K % 32 == 0 (quant4_mma.mma_loop's K32)
):
    pdl.enter(USE_PDL)
    pid_m, pid_n, expert, offs_m, pair, row_ok, dead = _rows(
        sorted_ptr, block_expert_ptr, num_padded_ptr, P, N_OUT, MAX_BLOCKS, BLOCK_M, BLOCK_N, GROUP_M, DIRECT,
        ZERO_EXPERTS, n_experts)
    if dead:
        return
    tok = (pair // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # One dot per K step over a [BLOCK_K, TILE_N] weight tile. Gated: tile column 2c is gate row n0 + c and
    # column 2c + 1 its up row, so the accumulator splits into (gate, up) pairs in registers.
    if GATED:
        offs_j = tl.arange(0, TILE_N)
        col_n = pid_n * BLOCK_N + offs_j // 2
        if GATE_STRIDE == 2:  # interleaved (up row = gate row + 1): the same rows and mask, written so that the
            w_rows = (pid_n * TILE_N + offs_j).to(tl.int64)  # compiler sees them contiguous (vector loads when
            col_ok = w_rows < 2 * N_OUT  # the rows have unit stride, the in_out layout)
        else:
            w_rows = col_n.to(tl.int64) * GATE_STRIDE + (offs_j % 2) * UP_OFFSET
            col_ok = col_n < N_OUT
    else:
        col_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = col_n.to(tl.int64)
        col_ok = col_n < N_OUT

    if W4 != 0 and W4_FORM == 4:  # 4-bit, the mma form: w_ptr holds the mma layout (ops/w4_layout.py)
        ws_ptrs = ws_ptr + expert * stride_se + w_rows * stride_sn
        zp_ptrs = (zp_ptr + expert * stride_se + w_rows * stride_sn) if W4 == 3 else ws_ptrs
        acc = quant4_mma.mma_loop(x_ptr + tok * stride_xm, row_ok, w_ptr + expert * stride_we + w_rows * stride_wn,
                                  col_ok, K, ws_ptrs, zp_ptrs, stride_sk, W4, Q_BLOCK_K, UPCAST, DOT_PRECISION,
                                  BLOCK_M, TILE_N, BLOCK_K, W4_K32)
    elif W4 != 0:  # 4-bit weights: packed bytes, group scales (the rows' own: gate / up columns read theirs)
        b_ptrs = (w_ptr + expert * stride_we + w_rows[None, :] * stride_wn
                  + tl.arange(0, BLOCK_K // 2)[:, None] * stride_wk)
        ws_ptrs = ws_ptr + expert * stride_se + w_rows * stride_sn
        zp_ptrs = (zp_ptr + expert * stride_se + w_rows * stride_sn) if W4 == 3 else ws_ptrs
        acc = quant4.dot_loop4(x_ptr + tok * stride_xm, row_ok, b_ptrs, col_ok, K, stride_wk, ws_ptrs, zp_ptrs,
                               stride_sk, W4, Q_BLOCK_K, UE8M0, UPCAST, DOT_PRECISION, BLOCK_M, TILE_N, BLOCK_K,
                               W4_FOLD, W4_FORM)
    elif W_SCALE == 0 and PAIR_LOAD:
        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
        gate_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] gate rows (up: UP_OFFSET rows on)
        g_ptrs = w_ptr + expert * stride_we + gate_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = kloop.pair_loop(a_ptrs, row_ok, g_ptrs, UP_OFFSET * stride_wn, gate_n < N_OUT, K, stride_wk, UPCAST,
                              DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    elif W_SCALE == 0:
        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
        b_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = kloop.dense_loop(a_ptrs, row_ok, b_ptrs, col_ok, K, stride_wk, UPCAST, DOT_PRECISION, BLOCK_M, TILE_N,
                               BLOCK_K)
    else:  # fp8 weights (concat gate/up: a tile column's up row is w_rows = col_n + I)
        a_scale = 1.0
        if A_QUANT == 2:
            a_scale = tl.load(as_ptr + expert)
        if A_QUANT == 3:  # (a constexpr branch: a_scale is then the rows' scale pointers)
            a_scale = as_ptr + tok * stride_am
        b_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk
        half = (tl.arange(0, TILE_N) % 2) if GATED else 0
        ws_ptrs = fp8.scale_ptrs(ws_ptr, expert * stride_se, w_rows, half, N_OUT, stride_sn, W_SCALE, Q_BLOCK_N)
        acc = fp8.dot_loop(x_ptr + tok * stride_xm, row_ok, b_ptrs, col_ok, K, stride_wk, ws_ptrs, stride_sk, a_scale,
                           A_QUANT, W_SCALE, Q_BLOCK_K, UE8M0, EXACT_CAST, UPCAST, DOT_PRECISION, BLOCK_M, TILE_N,
                           BLOCK_K, FOLD)
    pdl.release(USE_PDL)

    if W_ON_INPUT:  # (weight * x) . w: the rows scaled before the bias and the activation
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + w_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    if GATED:
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        h = _gated(g, u, alpha, limit, ACT, CLAMP)
    else:
        h = _act(acc, ACT)

    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    if Q_OUT:  # h as gemm2's A_QUANT 3 wants it: rounded to x's dtype, then quant_rows per 128-column group
        hq, hs = fp8.quant_groups(tl.where(n_ok[None, :], fp8.round_to(h, Q_OUT), 0.0), BLOCK_M, BLOCK_N, EXACT_CAST)
        tl.store(h_ptrs, hq, mask=row_ok[:, None] & n_ok[None, :])
        offs_g = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(hs_ptr + offs_m.to(tl.int64)[:, None] * stride_hsm + offs_g[None, :], hs,
                 mask=row_ok[:, None] & (offs_g < tl.cdiv(N_OUT, 128))[None, :])
    else:
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_gemm2_kernel(
    h_ptr,  # [S, K] sorted order
    w_ptr,  # expert weights (e, row n, col k)
    b_ptr,  # [E, N] bias or None
    topk_w_ptr,  # [P] fp32 routing weights (pair order)
    y_ptr,  # [P, N] out, pair order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,  # H
    K,  # I
    MAX_BLOCKS,
    stride_hm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0,
    ws_ptr=None, as_ptr=None, stride_se=0, stride_sn=0, stride_sk=0,  # FP8: as in moe_gemm1_kernel
    W_SCALE: tl.constexpr = 0, A_QUANT: tl.constexpr = 0, Q_BLOCK_N: tl.constexpr = 1, Q_BLOCK_K: tl.constexpr = 1,
    UE8M0: tl.constexpr = False, EXACT_CAST: tl.constexpr = False,
    stride_am=None, FOLD: tl.constexpr = 0,  # A_QUANT 3: h_ptr e4m3 h, as_ptr its group scales [S, cdiv(K, 128)]
    WEIGHTED: tl.constexpr = True,  # off: the weight was applied to gemm1's input (W_ON_INPUT)
    ZERO_EXPERTS: tl.constexpr = False, n_experts=0,  # as in moe_gemm1_kernel
    zp_ptr=None, W4: tl.constexpr = 0, W4_FOLD: tl.constexpr = 0, W4_FORM: tl.constexpr = 0,  # 4-bit: gemm1's
    W4_K32: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    pid_m, pid_n, expert, offs_m, pair, row_ok, dead = _rows(
        sorted_ptr, block_expert_ptr, num_padded_ptr, P, N, MAX_BLOCKS, BLOCK_M, BLOCK_N, GROUP_M, DIRECT,
        ZERO_EXPERTS, n_experts)
    if dead:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    if W4 != 0 and W4_FORM == 4:  # the mma form (as in moe_gemm1_kernel)
        rows = offs_n.to(tl.int64)
        ws_ptrs = ws_ptr + expert * stride_se + rows * stride_sn
        zp_ptrs = (zp_ptr + expert * stride_se + rows * stride_sn) if W4 == 3 else ws_ptrs
        acc = quant4_mma.mma_loop(h_ptr + offs_m.to(tl.int64) * stride_hm, row_ok,
                                  w_ptr + expert * stride_we + rows * stride_wn, n_ok, K, ws_ptrs, zp_ptrs, stride_sk,
                                  W4, Q_BLOCK_K, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, W4_K32)
    elif W4 != 0:
        rows = offs_n.to(tl.int64)
        b_ptrs = (w_ptr + expert * stride_we + rows[None, :] * stride_wn
                  + tl.arange(0, BLOCK_K // 2)[:, None] * stride_wk)
        ws_ptrs = ws_ptr + expert * stride_se + rows * stride_sn
        zp_ptrs = (zp_ptr + expert * stride_se + rows * stride_sn) if W4 == 3 else ws_ptrs
        acc = quant4.dot_loop4(h_ptr + offs_m.to(tl.int64) * stride_hm, row_ok, b_ptrs, n_ok, K, stride_wk, ws_ptrs,
                               zp_ptrs, stride_sk, W4, Q_BLOCK_K, UE8M0, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_K, W4_FOLD, W4_FORM)
    elif W_SCALE == 0:
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
        b_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = kloop.dense_loop(a_ptrs, row_ok, b_ptrs, n_ok, K, stride_wk, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_K)
    else:  # fp8 weights
        b_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
        a_scale = 1.0
        if A_QUANT == 2:
            a_scale = tl.load(as_ptr + expert)
        if A_QUANT == 3:
            a_scale = as_ptr + offs_m.to(tl.int64) * stride_am
        ws_ptrs = fp8.scale_ptrs(ws_ptr, expert * stride_se, offs_n.to(tl.int64), 0, N, stride_sn, W_SCALE, Q_BLOCK_N)
        acc = fp8.dot_loop(h_ptr + offs_m.to(tl.int64) * stride_hm, row_ok, b_ptrs, n_ok, K, stride_wk, ws_ptrs,
                           stride_sk, a_scale, A_QUANT, W_SCALE, Q_BLOCK_K, UE8M0, EXACT_CAST, UPCAST, DOT_PRECISION,
                           BLOCK_M, BLOCK_N, BLOCK_K, FOLD)
    pdl.release(USE_PDL)

    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
