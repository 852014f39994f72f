"""Dot-free (GEMV) decode kernels for 4-bit experts: each (token, expert) pair has one row of A, so no tensor cores
(the DIRECT dot path runs the pair as row 0 of a 16-row MMA tile: 15/16 padding, plus a nibble shuffle per step).

    gemm1 GEMV      one program per (pair p, BLOCK_N columns of h):    e = ids[p], t = p // k
                        acc[r] = sum_k x[t, k] * w13_e[row r, k]        r: the tile's 2 * BLOCK_N rows (gated: gate /
                                                                           up of each column, interleaved or concat)
                        h[p, n] = act(gate + b) * (up + b)               stored in x's dtype, [P, I] in pair order
    down-combine    one program per (token t, BLOCK_N columns of out):
                        out[t, n] = sum_j weight[p] * (h[p] . w2_e[n] + b2_e[n])  (p = t * k + j)
                                    (+ sigmoid(gate[t]) * shared[t, n]; zero experts add weight * x[t, n])

    K loop (``_rows_dot``), over steps of BLOCK_K columns; each weight row's step is BLOCK_K / 8 int32 words
    (8 codes each, column 8w + i in bits 4i..4i+3), loaded as [ROWS, NG, WG] (NG groups of WG words: 16-byte
    vectors along K, coalesced), x's step as [NG, WG, 8]:

        word r --(bit ops)--> 4 words of two fp16 each: columns (0, 4), (2, 6), (1, 5), (3, 7)
               --(cvt f16 -> f32, 8 of them)--> c0 .. c7 fp32
        t = c0 * x0 + ... + c7 * x7                                      (one FMUL, seven FFMA)
        REDUCE_END 1: acc[ROWS, NG, WG] += t * s      (s: the row's group scale; summed over NG, WG at the end)
        REDUCE_END 0: acc[ROWS] += sum(t * s)          (reduced every step)
        PREFETCH 1:   the next step's words and scales loaded before this step's decode (twice the bytes in flight)

    mxfp4: e2m1 codes s e1 e0 m become fp16 bits ``s << 15 | e1 e0 m << 9``: exponent field e, mantissa m, so
           e >= 1 is (1 + m / 2) * 2^(e - 15) and e = 0 the subnormal m * 2^-15: e2m1 * 2^-14 exactly, for all 16
           codes (``e2m1_x2m14``). In a word of 8 codes two columns 16 bits apart take the same shifts:
               (0, 4):  (r << 9) & 0x0E000E00 | (r << 12) & 0x80008000      (magnitude, sign)
               (2, 6):  (r << 1) & ...        | (r << 4) & ...
               (1, 5):  (r << 5) & ...        | (r << 8) & ...
               (3, 7):  (r >> 3) & ...        | r & ...
           so 8 codes take 7 shifts and 8 logic ops (~2 integer ops a code, against ~12 for ``quant4.e2m1``), then
           one cvt each (one HADD2.F32 on sm90: fp16 subnormals convert exactly). The 2^-14 goes to x (x * 2^14,
           once per x element and step, not per weight): the products are e2m1 * x exactly, and the group scale
           2^(byte - 127) (``fp8.ue8m0``, every byte) multiplies t. Exact weights for every code and scale byte;
           x * 2^14 overflows fp32 only for |x| >= 2^114.
    mxfp4, W4_MMA 1: words in the mma layout (``ops/w4_layout.py``, re-laid once at load for the aligned path's
           tensor-core decode): lane L's slot j (column 4L + j) holds e1 e0 m at lane bits 3j..3j+2, s at 15 - j:
               (0, 4):  (r << 9) & MAG | r & SIGN       (1, 5):  (r << 6) & ... | (r << 1) & ...
               (2, 6):  (r << 3) & ... | (r << 2) & ...  (3, 7):  r & ...      | (r << 3) & ...
           the same fp16 bits and columns from fewer shifts (5 distinct: r << 3 serves two slots; 8 AND, 4 OR, as
           packed), so the same x split, 2^14 and scales: bit-identical outputs (offline sm90 SASS, gemm1's K loop:
           5.36 instructions a code against 5.59; tests/kernels/test_sm90_compile_gemv_mma.py). int4 needs no flag
           (its mma bytes are the packed bytes).
    int4:  (r >> 4i) & 0x000F000F | 0x64006400 is two fp16 values 1024 + code (columns i, i + 4); minus 1024 + zero
           (fp16, two lanes an HADD2) is code - zero exactly (integers below 2048), then the cvt. The scale (fp16 /
           bf16 / fp32, as fp32) multiplies t: (code - zero) * scale exactly, products and sums in fp32.
    ASM 1 (CUDA only, a speed candidate; the interpreter cannot run it): the two halves of each fp16 pair word
           converted by inline PTX (``cvt.f32.f16`` on ``mov.b32 {lo, hi}``; int4's subtraction one ``sub.f16x2``),
           where the plain form lets LLVM repack halves of two words (a PRMT per two codes). Same values.

    Cost, offline SASS for sm90 (Triton 3.9), gemm1's K loop at 64 rows x BLOCK_K 128 (64 codes a thread a step):
    mxfp4 5.6 instructions a code (ASM 5.1), int4 with zero points 5.4 (ASM 4.8); the DIRECT dot path's loop at the
    same tile: 16.6 (mxfp4) and 7.0 (int4, with an I2F a code). One code a byte lane (the first draft) took 10.3.

Words need K % 8 == 0 and 4-byte aligned rows (the launcher checks; ``K_ALIGNED``: K % 32 == 0, so masks hold
over 4-word vectors and the loads are 16 bytes). x's step goes through shared memory once (the words' layout);
rows, words and groups past the ends load 0 (code 0 is +0 in e2m1; an int4 code 0 meets an x masked to 0).

Tiles (chosen in ``ops/triton_quant4_gemv.py``): narrow BLOCK_N so that T = 1 gives at least two programs per SM;
the down-combine loops over the k slots inside one program (no [P, H] buffer, no second launch, one fp32 sum per
output), so it has only T * H / BLOCK_N programs, and takes BLOCK_N 4..16 at T = 1 with long K steps instead of a
split over the slots (which would need a second pass or atomics). No host syncs, static grids: capturable.
"""

