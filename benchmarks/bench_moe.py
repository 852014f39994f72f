#!/usr/bin/env python3
"""Time one MoE block per model family: HF eager, HF grouped_mm, torch.compile, vLLM's fused-MoE kernel (when it is
available) and moecomp's custom op.

Each block is built from transformers' own class with a config of the family's sizes, directly on the device
in bf16 (``--dtype``), weights drawn from N(0, 0.02) in place (never zeros). moecomp calls
``torch.ops.moecomp.moe_forward`` on the block's own parameters with the ``MoESpec`` and tensors moecomp's
recogniser finds in the block (``moecomp.recognise.recognise.match_block``: what ``moecomp.optimize`` would bind; the script
has no spec of its own, and a block moecomp refuses is reported with its reject code, gets no moecomp timing, and
the exit status is 3).
Before timing, every path's output is compared with the HF block (per-expert eager loop) on the same random
input; moecomp's relative error is the "check" column, the vLLM peer's "check_vllm" (flagged loudly when above
``--tol``, the run keeps going).

The vLLM peer ("vllm") is vLLM's Triton fused-MoE kernel, loaded from a standalone copy (``--vllm-peer DIR``, the
directory holding ``vllm_fused_moe.py``) or from an installed ``vllm``; the block's own HF router module computes
the routing around it and the shared expert (where the family has one) runs in plain torch. On CPU the copy runs
under the Triton interpreter in fp32 (a smoke run; its times mean nothing there).

``--routing`` picks the routing: ``real`` (default) lets the random router weights route; ``uniform`` / ``zipf`` /
``one-hot`` draw the expert ids from that distribution and plant them: the router rows are set to orthonormal
vectors and each token's input is chosen so that its router logits rank the drawn experts first (by >= 2 logits),
so every path still runs the whole block and routes through the same router to the same ids (checked per cell).

Every path is timed with plain launches and, where it can be captured (T <= 1024), as a CUDA-graph replay;
the table shows the better, the JSON both. Times are ``triton.testing.do_bench`` medians in ms. The floor
per cell is max(bytes / copy rate, FLOPs / matmul rate) with bytes counted from the experts the batch's
routing actually touched, and both ceilings measured at the start of the same run; each path's achieved
TB/s and TFLOP/s (the floor's bytes and FLOPs over its time) sit next to those ceilings.

    python3 benchmarks/bench_moe.py                      # everything (~4-6 min on an H200)
    python3 benchmarks/bench_moe.py --families qwen3,olmoe --tokens 1,128 --peers hf_grouped_mm,moecomp
    python3 benchmarks/bench_moe.py --vllm-peer .peers/vllm_fused_moe --routing zipf
    python3 benchmarks/bench_moe.py --quick --vllm-peer .peers/vllm_fused_moe --dtype fp16
    python3 benchmarks/bench_moe.py --families qwen3,olmoe --tokens 1,16 --breakdown qwen3:1,olmoe:1
    python3 benchmarks/bench_moe.py --quick --vllm-peer .peers/vllm_fused_moe --dtype fp8
    python3 benchmarks/bench_moe.py --device cpu --tiny  # a smoke run on CPU (tiny sizes, host timer)

``--dtype bf16|fp16`` (default bf16) runs everything in that dtype (blocks, inputs, every peer, the floor's bytes, the
ceilings); fp16's default tolerance is tighter (``default_tolerance``). ``--breakdown family:T,...`` profiles
moecomp's op (and the vLLM peer where it was timed) in those cells with ``torch.profiler`` once every timing of the
run is done: per-kernel device time, calls and share of the op's wall time, and the gaps (wall - kernels).

``--dtype fp8``: every family's block gets FP8 block-quantized experts (e4m3, 128x128 fp32 block scales, routed and
shared; ``layer/fp8.py``), bf16 activations; the paths are moecomp's op on them (the kernel table's mode, then w8a8
and w8a16 forced through MOECOMP_FP8_MODE), moecomp bf16 on the same block unquantized, vLLM's fp8 block path and
``torch._scaled_grouped_mm`` (row-wise scales; ``layer/fp8_paths.py``); HF's paths are n/a (transformers' FP8 forward
needs hub kernels). Each fp8 path is checked against the dequantized reference; the floor counts fp8 bytes and the
fp8 matmul rate; ``report.py`` renders its own table.

The parts live in ``benchmarks/layer/`` (one module per concern, see its ``__init__``); this file is the CLI and the
grid (families x T x paths).

Output: ``benchmarks/results/<gpu>-<date>-<commit>.json`` (and a copy under ``$OUT`` when set), written after
every family; the markdown table is printed last. ``benchmarks/report.py`` turns JSONs into BENCHMARKS.md.
Depends only on torch, triton, transformers and the stdlib (plus moecomp from this repository).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import inspect
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):  # report.py, layer/ (the parts) and moecomp (this checkout) without installing anything
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py)
from layer import common, fp8, fp8_paths  # noqa: E402
# The parts, under the names this script always had (tests, diag scripts and bench_generate import them from here).
from layer.breakdown import (BREAKDOWN_NAME_CHARS, BREAKDOWN_PATHS, BREAKDOWN_REPS,  # noqa: E402,F401
                             FP8_BREAKDOWN_PATHS, _device_rows, parse_breakdown, profile_breakdown, run_breakdowns)
from layer.cli import parse_args, resolve_peers, result_header  # noqa: E402
from layer.checks import (bad_token_frac, check_output, check_record, rel_err, rel_err_rows,  # noqa: E402,F401
                          routing_ambiguous)
from layer.common import (ALL_PEERS, ALL_TOKENS, CORRECTION_BIAS_STD, DTYPES, FP8_PATHS, FP8_PEERS,  # noqa: E402,F401
                          GRAPH_CONSISTENCY_TOL, INIT_STD, PEER_ALIASES, TINY_TOKENS, FatalCudaError, cuda_healthy,
                          default_tolerance, dtype_name, log, policy, set_dtype)
from layer.common import resolve as _resolve, root_msg as _root_msg  # noqa: E402,F401
from layer.env import _slug, environment, git_commit, peer_hygiene, save as _save  # noqa: E402,F401
from layer.families import (FAMILIES, FAMILY_ALIASES, GRID_FAMILIES, BlockRefused, Family,  # noqa: E402,F401
                            block_spec, build_block,
                            family_label, set_experts_impl)
from layer.floors import achieved_of, floor_of  # noqa: E402
from layer.logs import cell_line as _cell_line, print_notes as _print_notes  # noqa: E402
from layer.optimize import run_optimize_path as _run_optimize_path  # noqa: E402
from layer.peers import (VLLM_INSTALLED_MODULE, hf_router, load_vllm_peer, make_vllm_fn,  # noqa: E402,F401
                         routing_fn, torch_shared_expert, vllm_unsupported)
from layer.routing import (PLANT_CHOSEN, PLANT_OTHER_STD, ROUTING_METHOD, ROUTING_MODES,  # noqa: E402,F401
                           ZIPF_EXPONENT, RoutingPlan, plant_router, planted_input, router_rows, routing_stats,
                           same_sets)
from layer.timing import Path, Timer, measure_ceilings, run_path, time_graph  # noqa: E402,F401


def __getattr__(name):  # ``bench_moe.DTYPE``: the run's dtype lives in layer.common (``set_dtype`` sets it)
    if name == "DTYPE":
        return common.DTYPE
    raise AttributeError(f"module 'bench_moe' has no attribute {name!r}")


# =================================================================================================== run
@dataclasses.dataclass
class Run:
    """One run's settings and state, shared by the steps below."""
    args: argparse.Namespace
    argv: list | None
    device: torch.device
    fams: list
    peers: list
    tokens: list
    timer: Timer
    bd_cells: list
    bd_missing: list
    t_start: float = dataclasses.field(default_factory=time.perf_counter)
    vllm_fused: object = None
    vllm_info: dict = dataclasses.field(default_factory=lambda: dict(requested=False))
    vllm_named: bool = False
    sgmm_why: str | None = None
    ceilings: dict | None = None
    result: dict | None = None
    out_json: str | None = None
    fatal: str | None = None
    skipped: list = dataclasses.field(default_factory=list)
    pending_bd: list = dataclasses.field(default_factory=list)  # (family, cell, x, [(path, fn, prepare)])

    @property
    def fp8(self) -> bool:
        return self.args.dtype == "fp8"

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t_start > self.args.budget_s


