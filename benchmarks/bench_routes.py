#!/usr/bin/env python3
"""The cost of routing record and replay on the op (issue 43): ``torch.ops.moecomp.moe_forward`` /
``moe_forward_routes`` at a real layer size (``moecomp.testing.LAYER_PRESETS``, bf16), per preset and token count,
timed four ways:

    plain      the op as it is
    record     moe_forward_routes with routes_out [T, k] int32 and route_weights_out [T, k] fp32 (written by the
               routing kernel)
    record_ids moe_forward_routes with routes_out only
    replay     moe_forward with routes_in [T, k] (the routes a recording call wrote)

each as plain launches and as a CUDA-graph replay of one call (what a decode step runs); times are
``triton.testing.do_bench`` medians in microseconds, with each variant's overhead over ``plain`` in percent. Targets
(issue 43): recording <= 2% of a batch-1 decode step (here: of the op's graph replay, a stricter measure), replay
<= 5% of a forward.

    python3 benchmarks/bench_routes.py                                   # qwen3_30b_a3b at T=1 and 64
    python3 benchmarks/bench_routes.py --presets qwen3_30b_a3b,deepseek_v3 --tokens 1,8,64 --out /tmp/routes.json

Output: JSON (``--out``, default ``$OUT/bench_routes.json`` when $OUT is set, else benchmarks/results/routes-<gpu>.json)
and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moecomp.testing import LAYER_PRESETS, random_moe_args  # noqa: E402


def _graph(fn):
    """fn captured in a CUDA graph after two warm-up calls on a side stream; returns the graph's replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _variants(args, spec, T: int) -> dict:
    k = spec.top_k
    out = torch.empty(T, k, dtype=torch.int32, device="cuda")
    wout = torch.empty(T, k, dtype=torch.float32, device="cuda")
    op, rec = torch.ops.moecomp.moe_forward, torch.ops.moecomp.moe_forward_routes
    rec(out, None, *args, spec.key)
    given = out.clone()
    return {
        "plain": lambda: op(*args, spec.key),
        "record": lambda: rec(out, wout, *args, spec.key),
        "record_ids": lambda: rec(out, None, *args, spec.key),
        "replay": lambda: op(*args, spec.key, routes_in=given),
    }


def bench(preset: str, T: int, reps: int) -> dict:
    import triton

    spec = LAYER_PRESETS[preset]
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T)
    row = {"preset": preset, "T": T}
    for mode in ("launch", "graph"):
        for name, fn in _variants(args, spec, T).items():
            run = fn if mode == "launch" else _graph(fn)
            ms = triton.testing.do_bench(run, warmup=25, rep=reps, return_mode="median")
            row[f"{mode}_{name}_us"] = ms * 1e3
        base = row[f"{mode}_plain_us"]
        for name in ("record", "record_ids", "replay"):
            row[f"{mode}_{name}_overhead_pct"] = 100.0 * (row[f"{mode}_{name}_us"] - base) / base
    del args
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--reps", type=int, default=200, help="do_bench's rep (ms of timing per cell)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_routes.py needs CUDA", file=sys.stderr)
        return 2
    rows = [bench(pr, int(t), a.reps) for pr in a.presets.split(",") for t in a.tokens.split(",")]
    gpu = torch.cuda.get_device_name()
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    doc = {"gpu": gpu, "commit": commit, "torch": torch.__version__, "rows": rows}
    out = a.out or (os.path.join(os.environ["OUT"], "bench_routes.json") if os.environ.get("OUT") else
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"routes-{gpu.replace(' ', '_')}.json"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{gpu} {commit}  (us, do_bench medians; overhead over plain in %)")
    for r in rows:
        for mode in ("launch", "graph"):
            cells = "  ".join(f"{n} {r[f'{mode}_{n}_us']:.1f}" + ("" if n == "plain" else
                              f" ({r[f'{mode}_{n}_overhead_pct']:+.1f}%)")
                              for n in ("plain", "record", "record_ids", "replay"))
            print(f"{r['preset']:>16} T={r['T']:<4} {mode:>6}: {cells}")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
