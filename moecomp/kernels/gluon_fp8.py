"""FP8 w8a8 gemm2 in Gluon (``triton.experimental.gluon``): the data contract of ``moe_gemm2_tma_fp8_kernel``
(kernels/grouped_gemm_tma_fp8.py) with the per-step promotion taken off the tensor cores' critical path.

    y[p(s), n] = (sum_g (h_q[s, g] . w2_q[n, g]) * s_h[s, g] * s_w[e, n // 128, g] + b2[e, n]) * weight[p(s)]
        h_q [S, I] e4m3 sorted rows, s_h [S, I/128] fp32; w2_q [E * H, I] e4m3, s_w [E, H/128, I/128] fp32
        (or ue8m0 bytes); e = block_expert[s // BLOCK_M]; rows past num_padded never visited; padding rows
        (sorted id >= P) computed and never stored

Why Gluon: the Triton kernel's ``tl.dot`` product is scaled before it is added to the accumulator, so the compiler
waits for every wgmma (``wgmma.wait_group 0``) and the tensor cores idle while the registers promote. Here the
K loop is written out by hand (one K step = BLOCK_K = 128 = one scale group):

    ring:     STAGES shared-memory slots of A [BM, 128] and B [BN, 128], filled by TMA, one mbarrier each
    step k:   wait slot k's barrier; issue wgmma_k (async, its own fp32 step accumulator, use_acc False)
              wait until one wgmma is outstanding (wgmma_k-1 is complete; wgmma_k still runs)
              refill slot (k-1) % STAGES with step k-1+STAGES (its reader, wgmma_k-1, is done)
              acc += p_{k-1} * s_h[:, k-1][:, None] * s_w[k-1]        <- registers, while wgmma_k runs
    end:      wait for the last wgmma, promote it; bias, routing weight, scattered store of the rows

The loop runs CHUNK steps an iteration, unrolled, with no product in flight at an iteration's ends: a product
carried in flight through a loop or branch is a phi copy, and ptxas then serializes every wgmma (``_chunk``).

Two step accumulators are live at once (p_{k-1} being promoted, p_k being written), plus acc: 3 * BM * BN / 128
fp32 registers a thread; BLOCK_M = 64 per warp group (num_warps = 4 * BLOCK_M // 64) keeps that at 192 for
BN = 128. Supported: block weight scales with Q_BLOCK_K = 128 and Q_BLOCK_N a multiple of BLOCK_N (one scalar
weight scale per step), fp32 or ue8m0; the launcher (ops/triton_fp8_gluon.py) checks and falls back otherwise.

API surface: Triton 3.6 (GPU machine) and 3.9 (here) differ in the TMA load's name (``tma.async_copy_global_to_shared``
until the rename, ``tma.async_load`` after, the old name raising); ``tma_load`` picks by feature.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _issue(h_desc, w_desc, a_s, b_s, bars, slot, row0, wrow0, k, pred, STEP_BYTES: gl.constexpr,
           BLOCK_K: gl.constexpr):
    """TMA loads of K step ``k``'s A and B tiles into ring slot ``slot`` (skipped where not ``pred``)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, STEP_BYTES, pred=pred)
    tma_load(h_desc, [row0, k * BLOCK_K], bar, a_s.index(slot), pred=pred)
    tma_load(w_desc, [wrow0, k * BLOCK_K], bar, b_s.index(slot), pred=pred)


@gluon.jit
def _step_scale(hs, k, ws, stride_sk, UE8M0: gl.constexpr):
    """Step k's scales: the rows' activation group scales [BM] times the tile's one block weight scale."""
    s_a = gl.load(hs + k)
    if UE8M0:
        e = gl.load(ws + k * stride_sk).to(gl.int32)
        bits = gl.where(e == 0, 0x400000, e << 23)
        bits = gl.where(e == 255, 0x7FC00000, bits)
        s_w = bits.to(gl.float32, bitcast=True)
    else:
        s_w = gl.load(ws + k * stride_sk)
    return s_a * s_w