@dataclasses.dataclass
class Fam:
    """One family's block, spec, paths and what its cells keep."""
    fam: Family
    fi: int
    frec: dict
    cfg: object = None
    block: object = None
    spec: object = None
    tensors: dict | None = None
    spec_err: str | None = None
    router_mod: object = None
    plan: RoutingPlan | None = None
    fb: fp8.Fp8Block | None = None
    fb_err: str | None = None
    compiled: object = None
    paths: list = dataclasses.field(default_factory=list)
    saved: list = dataclasses.field(default_factory=list)  # --via-optimize: (cell, x, ref, amb)
    gen: torch.Generator | None = None


def run(argv=None) -> dict:
    """Run the benchmark; returns the result dict (also saved as JSON). The table is printed last."""
    args = parse_args(argv, __doc__)
    prev = set_dtype(DTYPES[args.dtype])
    mode_before = os.environ.get(fp8.MODE_ENV)
    try:
        return _run(args, argv)
    finally:
        set_dtype(prev)
        fp8_paths.set_mode(mode_before)


def _run(args, argv) -> dict:
    ctx = _setup(args, argv)
    for fi, fname in enumerate(ctx.fams):
        if ctx.fatal:
            break
        _run_family(ctx, fi, fname)
    result, out_json = ctx.result, ctx.out_json
    if ctx.pending_bd and not ctx.fatal:
        ctx.fatal = run_breakdowns(ctx.pending_bd, ctx.device, result, out_json, profile=profile_breakdown)
    ctx.pending_bd = None
    result["total_wall_s"] = round(time.perf_counter() - ctx.t_start, 1)
    result["skipped_over_budget"] = ctx.skipped
    if ctx.skipped:
        log(f"[bench] over the {args.budget_s:g} s budget, skipped: {', '.join(ctx.skipped)}")
    if ctx.fp8:
        result["fp8"]["summary"] = report.fp8_summary(result)
    _save(result, out_json)
    _print_notes(result)
    if out_json:
        log(f"[bench] JSON: {out_json}" + (" (copy in $OUT)" if os.environ.get("OUT") else ""))
    log(f"[bench] total {result['total_wall_s']} s\n")
    log(report.render_table(result))
    return result


