#!/usr/bin/env python3
"""The skinny routed experts (``ops/skinny_moe.py``: two GEMV launches) against the op's MMA decode path (gemm1
DIRECT + the fused down-combine, the kernel table's tiles) at decode sizes, on the five layer presets in bf16 and
in e4m3 with 128x128 block scales (weight-only on both paths at these T: the table's FP8 mode there).

Each cell times the whole ``moe_forward`` (router, routing, experts, shared expert, combine) in a CUDA graph
(``triton.testing.do_bench_cudagraph``), checks the skinny output against the MMA path's and the fp32 reference,
and sweeps a few tiles (gemm1's with the down kernel's heuristic, then the down kernel's with gemm1's best) within
the budget. Printed: a markdown table with the floor (the touched experts' weight bytes, scales and the shared
expert over 4.25 TB/s), JSON with every timing.

    PYTHONPATH=. python3 benchmarks/diag_skinny_moe.py --tokens 1,2,4,8 --out-json /tmp/skinny_moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TILES = ((4, 512, 1), (4, 1024, 1), (8, 512, 1), (8, 1024, 1), (16, 512, 1), (8, 2048, 1), (16, 256, 0))
COPY_BPS = 4.25e12


def _floor_us(spec, args, scales, ids) -> float:
    """Bytes the call must read at least (touched experts' weights + scales, shared weights, router) over the copy
    rate, in us."""
    touched = torch.unique(ids).numel()
    per = sum(t[0].numel() * t.element_size() for t in (args[4], args[6]))
    per += sum(scales[n][0].numel() * scales[n].element_size() for n in ("w13_scale", "w2_scale") if n in scales)
    other = sum(t.numel() * t.element_size() for t in (args[1], *args[8:12]) if t is not None)
    other += sum(s.numel() * s.element_size() for n, s in scales.items() if n.startswith("shared"))
    return (touched * per + other) / COPY_BPS * 1e6


def main(argv=None) -> int:
    import triton.testing as tt

    from moecomp import reference
    from moecomp.ops import skinny_moe
    from moecomp.spec import QuantSpec
    from moecomp.testing import LAYER_PRESETS, quantize_moe_args, random_moe_args, rel_err

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--presets", default=",".join(LAYER_PRESETS))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, the interpreter, a plain timer")
    a = ap.parse_args(argv)
    dev = "cpu" if a.tiny else "cuda"
    t_end = time.time() + a.budget_s
    bench = lambda: tt.do_bench_cudagraph(fn, rep=20) * 1e3  # noqa: E731
    if a.tiny:
        bench = lambda: (lambda t0: (fn(), (time.perf_counter() - t0) * 1e6)[1])(time.perf_counter())  # noqa: E731
    rows = []
    print("| preset | T | weights | floor us | MMA decode us | skinny us (heuristic) | best us | best tiles (g1; down) "
          "| best / MMA | best / floor | err vs MMA | err vs ref |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.presets.split(","):
        base = LAYER_PRESETS[name]
        if a.tiny:
            base = base.replace(num_experts=8, top_k=min(base.top_k, 4), hidden_size=128, intermediate_size=128,
                                n_group=1, topk_group=1,
                                shared=None if base.shared is None else dataclasses.replace(base.shared,
                                                                                            intermediate_size=128))
        for wdt in ("bf16", "fp8"):
            spec = base if wdt == "bf16" else base.replace(
                quant=QuantSpec(), shared=None if base.shared is None else dataclasses.replace(base.shared,
                                                                                               quant=QuantSpec()))
            for T in (int(t) for t in a.tokens.split(",")):
                if time.time() > t_end:
                    rows.append(dict(preset=name, T=T, weights=wdt, skipped="budget"))
                    continue
                args = random_moe_args(spec, T, torch.bfloat16, device=dev, std=0.02, seed=T)
                args, scales = quantize_moe_args(spec, args) if spec.quant is not None else (args, {})
                ref_spec = spec if spec.quant is None else spec.replace(quant=dataclasses.replace(
                    spec.quant, activation="none"), shared=None if spec.shared is None else dataclasses.replace(
                    spec.shared, quant=dataclasses.replace(spec.shared.quant, activation="none")))
                x, rest = args[0], args[1:]
                logits = reference.router_logits(x, args[1], args[2], spec)
                ids = reference.route(logits, args[3], spec)[1]
                os.environ["MOECOMP_FP8_MODE"] = "w8a16"

                def fn():
                    return torch.ops.moecomp.moe_forward(x, *rest, spec.key, **scales)

                os.environ[skinny_moe.ENV] = "0"
                mma_out = fn()
                mma_us = bench()
                os.environ[skinny_moe.ENV] = "1"
                os.environ.pop("MOECOMP_SKINNY_MOE_TILES", None)
                out = fn()
                heur_us = bench()
                ref = reference.moe_forward(x, *rest, ref_spec, **scales)
                times = {"heuristic": heur_us}
                c1h, c2h = skinny_moe.tiles(ids.numel(), T, spec, args[4].element_size(), x.device)
                d2 = f"{c2h['BLOCK_N']},{c2h['BLOCK_K']},{c2h['REDUCE_END']}"
                best1 = min(TILES, key=lambda t: _time(times, f"{t[0]},{t[1]},{t[2]},{d2}", t_end, bench))
                g1 = f"{best1[0]},{best1[1]},{best1[2]}"
                for t in TILES:
                    _time(times, f"{g1},{t[0]},{t[1]},{t[2]}", t_end, bench)
                best = min(times, key=times.get)
                os.environ.pop("MOECOMP_SKINNY_MOE_TILES", None)
                fl = _floor_us(spec, args, scales, ids)
                r = dict(preset=name, T=T, weights=wdt, floor_us=fl, mma_us=mma_us, skinny_heuristic_us=heur_us,
                         best_us=times[best], best_tiles=best, times=times, err_vs_mma=rel_err(out, mma_out),
                         err_vs_ref=rel_err(out, ref), err_mma_vs_ref=rel_err(mma_out, ref),
                         heuristic_tiles=[c1h, c2h])
                rows.append(r)
                print(f"| {name} | {T} | {wdt} | {fl:.1f} | {mma_us:.1f} | {heur_us:.1f} | {times[best]:.1f} | {best} | "
                      f"{times[best] / mma_us:.2f}x | {times[best] / fl:.2f}x | {r['err_vs_mma']:.1e} | "
                      f"{r['err_vs_ref']:.1e} |", flush=True)
    os.environ.pop(skinny_moe.ENV, None)
    if a.out_json:
        import triton

        env = dict(torch=torch.__version__, triton=triton.__version__,
                   gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                   commit=os.environ.get("MOECOMP_COMMIT", "unknown"), date=time.strftime("%Y-%m-%d"))
        with open(a.out_json, "w") as f:
            json.dump(dict(env=env, rows=rows, tiles=TILES), f, indent=1)
    return 0


def _time(times: dict, tiles: str, t_end: float, bench) -> float:
    """The cell's time with MOECOMP_SKINNY_MOE_TILES=tiles (memoized in ``times``); inf past the budget."""
    if tiles not in times:
        if time.time() > t_end:
            return float("inf")
        os.environ["MOECOMP_SKINNY_MOE_TILES"] = tiles
        times[tiles] = bench()
    return times[tiles]


if __name__ == "__main__":
    sys.exit(main())
