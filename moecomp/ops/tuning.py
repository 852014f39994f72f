"""Kernel configs: tuned JSON tables keyed by GPU and shape, looked up at run time, with a heuristic fallback.

Files live in ``moecomp/kernels/configs/<device>.json`` (device = ``torch.cuda.get_device_name()`` with spaces as
``_``). Each maps ``"E=<E>,N=<I>,K=<H>,dtype=<dtype>"`` to ``{"<M bucket>": config}`` where the bucket is the
largest listed token count <= T; a config holds ``BLOCK_M`` (shared by alignment and both GEMMs) and per-GEMM
``g1`` / ``g2`` dicts of ``BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages``, and optionally ``decode``:
``max_t`` (the decode path up to this many tokens) with its own ``g1`` (DIRECT gemm1) and ``g2`` (``mode``
"fused": the down-combine kernel, or "pairs": gemm2 DIRECT + combine) tiles; without it, ``decode_config``'s
heuristic. ``python -m moecomp tune`` (:mod:`moecomp.cli.tune`; ``benchmarks/tune_moe.py`` wraps it) writes them, and
their measurements to ``<device>.meta.json``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from . import tuning_nearest

CONFIG_DIR = Path(__file__).resolve().parent.parent / "kernels" / "configs"


def device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:  # a driver query: once per device, not once per call
    return torch.cuda.get_device_name(index).replace(" ", "_")


def shape_key(E: int, N: int, K: int, dtype) -> str:
    """``dtype``: a torch dtype, or a table's own name for one ("fp8", "fp8_w8a16": the FP8 tables below)."""
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


def get_config(E: int, N: int, K: int, T: int, top_k: int, dtype: torch.dtype, device: torch.device,
               quant=None) -> dict:
    """Config for the MoE GEMMs of one call (N = intermediate size, K = hidden size). ``quant`` (a ``QuantSpec``):
    the FP8 experts' config (``fp8_config``), or the 4-bit experts' (``quant4_config``), instead."""
    override = os.environ.get("MOECOMP_CONFIG")
    if override:
        return json.loads(override)
    if quant is not None and quant.packed:
        return quant4_config(E, N, K, T, top_k, device, quant)
    if quant is not None:
        return fp8_config(E, N, K, T, top_k, device)
    tables = _own_table(device)
    table = tables.get(shape_key(E, N, K, dtype))
    if not table and dtype == torch.float16:  # same element size and tensor-core rate: bf16's tiles, if tuned
        table = tables.get(shape_key(E, N, K, torch.bfloat16))
    if table:
        return _bucket(table, T)
    if device.type == "cuda":
        for dt in dict.fromkeys((dtype, torch.bfloat16 if dtype == torch.float16 else dtype)):
            near = _nearest(E, N, K, T, top_k, str(dt).replace("torch.", ""), device)
            if near is not None:
                return near
    return _heuristic(E, N, K, T, top_k, device)


def _own_table(device: torch.device) -> dict:
    """This GPU's table ({} under MOECOMP_TABLE=off / loo: see ``tuning_nearest``)."""
    return _table(device_key(device)) if tuning_nearest.table_mode() == "on" else {}


def _nearest(E: int, N: int, K: int, T: int, top_k: int, table_dtype: str, device: torch.device) -> dict | None:
    """The nearest tuned entry of any shipped table (``tuning_nearest``), or None; a copy (callers may add keys)."""
    near = _nearest_cached(E, N, K, T, top_k, table_dtype, device, tuning_nearest.table_mode())
    return None if near is None else dict(near)


@functools.lru_cache(maxsize=4096)
def _nearest_cached(E, N, K, T, top_k, table_dtype, device, mode):  # mode: a key part (MOECOMP_TABLE is read inside)
    return tuning_nearest.nearest(str(CONFIG_DIR), device_key(device), E, N, K, T, top_k, table_dtype, device)