def _setup(args, argv) -> Run:
    if args.tol is None:
        args.tol = default_tolerance(common.DTYPE)
    if args.fp8_tol is None:
        args.fp8_tol = fp8.FP8_TOLERANCE
    if args.moecomp_backend:
        os.environ["MOECOMP_CUDA_BACKEND"] = args.moecomp_backend
    import moecomp  # noqa: F401  (registers torch.ops.moecomp.*)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fams = (list(GRID_FAMILIES) if args.families in ("all", "") else
            _resolve(args.families, FAMILIES, FAMILY_ALIASES, "family"))
    peers = resolve_peers(args.peers, args.dtype == "fp8")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TINY_TOKENS if args.tiny else ALL_TOKENS)
    ctx = Run(args, argv, device, fams, peers, tokens, Timer(device, args.quick), *parse_breakdown(args.breakdown,
                                                                                                   fams, tokens))
    _load_vllm(ctx)
    if ctx.fp8 and "scaled_grouped_mm" in peers:
        ctx.sgmm_why = fp8_paths.sgmm_probe(device)
        if ctx.sgmm_why:
            log(f"[bench] scaled_grouped_mm not timed: {ctx.sgmm_why}")
    env = environment(device)
    commit = git_commit()
    now = datetime.datetime.now(datetime.timezone.utc)
    full_run = (fams == list(GRID_FAMILIES) and args.peers in ("all", "") and tokens == list(ALL_TOKENS)
                and not args.quick and not args.tiny and not args.no_graph and args.routing == "real")
    suffix = "" if full_run else ("-tiny" if args.tiny else "-partial")
    if args.routing != "real":
        suffix = f"-{args.routing}{suffix}"
    if args.dtype != "bf16":
        suffix = f"-{args.dtype}{suffix}"
    short = "unknown" if commit == "unknown" else commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    gpu_slug = _slug(env["gpu"]) if device.type == "cuda" else "cpu"
    ctx.out_json = None if args.no_save else (
        args.out_json or os.path.join(HERE, "results", f"{gpu_slug}-{now:%Y%m%d}-{short}{suffix}.json"))

    log(f"[bench] {env['gpu']} | torch {env['torch']} triton {env['triton']} transformers {env['transformers']} | "
        f"commit {commit} | families {fams} | T {tokens} | peers {peers} | routing {args.routing} | "
        f"dtype {args.dtype} (tol {args.tol:.3g}" + (f", fp8 tol {args.fp8_tol:.3g})" if ctx.fp8 else ")"))
    if ctx.bd_missing:
        log(f"[bench] --breakdown: not in this run (families x T), ignored: {', '.join(ctx.bd_missing)}")
    if ctx.vllm_fused is not None:
        log(f"[bench] vllm peer: {ctx.vllm_info['source']}"
            + (" (Triton interpreter, fp32: a smoke run, its times mean nothing)" if device.type != "cuda" else "")
            + (" -- UNTUNED on this GPU: the copy ships no configs for it, vLLM's defaults run"
               if ctx.vllm_info.get("tuned_here") is False else ""))
    ctx.ceilings = ceilings = measure_ceilings(device, ctx.timer)
    log(f"[bench] ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
        f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({ceilings['matmul_size']}^3 "
        f"{ceilings['matmul_dtype']})")
    if ctx.fp8:
        ceilings.update(fp8.measure_fp8_ceiling(device, ctx.timer))
        r = ceilings.get("fp8_matmul_flops_per_s")
        log(f"[bench] fp8 matmul: {r / 1e12:.1f} TFLOP/s ({ceilings['fp8_matmul_note']})" if r else
            f"[bench] fp8 matmul: {ceilings['fp8_matmul_note']}")
    ctx.result = result_header(ctx, env, commit, now)
    _save(ctx.result, ctx.out_json)
    return ctx


def _load_vllm(ctx: Run) -> None:
    args = ctx.args
    if not any(p in ctx.peers for p in ("vllm", "vllm_fp8")):
        return
    fused, info = load_vllm_peer(args.vllm_peer, ctx.device)
    named = args.vllm_peer is not None or args.peers not in ("all", "")
    info["requested"] = named
    if fused is None:
        log(f"[bench] vllm peer not timed: {info['error']}")
        if not named and "vllm" in ctx.peers:  # not asked for by name: leave it out (the table keeps PEERS.md's)
            ctx.peers.remove("vllm")
    elif ctx.fp8:
        info["fp8_block"] = "use_fp8_w8a8" in inspect.signature(fused).parameters
    ctx.vllm_fused, ctx.vllm_info, ctx.vllm_named = fused, info, named




# ============================================================================================== families
def _run_family(ctx: Run, fi: int, fname: str) -> None:
    fam, args, device = FAMILIES[fname], ctx.args, ctx.device
    if ctx.over_budget():
        ctx.skipped += [f"{fname}:{T}" for T in ctx.tokens]
        return
    t_fam = time.perf_counter()
    frec: dict = dict(name=fam.name, label=fam.label, hf_class=f"{fam.module}.{fam.block_cls}", cells=[], errors=[])
    ctx.result["families"].append(frec)
    st = Fam(fam, fi, frec)
    try:
        _prepare_family(ctx, st)
        for T in ctx.tokens:
            if ctx.over_budget():
                ctx.skipped.append(f"{fname}:{T}")
                continue
            _run_cell(ctx, st, T)
        if args.via_optimize:
            _run_optimize_path(st.block, st.saved, ctx.timer, args, device, frec)
            _save(ctx.result, ctx.out_json)
    except FatalCudaError as e:
        ctx.fatal = ctx.result["fatal"] = str(e)
        frec["errors"].append(f"FATAL: {ctx.fatal}")
        log(f"[bench] FATAL CUDA error, stopping: {ctx.fatal}")
    except Exception as e:
        frec["errors"].append(_root_msg(e, 300))
        log(f"[bench] {fam.name}: {_root_msg(e, 300)}")
        if args.verbose:
            traceback.print_exc()
        if not cuda_healthy(device):
            ctx.fatal = ctx.result["fatal"] = f"{fam.name}: {_root_msg(e)}"
    finally:
        frec["wall_s"] = round(time.perf_counter() - t_fam, 1)
        st.__dict__.clear()  # the block, its fp8 copy, the paths: freed before the next family is built
        st = None
        try:
            torch._dynamo.reset()
        except Exception:
            pass
        gc.collect()
        if device.type == "cuda" and not ctx.fatal:
            torch.cuda.empty_cache()
    log(f"[bench] {fam.name} done in {frec['wall_s']} s (total {time.perf_counter() - ctx.t_start:.0f} s)")
    _save(ctx.result, ctx.out_json)


def _prepare_family(ctx: Run, st: Fam) -> None:
    """Build the block, recognise it, plant the routing, quantize it (fp8), and set up its paths."""
    args, device, fam, frec, fi = ctx.args, ctx.device, st.fam, st.frec, st.fi
    t0 = time.perf_counter()
    st.cfg, st.block = build_block(fam, args.tiny, device, args.seed + 1000 * fi, fp8=ctx.fp8)
    frec["build_s"] = round(time.perf_counter() - t0, 2)
    frec["config"] = {k: getattr(st.cfg, k, None) for k in sorted(fam.full)}
    frec["recognised"] = rec = {}
    try:  # the spec and tensors moecomp.optimize would use for this block: no spec of the benchmark's own
        from moecomp.ops.moe_op import check_args

        spec, tensors = block_spec(st.block, rec)
        frec["label"] = family_label(fam, spec)
        frec["spec"] = spec.key
        frec["spec_describe"] = spec.describe()
        check_args(torch.empty(1, spec.hidden_size, device=device, dtype=common.DTYPE), tensors, spec)
        st.spec, st.tensors = spec, tensors
    except BlockRefused as e:  # loud, and no moecomp timing: the benchmark has no spec to fall back to
        st.spec_err = str(e)
        frec["errors"].append(f"spec: {st.spec_err}")
        log(f"[bench] !!!!! {fam.name}: {st.spec_err}")
    except Exception as e:
        st.spec_err = _root_msg(e)
        frec["errors"].append(f"spec: {st.spec_err}")
        log(f"[bench] !!!!! {fam.name}: no spec ({st.spec_err})")
    spec = st.spec
    if spec is not None:  # the block's own router module: for the vllm paths and to check the ids
        st.router_mod, note = hf_router(st.block, rec.get("bindings"), spec, device)
        frec["hf_router"] = note if st.router_mod is not None else None
        if any(p in ctx.peers for p in ("vllm", "vllm_fp8", "scaled_grouped_mm")):
            frec["vllm_router"] = (f"HF router module {note!r}" if st.router_mod is not None else
                                   f"moecomp.oracle.reference.route on the recognised spec ({note})")
    if args.routing != "real":
        if spec is None:
            raise RuntimeError(f"--routing {args.routing} needs the recognised router weight ({st.spec_err})")
        plant_router(st.tensors, spec, args.seed + 1000 * fi + 11)
        st.plan = RoutingPlan(args.routing, spec, args.seed + 1000 * fi + 13)
        frec["routing_plan"] = st.plan.describe()
    if ctx.fp8:
        st.fb_err = st.spec_err
        if spec is not None:
            try:
                st.fb = fp8.quantize_block(spec, st.tensors)
                frec["fp8"] = st.fb.describe()
            except Exception as e:
                st.fb_err = _root_msg(e, 300)
                frec["errors"].append(f"fp8: {st.fb_err}")
                log(f"[bench] !!!!! {fam.name}: no fp8 block ({st.fb_err})")
    st.paths = _build_paths(ctx, st)
    st.gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * fi + 7)


