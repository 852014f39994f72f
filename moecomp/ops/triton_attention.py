"""The Triton path of ``torch.ops.moecomp.decode_attention`` (``ops/attention.py``): split over the cache length (a
sliding-window layer: over its window), then a combine over the splits that adds the attention sinks, if any
(``kernels/decode_attention.py``). Imported on the first Triton call only.

Two forms of the same math:

    two launches   decode_attn_split_kernel (B*Hkv, S), then decode_attn_combine_kernel (B*Hkv, G) (the default)
    one launch     decode_attn_one_kernel (B*Hkv, S): the split programs; the one of each (row, kv head) that counts
                   last on a per-device counter merges that pair's S partials with the combine's own code; with one
                   split (S == 1: a span of one block, or B*Hkv filling the GPU alone) no partials and no counter

The one-launch form is opt-in (``MOECOMP_ATTN_ONE_LAUNCH=1``): measured on the H100 (1c088c1) it wins only with two
splits and loses with more (docs/ARCHITECTURE.md, "Fewer launches per decoder layer", (5)). Its counters: an int32
buffer per device, zero between launches (each last program resets its own slot), made outside CUDA-graph capture on
a stream of its own (a first call during a capture that needs one it does not have takes the two launches); a bigger buffer, when one is needed, is added and
the old one kept (a captured graph holds its address). Two one-launch attentions must not run at the same time on
one device (on two streams): they would share the counters; nothing in moecomp does that.
"""

from __future__ import annotations

import os

import torch
import triton

from ..kernels import decode_attention as attn_k
from .common import dot_precision as _precision, upcast_bf16 as _upcast

ONE_LAUNCH_ENV = "MOECOMP_ATTN_ONE_LAUNCH"
COUNTER_SLOTS = 4096  # the first buffer's counters: B * Hkv up to 32 rows x 128 kv heads (DeepSeek-V3 as cached)
MERGE_TILE = 8192  # fp32 partials the last program merges at a time: S_PAD x G_STEP x BLOCK_DV (64 a thread)


def _splits(B: int, Hkv: int, L: int, block_n: int) -> int:
    """Enough programs to fill the GPU (about 2 per SM on 132 SMs), no more splits than blocks of the cache."""
    return max(1, min(triton.cdiv(L, block_n), triton.cdiv(264, B * Hkv)))


def one_launch_wanted() -> bool:
    return os.environ.get(ONE_LAUNCH_ENV, "0") == "1"


_counters: dict = {}  # (device type, index) -> [int32 buffers], the last the largest; none is ever dropped


def counter(device: torch.device, slots: int) -> torch.Tensor | None:
    """The device's zeroed int32 counters, at least ``slots`` of them (made on first use, and again larger when
    more are needed: the smaller buffer is kept, since a captured graph may still use it); None while a CUDA graph is
    being captured and none is large enough (then the two launches run). Made on a stream of its own, so that it
    never comes from a graph pool that owns the caller's stream."""
    key = (device.type, device.index)
    have = _counters.get(key, [])
    if have and have[-1].numel() >= slots:
        return have[-1]
    size = max(COUNTER_SLOTS, triton.next_power_of_2(slots))
    if device.type != "cuda":
        c = torch.zeros(size, dtype=torch.int32, device=device)
    elif torch.cuda.is_current_stream_capturing():
        return None
    else:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            c = torch.zeros(size, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).wait_stream(side)
    _counters[key] = have + [c]
    return c


def _plan(q, k, v, window: int) -> dict:
    """Launch sizes for q [B, Hq, Dk] over k [B, Hkv, L, Dk] / v [B, Hkv, L, Dv]: splits S, chunk, padded dims."""
    B, Hq, Dk = q.shape
    Hkv, L, Dv = k.shape[1], k.shape[2], v.shape[3]
    block_n = 64
    span = min(L, window) if window else L  # positions a row reads at most: its window, or the whole cache
    S = _splits(B, Hkv, span, block_n)
    chunk = triton.cdiv(triton.cdiv(span, S), block_n) * block_n
    S = triton.cdiv(span, chunk)
    G = Hq // Hkv
    return dict(B=B, Hkv=Hkv, G=G, Dv=Dv, S=S, chunk=chunk, block_n=block_n, BG=max(16, triton.next_power_of_2(G)),
                BDK=triton.next_power_of_2(Dk), BDV=triton.next_power_of_2(Dv))


