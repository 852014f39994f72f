#!/usr/bin/env python3
"""The skinny linear (``kernels/skinny.py``) at decode rows against cuBLAS (bf16 weights) and fp8_linear's dot form
(e4m3 block weights, weight-only), on the attention / shared-expert projections of Qwen3-30B-A3B and DeepSeek-V3.
Each call timed in a CUDA graph (``triton.testing.do_bench_cudagraph``), checked against an fp32 reference. The
heuristic tiles (``ops/skinny.skinny_config``) and the best of a small tile sweep (within --sweep-budget-s) are both
reported, with the weight bytes' bandwidth. Issue 19 / 20's B=1 decode: the projections are latency-bound launches
(fp8_linear 8.8 us each on Qwen3, cuBLAS 5-7 us, floors 0.5-4 us).

    PYTHONPATH=. python3 benchmarks/diag_skinny.py --rows 1,4 --out-json /tmp/skinny.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # name: (N, K)
    "qwen3 q_proj": (4096, 2048), "qwen3 k_proj": (512, 2048), "qwen3 o_proj": (2048, 4096),
    "deepseek q_b_proj": (24576, 1536), "deepseek kv_a_proj": (576, 7168), "deepseek o_proj": (7168, 16384),
    "deepseek shared gate_up": (4096, 7168),
    "gpt-oss-120b q_proj": (4096, 2880), "gpt-oss-120b k_proj": (512, 2880), "gpt-oss-120b o_proj": (2880, 4096),
}
SWEEP = dict(BLOCK_N=(4, 8, 16, 32), BLOCK_K=(256, 512, 1024), REDUCE_END=(1, 0), num_stages=(3,), num_warps=(4,))


def _err(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


def main(argv=None) -> int:
    import triton
    import triton.testing as tt

    from moecomp.core import quant as q8
    from moecomp.ops import skinny
    from moecomp.ops.common import sm_count as _sm_count
    from moecomp.core.spec import QuantSpec

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    q = QuantSpec(activation="none")
    os.environ["MOECOMP_SKINNY"] = "0"  # fp8_linear's own dot form
    os.environ["MOECOMP_FP8_MODE"] = "w8a16"
    rows, out, t_end = [int(r) for r in a.rows.split(",")], [], time.time() + a.sweep_budget_s
    bench = lambda fn: tt.do_bench_cudagraph(fn, rep=25) * 1e3  # noqa: E731
    print("| shape | M | weight | peer | peer us | skinny us (heuristic) | best us | best tiles | best / peer | "
          "best TB/s | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, (N, K)), M, wdt in itertools.product(SHAPES.items(), rows, ("bf16", "fp8")):
        w32 = torch.randn(N, K, device=dev) * 0.02
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        if wdt == "bf16":
            w, ws, qq = w32.to(torch.bfloat16), None, None
            ref = x.float() @ w.float().T
            peer, peer_fn = "cuBLAS", lambda: torch.nn.functional.linear(x, w)
            nbytes = N * K * 2
        else:
            w, ws = q8.quantize(w32, q)
            qq = q
            ref = x.float() @ q8.dequantize(w, ws, q).T
            peer, peer_fn = "fp8 dot", lambda: torch.ops.moecomp.fp8_linear(x, w, ws, None, None, q.key)
            nbytes = N * K + ws.numel() * 4
        t_peer = bench(peer_fn)
        heur = skinny.skinny_config(M, N, K, w.element_size(), dev, _sm_count(dev))
        y = skinny.skinny_linear(x, w, None, ws, qq)
        errs = [_err(y, ref)]
        t_heur = bench(lambda: skinny.skinny_linear(x, w, None, ws, qq))
        best = (t_heur, heur)
        for vals in itertools.product(*SWEEP.values()):
            c = dict(zip(SWEEP, vals))
            if time.time() > t_end:
                break
            if c["BLOCK_K"] > max(256, triton.next_power_of_2(K)) or (
                    c["REDUCE_END"] and M * c["BLOCK_N"] * c["BLOCK_K"] > 16384):
                continue
            try:
                yc = skinny.skinny_linear(x, w, None, ws, qq, cfg=c)
                errs.append(_err(yc, ref))
                tc = bench(lambda: skinny.skinny_linear(x, w, None, ws, qq, cfg=c))
            except Exception as e:  # a config the compiler refuses (registers, shared memory): skipped, said
                print(f"  skipped {c}: {type(e).__name__}: {str(e)[:80]}")
                continue
            if tc < best[0]:
                best = (tc, c)
        tbs = nbytes / (best[0] * 1e-6) / 1e12
        out.append(dict(shape=name, N=N, K=K, M=M, weight=wdt, peer=peer, peer_us=t_peer, heuristic_us=t_heur,
                        heuristic=heur, best_us=best[0], best=best[1], best_tbs=tbs, max_err=max(errs)))
        tiles = "{BLOCK_N}x{BLOCK_K} r{REDUCE_END} s{num_stages}".format(**best[1])
        print(f"| {name} | {M} | {wdt} | {peer} | {t_peer:.1f} | {t_heur:.1f} | {best[0]:.1f} | {tiles} | "
              f"{best[0] / t_peer:.2f}x | {tbs:.2f} | {max(errs):.1e} |", flush=True)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(rows=out, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, commit=os.environ.get("MOECOMP_COMMIT"),
                           date=time.strftime("%Y-%m-%d")), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