def _build_paths(ctx: Run, st: Fam) -> list[Path]:
    peers, block, cfg, spec, tensors = ctx.peers, st.block, st.cfg, st.spec, st.tensors
    paths: list[Path] = []
    if ctx.fp8:
        paths += fp8_paths.family_paths(spec, st.fb, st.fb_err, st.router_mod, peers, ctx.vllm_fused,
                                        ctx.vllm_info, ctx.vllm_named, ctx.sgmm_why, ctx.device)
    else:
        if "hf_eager" in peers:
            paths.append(Path("hf_eager", block, lambda b=block, c=cfg: set_experts_impl(b, c, "eager")))
        if "hf_grouped_mm" in peers:
            paths.append(Path("hf_grouped_mm", block, lambda b=block, c=cfg: set_experts_impl(b, c, "grouped_mm")))
        if "compile" in peers:
            torch._dynamo.reset()
            set_experts_impl(block, cfg, "grouped_mm")
            st.compiled = torch.compile(block, dynamic=True)
            paths.append(Path("compile", st.compiled, lambda b=block, c=cfg: set_experts_impl(b, c, "grouped_mm")))
        if "vllm" in peers:
            if ctx.vllm_fused is None:
                paths.append(Path("vllm", None, error=f"vLLM peer not loaded: {ctx.vllm_info.get('error')}"))
            elif spec is None:
                paths.append(Path("vllm", None, skip=f"no spec to run it from ({st.spec_err})"))
            elif why := vllm_unsupported(spec, tensors):
                paths.append(Path("vllm", None, skip=why))
                log(f"[bench] {st.fam.name}: vllm peer skipped: {why}")
            else:
                cd = common.DTYPE if ctx.device.type == "cuda" else torch.float32  # the interpreter: fp32 only
                paths.append(Path("vllm", make_vllm_fn(ctx.vllm_fused, spec, tensors, st.router_mod, cd)))
    if "moecomp" in peers:
        if spec is not None:
            from moecomp.core.args import MOE_ARGS

            op, key, H = torch.ops.moecomp.moe_forward, spec.key, spec.hidden_size

            def moecomp_fn(x, _op=op, _a=tuple(tensors[n] for n in MOE_ARGS), _k=key, _H=H):
                return _op(x.view(-1, _H), *_a, _k).view(x.shape)

            paths.append(Path("moecomp", moecomp_fn, note="bf16, the block unquantized" if ctx.fp8 else None))
        else:
            paths.append(Path("moecomp", None))
    return paths


