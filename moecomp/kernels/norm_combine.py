"""Combine over top-k with each pair's expert output normalised first (``MoESpec.expert_norm``, MuseSpark's
input-scaled RMSNorm), the shared expert folded in:

    s      = round(y[p] * (1 + nw))            y[p]: the pair's unweighted expert output row (x's dtype), 1 + nw
                                               formed in nw's dtype; round: a cast to y's dtype
    n      = round(s * rsqrt(mean(s ** 2) + eps))
    out[t] = sum_j w[t * k + j] * n[t * k + j]  (+ shared[t] * sigmoid(gate_logit[t]))

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
    nw_ptr,  # [H] the norm's weight
    shared_ptr,  # [T, H] or None
    gate_ptr,  # [T] shared-expert gate logits (strided) or None
    out_ptr,  # [T, H]
    H,
    eps,
    stride_y,
    stride_s,
    stride_g,
    stride_o,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    nw = tl.load(nw_ptr + offs, mask=ok, other=0.0)
    scale = (nw.to(tl.float32) + 1.0).to(nw_ptr.dtype.element_ty).to(tl.float32)  # 1 + w in w's dtype
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * TOP_K + j
        y = tl.load(y_ptr + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        s = (y * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
        n = (s * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(w_ptr + row) * n
    store_with_shared(acc, t, offs, ok, shared_ptr, stride_s, gate_ptr, stride_g, out_ptr, stride_o, HAS_SHARED,
                      HAS_GATE)