def _bucket(table: dict, T: int) -> dict:
    """The entry of the largest bucket <= T (the smallest bucket below every bucket)."""
    buckets = sorted(int(b) for b in table)
    best = buckets[0]
    for b in buckets:
        if b <= T:
            best = b
    return table[str(best)]


# ------------------------------------------------------------------------------------------------------ FP8
# Quantized experts (``MoESpec.quant``) have table entries of their own, whatever x's dtype: "dtype=fp8" in the shape
# key holds each bucket's winner over both modes (its config's "fp8" key: "w8a8", fp8 x fp8 dots on activations
# quantized in the kernel, or "w8a16", weight-only: e4m3 weights converted to x's dtype in registers);
# "dtype=fp8_w8a8" / "dtype=fp8_w8a16" hold one mode's tiles, read when MOECOMP_FP8_MODE forces that mode. The
# bf16 / fp16 / fp32 keys and their lookups are unchanged. Every FP8 tile has BLOCK_K = 128 (the activation group;
# the launcher halves a BLOCK_K that does not divide the spec's block_k or the group).
FP8_MODES = ("w8a8", "w8a16")
# a config without an "fp8" key (the dense fp8_linear's): weight-only up to this many tokens, w8a8 above (untuned);
# the experts' heuristic config says its mode (FP8_HEURISTIC_MODE)
FP8_W8A16_MAX_T = 16


def fp8_forced() -> str | None:
    """MOECOMP_FP8_MODE ("w8a8" | "w8a16"): the mode every dynamic-activation FP8 GEMM runs in (benchmarks)."""
    mode = os.environ.get("MOECOMP_FP8_MODE") or None
    if mode is not None and mode not in FP8_MODES:
        raise ValueError(f"MOECOMP_FP8_MODE={mode!r}: expected one of {FP8_MODES}")
    return mode


def fp8_mode(quant, T: int, cfg: dict | None = None) -> str:
    """"w8a8" or "w8a16" for a call of T tokens. The spec's activation decides unless it is "dynamic" ("static":
    w8a8, "none": w8a16); a dynamic one runs MOECOMP_FP8_MODE, else the config's "fp8" key, else weight-only up to
    ``FP8_W8A16_MAX_T`` tokens (the op may run a dynamic spec weight-only: its error is then smaller). A per-token
    spec (``QuantSpec.per_token``) always runs weight-only: no kernel quantizes a whole row yet."""
    if quant.activation != "dynamic":
        return "w8a8" if quant.activation == "static" else "w8a16"
    if quant.per_token:  # the kernels quantize activations in 128-column groups only: weight-only (allowed, closer)
        return "w8a16"
    forced = fp8_forced()
    if forced:
        return forced
    mode = (cfg or {}).get("fp8")
    if mode in FP8_MODES:
        return mode
    return "w8a16" if T <= FP8_W8A16_MAX_T else "w8a8"


# Speed candidates (docs/FP8.md, "Speed candidates"), off unless asked for: config key -> environment variable.
FP8_CANDIDATES = {"fp8_prequant": "MOECOMP_FP8_PREQUANT", "fp8_fold": "MOECOMP_FP8_FOLD"}


def fp8_candidates(cfg: dict | None = None) -> dict:
    """{"prequant": 0 | 1, "fold": 0 | 1 | 2} for one call: each candidate's environment variable when set (read at
    call time: benchmarks; "0" turns a config's candidate off), else the config's key (``FP8_CANDIDATES``; a table
    entry may carry it), else 0 (off). "prequant": a dynamic w8a8 GEMM reads activations quantized once (A_QUANT
    3); "fold": a w8a16 GEMM over block scales folds them into the weight tile (2: with the operands swapped)."""
    out = {}
    for key, env in FP8_CANDIDATES.items():
        allowed = ("0", "1", "2") if key == "fp8_fold" else ("0", "1")
        v = os.environ.get(env) or None
        if v is not None and v not in allowed:
            raise ValueError(f"{env}={v!r}: expected one of {allowed}")
        out[key[4:]] = int(v) if v is not None else int((cfg or {}).get(key) or 0)
    return out


