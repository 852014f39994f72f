"""The Triton path of ``torch.ops.moecomp.decode_attention`` (``ops/attention.py``): split over the cache length (a
sliding-window layer: over its window), then a combine over the splits that adds the attention sinks, if any
(``kernels/decode_attention.py``). Imported on the first Triton call only."""

from __future__ import annotations

import torch
import triton

from ..kernels import decode_attention as attn_k
from .common import dot_precision as _precision, upcast_bf16 as _upcast


def _splits(B: int, Hkv: int, L: int, block_n: int) -> int:
    """Enough programs to fill the GPU (about 2 per SM on 132 SMs), no more splits than blocks of the cache."""
    return max(1, min(triton.cdiv(L, block_n), triton.cdiv(264, B * Hkv)))


def decode_attention_triton(q, k, v, keep, n, scale: float, sinks=None, window: int = 0) -> torch.Tensor:
    B, Hq, Dk = q.shape
    Hkv, L, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    if k.stride(3) != 1 or v.stride(3) != 1 or q.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    keep = keep.contiguous()
    block_n = 64
    span = min(L, window) if window else L  # positions a row reads at most: its window, or the whole cache
    S = _splits(B, Hkv, span, block_n)
    chunk = triton.cdiv(triton.cdiv(span, S), block_n) * block_n
    S = triton.cdiv(span, chunk)
    BG = max(16, triton.next_power_of_2(G))
    BDK, BDV = triton.next_power_of_2(Dk), triton.next_power_of_2(Dv)
    po = torch.empty(B * Hkv * S * BG, BDV, device=q.device, dtype=torch.float32)
    pm = torch.empty(B * Hkv * S * BG, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    upcast = _upcast(q)
    attn_k.decode_attn_split_kernel[(B * Hkv, S)](
        q, k, v, keep, n, po, pm, pl, Hkv, L, float(scale), int(window),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        keep.stride(0),
        G=G, BLOCK_G=BG, DK=Dk, BLOCK_DK=BDK, DV=Dv, BLOCK_DV=BDV, BLOCK_N=block_n, CHUNK=chunk, SPLITS=S,
        UPCAST=upcast, DOT_PRECISION=_precision(q),
        num_warps=4 if BDK <= 128 else 8,
    )
    out = torch.empty(B, Hq, Dv, device=q.device, dtype=q.dtype)
    attn_k.decode_attn_combine_kernel[(B * Hkv, G)](
        po, pm, pl, out, sinks.contiguous() if sinks is not None else pm, Hkv, G=G, BLOCK_G=BG, DV=Dv, BLOCK_DV=BDV,
        SPLITS=S, S_PAD=max(2, triton.next_power_of_2(S)), HAS_SINKS=sinks is not None, num_warps=2,
    )
    return out
