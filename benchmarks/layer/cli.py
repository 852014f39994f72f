"""The CLI of ``bench_moe.py`` (its options, the paths a run times) and the header of its result JSON."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import common, fp8, fp8_paths
from .breakdown import BREAKDOWN_PATHS, BREAKDOWN_REPS, FP8_BREAKDOWN_PATHS
from .common import ALL_PEERS, DTYPES, FP8_PATHS, FP8_PEERS, PEER_ALIASES, default_tolerance
from .env import peer_hygiene
from .families import FAMILIES
from .routing import PLANT_CHOSEN, PLANT_OTHER_STD, ROUTING_METHOD, ROUTING_MODES, ZIPF_EXPONENT


def parse_args(argv=None, doc: str | None = None):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="all", help=f"comma list of {', '.join(FAMILIES)} (default all)")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1,16,128,1024,8192; tiny: 1,16,128)")
    ap.add_argument("--peers", default="all",
                    help=f"comma list of {', '.join(ALL_PEERS)} (default all; vllm only when its kernel is found); "
                         f"with --dtype fp8 also {', '.join(FP8_PATHS)} (all: every one of them, the HF peers as n/a, "
                         "and moecomp bf16; vllm means vllm_fp8)")
    ap.add_argument("--vllm-peer", metavar="DIR", default=None,
                    help="directory holding the standalone vllm_fused_moe.py (vLLM's kernel, timed as the peer "
                         "'vllm'); default: the installed vllm package when importable, else no vllm peer")
    ap.add_argument("--routing", choices=ROUTING_MODES, default="real",
                    help="real (default): random router weights route; uniform / zipf / one-hot: expert ids drawn "
                         "from that distribution and planted through the router (every path sees the same ids)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                    help="dtype of the whole run: blocks, inputs, every peer, the floor's bytes, the ceilings "
                         "(default bf16; the JSON name gets -<dtype> when not bf16); fp8: the blocks' experts "
                         "quantized to e4m3 with 128x128 fp32 block scales, bf16 activations (layer/fp8.py)")
    ap.add_argument("--breakdown", metavar="CELLS", default="",
                    help="family:T,... (e.g. qwen3:1,mixtral:8192): after every timing of the run, profile "
                         "moecomp's op (and the vLLM peer where timed) in those cells with torch.profiler: per-kernel "
                         "device time and the gaps (wall - kernels), in the JSON (cell.breakdown) and the log")
    ap.add_argument("--quick", action="store_true", help="shorter do_bench warmup / rep (noisier)")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph capture")
    ap.add_argument("--graph-max-t", type=int, default=1024, help="capture graphs up to this T (default 1024)")
    ap.add_argument("--via-optimize", action="store_true",
                    help="also time moecomp.optimize(block) (needs moecomp.optimize); direct binding stays")
    ap.add_argument("--moecomp-backend", choices=("triton", "torch"), default=None,
                    help="sets MOECOMP_CUDA_BACKEND for the op (default: the op's own default)")
    ap.add_argument("--tol", type=float, default=None,
                    help=f"moecomp vs HF rel-error tolerance (default: bf16 {default_tolerance(torch.bfloat16):g}, "
                         f"fp16 {default_tolerance(torch.float16):.2g}; see default_tolerance)")
    ap.add_argument("--fp8-tol", type=float, default=None,
                    help=f"--dtype fp8: an fp8 path vs its dequantized reference (default {fp8.FP8_TOLERANCE:g}; "
                         f"vLLM under the CPU interpreter {fp8.FP8_INTERPRET_TOLERANCE:g})")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke runs); no PEERS.md column")
    ap.add_argument("--table", choices=("on", "off", "loo"), default=None,
                    help="moecomp's kernel-config table (sets MOECOMP_TABLE): on (default); off = this GPU's table "
                         "ignored (the nearest entry of the other shipped tables, as a GPU without one gets); loo = "
                         "also every table's entry of the benchmarked shapes (as for shapes no table holds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="start no new cell after this many seconds (default 540: the table still prints inside a "
                         "10-minute limit); skipped cells are marked in the JSON")
    ap.add_argument("--out-json", default=None,
                    help="result path (default benchmarks/results/<gpu>-<date>-<commit>.json)")
    ap.add_argument("--no-save", action="store_true", help="write no JSON")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing paths")
    args = ap.parse_args(argv)
    if args.table is not None:
        os.environ["MOECOMP_TABLE"] = args.table
    return args


def resolve_peers(names: str, is_fp8: bool) -> list[str]:
    """The paths of a run: --peers resolved (aliases; under --dtype fp8 "vllm" is the vLLM peer's fp8 path)."""
    if names in ("all", ""):
        return list(FP8_PEERS if is_fp8 else ALL_PEERS)
    peers = common.resolve(names, {p: p for p in ALL_PEERS + FP8_PATHS}, PEER_ALIASES, "peer")
    if is_fp8:
        peers = list(dict.fromkeys("vllm_fp8" if p == "vllm" else p for p in peers))
    elif wrong := [p for p in peers if p in FP8_PATHS]:
        raise SystemExit(f"--peers {','.join(wrong)}: fp8 paths need --dtype fp8")
    return peers


def result_header(ctx, env: dict, commit: str, now) -> dict:
    """The result JSON before any family ran (``ctx``: bench_moe's Run)."""
    args, device = ctx.args, ctx.device
    vllm_timed = ctx.vllm_fused is not None and any(p in ctx.peers for p in ("vllm", "vllm_fp8"))
    bd_paths = FP8_BREAKDOWN_PATHS if ctx.fp8 else BREAKDOWN_PATHS
    result = dict(
        schema=2, **env, date=now.strftime("%Y-%m-%d"), timestamp=now.isoformat(timespec="seconds"), commit=commit,
        argv=sys.argv[1:] if ctx.argv is None else list(ctx.argv), tiny=args.tiny, quick=args.quick,
        dtype=args.dtype, config_table=os.environ.get("MOECOMP_TABLE") or "on",
        moecomp_backend=(os.environ.get("MOECOMP_CUDA_BACKEND", "triton") if device.type == "cuda"
                         else os.environ.get("MOECOMP_CPU_BACKEND", "torch")),
        moecomp_version=getattr(sys.modules.get("moecomp"), "__version__", None), tolerance=args.tol,
        init=dict(weight_std=common.INIT_STD, correction_bias_std=common.CORRECTION_BIAS_STD, input="randn (std 1)",
                  dtype=str(common.DTYPE)),
        timing=("triton.testing.do_bench median (ms), L2 flushed per call" if device.type == "cuda"
                else "host perf_counter median (ms), CPU"),
        ceilings=ctx.ceilings, families=[], fatal=None, json_path=ctx.out_json,
        breakdown=dict(cells=[f"{f}:{t}" for f, t in ctx.bd_cells], not_in_run=ctx.bd_missing, paths=list(bd_paths),
                       reps=BREAKDOWN_REPS) if args.breakdown else None,
        routing=dict(mode=args.routing, method=ROUTING_METHOD,
                     **(dict(zipf_exponent=ZIPF_EXPONENT) if args.routing == "zipf" else {}),
                     **(dict(plant_chosen_logits=PLANT_CHOSEN, plant_other_logit_std=PLANT_OTHER_STD)
                        if args.routing != "real" else {})),
        vllm_peer=dict(ctx.vllm_info, timed=vllm_timed,
                       compute_dtype=None if ctx.vllm_fused is None else
                       str(common.DTYPE if device.type == "cuda" else torch.float32),
                       router="the block's own router module (the owner of the recognised router weight), "
                              "else moecomp.oracle.reference.route on the recognised spec; shared expert in torch"))
    if ctx.fp8:
        result["fp8"] = dict(
            quant=fp8.quant_spec().key, method=fp8.QUANT_METHOD, reference=fp8.REFERENCE_METHOD,
            tolerance=args.fp8_tol, vllm_interpret_tolerance=max(args.fp8_tol, fp8.FP8_INTERPRET_TOLERANCE),
            floor=fp8.FLOOR_METHOD, matmul_rate=fp8.rate_key(ctx.ceilings), mode_env=fp8.MODE_ENV,
            mode_env_before=os.environ.get(fp8.MODE_ENV), hf_peers=fp8.HF_NA, targets=fp8.TARGETS,
            paths={"moecomp_fp8": "torch.ops.moecomp.moe_forward, quantized spec, scales after spec; the kernel "
                                  "table picks w8a8 or w8a16 per T",
                   "moecomp_fp8_w8a8": f"the same with {fp8.MODE_ENV}=w8a8",
                   "moecomp_fp8_w8a16": f"the same with {fp8.MODE_ENV}=w8a16",
                   "moecomp": "moecomp's op on the same block unquantized (bf16)",
                   "vllm_fp8": "vLLM fused_moe(use_fp8_w8a8=True, w1_scale, w2_scale, block_shape=[128, 128]) on "
                               "the same fp8 weights and scales; HF router; shared expert in torch on its weights "
                               "dequantized to bf16",
                   "scaled_grouped_mm": fp8_paths.SGMM_NOTE},
            scaled_grouped_mm=dict(available=ctx.sgmm_why is None, reason=ctx.sgmm_why))
    result["peer_hygiene"] = peer_hygiene()
    return result