import triton
import triton.language as tl

from . import fp8, pdl
from .activations import act as _act
from .activations import gated as _gated
from .combine import store_with_shared

MAG = tl.constexpr(0x0E000E00)  # e1 e0 m of both fp16 lanes (bits 9..11, 25..27)
SIGN = tl.constexpr(-2147450880)  # 0x80008000 as int32: both lanes' sign bits
NIB2 = tl.constexpr(0x000F000F)  # a code in each lane
F16_1024 = tl.constexpr(0x64006400)  # fp16 1024.0 in both lanes


@triton.jit
def e2m1_x2m14(c):
    """int32 codes 0..15 -> e2m1(c) * 2^-14 in fp32, exactly (one code a lane: what ``_e2m1_word`` does two at a
    time)."""
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _halves(w, ASM: tl.constexpr):
    """int32 words of two fp16 -> (low half, high half) as fp32."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _e2m1_word(r, ASM: tl.constexpr, W4_MMA: tl.constexpr = 0):
    """int32 words of 8 e2m1 codes -> their values times 2^-14 (fp32), columns 0..7 of the word; W4_MMA: the words
    in the mma layout (``ops/w4_layout.py``: slot j of lane L, column 4L + j, has its magnitude at lane bits 3j..3j+2
    and its sign at lane bit 15 - j), moved to the same fp16 bits with the same masks and fewer shifts."""
    if W4_MMA:
        c0, c4 = _halves(((r << 9) & MAG) | (r & SIGN), ASM)
        c1, c5 = _halves(((r << 6) & MAG) | ((r << 1) & SIGN), ASM)
        c2, c6 = _halves(((r << 3) & MAG) | ((r << 2) & SIGN), ASM)
        c3, c7 = _halves((r & MAG) | ((r << 3) & SIGN), ASM)
    else:
        c0, c4 = _halves(((r << 9) & MAG) | ((r << 12) & SIGN), ASM)
        c2, c6 = _halves(((r << 1) & MAG) | ((r << 4) & SIGN), ASM)
        c1, c5 = _halves(((r << 5) & MAG) | ((r << 8) & SIGN), ASM)
        c3, c7 = _halves(((r >> 3) & MAG) | (r & SIGN), ASM)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _int4_pair(w, zh, ASM: tl.constexpr):
    """Two fp16 lanes 1024 + code -> (code - zero) of each as fp32 (zh: 1024 + zero, fp16; exact)."""
    if ASM:  # one sub.f16x2 for both lanes, then the two cvt (what the plain form leaves to LLVM's packing)
        zb = zh.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .b32 d; sub.rn.f16x2 d, $2, $3; mov.b32 {l, h}, d; "
            "cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r,r", [w, zb | (zb << 16)], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = (w.to(tl.int16).to(tl.float16, bitcast=True) - zh).to(tl.float32)
        hi = ((w >> 16).to(tl.int16).to(tl.float16, bitcast=True) - zh).to(tl.float32)
    return lo, hi


@triton.jit
def _int4_word(r, zh, ASM: tl.constexpr):
    """int32 words of 8 int4 codes -> code - zero (fp32), columns 0..7 of the word (zh: 1024 + zero, fp16)."""
    c0, c4 = _int4_pair((r & NIB2) | F16_1024, zh, ASM)
    c1, c5 = _int4_pair(((r >> 4) & NIB2) | F16_1024, zh, ASM)
    c2, c6 = _int4_pair(((r >> 8) & NIB2) | F16_1024, zh, ASM)
    c3, c7 = _int4_pair(((r >> 12) & NIB2) | F16_1024, zh, ASM)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _x8(x_row, k0, offs_w, w_ok, XS: tl.constexpr):
    """x's step: offs_w [NG, WG] word indices -> columns 8w + i (i = 0..7) times XS, fp32, each [1, NG, WG]."""
    xx = tl.load(x_row + k0 + offs_w[:, :, None] * 8 + tl.arange(0, 8)[None, None, :], mask=w_ok[:, :, None],
                 other=0.0).to(tl.float32)  # [NG, WG, 8]
    if XS != 1.0:
        xx = xx * XS
    NG: tl.constexpr = xx.shape[0]
    WG: tl.constexpr = xx.shape[1]
    ev, od = tl.split(tl.reshape(xx, [NG, WG, 4, 2]))  # columns 0 2 4 6 / 1 3 5 7
    e0, e1 = tl.split(tl.reshape(ev, [NG, WG, 2, 2]))  # 0 4 / 2 6
    o0, o1 = tl.split(tl.reshape(od, [NG, WG, 2, 2]))  # 1 5 / 3 7
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0[None], x1[None], x2[None], x3[None], x4[None], x5[None], x6[None], x7[None]


