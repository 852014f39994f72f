"""The Triton path of ``torch.ops.moecomp.qk_norm_rope_cache`` (``ops/qk_rope.py``): one launch of
``kernels/qk_rope.qk_norm_rope_cache_kernel``, grid (B * T rows, Hq + 2 * Hkv heads). Imported on the first Triton
call only. No host sync and fixed launch sizes for a given shape: CUDA-graph capturable."""

from __future__ import annotations

import torch
import triton

from ..kernels import qk_rope as qk_k


def warps(D: int) -> int:
    """One warp per head up to D 128 (its sum of squares reduced in the warp, no shared memory), two above."""
    return 1 if D <= 128 else 2


def qk_norm_rope_cache_triton(q, k, v, q_weight, k_weight, eps, offset, cos, sin, k_cache, v_cache, index, Hq, Hkv,
                              D) -> torch.Tensor:
    B, T = q.shape[:2]
    out = q.new_empty(B, Hq, T, D)
    if B * T == 0:
        return out
    q, k, v, cos, sin = (t.contiguous() for t in (q, k, v, cos, sin))  # [B, T, H*D], [B, T, Dc]: rows of one stride
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("qk_norm_rope_cache: k_cache / v_cache must be contiguous in their last dim (D)")
    qw = q_weight if q_weight is not None else q  # a pointer the kernel never reads (HAS_QN False)
    kw = k_weight if k_weight is not None else k
    qk_k.qk_norm_rope_cache_kernel[(B * T, Hq + 2 * Hkv)](
        q, k, v, qw, kw, cos, sin, k_cache, v_cache, index, out, T, Hq, Hkv, float(eps),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), D=D, BLOCK_D=triton.next_power_of_2(D), HAS_QN=q_weight is not None,
        HAS_KN=k_weight is not None, OFFSET=bool(offset), CS_HALF=cos.shape[-1] != D, num_warps=warps(D))
    return out