# ================================================================================================= cells
def _run_cell(ctx: Run, st: Fam, T: int) -> None:
    """One family x T: the input, the HF reference, routing and floor, every path (checked, then timed), the
    verdicts; the cell is saved as soon as it is done."""
    args, fam, spec = ctx.args, st.fam, st.spec
    t_cell = time.perf_counter()
    cell: dict = dict(T=T, paths={})
    st.frec["cells"].append(cell)
    planned = None
    if st.plan is not None:  # synthetic routing: draw the ids, plant them through the router
        planned = st.plan.ids(T)
        x = planted_input(planned, st.tensors, spec, st.gen, ctx.device, common.DTYPE)
    else:
        x = torch.randn(1, T, st.cfg.hidden_size, device=ctx.device, dtype=common.DTYPE, generator=st.gen)
    with torch.no_grad():
        ref, ref_path = None, None
        for impl in ("eager", "grouped_mm"):  # the HF block itself (per-expert loop first)
            try:
                set_experts_impl(st.block, st.cfg, impl)
                ref, ref_path = st.block(x), f"hf_{impl}"
                break
            except Exception as e:
                cell.setdefault("ref_errors", []).append(f"{impl}: {_root_msg(e)}")
                if not cuda_healthy(ctx.device):
                    raise FatalCudaError(f"HF reference: {_root_msg(e)}") from e
        cell["ref_path"] = ref_path
        amb = _cell_routing(ctx, st, cell, x, planned) if spec is not None else None
        if (not args.tiny and args.routing == "real" and args.dtype == "bf16"  # PEERS.md: bf16
                and fam.name in report.PEERS_MD and T in report.PEERS_MD[fam.name]):
            cell["peers_md"] = report.peers_md_ref(fam.name, T)
        fchecks = _fp8_checks(ctx, st, cell, x, ref, amb) if ctx.fp8 and st.fb is not None and ref is not None else {}
        for p in st.paths:
            if ref is None:
                cell["paths"][p.name] = dict(error="no HF reference output", best_ms=None)
            elif p.fn is None:
                cell["paths"][p.name] = (dict(skipped=p.skip, best_ms=None) if p.skip else
                                         dict(error=p.error or f"spec: {st.spec_err}", best_ms=None))
            elif p.check != "hf" and p.check not in fchecks:
                cell["paths"][p.name] = dict(error="no fp8 reference in this cell", best_ms=None)
            else:
                kw = dict(check=fchecks[p.check]) if p.check != "hf" else {}
                pr = cell["paths"][p.name] = run_path(p, x, ref, ctx.timer, args, ctx.device, args.tol, amb, **kw)
                if p.check != "hf":
                    fp8_paths.set_mode(None)  # (MOECOMP_FP8_MODE only for the path that set it)
                if p.note:
                    pr["note"] = p.note
                if p.name in ("vllm", "vllm_fp8") and ctx.device.type != "cuda":
                    pr["compute_dtype"] = "float32 (Triton interpreter)"
        _cell_verdicts(ctx, st, cell, ref_path)
        if (fam.name, T) in ctx.bd_cells:  # profiled after every timing of the run (keeps x and the fns)
            _queue_breakdown(ctx, st, cell, x)
        if args.via_optimize and ref is not None:
            st.saved.append((cell, x, ref, amb))
    cell["wall_s"] = round(time.perf_counter() - t_cell, 2)
    log(_cell_line(fam.name, cell))
    _save(ctx.result, ctx.out_json)