@triton.jit
def _load_step(w_base, row3, s_rows, z_rows, k0, K, kw, offs_w, offs_g, stride_sk, W4: tl.constexpr,
               GROUP: tl.constexpr):
    """The raw loads of K step k0: (words [ROWS, NG, WG] int32, scale elements, zero points (W4 3; else 0)) [ROWS,
    NG, 1]; everything past K (or past the rows) loads 0 and, past K, reads no memory."""
    wi = k0 // 8 + offs_w
    r = tl.load(w_base + wi[None], mask=row3 & (wi < kw)[None], other=0)
    gi = k0 // GROUP + offs_g  # [NG] the step's groups
    g_ok = row3 & (gi * GROUP < K)[None, :, None]
    g_off = gi[None, :, None] * stride_sk
    sb = tl.load(s_rows[:, None, None] + g_off, mask=g_ok, other=0)
    zb = 0
    if W4 == 3:
        zb = tl.load(z_rows[:, None, None] + g_off, mask=g_ok, other=0)
    return r, sb, zb


@triton.jit
def _rows_dot(x_row, w_rows, row_ok, s_rows, z_rows, K, stride_sk, W4: tl.constexpr, GROUP: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr, K_ALIGNED: tl.constexpr,
              ASM: tl.constexpr, PREFETCH: tl.constexpr, W4_MMA: tl.constexpr = 0):
    """acc [ROWS] fp32 = x_row . each weight row over K columns (the module docstring's K loop). ``w_rows`` [ROWS]:
    byte pointers to each row's first packed byte (4-byte aligned); ``s_rows`` / ``z_rows`` [ROWS]: each row's
    first group scale / zero point (``stride_sk`` apart); W4 1 mxfp4, 2 int4, 3 int4 with zero points. PREFETCH:
    the next step's words and scales are loaded before this step's decode (twice the bytes in flight)."""
    NW: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
    WG: tl.constexpr = NW // NG
    XS: tl.constexpr = 16384.0 if W4 == 1 else 1.0  # mxfp4: the 2^14 that e2m1_x2m14 leaves out (exact)
    offs_g = tl.arange(0, NG)
    offs_w = offs_g[:, None] * WG + tl.arange(0, WG)[None, :]  # [NG, WG]
    kw = K // 8
    if K_ALIGNED:
        kw = tl.multiple_of(kw, 4)  # K % 32 == 0: masks hold over 16-byte vectors
    w_base = w_rows.to(tl.pointer_type(tl.int32))[:, None, None]  # [ROWS, 1, 1]
    row3 = row_ok[:, None, None]
    if REDUCE_END:
        acc = tl.zeros([ROWS, NG, WG], dtype=tl.float32)
    else:
        acc = tl.zeros([ROWS], dtype=tl.float32)
    if PREFETCH:
        r_n, sb_n, zb_n = _load_step(w_base, row3, s_rows, z_rows, 0, K, kw, offs_w, offs_g, stride_sk, W4, GROUP)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            r, sb, zb = r_n, sb_n, zb_n
            r_n, sb_n, zb_n = _load_step(w_base, row3, s_rows, z_rows, k0 + BLOCK_K, K, kw, offs_w, offs_g,
                                         stride_sk, W4, GROUP)
        else:
            r, sb, zb = _load_step(w_base, row3, s_rows, z_rows, k0, K, kw, offs_w, offs_g, stride_sk, W4, GROUP)
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_row, k0, offs_w, k0 // 8 + offs_w < kw, XS)
        if W4 == 1:
            s = fp8.ue8m0(sb)
            c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(r, ASM, W4_MMA)
        else:
            s = sb.to(tl.float32)
            if W4 == 3:
                zh = (zb.to(tl.float32) + 1024.0).to(tl.float16)
            else:
                zh = tl.full([ROWS, NG, 1], 1032.0, tl.float16)  # symmetric: zero 8
            c0, c1, c2, c3, c4, c5, c6, c7 = _int4_word(r, zh, ASM)
        t = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3 + c4 * x4 + c5 * x5 + c6 * x6 + c7 * x7  # [ROWS, NG, WG]
        if REDUCE_END:
            acc += t * s
        else:
            acc += tl.sum(tl.sum(t * s, axis=2), axis=1)
    if REDUCE_END:
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        out = acc
    return out


