"""The command line of ``python -m moecomp tune`` (:mod:`moecomp.cli.tune`): its options, the shapes and token
buckets to measure, the output path and the device."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..core.spec import MoESpec, QuantSpec
from ..ops import tuning
from ..testing import LAYER_PRESETS
from .tune_fp8 import FP8_CHOICES

TOKENS = [1, 16, 128, 1024, 8192]
# --interpret: a tiny shape, its buckets (its tiles: ``tune.INTERPRET_TILES``)
INTERPRET_SHAPE = (4, 32, 32, 2)  # E, I, H, k
INTERPRET_TOKENS = [1, 16]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moecomp tune",
        description="Tune the fused-MoE grouped-GEMM configs on this GPU and write the JSON table read at run time "
                    "(moecomp/kernels/configs/<gpu>.json; measurements in <gpu>.meta.json next to it). Resumable: "
                    "every finished (shape, token bucket) is saved at once and skipped by a rerun.",
        epilog="Exit status: 0 done, 1 an entry had no working candidate (reported, not saved), 3 stopped by "
               "--budget-s (rerun the same command to resume), 130 interrupted (the file keeps every finished entry; "
               "rerun without --restart to resume), 2 refused.")
    p.add_argument("--presets", action="extend", nargs="+", default=None, metavar="NAME",
                   help=f"layer presets, comma- or space-separated, or 'all' (default: all unless --shape is given; "
                        f"{', '.join(LAYER_PRESETS)})")
    p.add_argument("--shape", action="extend", nargs="+", default=None, metavar="E,I,H,k",
                   help="explicit shapes: experts, intermediate size, hidden size, top-k (repeatable)")
    p.add_argument("--tokens", default=None,
                   help=f"token-count buckets, comma-separated (default {','.join(map(str, TOKENS))}); the run-time "
                        "lookup takes the largest bucket <= the call's token count")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="activation / weight dtype (default bf16; fp32 under --interpret)")
    p.add_argument("--fp8", choices=sorted(FP8_CHOICES), default=None,
                   help="tune FP8 experts (e4m3 weights, 128x128 block scales, dynamic activations; --dtype: x's): "
                        "'both' measures w8a8 and w8a16, each with its speed candidates (prequant; fold 1, 2), per "
                        "bucket and keeps the fastest (table key dtype=fp8); 'plain' the two modes without the "
                        "candidates; 'lean' w8a8+prequant and w8a16+fold1 only (dtype=fp8); 'prequant' "
                        "w8a8+prequant only (dtype=fp8; with its TMA tiles, as every prequant run); 'w8a8' / "
                        "'w8a16' one mode (dtype=fp8_<mode>, read when MOECOMP_FP8_MODE forces it)")
    p.add_argument("--out", default=None, metavar="FILE|DIR",
                   help="the table to write (a DIR gets DIR/<gpu>.json); default: "
                        "moecomp/kernels/configs/<gpu>.json, the file the run-time lookup reads")
    p.add_argument("--copy-to", default=None, metavar="DIR",
                   help="also copy the table and its .meta.json into DIR after every entry")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", dest="restart", action="store_false", default=False,
                   help="skip the entries already in the file (the default)")
    g.add_argument("--restart", dest="restart", action="store_true",
                   help="measure every requested entry again (others in the file are kept; to resume an "
                        "interrupted --restart, rerun without it)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no new entry after S seconds (one entry at least; exit status 3 when entries "
                        "are left: rerun to resume)")
    p.add_argument("--rep", type=float, default=25, metavar="MS", help="do_bench rep per candidate (ms, default 25)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every BLOCK_M measured and every rejected / failing candidate")
    p.add_argument("--interpret", action="store_true",
                   help="FOR TESTS ONLY: run on CPU under TRITON_INTERPRET=1 with a tiny shape (E,I,H,k = "
                        f"{','.join(map(str, INTERPRET_SHAPE))}), buckets {','.join(map(str, INTERPRET_TOKENS))} and "
                        "two candidates per GEMM; timings are meaningless, --out is required")
    return p


def tune_shapes(a, interpret: bool) -> list[tuple[str, MoESpec]]:
    out = []
    names = [n for item in (a.presets or []) for n in item.split(",") if n]
    if names == ["all"] or (not names and not a.shape and not interpret):
        names = list(LAYER_PRESETS)
    for n in names:
        if n not in LAYER_PRESETS:
            raise SystemExit(f"unknown preset {n!r}; known: {', '.join(LAYER_PRESETS)}")
        out.append((n, LAYER_PRESETS[n]))
    shapes = list(a.shape or [])
    if interpret and not names and not shapes:
        shapes = [",".join(map(str, INTERPRET_SHAPE))]
    for s in shapes:
        try:
            E, I, H, k = (int(v) for v in s.split(","))
            spec = MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I)
        except Exception as e:
            raise SystemExit(f"--shape {s!r}: expected E,I,H,k (experts, intermediate, hidden, top-k): {e}") from None
        out.append((f"E={E},I={I},H={H},k={k}", spec))
    return out


def tune_jobs(a, dtype: torch.dtype, tokens: list[int]) -> list[tuple]:
    """(shape key, label, spec, T) for every requested bucket, once per key: presets sharing E, I, H (and the dtype)
    share a table. ``--fp8``: the spec quantized (128x128 blocks, dynamic), keyed by the FP8 table's dtype name."""
    jobs, seen = [], {}
    for label, spec in tune_shapes(a, a.interpret):
        if a.fp8:
            spec = spec.replace(quant=QuantSpec())
        table_dtype = ("fp8" if a.fp8 in ("both", "plain", "lean", "prequant") else f"fp8_{a.fp8}") if a.fp8 else dtype
        key = tuning.shape_key(spec.num_experts, spec.intermediate_size, spec.hidden_size, table_dtype)
        if key in seen:
            print(f"[tune] {label}: same table as {seen[key]} ({key}), tuned once", file=sys.stderr)
            continue
        seen[key] = label
        jobs += [(key, label, spec, T) for T in dict.fromkeys(tokens)]
    return jobs


def resolve_out(out: str | None, gpu: str, interpret: bool) -> str:
    if out is None:
        if interpret:
            raise SystemExit("--interpret writes no package file: give --out FILE")
        return str(tuning.CONFIG_DIR / f"{gpu}.json")
    if os.path.isdir(out) or out.endswith(os.sep) or not out.endswith(".json"):
        return os.path.join(out, f"{gpu}.json")
    return out


def setup_device(interpret: bool) -> torch.device | None:
    """The device to tune on, or None (refused, message printed)."""
    if interpret:
        kernels_loaded = any(m.startswith("moecomp.kernels.") for m in sys.modules)
        if os.environ.get("TRITON_INTERPRET") != "1" and kernels_loaded:
            print("tune --interpret: the Triton kernels were already imported without TRITON_INTERPRET=1; run it in "
                  "a fresh process (or set TRITON_INTERPRET=1 first)", file=sys.stderr)
            return None
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported: @triton.jit reads it then
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print("tune: no CUDA GPU here; the tuner measures kernels on the GPU whose table it writes. "
              "--interpret runs a tiny CPU tune under the Triton interpreter, for tests only.", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())