def _cell_routing(ctx: Run, st: Fam, cell: dict, x, planned) -> torch.Tensor:
    """The routing moecomp's spec takes on x: the floor (fp8: of the fp8 block, the bf16 one beside it), the tokens
    with an ambiguous routing (returned), the routing statistics and how the planted / HF routers agree."""
    from moecomp.oracle import reference
    from moecomp.ops.common import split_fused_gate

    spec, tensors, H, T = st.spec, st.tensors, st.spec.hidden_size, x.shape[1]
    rt = split_fused_gate(tensors, spec)  # (router rows only, should a spec ever fuse the gate)
    logits = reference.router_logits(x.view(-1, H), rt["router_w"], rt["router_b"], spec)
    _, ids = reference.route(logits, tensors.get("correction_bias"), spec)
    fl = floor_of(spec, T, ids, tensors, ctx.ceilings)
    if st.fb is not None:
        cell["floor_bf16"] = dict(fl)
        fl = floor_of(st.fb.spec, T, ids, st.fb.tensors, ctx.ceilings, st.fb.scales, fp8.rate_key(ctx.ceilings))
    cell["floor_ms"] = fl.pop("floor_ms")
    cell["floor"] = fl
    amb = routing_ambiguous(logits, tensors.get("correction_bias"), spec, spec.router_fp32)
    cell["ambiguous_tokens"] = int(amb.sum().item())
    rrec = dict(mode=ctx.args.routing, **routing_stats(ids, spec.num_experts))
    if planned is not None:  # the router picks the drawn experts (so does every path)
        rrec["planned_match"] = float(same_sets(ids, planned).float().mean())
        if rrec["planned_match"] < 1.0:
            log(f"[bench] !!!!! {st.fam.name} T={T}: the router picks the drawn experts for only "
                f"{rrec['planned_match']:.1%} of the tokens")
    if st.router_mod is not None:  # HF's own router module: the same ids?
        hids = st.router_mod(x.view(-1, H))[2]
        rrec["hf_router_match"] = float(same_sets(hids, ids).float().mean())
    cell["routing"] = rrec
    return amb


