#!/usr/bin/env python3
"""Where the host time of the one-liner's prefill goes (issues 19 / 20: at 48 layers the prefill's wall time is 5-10x
its GPU busy time, and the FP8 model's is 1.8x the bf16 one's). Qwen3-30B-A3B sizes at a cut depth, random
weights, bf16 then quantized in place (``to_fp8``): after the one-liner's warm-up calls, a call of one new token
(the prefill and nothing else to speak of) is run under cProfile. Printed: the call's wall time and the top
functions by own time and by cumulative time.

    PYTHONPATH=. python3 benchmarks/diag_prefill_host.py --layers 6 --prompt 512
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def profile_call(model, ids, top: int) -> tuple[float, str]:
    import bench_generate as bg

    for _ in range(2):
        bg.run_one_liner(model, ids, bg.ONE_LINER_WARM, True)
    bg.run_one_liner(model, ids, 1, True)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    bg.run_one_liner(model, ids, 1, True)
    torch.cuda.synchronize()
    pr.disable()
    wall = time.perf_counter() - t
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return wall, s.getvalue()


def main(argv=None) -> int:
    import bench_generate as bg

    import moecomp
    from moecomp.testing.fp8_convert import to_fp8

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--top", type=int, default=35)
    a = ap.parse_args(argv)
    model = bg.build("qwen3", "cuda", torch.bfloat16, a.layers, False, 0)
    ids = torch.randint(3, model.config.vocab_size, (1, a.prompt), device="cuda")
    for name in ("bf16", "fp8"):
        if name == "fp8":
            moecomp.unoptimize(model)
            if "generate" in model.__dict__:
                model.generate.release()
            to_fp8(model)
        moecomp.optimize(model)
        wall, text = profile_call(model, ids, a.top)
        print(f"===== {name}: one-token call {wall * 1e3:.1f} ms (under cProfile) =====")
        print("\n".join(line for line in text.splitlines() if line.strip())[:14000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
