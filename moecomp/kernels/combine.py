"""Weighted combine over top-k, with the shared expert folded in.

    out[t] = sum_j y[t * k + j]  (+ shared[t] * sigmoid(gate_logit[t]))        y already carries routing weights
    ZERO_EXPERTS (``MoESpec.zero_experts``): slots whose id is >= n_experts are zero experts: their y rows were
    never written and are not read; they add weight * x[t] instead (fp32, in the same sum)

fp32 sum, one store in the output dtype. One program per (token, BLOCK_H columns).
"""

import triton
import triton.language as tl

from . import pdl
from .activations import gated


@triton.jit
def store_with_shared(acc, t, offs, ok, shared_ptr, stride_s, gate_ptr, stride_g, out_ptr, stride_o,
                      HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr):
    """out[t, offs] = acc (+ shared[t, offs] (* sigmoid(gate_logit[t]))), in out's dtype: the tail every combining
    kernel shares (this module's, the decode down-combines, the norm combine)."""
    if HAS_SHARED:
        s = tl.load(shared_ptr + t * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            s = s * tl.sigmoid(tl.load(gate_ptr + t * stride_g).to(tl.float32))
        acc += s
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_kernel(
    y_ptr,  # [T * TOP_K, H]
    shared_ptr,  # [T, H] or None
    gate_ptr,  # [T] shared-expert gate logits (strided) or None
    out_ptr,  # [T, H]
    H,
    stride_y,
    stride_s,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
    # ZERO_EXPERTS: x [T, H] (row stride stride_x), the flat ids and fp32 weights [T * TOP_K], the expert count
    x_ptr=None, ids_ptr=None, w_ptr=None, stride_x=0, n_experts=0, ZERO_EXPERTS: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_k = tl.arange(0, K_PAD)
    rows = t * TOP_K + offs_k
    k_ok = offs_k < TOP_K
    if ZERO_EXPERTS:
        zero = k_ok & (tl.load(ids_ptr + rows, mask=k_ok, other=0) >= n_experts)  # [K_PAD]
        y_ok = k_ok & ~zero
    else:
        y_ok = k_ok
    y = tl.load(y_ptr + rows[:, None] * stride_y + offs_h[None, :], mask=y_ok[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)
    acc = tl.sum(y, axis=0)  # [BLOCK_H]
    if ZERO_EXPERTS:  # the zero experts' weight * x
        wz = tl.sum(tl.where(zero, tl.load(w_ptr + rows, mask=zero, other=0.0), 0.0), axis=0)
        acc += wz * tl.load(x_ptr + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    store_with_shared(acc, t, offs_h, h_ok, shared_ptr, stride_s, gate_ptr, stride_g, out_ptr, stride_o, HAS_SHARED,
                      HAS_GATE)


@triton.jit
def act_mul_kernel(
    gu_ptr, out_ptr, I, stride_gu, stride_o, alpha, limit, ACT: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Shared-expert activation: out[t] = act(gu[t, :I]) * gu[t, I:] (gate then up, concatenated; clamps and
    swiglu_oai as in ``activations.gated``, CLAMP its clamp code)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, gated(g, u, alpha, limit, ACT, CLAMP).to(out_ptr.dtype.element_ty), mask=ok)
