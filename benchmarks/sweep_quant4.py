#!/usr/bin/env python3
"""Tiles of the 4-bit experts' aligned GEMMs, swept on the GPU (issue 22): the table entries ``tuning.quant4_config``
reads (``moecomp/ops/configs/<gpu>.json``, key ``E=..,N=..,K=..,dtype=mxfp4``) come from this script's output.

For each T: gemm1's tile candidates with gemm2 at the current config's, then gemm2's with gemm1's winner; each
candidate is the whole op (``torch.ops.moecomp.moe_forward``) captured in a CUDA graph and timed by do_bench (median,
``diag_quant4.time_op``) under MOECOMP_CONFIG, for each K-step form asked for (the config's ``w4_form``). A candidate that fails to compile or launch (shared memory) is
skipped and listed. The decode path's tokens (T <= the config's decode ``max_t``) are not swept here.

    PYTHONPATH=. python3 benchmarks/sweep_quant4.py --tokens 16,64,128 --out-json /tmp/sweep.json
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from diag_quant4 import MODELS, env, pack, time_op  # noqa: E402

from moecomp.ops import tuning  # noqa: E402
from moecomp.core.args import MOE_ARGS  # noqa: E402
from moecomp.testing import random_moe_args  # noqa: E402

G1 = [dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=s)
      for bn, bk, w, s in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4))]
G2 = [dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=s)
      for bn, bk, w, s in itertools.product((64, 128, 256), (128, 256), (4, 8), (3, 4))]


def _tile(c: dict) -> str:
    return f"{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"


def sweep(name: str, T: int, t4: dict, extra4: dict, x_all: torch.Tensor, spec, form: str) -> dict:
    x = x_all[:T].contiguous()
    base = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, spec.top_k,
                             torch.bfloat16, x.device, spec.quant)
    base = dict(base, w4_form=form)
    rec = {"model": name, "T": T, "form": form, "base": base, "g1": {}, "g2": {}, "failed": []}

    def timed(cfg: dict) -> float | None:
        try:
            with env(MOECOMP_CONFIG=json.dumps(cfg)):
                return time_op(x, t4, spec, extra4)
        except Exception as e:  # noqa: BLE001  (a tile that does not fit: listed, skipped)
            rec["failed"].append(f"{_tile(cfg['g1'])} / {_tile(cfg['g2'])}: {type(e).__name__}: {str(e)[:160]}")
            return None

    rec["base_us"] = timed(base)
    best1, best1_us = base["g1"], rec["base_us"]
    for i, c in enumerate(G1):
        us = timed(dict(base, g1=c))
        rec["g1"][_tile(c)] = us
        if us is not None and (best1_us is None or us < best1_us):
            best1, best1_us = c, us
        print(f"\r[sweep] {name} {form} T={T} gemm1 {i + 1}/{len(G1)}", end="", file=sys.stderr, flush=True)
    best2, best2_us = base["g2"], best1_us
    for i, c in enumerate(G2):
        us = timed(dict(base, g1=best1, g2=c))
        rec["g2"][_tile(c)] = us
        if us is not None and (best2_us is None or us < best2_us):
            best2, best2_us = c, us
        print(f"\r[sweep] {name} {form} T={T} gemm2 {i + 1}/{len(G2)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rec["best"] = dict(base, g1=best1, g2=best2)
    rec["best_us"] = best2_us
    print(f"| {name} | {form} | {T} | {rec['base_us']:.1f} | {_tile(best1)} | {_tile(best2)} | {best2_us:.1f} | "
          f"{rec['base_us'] / best2_us:.2f}x | {len(rec['failed'])} |", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-oss-120b")
    ap.add_argument("--tokens", default="16,64,128")
    ap.add_argument("--forms", default="dot_scaled", help="K-step forms (ops/triton_quant4.FORMS), comma list")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_quant4.py needs CUDA")
    tokens = [int(v) for v in a.tokens.split(",")]
    print("| model | form | T | heuristic tiles us | best gemm1 tile | best gemm2 tile | best us | speed-up | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, t0 = [], time.time()
    for name in a.models.split(","):
        spec = MODELS[name]()
        raw = random_moe_args(spec, max(tokens), torch.bfloat16, "cuda", std=0.02, seed=0)
        t4, extra4 = pack(spec, dict(zip(MOE_ARGS, raw[1:])))
        for form in a.forms.split(","):
            for T in tokens:
                rows.append(sweep(name, T, t4, extra4, raw[0], spec, form))
                _write(a.out_json, rows, t0)  # after every row: a run cut short keeps what it measured
        del raw, t4, extra4
        torch.cuda.empty_cache()


def _write(path: str | None, rows: list, t0: float) -> None:
    if not path:
        return
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), commit=os.environ.get("MOECOMP_COMMIT", "?"),
                seconds=round(time.time() - t0, 1))
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
