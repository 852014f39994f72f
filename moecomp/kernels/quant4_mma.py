"""The "mma" K-step form of the 4-bit experts' GEMMs (W4_FORM 4 of ``grouped_gemm``'s gemm1 / gemm2; opt-in):
weights in the mma layout (``ops/w4_layout.py``: each 32-bit word 8 codes, re-encoded for mxfp4), decoded by bit
arithmetic, fed to ``tl.dot`` as the M side (swap-AB: the token tile is the dot's N side).

    per K step of BLOCK_K columns, a program of TILE_N weight rows and BLOCK_M tokens:
        r      [TILE_N, BLOCK_K / 8] int32 words (each row's words contiguous along K: 16-byte vector loads where
               the launcher passes K32, K % 32 == 0; else 8-byte ones: checked in tests/kernels/
               test_sm90_compile_w4mma.py)
        slot j of both 16-bit lanes:
            mxfp4   t = ((r << (6 - 3j)) & 0x01C001C0) | ((r << j) & 0x80008000)   bf16 bits of e2m1 * 2^-126
                    f = fp32(t << 16), fp32(t & 0xFFFF0000)                         the same value, each lane
                    v = f * 2^126 * 2^(scale_byte - 127)                            two fp32 multiplies, exact
            int4    t = ((r >> 4j) & 0x000F000F) | 0x64006400                       fp16 1024 + q
                    v = fp16(t) - (1024 + zero)                                     q - zero, exact
        tile   [TILE_N, BLOCK_K] = the 8 slots joined in column order (column 8w + 4L + j), cast to x's dtype
        mxfp4: accT = dot(tile, x^T, accT)           (the scale is in the tile: exact, 2 significant bits)
        int4:  accT += dot(tile, x^T) * s[:, None]   (BLOCK_K divides the group: one scale per row and step)
    returns trans(accT) [BLOCK_M, TILE_N]: the caller's epilogue (bias, activation, routing weight) as for the other
    forms.

Exactness: e2m1 * 2^-126 from the bf16 bits is exact (normal for e >= 1, the subnormal 2^-127 for code 1); times
2^126 (a power of two) it is e2m1; times the ue8m0 scale 2^(b - 127) (``fp8.ue8m0``: b = 0 the subnormal 2^-127, b =
255 NaN) the product has two significant bits: exact in fp32 (inf past 2^128, as the fp32 oracle), and exact again
when cast to bf16 (fp32's exponent range). The multiplies are fp32, not bf16: the interpreter's bf16 arithmetic is
not IEEE (its bf16 -> fp32 cast flushes subnormals and its bf16 products are wrong), so the CPU test could not run
a bf16 form; on the GPU the fp32 multiplies need subnormals kept (Triton's default; the GPU test
``tests/ops/test_quant4_mma_gpu.py`` checks the decode bit for bit). A bf16x2 multiply would halve them: a speed
candidate once measured. The tile is cast to x's dtype: exact for bf16 and fp32 x, for fp16 x while 2^-24 <= |w|
< 2^16 (as the other forms).
Masked words load 0 (+0 in both formats' mma bytes for mxfp4; int4's masked x columns are 0), masked scales 1.0.
UPCAST (the interpreter's bf16 dot): tile and x in fp32.
"""

import triton
import triton.language as tl

from . import fp8

EM6 = tl.constexpr(0x01C001C0)  # e1 e0 m at bits 6..8 of both lanes
SIGNS = tl.constexpr(-2147450880)  # 0x80008000 as int32
NIB2 = tl.constexpr(0x000F000F)
F16_1024 = tl.constexpr(0x64006400)
TWO126 = tl.constexpr(2.0 ** 126)
HI16 = tl.constexpr(-65536)  # 0xFFFF0000


@triton.jit
def _lanes_f32(t):
    """int32 words of two 16-bit float patterns (bf16 bits) -> (low half, high half) as fp32 of the same value: the
    bf16 bits moved to the top of an fp32 word (no 16-bit arithmetic: the interpreter's bf16 is not IEEE)."""
    return (t << 16).to(tl.float32, bitcast=True), (t & HI16).to(tl.float32, bitcast=True)


@triton.jit
def _lanes_f16(t):
    return (t.to(tl.int16).to(tl.float16, bitcast=True),
            (t >> 16).to(tl.int16).to(tl.float16, bitcast=True))


@triton.jit
def mx_slot(r, J: tl.constexpr):
    """mma-layout mxfp4 words -> slot J of both lanes (columns 8w + J, 8w + 4 + J): e2m1 * 2^-126 (fp32)."""
    if J == 3:
        em = r >> 3
    else:
        em = r << (6 - 3 * J)
    return _lanes_f32((em & EM6) | ((r << J) & SIGNS))


@triton.jit
def int4_slot(r, zh, J: tl.constexpr):
    """int4 words -> slot J of both lanes as fp16 code - zero (``zh``: 1024 + zero, fp16; exact)."""
    lo, hi = _lanes_f16(((r >> (4 * J)) & NIB2) | F16_1024)
    return lo - zh, hi - zh