def _fp8_checks(ctx: Run, st: Fam, cell: dict, x, ref, amb) -> dict:
    """--dtype fp8: the cell's dequantized references, the quantization error (w8a8 reference vs the bf16 HF
    block), and the check of each fp8 path (``Path.check`` -> out -> verdict)."""
    x2, tol = x.view(-1, st.spec.hidden_size), ctx.args.fp8_tol
    refs = fp8.references(x2, st.fb)
    cell["quant_error"] = fp8.quant_error(refs, ref, amb)
    checks = {n: (lambda out, m=m: fp8.fp8_check(out, refs, amb, tol, m)) for n, m in fp8.MODES.items()}
    vtol = tol if ctx.device.type == "cuda" else max(tol, fp8.FP8_INTERPRET_TOLERANCE)  # (the interpreter's cast)
    checks["vllm_fp8"] = lambda out: fp8.fp8_check(out, refs, amb, vtol, "w8a8", either=False)
    if any(p.check == "scaled_grouped_mm" and p.fn is not None for p in st.paths):
        rref = fp8_paths.sgmm_reference(x2, st.spec, st.fb, st.router_mod)
        checks["scaled_grouped_mm"] = lambda out: dict(
            check_output(out.reshape(rref.shape), rref, amb, tol, key="rel_err_vs_ref"), tolerance=tol,
            against="row-wise dequantized reference (per-channel weight, per-token activation scales)")
    return checks


def _cell_verdicts(ctx: Run, st: Fam, cell: dict, ref_path) -> None:
    """The checks of moecomp and the vLLM peer against the HF block, the fp8 paths' against the dequantized
    references (loud on failure), the achieved rates and, in fp8, the ratios and targets."""
    args, name, T = ctx.args, st.fam.name, cell["T"]
    g = cell["paths"].get("hf_grouped_mm", {}).get("rel_err_vs_hf")
    for pname, key, who in (("moecomp", "check", "moecomp"), ("vllm", "check_vllm", "vLLM peer")):
        pr = cell["paths"].get(pname)
        if pr is None or "skipped" in pr:
            continue
        chk = cell[key] = check_record(pr, args.tol, ref_path, g)
        if not chk["ok"]:
            log(f"[bench] !!!!! CORRECTNESS FAILURE {name} T={T}: {who} vs {ref_path} "
                f"rel err {chk['rel_err']} (tol {args.tol}) {chk.get('error', '')}")
    if ctx.fp8:
        cf = cell["check_fp8"] = {}
        for pname, pr in cell["paths"].items():
            if pname not in FP8_PATHS or "skipped" in pr:
                continue
            chk = cf[pname] = fp8.check_of(pr, args.fp8_tol)
            if not chk["ok"]:
                log(f"[bench] !!!!! CORRECTNESS FAILURE {name} T={T}: {pname} vs the dequantized reference rel err "
                    f"{chk['rel_err']} (tol {chk['tolerance']}) {chk.get('error', '')}")
            elif chk.get("mode_honoured") is False and fp8.MODES.get(pname):
                log(f"[bench] !!!!! {name} T={T}: {pname} computed {chk['ran']}, not the forced "
                    f"{fp8.MODES[pname]} ({fp8.MODE_ENV} not honoured on this path)")
        cell["fp8_ratios"] = report.fp8_cell_ratios(cell)
    if cell.get("floor"):
        def floor_for(pn):  # moecomp bf16 in an fp8 run: its own (bf16) floor
            return cell["floor_bf16"] if pn == "moecomp" and "floor_bf16" in cell else cell["floor"]

        cell["achieved"] = {pn: a for pn, pr in cell["paths"].items()
                            if (a := achieved_of(floor_for(pn), pr.get("best_ms"), ctx.ceilings))}


def _queue_breakdown(ctx: Run, st: Fam, cell: dict, x) -> None:
    todo, names = [], FP8_BREAKDOWN_PATHS if ctx.fp8 else BREAKDOWN_PATHS
    for p in st.paths:
        pr = cell["paths"].get(p.name)
        if p.name not in names or pr is None:
            continue
        if p.fn is not None and pr.get("best_ms") is not None:
            todo.append((p.name, p.fn, p.prepare))
        else:
            cell.setdefault("breakdown", {})[p.name] = dict(skipped="no timing in this cell")
    ctx.pending_bd.append((st.fam.name, cell, x, todo))


def main(argv=None) -> int:
    res = run(argv)
    bad = [c for f in res["families"] for c in f["cells"] if c.get("check") and not c["check"].get("ok")]
    bad += [c for f in res["families"] for c in f["cells"]  # the moecomp fp8 paths' checks (not the peers')
            for n, chk in (c.get("check_fp8") or {}).items() if n in fp8.MODES and not chk.get("ok")]
    refused = [f["name"] for f in res["families"] if f.get("recognised", {}).get("refused")]
    if res.get("fatal"):
        return 2
    if refused:  # 3: moecomp's recogniser refused a family's block (reason code in the log and the JSON)
        log(f"[bench] moecomp refused the block of: {', '.join(refused)}")
        return 3
    return 1 if bad else 0  # 1: a correctness check failed (see the table)


if __name__ == "__main__":
    sys.exit(main())
