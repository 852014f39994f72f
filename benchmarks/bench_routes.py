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
    python3 benchmarks/bench_routes.py --generate 12 --batches 1,32      # + generate() with and without routes

``--generate N``: also ``model.generate`` of Qwen3-30B-A3B cut to N layers (random bf16 weights, prompt 512, 64 new
tokens, greedy) after ``moecomp.optimize``, with and without ``return_routed_experts=True`` (recorded in the
engine's captured steps), alternating, 3 runs each; decode ms/step = the engine's decode time / its steps
(``generate.last``). The target's own measure: recording <= 2% of a batch-1 decode step.

Output: JSON (``--out``, default ``$OUT/bench_routes.json`` when $OUT is set, else benchmarks/results/routes-<gpu>.json)
and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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


def bench_generate(layers: int, batches: list[int], runs: int = 3) -> list[dict]:
    """generate() decode ms/step with and without return_routed_experts (module docstring)."""
    import statistics

    from bench_generate import build
    from gen_optimize import optimize_checked, require_generate

    model = build("qwen3", "cuda", torch.bfloat16, layers, False, 0)
    optimize_checked(model, "qwen3: ")
    require_generate(model)
    rows = []
    for B in batches:
        ids = torch.randint(3, model.config.vocab_size, (B, 512), device="cuda", generator=None)
        kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(ids))
        per = {"plain": [], "routes": []}
        for i in range(runs + 1):  # the first pair warms up (compiles, captures)
            for name in ("plain", "routes"):
                extra = dict(return_dict_in_generate=True, return_routed_experts=True) if name == "routes" else {}
                model.generate(ids, **kw, **extra)
                last = model.generate.last
                if name == "routes" and last.get("routes") != "recorded in the engine's steps":
                    raise RuntimeError(f"routes not recorded in the engine: {last}")
                if i:
                    per[name].append(1e3 * last["decode_s"] / last["decode_steps"])
        row = {"layers": layers, "B": B, **{f"{n}_ms_per_step": statistics.median(v) for n, v in per.items()},
               "runs": per, "graphs": last["graphs"]}
        row["overhead_pct"] = 100.0 * (row["routes_ms_per_step"] - row["plain_ms_per_step"]) / row["plain_ms_per_step"]
        rows.append(row)
        print(f"generate qwen3 {layers}L B={B}: plain {row['plain_ms_per_step']:.3f} ms/step, routes "
              f"{row['routes_ms_per_step']:.3f} ({row['overhead_pct']:+.2f}%), graphs {row['graphs']}", flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="qwen3_30b_a3b")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--reps", type=int, default=200, help="do_bench's rep (ms of timing per cell)")
    p.add_argument("--out", default=None)
    p.add_argument("--generate", type=int, default=0, help="also generate() with Qwen3-30B-A3B cut to N layers")
    p.add_argument("--batches", default="1", help="generate()'s batch sizes (with --generate)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_routes.py needs CUDA", file=sys.stderr)
        return 2
    rows = [bench(pr, int(t), a.reps) for pr in a.presets.split(",") for t in a.tokens.split(",")] \
        if a.tokens else []
    gen = bench_generate(a.generate, [int(b) for b in a.batches.split(",")]) if a.generate else []
    gpu = torch.cuda.get_device_name()
    commit = os.environ.get("MOECOMP_COMMIT") or os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    import transformers
    import triton

    doc = {"gpu": gpu, "commit": commit, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__, "rows": rows, "generate": gen}
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
