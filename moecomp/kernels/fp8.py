"""FP8 building blocks of the quantized GEMMs (``moecomp.quant`` is their oracle; docs/FP8.md the design).

    quant_rows(a)      a [BM, BK] fp32 (one 128-column group per row) -> (q e4m3 [BM, BK], s [BM] fp32)
                           s = max(max_k |a|, 1e-10) / 448          (IEEE division)
                           q = e4m3(clamp(a * (1 / s), -448, 448))   (IEEE reciprocal, round to nearest even)
    round_e4m3(v)      v fp32, |v| <= 448 -> the nearest e4m3 value (ties to even), in fp32: under the interpreter
                       (EXACT_CAST) the value is rounded in arithmetic first, because the interpreter's fp32 -> e4m3
                       cast rounds ties away and halves values that carry into the next power of two
    ue8m0(e)           uint8 biased exponents -> 2 ** (e - 127) in fp32, from the bits (e = 0: 2^-127, 255: NaN)
    scale_ptrs(...)    [N] pointers to each output column's weight scale (block: the column's row of block scales;
                       a gated w13's up rows read the second half of the scale rows)
    dot_loop(...)      the K loop of every quantized GEMM, a [BM, BK] A tile and a [BK, N] e4m3 weight tile a step:

        w8a16 (A_QUANT 0):   acc += a . f(b)                        f(b): e4m3 -> a's dtype, exact
        w8a8  (A_QUANT 1):   q_a, s_a = quant_rows(a);  acc += (q_a . b) * s_a[:, None]     fp8 x fp8 dot
              (A_QUANT 2):   q_a = e4m3(clamp(a / s_static));  acc += q_a . b ;  acc *= s_static after the loop
        weight scales:       block (W_SCALE 1): each step's product times s_w[k0 // Q_BLOCK_K][None, :]
                             channel / tensor (2 / 3): acc *= s_w[None, :] after the loop

    Every product of a step is its own dot, promoted to the fp32 accumulator with its scales (Hopper's fp8 tensor
    cores accumulate with fewer bits: one K step of 128 at a time stays accurate). For block scales BLOCK_K divides
    Q_BLOCK_K; for dynamic activations BLOCK_K divides the 128-column group (BLOCK_K < 128: the group is loaded once
    more per step for its scale).
"""

import triton
import triton.language as tl

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
             BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BM, TILE_N] fp32 = (A rows) x (e4m3 weight columns), every scale applied (see the module docstring).
    ``a_rows`` [BM]: pointers to the A rows (unit stride along K); ``b_ptrs`` [BK, TILE_N]: the first K step's
    weight tile; ``ws_ptrs`` [TILE_N]: ``scale_ptrs``; ``a_scale``: the static activation scale (A_QUANT 2)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_rows[:, None] + offs_k[None, :]
    if A_QUANT == 2:
        inv_static = tl.math.div_rn(1.0, a_scale)
    if W_SCALE != 1:
        s_w = load_scale(ws_ptrs, col_ok, UE8M0)
    acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if A_QUANT == 0:  # weight-only: e4m3 -> a's dtype is exact (fp32 under the interpreter's bf16 workaround)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            else:
                b = b.to(a.dtype)
            if W_SCALE == 1:
                part = tl.dot(a, b, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
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
        if W_SCALE == 1:
            part = part * load_scale(ws_ptrs + (k0 // Q_BLOCK_K) * stride_sk, col_ok, UE8M0)[None, :]
        if A_QUANT != 0 or W_SCALE == 1:
            acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if W_SCALE != 1:
        acc = acc * s_w[None, :]
    if A_QUANT == 2:
        acc = acc * a_scale
    return acc
