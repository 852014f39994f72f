"""Kernel configs: tuned JSON tables keyed by GPU and shape, looked up at run time, with a heuristic fallback.

Files live in ``moecomp/kernels/configs/<device>.json`` (device = ``torch.cuda.get_device_name()`` with spaces as
``_``). Each maps ``"E=<E>,N=<I>,K=<H>,dtype=<dtype>"`` to ``{"<M bucket>": config}`` where the bucket is the
largest listed token count <= T; a config holds ``BLOCK_M`` (shared by alignment and both GEMMs) and per-GEMM
``g1`` / ``g2`` dicts of ``BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages``, and optionally ``decode``:
``max_t`` (the decode path up to this many tokens) with its own ``g1`` (DIRECT gemm1) and ``g2`` (``mode``
"fused": the down-combine kernel, or "pairs": gemm2 DIRECT + combine) tiles; without it, ``decode_config``'s
heuristic. ``python -m moecomp tune`` (:mod:`moecomp.tune`; ``benchmarks/tune_moe.py`` wraps it) writes them, and
their measurements to ``<device>.meta.json``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent.parent / "kernels" / "configs"


def device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:  # a driver query: once per device, not once per call
    return torch.cuda.get_device_name(index).replace(" ", "_")


def shape_key(E: int, N: int, K: int, dtype: torch.dtype) -> str:
    return f"E={E},N={N},K={K},dtype={str(dtype).replace('torch.', '')}"


@functools.lru_cache(maxsize=None)
def _table(dev: str) -> dict:
    path = CONFIG_DIR / f"{dev}.json"
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def _heuristic(E: int, N: int, K: int, T: int, top_k: int, device: torch.device) -> dict:
    P = T * top_k
    if device.type != "cuda":  # interpreter: small tiles keep CPU tests fast
        g1 = dict(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
        g2 = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
        return dict(BLOCK_M=16, g1=g1, g2=g2)
    rows = P / max(1, min(E, P))  # mean rows per active expert
    if rows <= 16:
        bm = 16
        g1 = dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        g2 = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif rows <= 48:
        bm = 32
        g1 = dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)
        g2 = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)
    elif rows <= 128:
        bm = 64
        g1 = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
        g2 = dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        bm = 128
        g1 = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
        g2 = dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=bm, g1=g1, g2=g2)


def get_config(E: int, N: int, K: int, T: int, top_k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Config for the MoE GEMMs of one call (N = intermediate size, K = hidden size)."""
    override = os.environ.get("MOECOMP_CONFIG")
    if override:
        return json.loads(override)
    tables = _table(device_key(device))
    table = tables.get(shape_key(E, N, K, dtype))
    if not table and dtype == torch.float16:  # same element size and tensor-core rate: bf16's tiles, if tuned
        table = tables.get(shape_key(E, N, K, torch.bfloat16))
    if table:
        buckets = sorted(int(b) for b in table)
        best = buckets[0]
        for b in buckets:
            if b <= T:
                best = b
        return table[str(best)]
    return _heuristic(E, N, K, T, top_k, device)


# The decode path's token limit for shapes without a tuned entry (MOECOMP_DECODE_MAX_T overrides; 0 turns it off).
# Tuned on an H200 (2026-11-30), it won up to T = 2 on every preset but DeepSeek-V3 (up to 4 on three of them) and
# lost from T = 4-8 on.
DECODE_MAX_T = 2


def _decode_heuristic(device: torch.device) -> dict:
    if device.type != "cuda":  # interpreter: small tiles; up to 8 tokens, so the CPU tests' T = 1, 5, 7 take this path
        g = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
        return dict(max_t=8, g1=g, g2=dict(g, mode="fused"))
    g1 = dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    g2 = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, mode="pairs")
    return dict(max_t=DECODE_MAX_T, g1=g1, g2=g2)


def decode_config(cfg: dict, T: int, device: torch.device) -> dict | None:
    """The decode path's tiles when T is within its token limit, else None (the aligned path). An entry without
    tiles (tuned: never) takes the heuristic's when MOECOMP_DECODE_MAX_T forces the path on."""
    dec = cfg.get("decode") or _decode_heuristic(device)
    override = os.environ.get("MOECOMP_DECODE_MAX_T")
    max_t = int(override) if override else dec["max_t"]
    if T > max_t:
        return None
    return dec if "g1" in dec else dict(_decode_heuristic(device), max_t=dec["max_t"])
