"""Configs where this GPU's table has no entry: the nearest tuned entry of any shipped table.

    query (E, N, K, T, top_k, table dtype)
        ──► every (GPU, shape, bucket) entry of the tables in ``kernels/configs/`` with that table dtype
            ("bfloat16", "fp8", "mxfp4", ...), each entry's top-k read from the entry itself
        ──► distance = 2 |log2 rows - log2 rows'|  +  |log2 N - log2 N'|  +  |log2 K - log2 K'|
                       + OTHER_GPU (an entry tuned on another GPU)  +  TOKENS_TIE |log2 T - log2 T'|
            rows = T * k / min(E, T * k): the mean rows per active expert, what the tile shapes follow
        ──► the nearest entry's config (its decode-path limit included), TMA tiles dropped on GPUs
            without TMA (compute capability < 9); None when no table has that dtype (the static heuristic then)

Why: the tuned tables cover the layer presets on the GPUs we tuned (H100, H200). A model of other sizes, or a GPU
without a table, used to get a fixed row-class heuristic; the nearest tuned entry carries what the tuner learned
(TMA tiles at many rows per expert, the decode path's limit, BLOCK_M per row count) to neighbouring shapes.

``MOECOMP_TABLE`` (for measuring the fallback, ``benchmarks/bench_moe.py --table``): "on" (default); "off": this
GPU's own table is ignored, as on a GPU without one; "loo": also every table's entry of the queried shape, as for a
shape no table holds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re

import torch

OTHER_GPU = 0.25  # an entry tuned on another GPU is that much (in log2 units) farther than the same entry on this one
TOKENS_TIE = 0.1  # between entries of equal rows per expert, the nearer token count
TABLE_MODES = ("on", "off", "loo")
_KEY = re.compile(r"E=(\d+),N=(\d+),K=(\d+),dtype=(.+)")


def table_mode() -> str:
    mode = os.environ.get("MOECOMP_TABLE") or "on"
    if mode not in TABLE_MODES:
        raise ValueError(f"MOECOMP_TABLE={mode!r}: expected one of {TABLE_MODES}")
    return mode


@functools.lru_cache(maxsize=None)
def all_tables(config_dir: str) -> dict:
    """{GPU key: table} of every table in ``config_dir`` (the ``.meta.json`` sidecars skipped)."""
    out = {}
    for name in sorted(os.listdir(config_dir)):
        if name.endswith(".json") and not name.endswith(".meta.json"):
            with open(os.path.join(config_dir, name)) as f:
                out[name[: -len(".json")]] = json.load(f)
    return out


def _rows(T: int, k: int, E: int) -> float:
    P = max(1, T * k)
    return P / max(1, min(E, P))


def nearest(config_dir: str, own_gpu: str, E: int, N: int, K: int, T: int, top_k: int, table_dtype: str,
            device: torch.device) -> dict | None:
    """The config of the tuned entry nearest to the query (module docstring), or None."""
    mode = table_mode()
    rows = _rows(T, top_k, E)
    best = None
    for gpu, table in all_tables(config_dir).items():
        if gpu == own_gpu and mode != "on":
            continue
        for key, buckets in table.items():
            m = _KEY.fullmatch(key)
            if m is None or m.group(4) != table_dtype:
                continue
            e, n, kk = (int(m.group(i)) for i in (1, 2, 3))
            if mode == "loo" and (e, n, kk) == (E, N, K):
                continue
            for b, cfg in buckets.items():
                k_entry = int(cfg.get("top_k") or top_k)
                d = (2 * abs(math.log2(rows) - math.log2(_rows(int(b), k_entry, e)))
                     + abs(math.log2(N / n)) + abs(math.log2(K / kk)) + (OTHER_GPU if gpu != own_gpu else 0.0)
                     + TOKENS_TIE * abs(math.log2(T) - math.log2(int(b))))
                if best is None or d < best[0]:
                    best = (d, cfg)
    if best is None:
        return None
    return _fit_device(dict(best[1]), device)


def _fit_device(cfg: dict, device: torch.device) -> dict:
    """A borrowed config on this device: TMA tiles (``"tma"`` and what goes with it) become pointer tiles on GPUs of
    compute capability < 9, which have no tensor memory accelerator; the Gluon FP8 GEMMs (``"gluon"``: Hopper's
    wgmma) are asked for on 9.x only."""
    if device.type != "cuda":
        return cfg
    major = torch.cuda.get_device_capability(device)[0]
    drop = ("tma", "tma_a", "ws", "per_sm", "gluon") if major < 9 else ("gluon",) if major != 9 else ()
    for g in ("g1", "g2"):
        if drop and isinstance(cfg.get(g), dict):
            cfg[g] = {k: v for k, v in cfg[g].items() if k not in drop}
    return cfg
