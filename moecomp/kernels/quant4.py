"""4-bit weight-only (w4a16) building blocks of the grouped GEMMs (``moecomp.core.quant`` is their oracle).

Weights are packed two codes a byte along the input dim (the K of every expert GEMM): byte j of a row holds column
2j in its low nibble and column 2j + 1 in its high nibble. A kernel's weight pointers address bytes, so a K step of
BLOCK_K columns loads a [BLOCK_K / 2, N] uint8 tile.

    e2m1(c)            codes 0..15 (int32) -> fp32 e2m1 values, built from the bits:
                           c = s e1 e0 m:  e = 0: m * 0.5;  else (1 + m / 2) * 2 ** (e - 1);  sign s
    _decode(c, s, z)   int4: (c - z) as fp32 (z: the zero point, 8 for symmetric int4), an integer in [-15, 15];
                       mxfp4: e2m1(c) * s
    dot_loop4(...)     the K loop of a w4a16 GEMM: acc [BM, N] fp32 over K steps of BLOCK_K columns

        W4 1 (mxfp4):        b = e2m1(code) * 2 ** (scale_byte - 127)  (the ue8m0 scale of the element's group of
                             32 folded into the tile: the product has 2 significant bits, exact in bf16 / fp32 and in
                             fp16 while 2^-23 <= |w| < 2^16), acc = dot(a, b, acc)
        W4 2 / 3 (int4):     q = code - zero (zero 8, or w13_zero / w2_zero's byte: W4 3), exact in x's dtype;
                             part = dot(a, q);  acc += part * s[None, :]       (s: the column's group scale, fp32)
                             BLOCK_K divides the group, so one scale per column and step: the weights are used
                             exactly ((code - zero) * s, each product and sum in fp32 inside the MMA)
        W4_FOLD (int4):      the scale folded into the tile instead: b = x_dtype((code - zero) * s), one
                             accumulator chain; one rounding of each scaled weight to x's dtype (2^-9 relative in
                             bf16, 2^-11 in fp16, none in fp32). Off by default (a speed candidate).

    The K step's form (FORM, a speed candidate; all compute the same sums):
        0 interleave:  the decoded low / high nibble tiles interleaved back into one [BLOCK_K, N] tile (join,
                       permute, reshape: row 2j low nibble j, row 2j + 1 high nibble j), one dot with A's contiguous
                       tile (the default: offline for sm90 with Triton 3.9 it took 20-90 fewer registers than the
                       split form at most tiles, A going to shared memory as in the 16-bit loop)
        1 split:       A's step (loaded contiguous, [BM, BLOCK_K]) split into its even and odd columns (reshape
                       [BM, BLOCK_K / 2, 2] + split: the pairs are in one thread) and multiplied with the low and
                       high nibbles' tiles in two dots of K = BLOCK_K / 2 (the weights need no reordering; strided
                       loads of the even / odd columns instead had twice the load instructions)
        2 dot_scaled:  mxfp4 with 16-bit A only (else the interleave form): ``tl.dot_scaled(a, None, "bf16" |
                       "fp16", bytes, scale bytes [N, BLOCK_K / 32], "e2m1")``, Triton's own microscaled dot (on
                       Hopper it upcasts the codes itself: no fp4 MMA there; fp16 A: exact in the range named above)
        3 asm:         mxfp4 with 16-bit A on CUDA only (the launcher never asks for it under the interpreter, which
                       cannot run PTX): ``e2m1x2`` decodes four bytes a 32-bit lane into eight 16-bit values with
                       integer bit moves and one packed multiply a pair (below); A's even / odd columns (strided
                       loads) times the low / high nibble tiles, as batched dots over the step's BLOCK_K / 32 groups
                       ([G, BM, 16] x [G, 16, N]), each group's fp32 product times its ue8m0 scale (a power of two:
                       exact), summed over the groups

    ``e2m1x2`` (FORM 3): a byte's nibble n = s e1 e0 m placed as a 16-bit float's bits, em = n & 7 at the bottom of the
    exponent and the top of the mantissa, s at the sign: bf16 ``(em << 6) | (s << 15)`` is e2m1(n) * 2^-126 exactly
    (em < 2: a subnormal 0 / 2^-127), fp16 ``(em << 9) | (s << 15)`` is e2m1(n) * 2^-14; one ``fma.rn.{bf16x2,f16x2}``
    by 2^126 / 2^14 (and -0, which keeps the sign of zero) makes e2m1(n) (the packed 16-bit FMA keeps subnormal
    inputs). Per lane of four bytes: two ``prmt`` spread bytes 0, 1 and 2, 3 into the two halves of a word, then per
    word two shifts and masks each for the low and the high nibbles and one FMA each: 22 instructions for 8 values
    (and two moves of the FMA's constants: packed FMAs take registers only).

    Scales: ue8m0 bytes decode through ``fp8.ue8m0``; fp16 / bf16 / fp32 scales load as fp32. ``ws_ptrs`` [N]: each
    output column's scale row (group scales are per weight row, so a gated w13's gate / up columns read their own
    rows); the zero points (uint8, W4 3) have the scales' shape and strides. When BLOCK_K covers several groups (mxfp4
    at BLOCK_K > 32) the [BLOCK_K / Q_BLOCK_K, N] scales are broadcast over their groups' rows.

Masking: K is even (two columns a byte); rows, columns and bytes past the ends load 0 (code 0 is +0 in e2m1, and
any finite value in int4 times an A column that is masked to 0).
"""

