"""``torch.ops.moecomp.decode_attention``: attention of one query token per row over a static KV cache.

    q [B, Hq, Dk]   k [B, Hkv, L, Dk]   v [B, Hkv, L, Dv]   keep [B, L] bool   n [] int64   ->   out [B, Hq, Dv]

Position j of row b takes part when ``keep[b, j]`` and ``j < n`` (the cache positions written so far). Hq must be a
multiple of Hkv (grouped-query attention: query head i reads kv head i // (Hq / Hkv)).

CUDA: two Triton kernels (``kernels/decode_attention.py``): split over the cache length, each split reading only
positions below ``n``, each kv head read once for its query heads (no repeat of K / V); then a combine over the
splits. No host sync, fixed launch sizes for a given shape: CUDA-graph capturable. CPU: the same math in torch
(grouped view, masked softmax in fp32).
"""

from __future__ import annotations

import torch
import triton

from ..kernels import decode_attention as attn_k
from .moe_op import _backend, _on_device
from .triton_moe import _precision, _upcast


def _check(q, k, v, keep, n):
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"decode_attention: q must be [B, Hq, Dk] and k / v [B, Hkv, L, D], got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Hq, Dk = q.shape
    if k.shape[0] != B or k.shape[3] != Dk or v.shape[:3] != k.shape[:3] or Hq % k.shape[1] != 0:
        raise ValueError(f"decode_attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (k needs [B, Hkv, L, Dk] with Hq a multiple of Hkv; v [B, Hkv, L, Dv])")
    if keep.shape != (B, k.shape[2]) or keep.dtype != torch.bool:
        raise ValueError(f"decode_attention: keep must be a bool [B, L] = {(B, k.shape[2])}, got "
                         f"{keep.dtype} {tuple(keep.shape)}")
    if n.numel() != 1:
        raise ValueError(f"decode_attention: n must hold one value, got shape {tuple(n.shape)}")
    if len({t.device for t in (q, k, v, keep, n)}) != 1:
        raise ValueError("decode_attention: q, k, v, keep and n must be on one device")


def _torch(q, k, v, keep, n, scale: float) -> torch.Tensor:
    B, Hq, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, -1)  # [B, Hkv, G, Dk]
    s = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale  # [B, Hkv, G, L]
    ok = keep & (torch.arange(L, device=q.device) < n)  # [B, L]
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgl,bhld->bhgd", p, v.float()).reshape(B, Hq, -1).to(q.dtype)


def _splits(B: int, Hkv: int, L: int, block_n: int) -> int:
    """Enough programs to fill the GPU (about 2 per SM on 132 SMs), no more splits than blocks of the cache."""
    return max(1, min(triton.cdiv(L, block_n), triton.cdiv(264, B * Hkv)))


def _triton(q, k, v, keep, n, scale: float) -> torch.Tensor:
    B, Hq, Dk = q.shape
    Hkv, L, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    if k.stride(3) != 1 or v.stride(3) != 1 or q.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    keep = keep.contiguous()
    block_n = 64
    S = _splits(B, Hkv, L, block_n)
    chunk = triton.cdiv(triton.cdiv(L, S), block_n) * block_n
    S = triton.cdiv(L, chunk)
    BG = max(16, triton.next_power_of_2(G))
    BDK, BDV = triton.next_power_of_2(Dk), triton.next_power_of_2(Dv)
    po = torch.empty(B * Hkv * S * BG, BDV, device=q.device, dtype=torch.float32)
    pm = torch.empty(B * Hkv * S * BG, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    upcast = _upcast(q)
    attn_k.decode_attn_split_kernel[(B * Hkv, S)](
        q, k, v, keep, n, po, pm, pl, Hkv, L, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        keep.stride(0),
        G=G, BLOCK_G=BG, DK=Dk, BLOCK_DK=BDK, DV=Dv, BLOCK_DV=BDV, BLOCK_N=block_n, CHUNK=chunk, SPLITS=S,
        UPCAST=upcast, DOT_PRECISION=_precision(q),
        num_warps=4 if BDK <= 128 else 8,
    )
    out = torch.empty(B, Hq, Dv, device=q.device, dtype=q.dtype)
    attn_k.decode_attn_combine_kernel[(B * Hkv, G)](
        po, pm, pl, out, Hkv, G=G, BLOCK_G=BG, DV=Dv, BLOCK_DV=BDV, SPLITS=S,
        S_PAD=max(2, triton.next_power_of_2(S)), num_warps=2,
    )
    return out


@torch.library.custom_op("moecomp::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, n: torch.Tensor,
                     scale: float) -> torch.Tensor:
    _check(q, k, v, keep, n)
    if q.shape[0] == 0:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[3])
    if _backend(q.device) != "triton":  # CPU (or MOECOMP_CUDA_BACKEND=torch): the same math in torch
        return _torch(q, k, v, keep, n, scale)
    if q.is_cuda:
        return _on_device(q, lambda: _triton(q, k, v, keep, n, scale))
    return _triton(q, k, v, keep, n, scale)


@decode_attention.register_fake
def _(q, k, v, keep, n, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[3])