@triton.jit
def _join8(l0, l1, l2, l3, h0, h1, h2, h3):
    """8 [R, NW] tensors (lane L, slot j) -> [R, NW * 8] with (L, j) at column 8w + 4L + j."""
    a0 = tl.join(l0, h0)  # [.., L]
    a1 = tl.join(l1, h1)
    a2 = tl.join(l2, h2)
    a3 = tl.join(l3, h3)
    b0 = tl.join(a0, a2)  # [.., L, j1]   (j = 2 j1 + j0)
    b1 = tl.join(a1, a3)
    c = tl.join(b0, b1)  # [.., L, j1, j0]: flat 4L + 2 j1 + j0 = 4L + j
    R: tl.constexpr = l0.shape[0]
    NW: tl.constexpr = l0.shape[1]
    return tl.reshape(c, [R, NW * 8])


@triton.jit
def decode_mx(r, s):
    """mma-layout mxfp4 words [R, NW] and each word's scale [R, NW] (fp32 2^(b - 127)) -> fp32 weights
    [R, NW * 8], exact."""
    m = TWO126
    l0, h0 = mx_slot(r, 0)
    l1, h1 = mx_slot(r, 1)
    l2, h2 = mx_slot(r, 2)
    l3, h3 = mx_slot(r, 3)
    return _join8(l0 * m * s, l1 * m * s, l2 * m * s, l3 * m * s, h0 * m * s, h1 * m * s, h2 * m * s, h3 * m * s)


@triton.jit
def decode_int4(r, zh):
    """int4 words [R, NW] and 1024 + zero (fp16, broadcastable) -> fp16 code - zero [R, NW * 8], exact."""
    l0, h0 = int4_slot(r, zh, 0)
    l1, h1 = int4_slot(r, zh, 1)
    l2, h2 = int4_slot(r, zh, 2)
    l3, h3 = int4_slot(r, zh, 3)
    return _join8(l0, l1, l2, l3, h0, h1, h2, h3)


@triton.jit
def mma_loop(x_rows, row_ok, w_rows, col_ok, K, ws_rows, zp_rows, stride_sk, W4: tl.constexpr,
             Q_BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
             TILE_N: tl.constexpr, BLOCK_K: tl.constexpr, K32: tl.constexpr = 0):
    """acc [BLOCK_M, TILE_N] fp32 = (x rows) x (4-bit weight rows)^T (the module docstring). ``x_rows`` [BLOCK_M]:
    pointers to the token rows (unit stride; x's dtype); ``w_rows`` [TILE_N]: byte pointers to each weight row's
    first mma-layout byte (4-byte aligned; K % 8 == 0); ``ws_rows`` / ``zp_rows`` [TILE_N]: each row's first group
    scale (ue8m0 bytes for W4 1) / zero point (W4 3), ``stride_sk`` apart. BLOCK_K: a multiple of 32 (mxfp4) or a
    divisor of the group (int4). K32 (the launcher's promise that K % 32 == 0): the words' K mask is written over
    whole runs of 4 words, so that the compiler can load them as 16-byte vectors (K % 8 alone gives it 8 bytes)."""
    NW: tl.constexpr = BLOCK_K // 8
    A_DT: tl.constexpr = x_rows.dtype.element_ty
    offs_w = tl.arange(0, NW)
    offs_k = tl.arange(0, BLOCK_K)
    if K32:
        kw = (K // 32) * 4  # = K // 8, visibly a multiple of 4
    else:
        kw = K // 8
    w_base = w_rows.to(tl.pointer_type(tl.int32))[:, None]  # [TILE_N, 1]
    acc = tl.zeros([TILE_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wi = k0 // 8 + offs_w
        r = tl.load(w_base + wi[None, :], mask=col_ok[:, None] & (wi < kw)[None, :], other=0)  # [TILE_N, NW]
        xt = tl.load(x_rows[None, :] + k0 + offs_k[:, None], mask=row_ok[None, :] & (offs_k < K - k0)[:, None],
                     other=0.0)  # [BLOCK_K, BLOCK_M]
        if W4 == 1:
            G: tl.constexpr = BLOCK_K // 32
            gi = k0 // 32 + tl.arange(0, G)
            sb = tl.load(ws_rows[:, None] + gi[None, :] * stride_sk, mask=col_ok[:, None] & (gi * 32 < K)[None, :],
                         other=127)  # [TILE_N, G] (127: 1.0 where masked; those words are 0)
            s = fp8.ue8m0(sb)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [TILE_N, G, 4]), [TILE_N, NW])  # each word's group
            tile = decode_mx(r, s)
        else:
            g = k0 // Q_BLOCK_K
            if W4 == 3:
                z = tl.load(zp_rows + g * stride_sk, mask=col_ok, other=0).to(tl.float32)
                zh = (z + 1024.0).to(tl.float16)[:, None]
            else:
                zh = tl.full([TILE_N, 1], 1032.0, tl.float16)  # symmetric: zero 8
            tile = decode_int4(r, zh)
        if UPCAST:
            tile = tile.to(tl.float32)
            xt = xt.to(tl.float32)
        else:
            tile = tile.to(A_DT)
        if W4 == 1:
            acc = tl.dot(tile, xt, acc, input_precision=DOT_PRECISION)
        else:
            s4 = tl.load(ws_rows + g * stride_sk, mask=col_ok, other=0).to(tl.float32)
            acc += tl.dot(tile, xt, input_precision=DOT_PRECISION) * s4[:, None]
    return tl.trans(acc)