import triton
import triton.language as tl

from . import fp8


@triton.jit
def e2m1(c):
    """int32 codes 0..15 -> fp32 e2m1 values (bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))  # 0 / 0.5, or (1 + m / 2) 2^(e - 1)
    bits = bits | ((c >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


# The PTX of ``e2m1x2``: $4 = four bytes; $0 / $1 = the low nibbles of bytes (0, 1) / (2, 3) as 16-bit pairs, $2 / $3
# the high nibbles'. Per output: the spread word (prmt) shifted so that em lands at EM_MASK and the sign bit (bit 3 of
# the nibble) at bit 15 of its half, then one packed FMA by ONE (2^126 / 2^14) and -0.
_E2M1X2_HEAD = ("{\n.reg .b32 t<2>, u<2>, one, nz;\nmov.b32 one, ONE;\nmov.b32 nz, 0x80008000;\n"
                "prmt.b32 t0, $4, 0, 0x4140;\nprmt.b32 t1, $4, 0, 0x4342;\n")
_E2M1X2_OUT = ("shl.b32 u0, tW, EM;\nand.b32 u0, u0, EM_MASK;\nshl.b32 u1, tW, SIGN;\nand.b32 u1, u1, 0x80008000;\n"
               "or.b32 u0, u0, u1;\nfma.rn.TYPE $OUT, u0, one, nz;\n")
_E2M1X2 = _E2M1X2_HEAD + "".join(
    _E2M1X2_OUT.replace("OUT", str(o)).replace("tW", f"t{o % 2}").replace("EM;", "LO_EM;" if o < 2 else "HI_EM;")
    .replace("SIGN", "12" if o < 2 else "8") for o in range(4)) + "}"
# bf16: em to bits 6..8 (low nibble << 6, high << 2), times 2^126 (0x7E80); fp16: em to bits 9..11, times 2^14 (0x7400)
E2M1X2_BF16 = tl.constexpr(_E2M1X2.replace("LO_EM", "6").replace("HI_EM", "2").replace("EM_MASK", "0x01C001C0")
                           .replace("ONE", "0x7E807E80").replace("TYPE", "bf16x2"))
E2M1X2_F16 = tl.constexpr(_E2M1X2.replace("LO_EM", "9").replace("HI_EM", "5").replace("EM_MASK", "0x0E000E00")
                          .replace("ONE", "0x74007400").replace("TYPE", "f16x2"))


@triton.jit
def e2m1x2(p, F16: tl.constexpr):
    """uint8 bytes (any shape; CUDA only) -> (low nibbles' e2m1 values, high nibbles'), bf16 (fp16 when F16), exact
    (module docstring: FORM 3)."""
    if F16:
        lo, hi = tl.inline_asm_elementwise(E2M1X2_F16, "=r,=r,=r,=r,r", [p], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(E2M1X2_BF16, "=r,=r,=r,=r,r", [p], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _asm_step(a_rows, row_ok, b_ptrs, j_ok, col_ok, ws_ptrs, k0, K, stride_sk, acc, DOT_PRECISION: tl.constexpr,
              BLOCK_K: tl.constexpr, TILE_N: tl.constexpr):
    """One K step of FORM 3 over its G = BLOCK_K / 32 ue8m0 groups at once: the [BK / 2, N] bytes viewed as
    [G, 16, N] and asm-decoded, A's even / odd columns loaded as [G, BM, 16] (strided), two batched dots ->
    [G, BM, N] fp32 products, each group's times its power of two, summed over G."""
    G: tl.constexpr = BLOCK_K // 32
    BM: tl.constexpr = a_rows.shape[0]
    g = tl.arange(0, G)
    jj = tl.arange(0, 16)
    p = tl.load(b_ptrs, mask=j_ok[:, None] & col_ok[None, :], other=0)  # [BK / 2, N] bytes
    lo, hi = e2m1x2(tl.reshape(p, [G, 16, TILE_N]), a_rows.dtype.element_ty == tl.float16)  # [G, 16, N] each
    cols = k0 + 32 * g[:, None, None] + 2 * jj[None, None, :]  # [G, 1, 16] even columns
    a_ok = row_ok[None, :, None] & (cols < K)
    a_e = tl.load(a_rows[None, :, None] + cols, mask=a_ok, other=0.0)  # [G, BM, 16]
    a_o = tl.load(a_rows[None, :, None] + cols + 1, mask=a_ok, other=0.0)
    part = tl.dot(a_o, hi, tl.dot(a_e, lo, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    g_ok = (k0 + 32 * g) < K
    sg = fp8.load_scale(ws_ptrs[None, :] + ((k0 // 32) + g)[:, None] * stride_sk, g_ok[:, None] & col_ok[None, :],
                        True)  # [G, N] fp32 2^(byte - 127)
    return acc + tl.sum(part * sg[:, None, :], axis=0)  # [BM, N]


@triton.jit
def _scales(ws_ptrs, zp_ptrs, k0, K, stride_sk, col_ok, W4: tl.constexpr, Q_BLOCK_K: tl.constexpr,
            UE8M0: tl.constexpr, BLOCK_K: tl.constexpr, TILE_N: tl.constexpr):
    """(s fp32, z int32) of a K step: [1, N] when the step lies in one group (BLOCK_K <= Q_BLOCK_K), else
    [BLOCK_K / 2, N] (each packed row's group: [BLOCK_K / Q_BLOCK_K, N] loads broadcast over their rows). z: the
    zero points (W4 3), else the constant 8."""
    if BLOCK_K <= Q_BLOCK_K:
        g = k0 // Q_BLOCK_K
        s = fp8.load_scale(ws_ptrs + g * stride_sk, col_ok, UE8M0)[None, :]
        z = 8
        if W4 == 3:
            z = tl.load(zp_ptrs + g * stride_sk, mask=col_ok, other=0).to(tl.int32)[None, :]
    else:
        NG: tl.constexpr = BLOCK_K // Q_BLOCK_K
        offs_g = k0 // Q_BLOCK_K + tl.arange(0, NG)
        g_ok = (offs_g * Q_BLOCK_K < K)[:, None] & col_ok[None, :]
        sg = fp8.load_scale(ws_ptrs[None, :] + offs_g[:, None] * stride_sk, g_ok, UE8M0)  # [NG, N]
        s = tl.reshape(tl.broadcast_to(sg[:, None, :], [NG, Q_BLOCK_K // 2, TILE_N]), [BLOCK_K // 2, TILE_N])
        z = 8
        if W4 == 3:
            zg = tl.load(zp_ptrs[None, :] + offs_g[:, None] * stride_sk, mask=g_ok, other=0).to(tl.int32)
            z = tl.reshape(tl.broadcast_to(zg[:, None, :], [NG, Q_BLOCK_K // 2, TILE_N]), [BLOCK_K // 2, TILE_N])
    return s, z


@triton.jit
def _decode(c, s, z, W4: tl.constexpr, FOLDED: tl.constexpr, UPCAST: tl.constexpr):
    """int32 codes [BK / 2, N] -> fp32 weights: mxfp4 e2m1 * s (exact); int4 (c - z), times s when FOLDED (then
    rounded to bf16 under UPCAST, as the bf16 tile the GPU multiplies; the caller's cast to x's dtype rounds
    otherwise)."""
    if W4 == 1:
        v = e2m1(c) * s  # exact: 2 significant bits times a power of two
    else:
        v = (c - z).to(tl.float32)
        if FOLDED:
            v = v * s
            if UPCAST:
                v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def dot_loop4(a_rows, row_ok, b_ptrs, col_ok, K, stride_bk, ws_ptrs, zp_ptrs, stride_sk,
              W4: tl.constexpr, Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr,
              FOLD: tl.constexpr = 0, FORM: tl.constexpr = 0):
    """acc [BM, TILE_N] fp32 = (A rows) x (4-bit weight columns), scales applied (see the module docstring).
    ``a_rows`` [BM]: pointers to the A rows (unit stride along K; x's dtype); ``b_ptrs`` [BK / 2, TILE_N]: the
    first step's packed bytes (``stride_bk``: the bytes' stride along K); ``ws_ptrs`` / ``zp_ptrs`` [TILE_N]: each
    column's scale / zero row (group 0); ``stride_sk``: the group stride of both. K: unpacked columns (even)."""
    HALF: tl.constexpr = BLOCK_K // 2
    FOLDED: tl.constexpr = W4 == 1 or FOLD != 0
    A_DT: tl.constexpr = a_rows.dtype.element_ty
    SCALED: tl.constexpr = FORM == 2 and W4 == 1 and A_DT != tl.float32
    ASM: tl.constexpr = FORM == 3 and W4 == 1 and A_DT != tl.float32 and BLOCK_K % 32 == 0 and UE8M0
    INTERLEAVE: tl.constexpr = FORM != 1
    offs_j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j_ok = offs_j < (K - k0) // 2
        if ASM:
            acc = _asm_step(a_rows, row_ok, b_ptrs, j_ok, col_ok, ws_ptrs, k0, K, stride_sk, acc, DOT_PRECISION,
                            BLOCK_K, TILE_N)
        elif SCALED:
            acc = _scaled_step(a_rows, row_ok, b_ptrs, j_ok, col_ok, ws_ptrs, k0, K, stride_sk, acc,
                               "fp16" if A_DT == tl.float16 else "bf16", BLOCK_K)
        else:
            acc = _step(a_rows, row_ok, b_ptrs, j_ok, col_ok, ws_ptrs, zp_ptrs, k0, K, stride_sk, acc, offs_j, W4,
                        Q_BLOCK_K, UE8M0, UPCAST, DOT_PRECISION, TILE_N, BLOCK_K, FOLDED, INTERLEAVE)
        b_ptrs += HALF * stride_bk
    return acc


@triton.jit
def _scaled_step(a_rows, row_ok, b_ptrs, j_ok, col_ok, ws_ptrs, k0, K, stride_sk, acc, A_FMT: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One K step of FORM 2: ``tl.dot_scaled`` on the packed bytes and their ue8m0 bytes (mxfp4 groups of 32)."""
    offs_k = tl.arange(0, BLOCK_K)
    a = tl.load(a_rows[:, None] + k0 + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
    p = tl.load(b_ptrs, mask=j_ok[:, None] & col_ok[None, :], other=0)  # [BK / 2, N] uint8
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(ws_ptrs[:, None] + offs_g[None, :] * stride_sk, mask=col_ok[:, None] & (offs_g * 32 < K)[None, :],
                other=127)  # [N, BK / 32] scale bytes (127: 1.0 where masked; those codes are 0)
    return tl.dot_scaled(a, None, A_FMT, p, s, "e2m1", acc)


@triton.jit
def _step(a_rows, row_ok, b_ptrs, j_ok, col_ok, ws_ptrs, zp_ptrs, k0, K, stride_sk, acc, offs_j, W4: tl.constexpr,
          Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
          TILE_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLDED: tl.constexpr, INTERLEAVE: tl.constexpr):
    """One K step of FORM 0 (interleave) or 1 (split): unpack, decode, dot(s), scale (see the module docstring)."""
    offs_k = tl.arange(0, BLOCK_K)
    a = tl.load(a_rows[:, None] + k0 + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
    if not INTERLEAVE:  # A's even columns 2j and odd columns 2j + 1, [BM, BK / 2] each
        a, a_odd = tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))
    p = tl.load(b_ptrs, mask=j_ok[:, None] & col_ok[None, :], other=0).to(tl.int32)  # [BK / 2, N] bytes
    s, z = _scales(ws_ptrs, zp_ptrs, k0, K, stride_sk, col_ok, W4, Q_BLOCK_K, UE8M0, BLOCK_K, TILE_N)
    lo = _decode(p & 15, s, z, W4, FOLDED, UPCAST)  # columns 2j
    hi = _decode(p >> 4, s, z, W4, FOLDED, UPCAST)  # columns 2j + 1
    if UPCAST:  # the interpreter's bf16 dot workaround: both operands fp32
        a = a.to(tl.float32)
    else:
        lo = lo.to(a.dtype)
        hi = hi.to(a.dtype)
    if INTERLEAVE:
        b = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BLOCK_K, TILE_N])  # row 2j lo[j], 2j + 1 hi[j]
        if FOLDED:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        else:
            part = tl.dot(a, b, input_precision=DOT_PRECISION)
    else:
        if UPCAST:
            a_odd = a_odd.to(tl.float32)
        if FOLDED:
            acc = tl.dot(a, lo, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(a_odd, hi, acc, input_precision=DOT_PRECISION)
        else:
            part = tl.dot(a_odd, hi, tl.dot(a, lo, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    if not FOLDED:
        acc += part * s
    return acc