def fp8_config(E: int, N: int, K: int, T: int, top_k: int, device: torch.device) -> dict:
    """The FP8 experts' config: the forced mode's table (MOECOMP_FP8_MODE), else the "fp8" table, else the
    heuristic."""
    tables = _own_table(device)
    forced = fp8_forced()
    for dt in ([f"fp8_{forced}"] if forced else []) + ["fp8"]:
        table = tables.get(shape_key(E, N, K, dt))
        if table:
            return _bucket(table, T)
    if device.type == "cuda":
        for dt in ([f"fp8_{forced}"] if forced else []) + ["fp8"]:
            near = _nearest(E, N, K, T, top_k, dt, device)
            if near is not None:
                return near
    return _fp8_heuristic(E, N, K, T, top_k, device)


def _fp8_heuristic(E: int, N: int, K: int, T: int, top_k: int, device: torch.device) -> dict:
    """bf16's heuristic tiles with BLOCK_K = 128 (narrower and fewer stages where an fp8 weight tile of 128 rows
    and a 16-bit A tile would not fit shared memory), the decode path in "pairs" mode, and ``FP8_HEURISTIC_MODE``."""
    cfg = _heuristic(E, N, K, T, top_k, device)
    g1, g2 = dict(cfg["g1"], BLOCK_K=128), dict(cfg["g2"], BLOCK_K=128)
    if cfg["BLOCK_M"] >= 128:
        g1["num_stages"] = g2["num_stages"] = 3
        g2["BLOCK_N"] = min(g2["BLOCK_N"], 128)
    dec = _decode_heuristic(device)
    dec = dict(dec, g1=dict(dec["g1"], BLOCK_K=128), g2=dict(dec["g2"], BLOCK_K=128, mode="pairs"))
    return dict(cfg, g1=g1, g2=g2, decode=dec, **FP8_HEURISTIC_MODE)


# The experts' mode without a table entry: w8a8 on activations quantized once ("prequant") at every T. Measured by
# ``tune --fp8 both`` on an H200 (2f93783, benchmarks/results/...-2f93783-tune-fp8.log): w8a8+prequant was the
# fastest of the five variants in 7 of the 8 entries tuned (Qwen3-30B-A3B T = 16..8192, DeepSeek-V3 T = 1, 16, 128),
# 1.05-1.73x ahead of w8a8 without it and 1.04-1.55x ahead of the best weight-only variant (w8a16+fold1); the
# eighth, Qwen3 T=1, went to w8a16+fold1 by 7% (36.3 against 39.0 us).
FP8_HEURISTIC_MODE = {"fp8": "w8a8", "fp8_prequant": 1}


# The dense FP8 linear's speed candidates when no block config is given (a standalone FP8Linear) and it has more
# than 64 rows: its w8a8 calls read activations quantized once. Measured on an H200 (diag_fp8_linear.py,
# 2026-12-02, ...-fd6dfe0-diag-fp8-linear.json): 2.4-6.4x faster than quantizing in every program at 512 and 2048
# rows on the 7 Qwen3-30B-A3B / DeepSeek-V3 projection shapes (with the tiles below).
FP8_LINEAR_DEFAULTS = {"fp8_prequant": 1}