def _split_args(q, k, v, keep, n, scale: float, window: int) -> tuple:
    """The arguments decode_attn_split_kernel and decode_attn_one_kernel share after the pointers."""
    return (k.shape[1], k.shape[2], float(scale), int(window), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), keep.stride(0))


def _partials(p: dict, device) -> tuple:
    rows = p["B"] * p["Hkv"] * p["S"] * p["BG"]
    po = torch.empty(rows, p["BDV"], device=device, dtype=torch.float32)
    pm = torch.empty(rows, device=device, dtype=torch.float32)
    return po, pm, torch.empty_like(pm)


def _merge_step(p: dict, s_pad: int) -> int:
    """Query heads the one-launch kernel's last program merges at a time: as many as MERGE_TILE allows (>= 1)."""
    step = triton.next_power_of_2(p["G"])
    while step > 1 and s_pad * step * p["BDV"] > MERGE_TILE:
        step //= 2
    return step


def decode_attention_triton(q, k, v, keep, n, scale: float, sinks=None, window: int = 0) -> torch.Tensor:
    if k.stride(3) != 1 or v.stride(3) != 1 or q.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    keep = keep.contiguous()
    p = _plan(q, k, v, window)
    if one_launch_wanted():
        cnt = None if p["S"] == 1 else counter(q.device, p["B"] * p["Hkv"])
        if p["S"] == 1 or cnt is not None:
            return _one_launch(q, k, v, keep, n, scale, sinks, window, p, cnt)
    return _two_launches(q, k, v, keep, n, scale, sinks, window, p)


def _two_launches(q, k, v, keep, n, scale, sinks, window, p) -> torch.Tensor:
    B, Hkv, G, S, BG, BDV = p["B"], p["Hkv"], p["G"], p["S"], p["BG"], p["BDV"]
    po, pm, pl = _partials(p, q.device)
    attn_k.decode_attn_split_kernel[(B * Hkv, S)](
        q, k, v, keep, n, po, pm, pl, *_split_args(q, k, v, keep, n, scale, window),
        G=G, BLOCK_G=BG, DK=q.shape[2], BLOCK_DK=p["BDK"], DV=p["Dv"], BLOCK_DV=BDV, BLOCK_N=p["block_n"],
        CHUNK=p["chunk"], SPLITS=S, UPCAST=_upcast(q), DOT_PRECISION=_precision(q),
        num_warps=4 if p["BDK"] <= 128 else 8,
    )
    out = torch.empty(B, G * Hkv, p["Dv"], device=q.device, dtype=q.dtype)
    attn_k.decode_attn_combine_kernel[(B * Hkv, G)](
        po, pm, pl, out, sinks.contiguous() if sinks is not None else pm, Hkv, G=G, BLOCK_G=BG, DV=p["Dv"],
        BLOCK_DV=BDV, SPLITS=S, S_PAD=max(2, triton.next_power_of_2(S)), HAS_SINKS=sinks is not None, num_warps=2,
    )
    return out


def _one_launch(q, k, v, keep, n, scale, sinks, window, p, cnt) -> torch.Tensor:
    """decode_attn_one_kernel; ``cnt``: the device's counters (None with one split: no partials, no counter)."""
    B, Hkv, G, S = p["B"], p["Hkv"], p["G"], p["S"]
    po, pm, pl = _partials(p, q.device) if S > 1 else (None, None, None)
    out = torch.empty(B, G * Hkv, p["Dv"], device=q.device, dtype=q.dtype)
    s_pad = max(2, triton.next_power_of_2(S))
    attn_k.decode_attn_one_kernel[(B * Hkv, S)](
        q, k, v, keep, n, po, pm, pl, out, sinks.contiguous() if sinks is not None else None, cnt,
        *_split_args(q, k, v, keep, n, scale, window),
        G=G, BLOCK_G=p["BG"], DK=q.shape[2], BLOCK_DK=p["BDK"], DV=p["Dv"], BLOCK_DV=p["BDV"], BLOCK_N=p["block_n"],
        CHUNK=p["chunk"], SPLITS=S, S_PAD=s_pad, G_STEP=_merge_step(p, s_pad), HAS_SINKS=sinks is not None,
        UPCAST=_upcast(q), DOT_PRECISION=_precision(q), num_warps=4 if p["BDK"] <= 128 else 8,
    )
    return out