@triton.jit
def moe_gemv1_kernel(
    x_ptr,  # [T, K] (unit stride along K)
    w_ptr,  # packed w13 bytes [E, rows, K / 2] (unit stride along K; 4-byte aligned rows)
    b_ptr,  # [E, rows] bias or None
    h_ptr,  # [P, N_OUT] out, pair order, x's dtype
    ids_ptr,  # [P] int32 expert of each pair
    ws_ptr,  # group scales [E, rows, ceil(K / GROUP)] (ue8m0 bytes: mxfp4)
    zp_ptr,  # int4 zero points (W4 3; the scales' shape and strides) or None
    TOP_K,
    N_OUT,  # I
    K,  # H
    stride_xm, stride_we, stride_wn, stride_be, stride_hm, stride_se, stride_sn, stride_sk,
    UP_OFFSET,  # row of up[n] = n * GATE_STRIDE + UP_OFFSET
    alpha, limit,
    GATE_STRIDE: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, HAS_BIAS: tl.constexpr,
    W4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr,
    K_ALIGNED: tl.constexpr, USE_PDL: tl.constexpr = 0, ASM: tl.constexpr = 0, PREFETCH: tl.constexpr = 0,
    topk_w_ptr=None, W_ON_INPUT: tl.constexpr = False,  # [P] fp32 routing weights: weight_on_input
    ZERO_EXPERTS: tl.constexpr = False, n_experts=0,  # pairs of ids >= n_experts skipped
    W4_MMA: tl.constexpr = 0,  # mxfp4 words in the mma layout (ops/w4_layout.py; int4's bytes are the packed ones)
):
    pdl.enter(USE_PDL)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    pair = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if ZERO_EXPERTS:  # a zero expert's pair: nothing to compute (its h row stays unwritten, never read)
        if expert >= n_experts:
            return
    tok = (pair // TOP_K).to(tl.int64)
    TILE_N: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    offs_j = tl.arange(0, TILE_N)
    if GATED:  # tile row 2c: gate row of column n0 + c, 2c + 1 its up row
        col_n = pid_n * BLOCK_N + offs_j // 2
        w_rows = col_n.to(tl.int64) * GATE_STRIDE + (offs_j % 2) * UP_OFFSET
    else:
        col_n = pid_n * BLOCK_N + offs_j
        w_rows = col_n.to(tl.int64)
    row_ok = col_n < N_OUT
    s_rows = ws_ptr + expert * stride_se + w_rows * stride_sn
    z_rows = (zp_ptr + expert * stride_se + w_rows * stride_sn) if W4 == 3 else s_rows
    acc = _rows_dot(x_ptr + tok * stride_xm, w_ptr + expert * stride_we + w_rows * stride_wn, row_ok, s_rows, z_rows,
                    K, stride_sk, W4, GROUP, TILE_N, BLOCK_K, REDUCE_END, K_ALIGNED, ASM, PREFETCH, W4_MMA)  # [TILE_N]
    pdl.release(USE_PDL)
    if W_ON_INPUT:  # (weight * x) . w
        acc = acc * tl.load(topk_w_ptr + pair)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + w_rows, mask=row_ok, other=0.0).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATED:
        g, u = tl.split(tl.reshape(acc, [BLOCK_N, 2]))
        h = _gated(g, u, alpha, limit, ACT, CLAMP)
    else:
        h = _act(acc, ACT)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=offs_n < N_OUT)


