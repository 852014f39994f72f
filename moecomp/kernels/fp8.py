"""FP8 building blocks of the quantized GEMMs (``moecomp.core.quant`` is their oracle; docs/FP8.md the design).

    quant_rows(a)      a [BM, BK] fp32 (one 128-column group per row) -> (q e4m3 [BM, BK], s [BM] fp32)
                           s = max(max_k |a|, 1e-10) / 448          (IEEE division)
                           q = e4m3(clamp(a * (1 / s), -448, 448))   (IEEE reciprocal, round to nearest even)
    round_e4m3(v)      v fp32, |v| <= 448 -> the nearest e4m3 value (ties to even), in fp32: under the interpreter
                       (EXACT_CAST) the value is rounded in arithmetic first, because the interpreter's fp32 -> e4m3
                       cast rounds ties away and halves values that carry into the next power of two
    ue8m0(e)           uint8 biased exponents -> 2 ** (e - 127) in fp32, from the bits (e = 0: 2^-127, 255: NaN)
    scale_ptrs(...)    [N] pointers to each output column's weight scale (block: the column's row of block scales;
                       a gated w13's up rows read the second half of the scale rows)
    quant_act_kernel   "prequant" (docs/FP8.md, speed candidates): quant_rows once per (row, 128-column group) of
                       an activation [M, K] -> e4m3 [M, K] + scales [M, cdiv(K, 128)]; quant_groups / round_to:
                       the same in gemm1's epilogue (Q_OUT)
    dot_loop(...)      the K loop of every quantized GEMM, a [BM, BK] A tile and a [BK, N] e4m3 weight tile a step:

        w8a16 (A_QUANT 0):   acc += a . f(b)                        f(b): e4m3 -> a's dtype, exact
        w8a8  (A_QUANT 1):   q_a, s_a = quant_rows(a);  acc += (q_a . b) * s_a[:, None]     fp8 x fp8 dot
              (A_QUANT 2):   q_a = e4m3(clamp(a / s_static));  acc += q_a . b ;  acc *= s_static after the loop
              (A_QUANT 3):   A is e4m3 already (``quant_act_kernel`` or gemm1's Q_OUT epilogue, the same formula
                             once per row and group): acc += (q_a . b) * s_a[row, k0 // 128][:, None]; ``a_scale``
                             is then the [BM] pointers to each row's group scales ("prequant", docs/FP8.md)
        weight scales:       block (W_SCALE 1): each step's product times s_w[k0 // Q_BLOCK_K][None, :]
                             channel / tensor (2 / 3): acc *= s_w[None, :] after the loop
        FOLD (w8a16, block): the step's scale folded into the B tile instead: b = x_dtype(f32(q_w) * s_w[None, :]),
                             acc = dot(a, b, acc): one accumulator chain (one more rounding of each scaled weight);
                             FOLD 2 swaps the operands, acc^T = dot(b^T, a^T, acc^T): the scaled weights are then
                             the MMA's register operand and x's tile stays in shared memory (on Hopper a wgmma with
                             one dot in flight; FOLD 1 writes b back to shared memory and waits for every dot)

    Every product of a step is its own dot, promoted to the fp32 accumulator with its scales (Hopper's fp8 tensor
    cores accumulate with fewer bits: one K step of 128 at a time stays accurate). For block scales BLOCK_K divides
    Q_BLOCK_K; for dynamic activations BLOCK_K divides the 128-column group (BLOCK_K < 128: the group is loaded once
    more per step for its scale).
"""

import triton
import triton.language as tl

from . import pdl

# Constants are written out in the code (448.0: the largest e4m3 value; 1e-10: the smallest amax a scale is taken from;
# 128: the activation group): a global constexpr does not mix with the interpreter's Python-int loop variables.