def fp8_linear_config(M: int, N: int, K: int, device: torch.device, sms: int) -> dict:
    """Tiles of the dense FP8 linear (``kernels/fp8_linear.py``; ``sms``: the device's SM count): at up to 16 rows
    BLOCK_M = 16 and BLOCK_N chosen so that there are about two programs per SM (memory-bound: every SM streams
    weight tiles). Above 64 rows the winners of the H200 sweep (diag_fp8_linear.py, 2026-12-02; activations
    quantized once): 64 x 64 tiles up to 1024 columns (k / v projections: 0.75x the 64 x 128 time at 512 rows),
    128 x 128 with 8 warps from 24M weight elements (0.94-1.00x), 64 x 128 between.
    MOECOMP_FP8_LINEAR_TILES="BLOCK_M,BLOCK_N,GROUP_M,num_warps,num_stages" (BLOCK_K 128) overrides every call
    (benchmarks/diag_fp8_linear.py's sweep)."""
    env = os.environ.get("MOECOMP_FP8_LINEAR_TILES")
    if env:
        bm, bn, gm, nw, ns = (int(v) for v in env.split(","))
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=gm, num_warps=nw, num_stages=ns)
    if device.type != "cuda":  # the interpreter: small tiles
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=1)
    if M <= 16:
        bn = 64 if -(-N // 64) >= 2 * sms else 32
        return dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=32 if M <= 32 else 64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if N <= 1024:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
    if N * K >= 24 << 20:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


# ------------------------------------------------------------------------------------------------------ 4-bit
# 4-bit experts (mxfp4, int4: w4a16, ``kernels/quant4.py``): table key "dtype=<quant4_key>" ("mxfp4", "int4_g128",
# "int4_g128_zp"), else the heuristic below. Not timed yet (benchmarks/diag_quant4.py times it).
# The decode path up to 8 tokens (MOECOMP_DECODE_MAX_T overrides), on the dot-free GEMV kernels
# (``ops/triton_quant4_gemv.py``; decode entry "mode": "gemv") on CUDA up to ``QUANT4_GEMV_MAX_T`` tokens, else the
# DIRECT dot kernels (MOECOMP_W4_DECODE=gemv|dot overrides). Measured on an H200 (gpt-oss-120b layer, diag_quant4.py
# --quick, 6f5ee9c, ...-6f5ee9c-diag-gemv.json): GEMV against the DIRECT dot decode 57 / 88 us at T = 1, 101 / 134
# at 2, 160 / 227 at 4, 294 / 409 at 8, 548 / 783 at 16; the aligned path (tl.dot_scaled) took 227 us at T = 4 and
# 549 at 16 (3ab902a), so GEMV ties it at 16 and wins below: the decode path ends at 8.
QUANT4_DECODE_MAX_T = 8
QUANT4_GEMV_MAX_T = 8


def quant4_key(quant) -> str:
    """The table's dtype name of a 4-bit spec (the group and zero points change the K loop)."""
    if quant.weight == "mxfp4":
        return "mxfp4"
    return f"int4_g{quant.block_k}" + ("_zp" if quant.zero_point else "")


def quant4_config(E: int, N: int, K: int, T: int, top_k: int, device: torch.device, quant) -> dict:
    """The 4-bit experts' config: the table's entry (``quant4_key``), else ``_quant4_heuristic`` with the decode path
    up to ``QUANT4_DECODE_MAX_T`` tokens (bf16's decode tiles, "pairs" mode on CUDA; on CUDA up to
    ``QUANT4_GEMV_MAX_T`` tokens the GEMV kernels: ``"mode": "gemv"``). BLOCK_K: a multiple of 32 dividing the int4
    group (the launcher's ``triton_quant4.tile`` enforces it for any config)."""
    table = _own_table(device).get(shape_key(E, N, K, quant4_key(quant)))
    if table:
        return _bucket(table, T)
    near = _nearest(E, N, K, T, top_k, quant4_key(quant), device) if device.type == "cuda" else None
    if near is not None:
        return near
    g = quant.block_k if quant.weight == "int4" else 128

    def bk(c: dict) -> dict:
        b = max(32, c["BLOCK_K"])
        while g % b:
            b //= 2
        return dict(c, BLOCK_K=b)

    cfg = _heuristic(E, N, K, T, top_k, device) if device.type != "cuda" else _quant4_heuristic(T, top_k, E, quant)
    dec = _decode_heuristic(device)
    dec = dict(dec, max_t=QUANT4_DECODE_MAX_T if device.type == "cuda" else dec["max_t"], g1=bk(dec["g1"]),
               g2=bk(dec["g2"]))
    if device.type == "cuda" and T <= QUANT4_GEMV_MAX_T:
        dec["mode"] = "gemv"
    return dict(cfg, g1=bk(cfg["g1"]), g2=bk(cfg["g2"]), decode=dec)


def _quant4_heuristic(T: int, top_k: int, E: int, quant) -> dict:
    """bf16's row classes with tiles that fit a 4-bit K loop without spilling: compiled offline for sm90 (Triton 3.9,
    the interleave form, 2026-12-03) bf16's tiles spilled where the decoded tile, the unscaled int4 product and the
    accumulator are live together: gemm2 at BLOCK_M 128 x BLOCK_N 256 (184-888 bytes of stack), int4 gemm1 at 128 x
    64 (24-80 bytes), int4 gemm2 at 128 x 128 (280-328). These tiles compile without stack (int4 gemm1 128 x 32:
    161 registers; gemm2 128 x 64: 194; mxfp4 gemm2 128 x 128: 217; 64 x 64 / 128: 168-232). int4 takes the narrower
    N (its scale multiplies a second [BM, N] product each step)."""
    rows = T * top_k / max(1, min(E, T * top_k))
    narrow = quant.weight == "int4"
    if rows <= 16:
        return dict(BLOCK_M=16, g1=dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
                    g2=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4))
    if rows <= 48:
        return dict(BLOCK_M=32, g1=dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4),
                    g2=dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=4))
    if rows <= 128:
        return dict(BLOCK_M=64, g1=dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
                    g2=dict(BLOCK_N=64 if narrow else 128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4))
    return dict(BLOCK_M=128, g1=dict(BLOCK_N=32 if narrow else 64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
                g2=dict(BLOCK_N=64 if narrow else 128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3))


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


# --------------------------------------------------------------------------------------------- routing launch shape
ROUTE_ONE_TOKEN_T = 1024  # up to this many tokens, one token per routing program (``route_tiles``)
ROUTE_ELEMS = 2048  # above: tokens x experts (padded) per routing program at most (MOECOMP_ROUTE_ELEMS overrides)


def route_tiles(T: int, E: int, n_group: int) -> dict:
    """The routing kernel's launch shape for T tokens of E experts: ``block_t`` tokens per program, ``num_warps``, and
    ``group_3d`` (per-group reductions on a 3-D view, when E fills its power of two and splits into equal groups).

    Measured on an H200 (``benchmarks/diag_kernels.py --parts route``;
    benchmarks/results/nvidia-h200-2026-11-30-47f803a-diag.json): one token per one-warp program is the fastest up
    to T=128 for 8 to 256 experts, and at every T for 256 experts (DeepSeek-V3 at T=16: 7.0 us against 85 us for the
    16-token, 4-warp program, whose [16, 256] fp32 tiles spill); at T=8192 and E <= 128, 16-token 4-warp programs
    win (Mixtral 5.6 us against 14.2). Above 256 experts (not measured) one token per program with a warp per 256
    experts. MOECOMP_ROUTE_ELEMS caps block_t * next_pow2(E) of the many-token programs (default ROUTE_ELEMS)."""
    block_e = _pow2(E)
    group_3d = n_group > 1 and E == block_e and E % n_group == 0
    if T <= ROUTE_ONE_TOKEN_T or block_e > 128:
        return dict(block_t=1, num_warps=max(1, block_e // 256), group_3d=group_3d)
    elems = int(os.environ.get("MOECOMP_ROUTE_ELEMS", ROUTE_ELEMS))
    return dict(block_t=max(1, min(16, elems // block_e)), num_warps=4, group_3d=group_3d)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()
