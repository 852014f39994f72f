"""Eager-mode cost of one `torch.ops.moecomp.moe_forward` call on the GPU: plain launches vs the op's own per-shape
CUDA graphs (ops/graphs.py), against the GPU time of the op alone (replay of an outer CUDA graph).

    PYTHONPATH=. python3 benchmarks/eager_overhead.py

Columns (bf16, real layer sizes, random data):
  gpu        do_bench of an outer CUDA-graph replay of the op: kernels only, no host work
  plain      do_bench of eager calls with MOECOMP_OP_GRAPHS_MAX_T=0 (8 launches + host work per call)
  graphs     do_bench of eager calls with the op's graphs on (default)
  direct     the same through `moe_op.call_moe_forward` (what bound HF blocks call: no custom-op dispatcher)
  host       host time per call (200 back-to-back calls, no sync, divided by 200) for plain / graphs / direct

EAGER_CASES="qwen3_30b_a3b:512,qwen3_30b_a3b:2048" picks the cases; EAGER_PROFILE=1 also prints, per case, the top
functions by own time of 50 plain calls through the dispatcher under cProfile (where a prefill-sized call's host time
goes: issue 19 / 20's host-bound prefill).
"""

from __future__ import annotations

import json
import os

import torch
from triton.testing import do_bench

from moecomp.ops import graphs
from moecomp.ops.moe_op import call_moe_forward
from moecomp.testing import LAYER_PRESETS, host_us, random_moe_args

CASES = [(c.split(":")[0], int(c.split(":")[1])) for c in os.environ["EAGER_CASES"].split(",")] \
    if os.environ.get("EAGER_CASES") else [("qwen3_30b_a3b", 1), ("qwen3_30b_a3b", 8), ("qwen3_30b_a3b", 64), ("qwen15_moe_a27b", 1),
         ("qwen15_moe_a27b", 8), ("olmoe_1b_7b", 1), ("deepseek_v3", 1), ("mixtral_8x7b", 1)]


def _profile(fn, label: str, n: int = 50) -> None:
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"===== {label}: {n} plain calls under cProfile =====\n{buf.getvalue()}", flush=True)


def main():
    rows = []
    with torch.no_grad():
        for name, T in CASES:
            spec = LAYER_PRESETS[name]
            args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=0)

            def call():
                return torch.ops.moecomp.moe_forward(*args, spec.key)

            os.environ["MOECOMP_OP_GRAPHS_MAX_T"] = "0"
            call()
            plain = do_bench(call, return_mode="median")
            plain_host = host_us(call)
            if os.environ.get("EAGER_PROFILE"):
                _profile(call, f"{name} T={T}")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            gpu = do_bench(g.replay, return_mode="median")
            os.environ["MOECOMP_OP_GRAPHS_MAX_T"] = "256"
            graphs.clear()
            call(), call()
            with_graphs = do_bench(call, return_mode="median")
            graphs_host = host_us(call)

            def direct():
                return call_moe_forward(args[0], args[1:], spec)

            direct_ms = do_bench(direct, return_mode="median")
            direct_host = host_us(direct)
            row = dict(case=f"{name} T={T}", gpu_ms=gpu, plain_ms=plain, graphs_ms=with_graphs, direct_ms=direct_ms,
                       plain_host_us=plain_host, graphs_host_us=graphs_host, direct_host_us=direct_host,
                       stats=dict(graphs.stats))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| case | gpu (outer graph) ms | eager plain ms | eager with op graphs ms | graphs + direct ms | "
          "plain / (graphs + direct) | host us per call (plain / graphs / direct) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['gpu_ms']:.3f} | {r['plain_ms']:.3f} | {r['graphs_ms']:.3f} | {r['direct_ms']:.3f} | "
              f"{r['plain_ms'] / r['direct_ms']:.2f}x | {r['plain_host_us']:.0f} / {r['graphs_host_us']:.0f} / "
              f"{r['direct_host_us']:.0f} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "eager_overhead.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "commit": os.environ.get("MOECOMP_COMMIT", "?"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