@triton.jit
def moe_gemv_down_kernel(
    h_ptr,  # [P, K] pair order (unit stride along K)
    w_ptr,  # packed w2 bytes [E, N, K / 2]
    b_ptr,  # [E, N] bias or None
    ids_ptr,  # [P] int32
    topk_w_ptr,  # [P] fp32 routing weights
    shared_ptr,  # [T, N] shared-expert output or None
    gate_ptr,  # [T] shared-expert gate logits (strided) or None
    out_ptr,  # [T, N]
    ws_ptr, zp_ptr,  # group scales / zero points of w2, as in moe_gemv1_kernel
    N,  # H
    K,  # I
    stride_hm, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_sk, stride_s, stride_g, stride_o,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr,
    W4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr,
    K_ALIGNED: tl.constexpr, USE_PDL: tl.constexpr = 0, ASM: tl.constexpr = 0, PREFETCH: tl.constexpr = 0,
    WEIGHTED: tl.constexpr = True,  # off: weight_on_input / expert_norm
    x_ptr=None, stride_xm=0, n_experts=0, ZERO_EXPERTS: tl.constexpr = False,  # x [T, N]: the zero experts' input
    W4_MMA: tl.constexpr = 0,  # as in moe_gemv1_kernel
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
        if ZERO_EXPERTS:  # nested under the constexpr: a zero expert adds weight * x[t]
            if expert >= n_experts:
                total += tl.load(topk_w_ptr + p) * tl.load(x_ptr + t * stride_xm + offs_n, mask=n_ok,
                                                           other=0.0).to(tl.float32)
            else:
                total += _slot(h_ptr + p * stride_hm, w_ptr, b_ptr, ws_ptr, zp_ptr, topk_w_ptr, p, expert, rows, n_ok,
                               K, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_sk, HAS_BIAS,
                               WEIGHTED, W4, GROUP, BLOCK_N, BLOCK_K, REDUCE_END, K_ALIGNED, ASM, PREFETCH, W4_MMA)
        else:
            total += _slot(h_ptr + p * stride_hm, w_ptr, b_ptr, ws_ptr, zp_ptr, topk_w_ptr, p, expert, rows, n_ok, K,
                           stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_sk, HAS_BIAS, WEIGHTED, W4,
                           GROUP, BLOCK_N, BLOCK_K, REDUCE_END, K_ALIGNED, ASM, PREFETCH, W4_MMA)
    pdl.release(USE_PDL)
    store_with_shared(total, t, offs_n, n_ok, shared_ptr, stride_s, gate_ptr, stride_g, out_ptr, stride_o, HAS_SHARED,
                      HAS_GATE)


@triton.jit
def _slot(h_row, w_ptr, b_ptr, ws_ptr, zp_ptr, topk_w_ptr, p, expert, rows, n_ok, K, stride_we, stride_wn,
          stride_be, stride_se, stride_sn, stride_sk, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
          W4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          REDUCE_END: tl.constexpr, K_ALIGNED: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
          W4_MMA: tl.constexpr):
    """One slot's [BLOCK_N] term: weight[p] * (h[p] . w2_e[rows] (+ b2_e)), unweighted when not WEIGHTED."""
    s_rows = ws_ptr + expert * stride_se + rows * stride_sn
    z_rows = (zp_ptr + expert * stride_se + rows * stride_sn) if W4 == 3 else s_rows
    r = _rows_dot(h_row, w_ptr + expert * stride_we + rows * stride_wn, n_ok, s_rows, z_rows, K, stride_sk, W4, GROUP,
                  BLOCK_N, BLOCK_K, REDUCE_END, K_ALIGNED, ASM, PREFETCH, W4_MMA)
    if HAS_BIAS:
        r += tl.load(b_ptr + expert * stride_be + rows, mask=n_ok, other=0.0).to(tl.float32)
    if WEIGHTED:
        r = r * tl.load(topk_w_ptr + p)
    return r
