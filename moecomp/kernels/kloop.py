"""The K loop of the 16-bit grouped GEMMs (gemm1, gemm2, the decode down-combine): one jit helper, inlined.

    acc [BLOCK_M, TILE_N] fp32 = sum over K steps of  A[rows, k0:k0+BK] . B[k0:k0+BK, cols]
    a_ptrs [BLOCK_M, BLOCK_K], b_ptrs [BLOCK_K, TILE_N]: the first step's tiles (unit stride along K for A, stride_bk
    for B); rows / columns outside ``row_ok`` / ``col_ok`` and K past the end load 0. UPCAST: both operands to fp32
    first (the interpreter's bf16 dot workaround). The FP8 loops are ``fp8.dot_loop``.

``pair_loop`` is gemm1's loop for concatenated gate / up halves in the in_out layout ([E, H, 2I]: columns unit
stride): the gate and up tiles [BLOCK_K, BLOCK_N] are loaded apart, each contiguous along N, and multiplied apart,
and the two accumulators are interleaved once after the loop into the [BLOCK_M, 2 * BLOCK_N] tile that
``dense_loop`` would have given (column 2c gate c, 2c + 1 up c). One tile with columns gate c, up c, gate c + 1, ...
would gather two elements 2I apart per pair: no vector loads along N, 5-7x slower on Llama 4 Scout's layer.
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


@triton.jit
def pair_loop(a_ptrs, row_ok, g_ptrs, up_offset, col_ok, K, stride_bk, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """g_ptrs [BLOCK_K, BLOCK_N]: the gate tile's first step; the up tile is ``up_offset`` elements on."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & col_ok[None, :]
        g = tl.load(g_ptrs, mask=b_ok, other=0.0)
        u = tl.load(g_ptrs + up_offset, mask=b_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_bk
    return tl.reshape(tl.join(acc_g, acc_u), [BLOCK_M, 2 * BLOCK_N])  # [BM, BN, 2] -> columns 2c, 2c + 1


@triton.jit
def block_ids(pid, n_cols, MAX_BLOCKS, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid`` in grouped order: GROUP_M row blocks (of MAX_BLOCKS) sweep the
    columns together, so that their weight tiles stay in L2. The grouped GEMMs and the dense FP8 / 4-bit linears."""
    num_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(MAX_BLOCKS - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n
