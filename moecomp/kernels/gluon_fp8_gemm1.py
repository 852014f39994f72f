"""FP8 w8a8 gemm1 in Gluon: the gated activation GEMM of ``moe_gemm1_tma_fp8_kernel`` (kernels/grouped_gemm_tma_fp8.py,
A_TMA form) with each K step's promotion run while the next step's wgmma does, as the Gluon gemm2 (gluon_fp8.py).

    acc[s, j]  = sum_g (x_q[s, g] . w13_q[j, g]) * s_x[s, g] * s_w[e, j // 128, g]       j over gate | up rows
    h[s, n]    = act(acc[s, n] (* weight) + b1[e, n]) * (acc[s, I + n] (* weight) + b3[e, n])
                 stored in h's dtype, or (Q_OUT) as e4m3 codes + one fp32 scale per row and 128 columns, of h
                 rounded to x's dtype first (``fp8.quant_groups`` / ``round_to``: what gemm2 reads)
        x_q [S, H] e4m3: x's rows gathered into sorted order and quantized (``quant_act_kernel`` GATHER),
        s_x [S, H/128] fp32; w13_q [E, 2I, H] e4m3 read as [E * 2I, H] rows; s_w [E, 2I/128, H/128] fp32 or
        ue8m0 bytes (the gate half's block rows, then the up half's); e = block_expert[s // BLOCK_M]

One wgmma a K step covers both halves: the B ring slot holds the tile's BLOCK_N gate rows then its BLOCK_N up rows
(two TMA boxes into the slot's two halves), so each warp group's wgmma is N = 128 wide (narrower ones read shared
memory at the rate the tensor cores consume it). The product [BLOCK_M, 2 * BLOCK_N] is promoted with a per-column
weight scale (gate columns the gate block's, up columns the up block's) while the next step's wgmma runs: the K loop
is gluon_fp8's (``_chunk`` shape: unrolled chunks, no product in flight at a chunk's ends).

Registers: the accumulator and two step products, [BLOCK_M, 2 * BLOCK_N] fp32 each, 64 a thread at the two tiles
(8 warps): BLOCK_M 64 x BLOCK_N 128 (warps 4 x 2: each warp group 64 rows x one half) and BLOCK_M 128 x BLOCK_N 64
(warps 8 x 1). The gate and up columns of an output column sit in different registers (or warp groups): the
epilogue goes through shared memory (the accumulator stored as fp32, each half loaded back in a row layout).
Q_OUT needs BLOCK_N = 128 (one activation group a tile).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma_wait

from .gluon_fp8 import mma_step, tma_load


@gluon.jit
def _issue1(x_desc, w_desc, a_s, b_s, bars, slot, row0, grow0, urow0, k, pred, STEP_BYTES: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """TMA loads of K step ``k`` into ring slot ``slot``: A's rows, then the gate rows and the up rows into the two
    halves of the B slot (skipped where not ``pred``)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, STEP_BYTES, pred=pred)
    tma_load(x_desc, [row0, k * BLOCK_K], bar, a_s.index(slot), pred=pred)
    b = b_s.index(slot)
    tma_load(w_desc, [grow0, k * BLOCK_K], bar, b.slice(0, BLOCK_N), pred=pred)
    tma_load(w_desc, [urow0, k * BLOCK_K], bar, b.slice(BLOCK_N, BLOCK_N), pred=pred)


@gluon.jit
def _wscale(ws, UE8M0: gl.constexpr):
    """One block weight scale as fp32 (ue8m0: 2 ** (e - 127) from the exponent byte's bits)."""
    if UE8M0:
        e = gl.load(ws).to(gl.int32)
        bits = gl.where(e == 0, 0x400000, e << 23)
        bits = gl.where(e == 255, 0x7FC00000, bits)
        s = bits.to(gl.float32, bitcast=True)
    else:
        s = gl.load(ws)
    return s


@gluon.jit
def _step_scale1(xs, k, ws_g, ws_u, stride_sk, col_l: gl.constexpr, UE8M0: gl.constexpr, BLOCK_N: gl.constexpr):
    """Step k's scales [BM, 2 * BN]: each row's activation group scale times the column's block weight scale."""
    s_a = gl.load(xs + k)
    gate = gl.arange(0, 2 * BLOCK_N, layout=col_l) < BLOCK_N
    s_w = gl.where(gate, _wscale(ws_g + k * stride_sk, UE8M0), _wscale(ws_u + k * stride_sk, UE8M0))
    return s_a[:, None] * s_w[None, :]


