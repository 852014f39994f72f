"""Tune the grouped-GEMM configs on this GPU and write ``moecomp/kernels/configs/<gpu>.json``.

For each layer preset and token count: route once, then for every BLOCK_M candidate align the tokens and time
each gemm1 candidate and each gemm2 candidate on their own (``triton.testing.do_bench`` medians, L2 flushed).
The best (align + gemm1 + gemm2) wins. Candidates are checked against the first one (relative error), so a
broken config is never chosen.

    python3 benchmarks/tune_moe.py [--presets a,b] [--tokens 1,16,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
from triton.testing import do_bench

from moecomp.ops import triton_moe, tuning
from moecomp.testing import LAYER_PRESETS, random_moe_args

TOKENS = [1, 16, 128, 1024, 8192]
# (BLOCK_N, BLOCK_K, num_warps, num_stages); gemm1's weight tile is 2 * BLOCK_N wide (gate and up columns)
TILES = {
    "g1": [(16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 64, 8, 4),
           (64, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4)],
    "g2": [(32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3),
           (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3)],
}


def block_ms(T: int, k: int, E: int) -> list[int]:
    rows = T * k / max(1, min(E, T * k))
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * triton.next_power_of_2(int(rows)))]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def tune_one(spec, T: int, rep: int = 25):
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T)
    x = args[0]
    named = dict(zip(("router_w", "router_b", "correction_bias", "w13", "b13", "w2", "b2"), args[1:8]))
    logits, _ = triton_moe.router_logits(x, {**named, "shared_gate_w": None}, spec)
    ids, weights = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    k = spec.top_k
    best = None
    for bm in block_ms(T, k, spec.num_experts):
        aligned = triton_moe.align(ids, spec.num_experts, bm)
        t_align = do_bench(lambda: triton_moe.align(ids, spec.num_experts, bm), warmup=5, rep=rep,
                           return_mode="median")
        res = {}
        for which in ("g1", "g2"):
            ref_out, best_t, best_c = None, float("inf"), None
            for bn, bk, nw, ns in TILES[which]:
                c = dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if bm >= 64 else 1, num_warps=nw, num_stages=ns)
                if which == "g1":
                    fn = lambda c=c: triton_moe.gemm1(x, named["w13"], named["b13"], spec, aligned, k, bm, c)  # noqa: E731
                else:
                    h = res["h"]
                    fn = lambda c=c: triton_moe.gemm2(h, named["w2"], named["b2"], weights, spec, aligned, T * k, bm, c)  # noqa: E731
                try:
                    out = fn()
                    torch.cuda.synchronize()
                except Exception as e:  # out of shared memory / registers for this tile
                    print(f"    skip {which} {c}: {type(e).__name__}")
                    continue
                if which == "g1":  # padding rows and rows past num_padded are never written: real rows only
                    real = (aligned[0] < T * k) & (torch.arange(aligned[0].numel(), device="cuda") < aligned[2])
                    out = out[real]
                if ref_out is None:
                    ref_out = out.clone()
                elif rel(out, ref_out) > 1e-2:
                    print(f"    REJECT {which} {c}: rel err {rel(out, ref_out):.2e}")
                    continue
                t = do_bench(fn, warmup=5, rep=rep, return_mode="median")
                if t < best_t:
                    best_t, best_c = t, c
            res[which] = (best_t, best_c)
            if which == "g1":
                res["h"] = triton_moe.gemm1(x, named["w13"], named["b13"], spec, aligned, k, bm, best_c)
        total = t_align + res["g1"][0] + res["g2"][0]
        print(f"  T={T:5d} BM={bm:3d}: align {t_align*1e3:7.1f} us  g1 {res['g1'][0]*1e3:8.1f} us  "
              f"g2 {res['g2'][0]*1e3:8.1f} us  {res['g1'][1]} / {res['g2'][1]}")
        if best is None or total < best[0]:
            best = (total, dict(BLOCK_M=bm, g1=res["g1"][1], g2=res["g2"][1]))
    del args
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(LAYER_PRESETS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--out", default=os.environ.get("OUT", str(tuning.CONFIG_DIR)))
    ap.add_argument("--rep", type=int, default=25)
    ap.add_argument("--copy-to", default=None, help="also write the table into this folder")
    a = ap.parse_args()
    dev = torch.device("cuda")
    name = tuning.device_key(dev)
    path = os.path.join(a.out, f"{name}.json")
    table = json.load(open(path)) if os.path.exists(path) else {}
    t0 = time.time()
    for preset in a.presets.split(","):
        spec = LAYER_PRESETS[preset]
        key = tuning.shape_key(spec.num_experts, spec.intermediate_size, spec.hidden_size, torch.bfloat16)
        print(f"{preset} {key}", flush=True)
        entry = table.setdefault(key, {})
        for T in map(int, a.tokens.split(",")):
            t, cfg = tune_one(spec, T, a.rep)
            entry[str(T)] = cfg
            print(f"  -> T={T}: {t*1e3:.1f} us {cfg}", flush=True)
        torch.cuda.empty_cache()
        os.makedirs(a.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        if a.copy_to:
            with open(os.path.join(a.copy_to, f"{name}.json"), "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
    print(f"wrote {path} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