@gluon.jit
def mma_step(a_s, b_s, bars, k, zero, STAGES: gl.constexpr):
    """Wait for step k's tiles, issue its wgmma (async) into a fresh step accumulator."""
    slot = k % STAGES
    mbarrier.wait(bars.index(slot), (k // STAGES) & 1)
    return warpgroup_mma(a_s.index(slot), b_s.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _promote(acc, part, OUTSTANDING: gl.constexpr, hs, ws, stride_sk, h_desc, w_desc, a_s, b_s, bars, row0, wrow0, k,
             nk, UE8M0: gl.constexpr, STEP_BYTES: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """acc + step k's product times its scales, once at most OUTSTANDING wgmmas (the next step's) are in flight;
    step k's ring slot refills with step k + STAGES first (its wgmma has read it)."""
    scale = _step_scale(hs, k, ws, stride_sk, UE8M0)
    done = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=[part])
    _issue(h_desc, w_desc, a_s, b_s, bars, k % STAGES, row0, wrow0, k + STAGES, k + STAGES < nk, STEP_BYTES, BLOCK_K)
    return acc + done * scale[:, None]


@gluon.jit
def _chunk(acc, k0, zero, hs, ws, stride_sk, h_desc, w_desc, a_s, b_s, bars, row0, wrow0, nk, STEPS: gl.constexpr,
           UE8M0: gl.constexpr, STEP_BYTES: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Steps k0 .. k0 + STEPS - 1, unrolled: each step's wgmma is issued before the previous step's product is
    promoted. No product is in flight at the chunk's ends: an in-flight step accumulator carried through a loop or
    a branch is copied (a phi), ptxas then waits for every wgmma of the kernel (C7514 "wgmma.mma_async
    instructions are serialized"). So one promotion a chunk (its last) runs with no MMA beside it."""
    prev = mma_step(a_s, b_s, bars, k0, zero, STAGES)
    for i in gl.static_range(1, STEPS):
        cur = mma_step(a_s, b_s, bars, k0 + i, zero, STAGES)
        acc = _promote(acc, prev, 1, hs, ws, stride_sk, h_desc, w_desc, a_s, b_s, bars, row0, wrow0, k0 + i - 1, nk,
                       UE8M0, STEP_BYTES, BLOCK_K, STAGES)
        prev = cur
    return _promote(acc, prev, 0, hs, ws, stride_sk, h_desc, w_desc, a_s, b_s, bars, row0, wrow0, k0 + STEPS - 1, nk,
                    UE8M0, STEP_BYTES, BLOCK_K, STAGES)


@gluon.jit
def moe_gemm2_gluon_fp8_kernel(
    h_desc,  # e4m3 [S, K] sorted order, box [BLOCK_M, BLOCK_K]
    hs_ptr,  # fp32 [S, K / 128] h's group scales (row stride stride_hsm)
    w_desc,  # e4m3 [E * N, K], box [BLOCK_N, BLOCK_K]
    ws_ptr,  # block weight scales [E, cdiv(N, Q_BLOCK_N), K / 128] fp32, or ue8m0 bytes
    b_ptr,  # [E, N] bias or None
    topk_w_ptr,  # [P] fp32 routing weights (pair order)
    y_ptr,  # [P, N] out, pair order
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N,  # H
    K,  # I
    stride_hsm,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_ym,
    Q_BLOCK_N: gl.constexpr,
    UE8M0: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    WEIGHTED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    CHUNK: gl.constexpr,  # K steps a loop iteration (unrolled); the launcher picks it
    TAIL: gl.constexpr,  # cdiv(K, BLOCK_K) % CHUNK: the steps after the loop
):
    WARPS: gl.constexpr = BLOCK_M // 16
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    STEP_BYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K

    num_n = gl.cdiv(N, BLOCK_N)
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    if pid_m * BLOCK_M < gl.load(num_padded_ptr):
        a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], h_desc.layout)
        b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        expert = gl.load(block_expert_ptr + pid_m)
        row0 = pid_m * BLOCK_M
        wrow0 = expert * N + pid_n * BLOCK_N
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=row_l)
        hs = hs_ptr + offs_m.to(gl.int64) * stride_hsm
        ws = ws_ptr + expert.to(gl.int64) * stride_se + (pid_n * BLOCK_N // Q_BLOCK_N) * stride_sn
        nk = gl.cdiv(K, BLOCK_K)
        for i in gl.static_range(STAGES):
            _issue(h_desc, w_desc, a_s, b_s, bars, i, row0, wrow0, i, i < nk, STEP_BYTES, BLOCK_K)

        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        for c in range(0, nk // CHUNK):
            acc = _chunk(acc, c * CHUNK, zero, hs, ws, stride_sk, h_desc, w_desc, a_s, b_s, bars, row0, wrow0, nk,
                         CHUNK, UE8M0, STEP_BYTES, BLOCK_K, STAGES)
        if TAIL > 0:
            acc = _chunk(acc, nk - TAIL, zero, hs, ws, stride_sk, h_desc, w_desc, a_s, b_s, bars, row0, wrow0, nk,
                         TAIL, UE8M0, STEP_BYTES, BLOCK_K, STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
        n_ok = offs_n < N
        if HAS_BIAS:
            bias = gl.load(b_ptr + expert.to(gl.int64) * stride_be + offs_n, mask=n_ok, other=0.0)
            acc += bias.to(gl.float32)[None, :]
        pair = gl.load(sorted_ptr + offs_m)
        row_ok = pair < P
        if WEIGHTED:
            acc = acc * gl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        y_ptrs = y_ptr + pair.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
        gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