@triton.jit
def ue8m0(e):
    """uint8 biased exponents -> fp32 2 ** (e - 127), built from the bits (e = 0 is the subnormal 2^-127)."""
    b = e.to(tl.int32)
    bits = tl.where(b == 0, 0x400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_scale(ptrs, mask, UE8M0: tl.constexpr):
    """Weight scales at ``ptrs`` as fp32 (0 where masked)."""
    s = tl.load(ptrs, mask=mask, other=0)
    if UE8M0:
        r = ue8m0(s)
    else:
        r = s.to(tl.float32)
    return r


@triton.jit
def round_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the e4m3 grid, ties to even: spacing 2^(e - 3) for |v| >= 2^-6 (e = the
    exponent, read from the bits), 2^-9 below (subnormals). v is scaled by a power of two into [8, 16) (or [0, 8)),
    rounded to an integer by adding and subtracting 1.5 * 2^23 (on |v|; the sign bit put back, so -0 stays -0), and
    scaled back: every step exact."""
    bits = v.to(tl.int32, bitcast=True)
    se = tl.maximum((bits >> 23) & 0xFF, 121) - 130  # log2 of the spacing: >= -9
    up = ((127 - se) << 23).to(tl.float32, bitcast=True)  # 2^-se
    down = ((127 + se) << 23).to(tl.float32, bitcast=True)  # 2^se
    t = tl.abs(v) * up
    r = ((t + 12582912.0) - 12582912.0) * down
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # v's sign (-0 too)


@triton.jit
def to_e4m3(v, EXACT_CAST: tl.constexpr):
    """fp32 v, already clamped to +-448 -> e4m3 (round to nearest even)."""
    if EXACT_CAST:
        v = round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def group_scale(a):
    """a [BM, G] fp32 -> s [BM] = max(max |a|, 1e-10) / 448 (IEEE division)."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10)
    return tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def reciprocal(s):
    """1 / s, IEEE-rounded (s an fp32 tensor)."""
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def quantize(a, inv, EXACT_CAST: tl.constexpr):
    """e4m3(clamp(a * inv, -448, 448)) for fp32 a and its (broadcastable) reciprocal scale inv."""
    return to_e4m3(tl.clamp(a * inv, -448.0, 448.0), EXACT_CAST)


@triton.jit
def quant_rows(a, EXACT_CAST: tl.constexpr):
    """a [BM, BK] fp32 (each row one activation group) -> (q e4m3 [BM, BK], s [BM])."""
    s = group_scale(a)
    return quantize(a, reciprocal(s)[:, None], EXACT_CAST), s


@triton.jit
def scale_ptrs(ws_ptr, base, rows, half, n_half, stride_sn, W_SCALE: tl.constexpr, Q_BLOCK_N: tl.constexpr):
    """[N] pointers to each output column's weight scale. ``rows``: each column's weight row (int64); ``half``: 0, or
    1 for the up rows of a gated w13 (rows = n + n_half); ``base``: the expert's offset into the scales.
    Block: scale row (rows - half * n_half) // Q_BLOCK_N + half * ceil(n_half / Q_BLOCK_N) (gate and up blocked
    apart); channel: scale[rows]; tensor: the one scale (broadcast)."""
    if W_SCALE == 1:
        srow = (rows - half * n_half) // Q_BLOCK_N + half * tl.cdiv(n_half, Q_BLOCK_N)
        p = ws_ptr + base + srow * stride_sn
    elif W_SCALE == 2:
        p = ws_ptr + base + rows * stride_sn
    else:
        p = ws_ptr + base + rows * 0
    return p


@triton.jit
def dot_loop(a_rows, row_ok, b_ptrs, col_ok, K, stride_bk, ws_ptrs, stride_sk, a_scale,
             A_QUANT: tl.constexpr, W_SCALE: tl.constexpr, Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr,
             EXACT_CAST: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr = 0):
    """acc [BM, TILE_N] fp32 = (A rows) x (e4m3 weight columns), every scale applied (see the module docstring).
    ``a_rows`` [BM]: pointers to the A rows (unit stride along K); ``b_ptrs`` [BK, TILE_N]: the first K step's
    weight tile; ``ws_ptrs`` [TILE_N]: ``scale_ptrs``; ``a_scale``: the static activation scale (A_QUANT 2), or the
    [BM] pointers to the rows' group scales (A_QUANT 3); FOLD 1 / 2: block scales folded into B (A_QUANT 0,
    W_SCALE 1; 2: operands swapped)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_rows[:, None] + offs_k[None, :]
    if A_QUANT == 2:
        inv_static = tl.math.div_rn(1.0, a_scale)
    if W_SCALE != 1:
        s_w = load_scale(ws_ptrs, col_ok, UE8M0)
    if FOLD == 2 and A_QUANT == 0 and W_SCALE == 1:
        acc = tl.zeros([TILE_N, BLOCK_M], dtype=tl.float32)  # transposed (swapped operands)
    else:
        acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if A_QUANT == 0:  # weight-only: e4m3 -> a's dtype is exact (fp32 under the interpreter's bf16 workaround)
            if FOLD and W_SCALE == 1:  # q_w * s_w rounded once to a's dtype (bf16 under UPCAST, then fp32)
                bs = b.to(tl.float32) * load_scale(ws_ptrs + (k0 // Q_BLOCK_K) * stride_sk, col_ok, UE8M0)[None, :]
                if UPCAST:
                    a = a.to(tl.float32)
                    b = bs.to(tl.bfloat16).to(tl.float32)
                else:
                    b = bs.to(a.dtype)
                if FOLD == 2:
                    acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=DOT_PRECISION)
                else:
                    acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            else:
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                else:
                    b = b.to(a.dtype)
                if W_SCALE == 1:
                    part = tl.dot(a, b, input_precision=DOT_PRECISION)
                else:
                    acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        elif A_QUANT == 3:  # e4m3 A and its rows' scales of this step's 128-column group
            s_a = tl.load(a_scale + k0 // 128, mask=row_ok, other=0.0)
            part = tl.dot(a, b) * s_a[:, None]
        else:
            af = a.to(tl.float32)
            if A_QUANT == 1:
                if BLOCK_K == 128:
                    grp = af
                else:  # the scale is the whole 128-column group's: load it (cached) for this step
                    offs_g = k0 - k0 % 128 + tl.arange(0, 128)
                    grp = tl.load(a_rows[:, None] + offs_g[None, :], mask=row_ok[:, None] & (offs_g < K)[None, :],
                                  other=0.0).to(tl.float32)
                s_a = group_scale(grp)
                part = tl.dot(quantize(af, reciprocal(s_a)[:, None], EXACT_CAST), b) * s_a[:, None]
            else:
                part = tl.dot(quantize(af, inv_static, EXACT_CAST), b)
        if W_SCALE == 1 and not (FOLD and A_QUANT == 0):
            part = part * load_scale(ws_ptrs + (k0 // Q_BLOCK_K) * stride_sk, col_ok, UE8M0)[None, :]
        if A_QUANT != 0 or (W_SCALE == 1 and not FOLD):
            acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if FOLD == 2 and A_QUANT == 0 and W_SCALE == 1:
        acc = tl.trans(acc)
    if W_SCALE != 1:
        acc = acc * s_w[None, :]
    if A_QUANT == 2:
        acc = acc * a_scale
    return acc


@triton.jit
def round_to(v, H_DTYPE: tl.constexpr):
    """fp32 v rounded to the 16-bit dtype h is kept in (H_DTYPE 2: bf16, 3: fp16; else unchanged), back in fp32."""
    if H_DTYPE == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif H_DTYPE == 3:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def quant_groups(v, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_CAST: tl.constexpr):
    """v [BM, BN] fp32 (BN a multiple of 128; masked columns 0) -> (q e4m3 [BM, BN], s [BM, BN // 128]): quant_rows
    of every 128-column group (gemm1's Q_OUT epilogue)."""
    g = tl.reshape(v, [BLOCK_M, BLOCK_N // 128, 128])
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-10)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    q = quantize(g, reciprocal(s)[:, :, None], EXACT_CAST)
    return tl.reshape(q, [BLOCK_M, BLOCK_N]), s


@triton.jit
def quant_act_kernel(
    x_ptr,  # [M, K] (any float dtype, unit column stride)
    q_ptr,  # [M, K] e4m3 out
    s_ptr,  # [M, cdiv(K, 128)] fp32 out
    sorted_ptr,  # ROWS_SORTED: sorted ids [M] (rows whose id is the sentinel P, or at / past num_padded, are skipped)
    num_padded_ptr,
    M,
    K,
    P,
    stride_xm,
    stride_qm,
    stride_sm,
    ROWS_SORTED: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    stride_sg=1,  # the scales' group stride (M: column-major scales, as torch's BlockWise1x128 GEMM reads them)
    GATHER: tl.constexpr = 0,  # top-k: row r of q / s is x's row sorted[r] // GATHER (ROWS_SORTED; the FP8 TMA gemm1)
):
    """Dynamic activation quantization once per (row, 128-column group): q, s = quant_rows(x[rows, group]), the
    formula dot_loop's A_QUANT 1 applies in every GEMM program ("prequant"). One program per BLOCK_M rows and group.
    ROWS_SORTED (h of the aligned path, [S, I] in sorted order): padding rows are neither read nor written (the
    GEMMs mask them). GATHER (with ROWS_SORTED): x [T, K] is read at each sorted row's token (pair // GATHER), so
    q / s are x's rows gathered into sorted order and quantized in one pass."""
    pdl.enter(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * 128 + tl.arange(0, 128)
    row_ok = offs_m < M
    if ROWS_SORTED:
        row_ok = row_ok & (offs_m < tl.load(num_padded_ptr))
        row_ok = row_ok & (tl.load(sorted_ptr + offs_m, mask=row_ok, other=P) < P)
    rows = offs_m.to(tl.int64)
    src = rows
    if GATHER:
        src = (tl.load(sorted_ptr + offs_m, mask=row_ok, other=0) // GATHER).to(tl.int64)
    m = row_ok[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
    q, s = quant_rows(x, EXACT_CAST)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q, mask=m)
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1) * stride_sg, s, mask=row_ok)
    pdl.release(USE_PDL)
