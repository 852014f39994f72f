"""The K loop of the 16-bit grouped GEMMs (gemm1, gemm2, the decode down-combine): one jit helper, inlined.

    acc [BLOCK_M, TILE_N] fp32 = sum over K steps of  A[rows, k0:k0+BK] . B[k0:k0+BK, cols]
    a_ptrs [BLOCK_M, BLOCK_K], b_ptrs [BLOCK_K, TILE_N]: the first step's tiles (unit stride along K for A, stride_bk
    for B); rows / columns outside ``row_ok`` / ``col_ok`` and K past the end load 0. UPCAST: both operands to fp32
    first (the interpreter's bf16 dot workaround). The FP8 loops are ``fp8.dot_loop``.
"""

import triton
import triton.language as tl


@triton.jit
def dense_loop(a_ptrs, row_ok, b_ptrs, col_ok, K, stride_bk, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc
