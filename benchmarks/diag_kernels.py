#!/usr/bin/env python3
"""Kernel-level diagnostics of the op on one GPU, on the layer presets (``moecomp.testing.LAYER_PRESETS``), one table
per part. Times are CUDA-graph replays (``moecomp.cli.tune.bench_graph``: ``do_bench`` medians, L2 flushed), in us.

    route   the routing kernel alone: tokens per program x warps (x the 3-D group form on grouped routers), per T
    pdl     the whole op (moe_forward) at small T with programmatic dependent launch off / signalled at each
            kernel's start / signalled after the GEMMs' main loops (MOECOMP_PDL=0 / early / the default) / as the
            default, but the aligned path keeps PDL beside the shared experts' side stream (side); a "/seq" suffix
            runs the shared experts in line
    split   the op's kernels under torch.profiler at the given cells (per call, us), with the GEMMs' TFLOP/s
    router  the router GEMM at small T: our GEMV kernel (``kernels/router.py``) against linear (cuBLAS), alone and
            as part of the whole op (moe_forward), per preset and T (MOECOMP_ROUTER_GEMV_MAX_T = 1 << 30 / 0)
    route_ab  the routing kernel (default launch shape) against another version of ``kernels/routing.py``
            (``--route-ab FILE``, e.g. the previous commit's), per preset and T, alone and inside the whole op; checks
            that both give the same ids and weights bit for bit
    tma     gemm1 / gemm2 of the table's config against TMA tiles (``kernels/grouped_gemm_tma.py``) and the pointer
            kernels, at the table's BLOCK_M, per cell, checked against the table config's output

    PYTHONPATH=. python3 benchmarks/diag_kernels.py --parts route,pdl,split --split mixtral_8x7b:8192,qwen3_30b_a3b:8192
    PYTHONPATH=. python3 benchmarks/diag_kernels.py --parts tma --tma mixtral_8x7b:8192

Prints the tables and writes them as JSON (``--out-json``). A diagnostic, not the benchmark: bench_moe.py is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.testing import LAYER_PRESETS, random_moe_args
from moecomp.cli.tune import bench_graph

ROUTE_TILES = [(1, 1), (1, 2), (1, 4), (2, 2), (4, 4), (8, 4), (16, 4), (16, 8)]  # (block_t, num_warps)


def log(msg: str) -> None:
    print(msg, flush=True)


def _inputs(spec, T, dev, seed=0):
    args = random_moe_args(spec, T, torch.bfloat16, dev, std=0.02, seed=seed)
    return args[0], dict(zip(MOE_ARGS, args[1:]))


def _cells(presets, tokens, dev):
    """(name, spec, T, x, named args) for every preset x T, the inputs drawn per cell."""
    for name in presets:
        spec = LAYER_PRESETS[name]
        for T in tokens:
            yield (name, spec, T, *_inputs(spec, T, dev))


def part_route(presets, tokens, dev, rep) -> list:
    rows = []
    for name, spec, T, x, args in _cells(presets, tokens, dev):
        forms = [True, False] if spec.n_group > 1 else [False]
        logits, _ = triton_moe.router_logits(x, args, spec)
        ref_ids, ref_w = triton_moe.route(logits, args["correction_bias"], spec, x.dtype,
                                          tiles=dict(block_t=1, num_warps=4, group_3d=False))
        default = triton_moe.route_tiles(T, spec.num_experts, spec.n_group)
        cells = {}
        for g3 in forms:
            for bt, nw in ROUTE_TILES:
                if bt > 1 and bt > triton_moe.triton.next_power_of_2(T):
                    continue
                tiles = dict(block_t=bt, num_warps=nw, group_3d=g3)
                ids, w = triton_moe.route(logits, args["correction_bias"], spec, x.dtype, tiles=tiles)
                # weights within bf16 rounding (round_weights: a last-bit fp32 difference can flip a bf16 ulp)
                same = torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-2, atol=1e-6)
                us = bench_graph(lambda: triton_moe.route(logits, args["correction_bias"], spec, x.dtype,
                                                          tiles=tiles), rep, dev) * 1e3
                cells[f"{bt}x{nw}{'g3' if g3 else ''}"] = dict(us=us, same=same)
        best = min(cells, key=lambda c: cells[c]["us"])
        d = f"{default['block_t']}x{default['num_warps']}{'g3' if default['group_3d'] else ''}"
        rows.append(dict(preset=name, T=T, cells=cells, best=best, default=d))
        bad = [c for c, v in cells.items() if not v["same"]]
        log(f"[route] {name:16s} T={T:5d} default {d:8s} {cells.get(d, {}).get('us', float('nan')):8.1f}  best "
            f"{best:8s} {cells[best]['us']:8.1f}  | " + " ".join(f"{c}={v['us']:.1f}" for c, v in cells.items())
            + (f"  MISMATCH {bad}" if bad else ""))
    return rows


def _load_routing(path: str):
    """A routing module from a file (a copy of ``moecomp/kernels/routing.py``, its relative imports made absolute)."""
    import importlib.util

    src = open(path).read().replace("from . import pdl", "from moecomp.kernels import pdl")
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), "_route_ab_module.py")
    with open(tmp, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("_route_ab_module", tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def part_route_ab(presets, tokens, dev, rep, other_path: str) -> list:
    """The current routing kernel ("new") against ``other_path``'s ("old"), same launch shape, same logits."""
    new_mod, old_mod = triton_moe.routing_k, _load_routing(other_path)
    rows = []
    for name, spec, T, x, args in _cells(presets, tokens, dev):
        logits, _ = triton_moe.router_logits(x, args, spec)
        rec = {}
        for label, mod in (("old", old_mod), ("new", new_mod), ("old2", old_mod), ("new2", new_mod)):
            triton_moe.routing_k = mod
            try:
                ids, w = triton_moe.route(logits, args["correction_bias"], spec, x.dtype)
                rec[label] = dict(
                    ids=ids, w=w,
                    route_us=bench_graph(lambda: triton_moe.route(logits, args["correction_bias"], spec, x.dtype),
                                         rep, dev) * 1e3,
                    op_us=bench_graph(lambda: triton_moe.moe_forward(x, args, spec), rep, dev) * 1e3)
            finally:
                triton_moe.routing_k = new_mod
        same = torch.equal(rec["old"]["ids"], rec["new"]["ids"]) and torch.equal(rec["old"]["w"], rec["new"]["w"])
        row = dict(preset=name, T=T, same_bits=same,
                   **{f"{lb}_{k}": v[k] for lb, v in rec.items() for k in ("route_us", "op_us")})
        rows.append(row)
        log(f"[route_ab] {name:16s} T={T:5d} route old {row['old_route_us']:6.1f}/{row['old2_route_us']:6.1f} "
            f"new {row['new_route_us']:6.1f}/{row['new2_route_us']:6.1f} us | op old {row['old_op_us']:8.1f}/"
            f"{row['old2_op_us']:8.1f} new {row['new_op_us']:8.1f}/{row['new2_op_us']:8.1f} us | "
            + ("same bits" if same else "DIFFERENT ids/weights"))
    return rows


def part_pdl(presets, tokens, dev, rep, modes=("0", "early", "late")) -> list:
    """Each mode is a MOECOMP_PDL value ("late" = unset, the default; "side" = PDL on the aligned path beside the
    shared experts' side stream too); a "/seq" suffix also sets MOECOMP_NO_OVERLAP=1 (shared experts in line)."""
    rows = []
    for name, spec, T, x, args in _cells(presets, tokens, dev):
        rec = {}
        for mode in modes:
            pdl, _, seq = mode.partition("/")
            if pdl == "late":
                os.environ.pop("MOECOMP_PDL", None)
            else:
                os.environ["MOECOMP_PDL"] = pdl
            if seq:
                os.environ["MOECOMP_NO_OVERLAP"] = "1"
            out = triton_moe.moe_forward(x, args, spec)
            rec[mode] = dict(us=bench_graph(lambda: triton_moe.moe_forward(x, args, spec), rep, dev) * 1e3,
                             out=out)
            os.environ.pop("MOECOMP_PDL", None)
            os.environ.pop("MOECOMP_NO_OVERLAP", None)
        ok = all(torch.allclose(rec[m]["out"], rec[modes[0]]["out"], rtol=2e-2, atol=1e-3) for m in rec)
        rows.append(dict(preset=name, T=T, us={m: v["us"] for m, v in rec.items()}, same=ok))
        log(f"[pdl] {name:16s} T={T:4d} " + "  ".join(f"{m} {v['us']:7.1f}" for m, v in rec.items())
            + ("" if ok else "  OUTPUTS DIFFER"))
    return rows


def part_router(presets, tokens, dev, rep) -> list:
    rows = []
    for name, spec, T, x, args in _cells(presets, tokens, dev):
        rec = {}
        for label, limit in (("gemv", str(1 << 30)), ("linear", "0")):
            os.environ["MOECOMP_ROUTER_GEMV_MAX_T"] = limit
            logits = triton_moe.router_logits(x, args, spec)[0].float()
            rec[label] = dict(
                logits=logits,
                router_us=bench_graph(lambda: triton_moe.router_logits(x, args, spec), rep, dev) * 1e3,
                op_us=bench_graph(lambda: triton_moe.moe_forward(x, args, spec), rep, dev) * 1e3)
        os.environ.pop("MOECOMP_ROUTER_GEMV_MAX_T", None)
        err = ((rec["gemv"]["logits"] - rec["linear"]["logits"]).abs().max()).item()
        rows.append(dict(preset=name, T=T, max_abs_diff=err,
                         **{f"{lb}_{k}": v[k] for lb, v in rec.items() for k in ("router_us", "op_us")}))
        log(f"[router] {name:16s} T={T:4d} router: gemv {rec['gemv']['router_us']:6.1f} linear "
            f"{rec['linear']['router_us']:6.1f} us | op: gemv {rec['gemv']['op_us']:7.1f} linear "
            f"{rec['linear']['op_us']:7.1f} us | max |diff| {err:.1e}")
    return rows


def part_split(cells, dev, reps=20) -> list:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for cell in cells:
        name, T = cell.split(":")
        spec, T = LAYER_PRESETS[name], int(T)
        x, args = _inputs(spec, T, dev)
        fn = lambda: triton_moe.moe_forward(x, args, spec)  # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6 / reps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us > 0 and ev.key != "ProfilerStep*":
                per[ev.key] = per.get(ev.key, 0.0) + us / reps
        P = T * spec.top_k
        flops = {"moe_gemm1_kernel": 2 * P * spec.hidden_size * 2 * spec.intermediate_size,
                 "moe_gemm2_kernel": 2 * P * spec.hidden_size * spec.intermediate_size}
        top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
        rows.append(dict(cell=cell, wall_us=wall, kernels=dict(top),
                         tflops={k: flops[k] / (per[k] * 1e-6) / 1e12 for k in flops if k in per}))
        log(f"[split] {cell}: wall {wall:.0f} us; " + ", ".join(
            f"{k[:28]} {v:.0f}" + (f" ({flops[k] / (v * 1e-6) / 1e12:.0f} TF/s)" if k in flops else "")
            for k, v in top))
    return rows


TMA_TILES = {  # (BLOCK_N, BLOCK_K, warps, stages, warp specialisation[, gemm1: "a" = x gathered and read by TMA])
    "g1": [(128, 64, 8, 3, False), (128, 64, 8, 4, False), (64, 64, 4, 4, False), (128, 64, 8, 3, True, "a"),
           (128, 64, 8, 4, True, "a"), (128, 64, 8, 3, False, "a")],
    "g2": [(256, 64, 8, 3, True), (128, 64, 8, 4, True), (128, 128, 8, 3, True), (256, 64, 8, 4, True),
           (128, 64, 4, 4, True), (256, 64, 8, 3, False)],
}


def part_tma(cells, dev, rep, gemms=("g1", "g2")) -> list:
    from moecomp.ops import tuning
    from moecomp.cli.tune import _rel

    rows = []
    for cell in cells:
        name, T = cell.split(":")
        spec, T = LAYER_PRESETS[name], int(T)
        x, args = _inputs(spec, T, dev)
        logits, _ = triton_moe.router_logits(x, args, spec)
        ids, w = triton_moe.route(logits, args["correction_bias"], spec, x.dtype)
        k, P = spec.top_k, T * spec.top_k
        cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, k, x.dtype, dev)
        bm = cfg["BLOCK_M"]
        aligned = triton_moe.align(ids, spec.num_experts, bm)
        flops = dict(g1=2 * P * spec.hidden_size * 2 * spec.intermediate_size,
                     g2=2 * P * spec.hidden_size * spec.intermediate_size)
        rec = dict(cell=cell, BLOCK_M=bm, g1={}, g2={})
        real = (aligned[0] < P) & (torch.arange(aligned[0].numel(), device=dev) < aligned[2])
        h = triton_moe.gemm1(x, args["w13"], args["b13"], spec, aligned, k, bm, cfg["g1"])
        for which in gemms:
            def run(c):
                if which == "g1":
                    return triton_moe.gemm1(x, args["w13"], args["b13"], spec, aligned, k, bm, c)
                return triton_moe.gemm2(h, args["w2"], args["b2"], w, spec, aligned, P, bm, c)
            ref = run(cfg[which])
            ref = ref[real] if which == "g1" else ref  # gemm1 writes real rows only: compare those
            pointer = {kk: v for kk, v in cfg[which].items() if kk not in ("tma", "tma_a", "ws")}
            cands = [("table", cfg[which]), ("pointer", pointer)] + [
                (f"tma{'-a' if rest else ''} {bn}x{bk}/w{nw}s{ns}{' ws' if ws else ''}",
                 dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=nw, num_stages=ns, tma=1, ws=ws,
                      tma_a=bool(rest)))
                for bn, bk, nw, ns, ws, *rest in TMA_TILES[which]]
            for label, c in cands:
                try:
                    out = run(c)
                    torch.cuda.synchronize()
                    err = _rel(out[real] if which == "g1" else out, ref)
                    us = bench_graph(lambda c=c: run(c), rep, dev) * 1e3
                except Exception as e:  # out of shared memory / registers for this tile
                    rec[which][label] = dict(error=type(e).__name__)
                    continue
                rec[which][label] = dict(us=us, tflops=flops[which] / (us * 1e-6) / 1e12, err=err)
            ok = {lb: v for lb, v in rec[which].items() if "us" in v and v["err"] < 1e-2}
            best = min(ok, key=lambda lb: ok[lb]["us"])
            t0 = rec[which]["table"]["us"]
            log(f"[tma] {cell:22s} BM={bm:3d} {which}: table {t0:8.1f} us ({rec[which]['table']['tflops']:.0f} TF/s)"
                f"  best {best} {ok[best]['us']:8.1f} ({ok[best]['tflops']:.0f} TF/s, {t0 / ok[best]['us']:.2f}x)  | "
                + " ".join(f"[{lb}: " + (f"{v['us']:.0f}" + (f" ERR {v['err']:.1e}" if v['err'] >= 1e-2 else "")
                                         if "us" in v else v["error"]) + "]" for lb, v in rec[which].items()))
        rows.append(rec)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="route,pdl,split")
    ap.add_argument("--presets", default=",".join(LAYER_PRESETS))
    ap.add_argument("--route-tokens", default="1,16,128,8192")
    ap.add_argument("--route-ab", default=None, help="route_ab part: the other routing.py to time against")
    ap.add_argument("--route-ab-tokens", default="1,16,1024,8192")
    ap.add_argument("--pdl-tokens", default="1,2,16")
    ap.add_argument("--pdl-modes", default="0,early,late",
                    help="MOECOMP_PDL values (late = the default; side; a /seq suffix: shared experts in line)")
    ap.add_argument("--router-tokens", default="1,2,4,8,16,32")
    ap.add_argument("--split", default="mixtral_8x7b:8192,qwen3_30b_a3b:8192,olmoe_1b_7b:1024")
    ap.add_argument("--tma", default="mixtral_8x7b:1024,mixtral_8x7b:8192,qwen3_30b_a3b:1024,qwen3_30b_a3b:8192,"
                    "olmoe_1b_7b:1024,olmoe_1b_7b:8192,qwen15_moe_a27b:1024,qwen15_moe_a27b:8192,deepseek_v3:1024,"
                    "deepseek_v3:8192")
    ap.add_argument("--tma-gemms", default="g1,g2", help="which GEMMs the tma part times (g1,g2)")
    ap.add_argument("--rep", type=float, default=10.0, help="do_bench rep (ms) per timing")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    presets = [p for p in a.presets.split(",") if p]
    parts = a.parts.split(",")
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton_moe.triton.__version__,
               commit=os.environ.get("MOECOMP_COMMIT"), date=time.strftime("%Y-%m-%d"))
    with torch.no_grad():
        if "route" in parts:
            out["route"] = part_route(presets, [int(t) for t in a.route_tokens.split(",")], dev, a.rep)
        if "route_ab" in parts:
            out["route_ab"] = part_route_ab(presets, [int(t) for t in a.route_ab_tokens.split(",")], dev, a.rep,
                                            a.route_ab)
        if "pdl" in parts:
            out["pdl"] = part_pdl(presets, [int(t) for t in a.pdl_tokens.split(",")], dev, a.rep,
                                  tuple(a.pdl_modes.split(",")))
        if "router" in parts:
            out["router"] = part_router(presets, [int(t) for t in a.router_tokens.split(",")], dev, a.rep)
        if "split" in parts:
            out["split"] = part_split([c for c in a.split.split(",") if c], dev)
        if "tma" in parts:
            out["tma"] = part_tma([c for c in a.tma.split(",") if c], dev, a.rep, a.tma_gemms.split(","))
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