@gluon.jit
def _promote1(acc, part, OUTSTANDING: gl.constexpr, xs, ws_g, ws_u, stride_sk, x_desc, w_desc, a_s, b_s, bars, row0,
              grow0, urow0, k, nk, col_l: gl.constexpr, UE8M0: gl.constexpr, STEP_BYTES: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """acc + step k's product times its scales, once at most OUTSTANDING wgmmas are in flight; step k's slot refills
    with step k + STAGES first."""
    scale = _step_scale1(xs, k, ws_g, ws_u, stride_sk, col_l, UE8M0, BLOCK_N)
    done = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=[part])
    _issue1(x_desc, w_desc, a_s, b_s, bars, k % STAGES, row0, grow0, urow0, k + STAGES, k + STAGES < nk, STEP_BYTES,
            BLOCK_N, BLOCK_K)
    return acc + done * scale


@gluon.jit
def _chunk1(acc, k0, zero, xs, ws_g, ws_u, stride_sk, x_desc, w_desc, a_s, b_s, bars, row0, grow0, urow0, nk,
            STEPS: gl.constexpr, col_l: gl.constexpr, UE8M0: gl.constexpr, STEP_BYTES: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Steps k0 .. k0 + STEPS - 1 unrolled, each wgmma issued before the previous product's promotion; nothing in
    flight at the ends (gluon_fp8._chunk says why)."""
    prev = mma_step(a_s, b_s, bars, k0, zero, STAGES)
    for i in gl.static_range(1, STEPS):
        cur = mma_step(a_s, b_s, bars, k0 + i, zero, STAGES)
        acc = _promote1(acc, prev, 1, xs, ws_g, ws_u, stride_sk, x_desc, w_desc, a_s, b_s, bars, row0, grow0, urow0,
                        k0 + i - 1, nk, col_l, UE8M0, STEP_BYTES, BLOCK_N, BLOCK_K, STAGES)
        prev = cur
    return _promote1(acc, prev, 0, xs, ws_g, ws_u, stride_sk, x_desc, w_desc, a_s, b_s, bars, row0, grow0, urow0,
                     k0 + STEPS - 1, nk, col_l, UE8M0, STEP_BYTES, BLOCK_N, BLOCK_K, STAGES)


@gluon.jit
def _sigmoid(v):
    return 1.0 / (1.0 + gl.exp(-v))


@gluon.jit
def gated_act(g, u, ACT: gl.constexpr):
    """act(g) * u in fp32, kernels/activations.py's codes 0 silu, 1 gelu, 2 gelu_tanh, 3 relu, 5 relu2 (no clamp,
    no softcap: the launcher falls back for those); the same formulas as ``activations.act``."""
    if ACT == 0:
        a = g * _sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + gl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        a = g * _sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    elif ACT == 5:
        r = gl.maximum(g, 0.0)
        a = r * r
    else:
        a = gl.maximum(g, 0.0)
    return a * u


@gluon.jit
def _store_q(h, h_ptrs, hs_ptr, offs_m, pid_n, row_ok, n_ok, stride_hsm, row_l: gl.constexpr, Q_OUT: gl.constexpr):
    """Q_OUT (BLOCK_N = 128: the tile is one activation group): h rounded to x's dtype (Q_OUT 2 bf16, 3 fp16),
    s = max(amax, 1e-10) / 448 per row, codes e4m3(clamp(h * (1 / s), +-448)) (IEEE division and reciprocal)."""
    if Q_OUT == 2:
        h = h.to(gl.bfloat16).to(gl.float32)
    elif Q_OUT == 3:
        h = h.to(gl.float16).to(gl.float32)
    h = gl.where(n_ok[None, :], h, 0.0)
    amax = gl.maximum(gl.max(gl.abs(h), axis=1), 1e-10)
    s = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, row_l))
    inv = gl.div_rn(gl.full(amax.shape, 1.0, gl.float32, row_l), s)
    q = gl.minimum(gl.maximum(h * inv[:, None], -448.0), 448.0).to(gl.float8e4nv)
    gl.store(h_ptrs, q, mask=row_ok[:, None] & n_ok[None, :])
    gl.store(hs_ptr + offs_m.to(gl.int64) * stride_hsm + pid_n, s, mask=row_ok)


@gluon.jit
def moe_gemm1_gluon_fp8_kernel(
    x_desc,  # e4m3 [S, K] x gathered into sorted order and quantized, box [BLOCK_M, BLOCK_K]
    xs_ptr,  # fp32 [S, K / 128] its group scales (row stride stride_xsm)
    w_desc,  # e4m3 w13 as [E * 2 * N_OUT, K] rows, box [BLOCK_N, BLOCK_K]
    ws_ptr,  # block weight scales [E, 2 * cdiv(N_OUT, Q_BLOCK_N), K / 128] fp32, or ue8m0 bytes
    b_ptr,  # [E, 2 * N_OUT] bias (gate then up) or None
    h_ptr,  # [S, N_OUT] out, sorted order: x's dtype, or e4m3 codes (Q_OUT)
    hs_ptr,  # Q_OUT: fp32 [S, N_OUT / 128] h's group scales (row stride stride_hsm), else None
    topk_w_ptr,  # W_ON_INPUT: [P] fp32 routing weights, else None
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    P,
    N_OUT,  # I
    K,  # H
    stride_xsm,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_hm,
    stride_hsm,
    Q_BLOCK_N: gl.constexpr,
    UE8M0: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ACT: gl.constexpr,
    Q_OUT: gl.constexpr,  # 0: h in h_ptr's dtype; 1 / 2 / 3: e4m3 codes of h rounded to fp32 / bf16 / fp16 first
    W_ON_INPUT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    WARPS_N: gl.constexpr,  # 2: the gate half on one warp group, the up half on the other (BLOCK_M 64)
    STAGES: gl.constexpr,
    CHUNK: gl.constexpr,
    TAIL: gl.constexpr,
):
    WARPS_M: gl.constexpr = BLOCK_M // 16
    TILE_N: gl.constexpr = 2 * BLOCK_N
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                    instr_shape=[16, TILE_N // WARPS_N, 32])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    row_acc_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    epi_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, BLOCK_N // 32], threads_per_warp=[1, 32],
                                           warps_per_cta=[WARPS_M * WARPS_N, 1], order=[1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, epi_l)
    ncol_l: gl.constexpr = gl.SliceLayout(0, epi_l)
    STEP_BYTES: gl.constexpr = (BLOCK_M + TILE_N) * BLOCK_K

    num_n = gl.cdiv(N_OUT, BLOCK_N)
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    if pid_m * BLOCK_M < gl.load(num_padded_ptr):
        a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        expert = gl.load(block_expert_ptr + pid_m)
        row0 = pid_m * BLOCK_M
        grow0 = expert * 2 * N_OUT + pid_n * BLOCK_N
        urow0 = grow0 + N_OUT
        xs = xs_ptr + (row0 + gl.arange(0, BLOCK_M, layout=row_acc_l)).to(gl.int64) * stride_xsm
        ws_g = ws_ptr + expert.to(gl.int64) * stride_se + (pid_n * BLOCK_N // Q_BLOCK_N) * stride_sn
        ws_u = ws_g + gl.cdiv(N_OUT, Q_BLOCK_N) * stride_sn
        nk = gl.cdiv(K, BLOCK_K)
        for i in gl.static_range(STAGES):
            _issue1(x_desc, w_desc, a_s, b_s, bars, i, row0, grow0, urow0, i, i < nk, STEP_BYTES, BLOCK_N, BLOCK_K)

        zero = gl.zeros([BLOCK_M, TILE_N], gl.float32, acc_l)
        acc = gl.zeros([BLOCK_M, TILE_N], gl.float32, acc_l)
        for c in range(0, nk // CHUNK):
            acc = _chunk1(acc, c * CHUNK, zero, xs, ws_g, ws_u, stride_sk, x_desc, w_desc, a_s, b_s, bars, row0, grow0,
                          urow0, nk, CHUNK, col_l, UE8M0, STEP_BYTES, BLOCK_N, BLOCK_K, STAGES)
        if TAIL > 0:
            acc = _chunk1(acc, nk - TAIL, zero, xs, ws_g, ws_u, stride_sk, x_desc, w_desc, a_s, b_s, bars, row0,
                          grow0, urow0, nk, TAIL, col_l, UE8M0, STEP_BYTES, BLOCK_N, BLOCK_K, STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        # gate and up halves apart: through shared memory into a row layout (rows of 8 fp32 swizzled by row)
        c_s = gl.allocate_shared_memory(gl.float32, [BLOCK_M, TILE_N],
                                        gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
        c_s.store(acc)
        g = c_s.slice(0, BLOCK_N, dim=1).load(epi_l)
        u = c_s.slice(BLOCK_N, BLOCK_N, dim=1).load(epi_l)

        offs_m = row0 + gl.arange(0, BLOCK_M, layout=row_l)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=ncol_l)
        n_ok = offs_n < N_OUT
        pair = gl.load(sorted_ptr + offs_m)
        row_ok = pair < P
        if W_ON_INPUT:  # (weight * x) . w, before the bias and the activation
            wt = gl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
            g = g * wt
            u = u * wt
        if HAS_BIAS:
            bias = b_ptr + expert.to(gl.int64) * stride_be + offs_n
            g += gl.load(bias, mask=n_ok, other=0.0).to(gl.float32)[None, :]
            u += gl.load(bias + N_OUT, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        h = gated_act(g, u, ACT)
        h_ptrs = h_ptr + offs_m.to(gl.int64)[:, None] * stride_hm + offs_n[None, :]
        if Q_OUT:
            _store_q(h, h_ptrs, hs_ptr, offs_m, pid_n, row_ok, n_ok, stride_hsm, row_l, Q_OUT)
        else:
            gl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
