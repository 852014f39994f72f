"""Kernel configs: tuned JSON tables keyed by GPU and shape, looked up at run time, with a heuristic fallback.

Files live in ``moecomp/kernels/configs/<device>.json`` (device = ``torch.cuda.get_device_name()`` with spaces as
``_``). Each maps ``"E=<E>,N=<I>,K=<H>,dtype=<dtype>"`` to ``{"<M bucket>": config}`` where the bucket is the
largest listed token count <= T; a config holds ``BLOCK_M`` (shared by alignment and both GEMMs) and per-GEMM
``g1`` / ``g2`` dicts of ``BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages``. ``python -m moecomp tune``
(:mod:`moecomp.tune`; ``benchmarks/tune_moe.py`` wraps it) writes them, and their measurements to ``<device>.meta.json``.
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
    table = _table(device_key(device)).get(shape_key(E, N, K, dtype))
    if table:
        buckets = sorted(int(b) for b in table)
        best = buckets[0]
        for b in buckets:
            if b <= T:
                best = b
        return table[str(best)]
    return _heuristic(E, N, K, T, top_k, device)
