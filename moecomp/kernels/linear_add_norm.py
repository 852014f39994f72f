"""A skinny linear, the residual add after it and the RMSNorm of the sum in one launch (decode, M <= 4 rows):

    a = x @ W^T (+ b)          x [M, K], W [N, K] (16-bit, or e4m3 with its scales): the skinny kernel's tile
    h = r + a                  r [M, N]; h written out (the next residual)
    n = rmsnorm(h) * gw        n [M, N]; gw = g (OFFSET 0) or 1 + g (OFFSET 1)

The GEMV splits N over programs, the norm needs whole rows of h, so the launch ends as the fused router's does
("last program finishes", ``kernels/router.router_topk_kernel``):

    program p:      its BLOCK_N columns of a (``skinny.tile_sums``, the unfused skinny kernel's K loop), rounded
                    to the activation dtype; h = r + a rounded again; h stored for every row
    then:           CTA barrier; atomic_add(counter, 1) (acq_rel, gpu scope)
    last program:   counter <- 0; sum(h^2) over all N columns of h read back with ``.cg`` loads (L2, never a stale
                    L1 line), rsqrt, then n; every row at once, [ROWS_PAD, BLOCK_D] a step

Rounding, as the unfused graph rounds (dt: the activation dtype): a = dt(sum) (the skinny kernel's store), h =
dt(r + a) (the add), u = h32 * rs with rs = rsqrt(sum(h32^2) / N + eps), then n = dt(gw * dt(u)) with ROUND_UNIT
(Llama / Qwen: ``w * (h32 * rsqrt).to(dt)``) or n = dt(u * gw) without (Gemma: ``(h32 * rsqrt * (1 + w32)).to(dt)``,
gpt-oss: ``(w * h32 * rsqrt).to(dt)``). a and h are bit-identical to the unfused skinny kernel + add (same K steps
and reduction: BLOCK_N does not change a row's sum); n can differ from torch's by the order of the sum of squares
and the rsqrt's approximation (a unit of dt's last place at most, on some elements).

One program (SINGLE) needs no counter. The counter is a buffer the launcher keeps per device, zero between launches
(the last program puts it back), so a CUDA graph replays the launch as captured; two launches sharing it must not
run at the same time (two streams of one device).
"""

import triton
import triton.language as tl

from . import pdl
from .skinny import row_value, tile_end, tile_sums


@triton.jit
def _add_store(acc, r_row, h_row, offs_n, n_ok, s_fin, bias, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
               REDUCE_END: tl.constexpr):
    """One row of the tile: a rounded to h's dtype, h = r + a rounded again, stored."""
    dt = h_row.dtype.element_ty
    a = row_value(acc, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END).to(dt)
    r = tl.load(r_row + offs_n, mask=n_ok, other=0.0)
    h = (r.to(tl.float32) + a.to(tl.float32)).to(dt)
    tl.store(h_row + offs_n, h, mask=n_ok)


@triton.jit
def _norm_rows(h_ptr, n_ptr, g_ptr, N, eps, stride_hm, stride_nm, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
               OFFSET: tl.constexpr, ROUND_UNIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """The last program's work: every row's sum of squares from h (``.cg`` reads), then n; all rows at once, a
    [ROWS_PAD, BLOCK_D] tile a step (one L2 round trip a pass where BLOCK_D covers N)."""
    dt = n_ptr.dtype.element_ty
    offs_m = tl.arange(0, ROWS_PAD)
    m_ok = offs_m < ROWS
    offs = tl.arange(0, BLOCK_D)
    h_rows = h_ptr + offs_m[:, None] * stride_hm
    ss = tl.zeros([ROWS_PAD], dtype=tl.float32)
    for d0 in range(0, N, BLOCK_D):
        ok = m_ok[:, None] & (offs < N - d0)[None, :]
        hf = tl.load(h_rows + d0 + offs[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        ss += tl.sum(hf * hf, axis=1)  # (a row sum a step: no [ROWS_PAD, BLOCK_D] accumulator held in registers)
    rs = tl.rsqrt(ss / N + eps)[:, None]  # [ROWS_PAD, 1]
    for d0 in range(0, N, BLOCK_D):
        d_ok = offs < N - d0
        ok = m_ok[:, None] & d_ok[None, :]
        hf = tl.load(h_rows + d0 + offs[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        g = tl.load(g_ptr + d0 + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        if OFFSET:
            g = 1.0 + g
        u = hf * rs
        if ROUND_UNIT:
            u = u.to(dt).to(tl.float32)
        n = u * g
        tl.store(n_ptr + offs_m[:, None] * stride_nm + d0 + offs[None, :], n.to(dt), mask=ok)


@triton.jit
def linear_add_norm_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    ws_ptr,  # weight scales (W_SCALE 1-3, as the skinny kernel's) or None
    b_ptr,  # [N] bias or None
    r_ptr,  # [M, N] residual, unit stride along N
    h_ptr,  # [M, N] out: r + a
    g_ptr,  # [N] norm weight
    n_ptr,  # [M, N] out: the normalized h
    counter_ptr,  # [1] int32, 0 between launches (the last program puts it back); unused with SINGLE
    eps,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_rm,
    stride_hm,
    stride_nm,
    ROWS: tl.constexpr,  # M, 1..4
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,  # 0 none (16-bit weights), 1 block, 2 channel, 3 tensor
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    OFFSET: tl.constexpr,  # 0: * g, 1: * (1 + g)
    ROUND_UNIT: tl.constexpr,  # h * rs rounded to dt before the weight multiply (Llama / Qwen), or not
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
    ROWS_PAD: tl.constexpr,  # ROWS rounded up to a power of two (the last program's tile rows)
    BLOCK_D: tl.constexpr,  # the last program's columns a step
    SINGLE: tl.constexpr,  # one program: no counter
    USE_PDL: tl.constexpr = 0,  # 0 off, 2 wait at the start, release after the K loop (kernels/pdl.py)
):
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    offs_n, n_ok, rows_n, acc0, acc1, acc2, acc3 = tile_sums(pid, x_ptr, w_ptr, ws_ptr, N, K, stride_xm, stride_wn,
                                                             stride_sn, stride_sk, ROWS, W_SCALE, Q_BLOCK_N,
                                                             Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END)
    pdl.release(USE_PDL)
    s_fin, bias = tile_end(ws_ptr, b_ptr, rows_n, offs_n, n_ok, stride_sn, HAS_BIAS, W_SCALE, UE8M0)
    _add_store(acc0, r_ptr, h_ptr, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 1:
        _add_store(acc1, r_ptr + stride_rm, h_ptr + stride_hm, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE,
                   REDUCE_END)
    if ROWS > 2:
        _add_store(acc2, r_ptr + 2 * stride_rm, h_ptr + 2 * stride_hm, offs_n, n_ok, s_fin, bias, HAS_BIAS,
                   W_SCALE, REDUCE_END)
    if ROWS > 3:
        _add_store(acc3, r_ptr + 3 * stride_rm, h_ptr + 3 * stride_hm, offs_n, n_ok, s_fin, bias, HAS_BIAS,
                   W_SCALE, REDUCE_END)
    tl.debug_barrier()  # every thread's h stored before the count (and, in one program, before the reads)
    if SINGLE:
        last = True
    else:
        last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1
    if last:
        if not SINGLE:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # every program has counted: reset
        _norm_rows(h_ptr, n_ptr, g_ptr, N, eps, stride_hm, stride_nm, ROWS, ROWS_PAD, OFFSET, ROUND_UNIT,
                   BLOCK_D)
