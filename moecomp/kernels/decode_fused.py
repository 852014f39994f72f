"""The routed experts of a few tokens in one launch (issue 20's "monolithic" decode path; off unless asked for).

    program (pair p = t * k + j, slice s of I):   e = ids[p], i in [s * BLOCK_I, (s + 1) * BLOCK_I)
        g[i], u[i] = x[t] . w13_e[gate row of i], x[t] . w13_e[up row of i]    (+ b13)      fp32, K = H
        h[i]       = act(g) * u, rounded to x's dtype (what the two-kernel path stores)
        acc[t, :] += weight[p] * (w2_e[:, i] . h[i])   (+ weight[p] * b2_e on slice 0)     fp32 atomics, N = H
        the program that finishes token t's k * S slices last (an atomic counter per token) writes
        out[t] = acc[t] (+ sigmoid(gate[t]) * shared[t]) in out's dtype

At T <= 4 the two-kernel decode path (DIRECT gemm1, then the down-combine) launches twice and its down-combine has
only T * H / BLOCK_N programs (32 at H = 2048: a quarter of the SMs stream every expert's w2). Here gemm1 and gemm2
of one slice of I run in the same program, so k * I / BLOCK_I programs (192 for Qwen3-30B-A3B at T = 1) stream
both weight matrices, and h never goes through memory. The price: fp32 atomics into ``acc`` (sums in a
run-dependent order: results can differ from run to run by fp32 rounding, below the output's own rounding almost
always) and an accumulator that must be zero at launch (the launcher zeroes ``acc`` and the counters with one
memset). No tensor cores: each K step multiplies a [BLOCK_I, BLOCK_H] weight tile with x in fp32 and reduces it,
which is what a memory-bound GEMV needs.

16-bit and fp32 experts only (no quantized weights, no weight_on_input, no zero experts: the launcher takes the
two-kernel path for those).
"""

import triton
import triton.language as tl

from .activations import act as _act
from .activations import gated as _gated


@triton.jit
def _finish(acc_ptr, out_ptr, shared_ptr, gate_ptr, t, H, stride_a, stride_o, stride_s, stride_g,
            HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = acc[t] (+ gated shared[t]): the last program of token t."""
    for n0 in range(0, H, BLOCK_H):
        offs = n0 + tl.arange(0, BLOCK_H)
        ok = offs < H
        v = tl.load(acc_ptr + t * stride_a + offs, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_SHARED:
            s = tl.load(shared_ptr + t * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_GATE:
                s = s * tl.sigmoid(tl.load(gate_ptr + t * stride_g).to(tl.float32))
            v += s
        tl.store(out_ptr + t * stride_o + offs, v.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def moe_decode_fused_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # element (e, n, k) at e * s13e + n * s13n + k * s13k (gate / up rows n, hidden k)
    w2_ptr,  # element (e, n, k) at e * s2e + n * s2n + k * s2k (output n in [0, H), k in [0, I))
    b13_ptr,  # [E, rows] or None
    b2_ptr,  # [E, H] or None
    ids_ptr,  # [P] int32
    wts_ptr,  # [P] fp32
    acc_ptr,  # [T, H] fp32, zero at launch
    cnt_ptr,  # [T] int32, zero at launch
    shared_ptr,  # [T, H] or None
    gate_ptr,  # [T] (strided) or None
    out_ptr,  # [T, H]
    H,
    I,
    stride_x, s13e, s13n, s13k, s2e, s2n, s2k, stride_b13, stride_b2, stride_a, stride_s, stride_g, stride_o,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,  # gate / up rows 2i, 2i + 1 (else i, I + i)
    HAS_B13: tl.constexpr,
    HAS_B2: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ACT: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SLICES: tl.constexpr,  # cdiv(I, BLOCK_I)
):
    pid = tl.program_id(0)
    p = pid // SLICES
    s = pid % SLICES
    t = (p // TOP_K).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    w = tl.load(wts_ptr + p)
    offs_i = s * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < I
    if INTERLEAVED:
        rows_g, rows_u = 2 * offs_i, 2 * offs_i + 1
    else:
        rows_g, rows_u = offs_i, I + offs_i
    base13 = w13_ptr + e * s13e
    g = tl.zeros([BLOCK_I], dtype=tl.float32)
    u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):  # gate / up slice: [BLOCK_I] = w13[rows, :] . x[t]
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        xv = tl.load(x_ptr + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        m = i_ok[:, None] & h_ok[None, :]
        wg = tl.load(base13 + rows_g.to(tl.int64)[:, None] * s13n + offs_h[None, :] * s13k, mask=m, other=0.0)
        g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        if GATED:
            wu = tl.load(base13 + rows_u.to(tl.int64)[:, None] * s13n + offs_h[None, :] * s13k, mask=m, other=0.0)
            u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    if HAS_B13:
        g += tl.load(b13_ptr + e * stride_b13 + rows_g, mask=i_ok, other=0.0).to(tl.float32)
        if GATED:
            u += tl.load(b13_ptr + e * stride_b13 + rows_u, mask=i_ok, other=0.0).to(tl.float32)
    if GATED:
        h = _gated(g, u, alpha, limit, ACT, CLAMP)
    else:
        h = _act(g, ACT)
    h = tl.where(i_ok, h.to(x_ptr.dtype.element_ty).to(tl.float32), 0.0)  # [BLOCK_I], as the 16-bit h buffer
    base2 = w2_ptr + e * s2e
    for n0 in range(0, H, BLOCK_H):  # down slice: acc[t, n] += w * sum_i w2[n, i] h[i]
        offs_n = n0 + tl.arange(0, BLOCK_H)
        n_ok = offs_n < H
        w2 = tl.load(base2 + offs_n.to(tl.int64)[:, None] * s2n + offs_i[None, :] * s2k,
                     mask=n_ok[:, None] & i_ok[None, :], other=0.0)
        y = tl.sum(w2.to(tl.float32) * h[None, :], axis=1)  # [BLOCK_H]
        if HAS_B2:
            y += tl.where(s == 0, tl.load(b2_ptr + e * stride_b2 + offs_n, mask=n_ok, other=0.0).to(tl.float32), 0.0)
        tl.atomic_add(acc_ptr + t * stride_a + offs_n, w * y, mask=n_ok)
    done = tl.atomic_add(cnt_ptr + t, 1)  # acq_rel: this program's adds are visible to the one that sees the last
    if done == TOP_K * SLICES - 1:
        _finish(acc_ptr, out_ptr, shared_ptr, gate_ptr, t, H, stride_a, stride_o, stride_s, stride_g,
                HAS_SHARED, HAS_GATE, BLOCK_H)
