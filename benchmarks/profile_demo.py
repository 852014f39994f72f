"""Where the host time of the demo's forward goes (GPU): torch.profiler over one prefill forward of the demo model
before and after `moecomp.optimize`, plus the op-graph counters and per-block call / fallback counts.

    PYTHONPATH=. python3 benchmarks/profile_demo.py [--seq 128]
"""

from __future__ import annotations

import argparse
import time

import torch


def main():
    import moecomp
    from moecomp.cli.demo import build
    from moecomp.ops import graphs
    from moecomp.api.optimize import rewritten_blocks

    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    model = build("cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, a.seq), device="cuda")

    def fwd():
        with torch.no_grad():
            return model(input_ids=ids).logits

    def timed(tag):
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fwd()
        host = (time.perf_counter() - t) / 10
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 10
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd()
            torch.cuda.synchronize()
        print(f"\n=== {tag}: host {host * 1e3:.2f} ms / forward (no sync), wall {wall * 1e3:.2f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))

    timed("HF")
    moecomp.optimize(model)
    timed("moecomp")
    print("graphs", graphs.stats, graphs.last_error)
    for n, b in rewritten_blocks(model).items():
        st = b._moecomp
        print(n, "calls", st.calls, "fallbacks", st.fallbacks)


if __name__ == "__main__":
    main()
