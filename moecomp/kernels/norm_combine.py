"""Combine over top-k with each pair's expert output normalised first (``MoESpec.expert_norm``, MuseSpark's
input-scaled RMSNorm), the shared expert folded in:

    s      = round(y[p] * (1 + nw))            y[p]: the pair's unweighted expert output row (x's dtype), 1 + nw
                                               formed in nw's dtype; round: a cast to y's dtype
    n      = round(s * rsqrt(mean(s ** 2) + eps))
    out[t] = sum_j w[t * k + j] * n[t * k + j]  (+ shared[t] * sigmoid(gate_logit[t]))

PER_EXPERT (``rms_per_expert``, Ergo): n = round(y[p] * rsqrt(mean(y[p] ** 2) + eps) * nw[e]), nw [E, H] and e the
pair's expert (``ids`` [T * k], pair order), in fp32.

The norm needs the whole row: one program per token, BLOCK_H = next_pow2(H) >= H columns, fp32 math, one store in
the output dtype.
"""

import triton
import triton.language as tl

from .combine import store_with_shared


@triton.jit
def norm_combine_kernel(
    y_ptr,  # [T * TOP_K, H] unweighted pair rows
    w_ptr,  # [T * TOP_K] fp32 routing weights
    nw_ptr,  # [H] the norm's weight ([E, H] with PER_EXPERT)
    ids_ptr,  # [T * TOP_K] the pairs' experts (PER_EXPERT) or None
    shared_ptr,  # [T, H] or None
    gate_ptr,  # [T] shared-expert gate logits (strided) or None
    out_ptr,  # [T, H]
    H,
    eps,
    stride_y,
    stride_s,
    stride_g,
    stride_o,
    stride_nw,  # nw's row stride (PER_EXPERT)
    TOP_K: tl.constexpr,
    PER_EXPERT: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    if not PER_EXPERT:
        nw = tl.load(nw_ptr + offs, mask=ok, other=0.0)
        scale = (nw.to(tl.float32) + 1.0).to(nw_ptr.dtype.element_ty).to(tl.float32)  # 1 + w in w's dtype
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * TOP_K + j
        y = tl.load(y_ptr + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        if PER_EXPERT:
            e = tl.load(ids_ptr + row).to(tl.int64)
            we = tl.load(nw_ptr + e * stride_nw + offs, mask=ok, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / H + eps)
            n = (y * inv * we).to(y_ptr.dtype.element_ty).to(tl.float32)
        else:
            s = (y * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
            n = (s * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(w_ptr + row) * n
    store_with_shared(acc, t, offs, ok, shared_ptr, stride_s, gate_ptr, stride_g, out_ptr, stride_o, HAS_SHARED,
                      HAS_GATE)
