"""The down-projection grouped GEMM for many tokens on Hopper: tensor-memory-accelerator (TMA) loads, persistent
programs, and Triton's warp specialisation (a producer warp group issues the TMA loads while the others run the MMAs).

    gemm2:  y[p(s), n] = (h[s] . w2_e[n] + b2) * weight[p(s)]     h: [S, I] in sorted order -> y: [P, H] in pair order

Same data and layout contract as ``grouped_gemm.py``'s moe_gemm2_kernel (sorted_ids, block_expert, num_padded from
the alignment), with limits the launcher checks (``ops/triton_moe._tma_ok``): w2 in the [E, H, I] layout and
contiguous, so that it reads as one 2-D [E * H, I] matrix; 16-bit dtypes; rows of whole 16-byte units. h is already
in sorted order, so both operands are plain TMA tiles; the epilogue scatters rows to pair order with pointer stores.

A tile straddling the end of an expert's H rows reads the next expert's first rows (or zeros past the last): those
are output columns >= H, which are never stored. Past I the descriptors read zeros. The persistent loop runs over
the tiles of the padded rows only (num_padded, read on the device), in ``grouped_gemm._block_ids`` order, so the
grid is static (capturable) and padding costs no tile.

gemm1 has no TMA form: measured on an H200 (2026-11-30) the gate/up GEMM on TMA tiles (x gathered into sorted order
first, gate and up tiles in two dots, or joined into one) was 6-30% slower than the pointer kernel; gemm2 on TMA
was 6-33% faster from T=1024 (``benchmarks/NOTES.md``).
"""

import triton
import triton.language as tl

from . import pdl
from .grouped_gemm import _block_ids


@triton.jit
def moe_gemm2_tma_kernel(
    h_desc,  # [S, K] sorted order, block [BLOCK_M, BLOCK_K]
    w_desc,  # [E * N, K], block [BLOCK_N, BLOCK_K]
    b_ptr,  # [E, N] bias or None
    topk_w_ptr,  # [P] fp32 routing weights (pair order)
    y_ptr,  # [P, N] out, pair order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,  # H
    K,  # I
    stride_be,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    n_m = tl.load(num_padded_ptr) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * num_n, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _block_ids(tile, N, n_m, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m)
        row0 = pid_m * BLOCK_M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(h_desc.load([row0, k0]), w_desc.load([expert * N + pid_n * BLOCK_N, k0]).T, acc)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        pair = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
        row_ok = pair < P
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    pdl.release(USE_PDL)
