#!/usr/bin/env python3
"""fp8_linear at a few rows: the GEMV form (``fp8_gemv_kernel``) against the dot form (``fp8_linear_kernel``) and
cuBLAS bf16 on the same shapes (the attention / shared-expert projections of Qwen3-30B-A3B and DeepSeek-V3), each in
a CUDA graph (``triton.testing.do_bench_cudagraph``), both checked against the weight-only reference
(``torch_fp8_linear``). Issue 19's B=1 decode: 24 fp8_linear launches took 211 us a step on Qwen3 (8.8 us each).

    PYTHONPATH=. python3 benchmarks/diag_fp8_gemv.py --rows 1,4 --out-json /tmp/gemv.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # name: (N, K)
    "qwen3 q_proj": (4096, 2048), "qwen3 k_proj": (512, 2048), "qwen3 o_proj": (2048, 4096),
    "deepseek q_a_proj": (1536, 7168), "deepseek q_b_proj": (24576, 1536), "deepseek kv_a_proj": (576, 7168),
    "deepseek kv_b_proj": (32768, 512), "deepseek o_proj": (7168, 16384), "deepseek shared gate_up": (4096, 7168),
}


def main(argv=None) -> int:
    import triton.testing as tt

    from moecomp import quant as q8
    from moecomp.spec import QuantSpec

    op_mod = importlib.import_module("moecomp.ops.fp8_linear")
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    q = QuantSpec()
    os.environ["MOECOMP_FP8_MODE"] = "w8a16"
    rows, out = [int(r) for r in a.rows.split(",")], []
    print("| shape | M | GEMV us | dot us | cuBLAS bf16 us | GEMV / dot | GEMV TB/s | err GEMV | err dot |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        w16 = torch.randn(N, K, device=dev) * 0.02
        wq, ws = q8.quantize(w16, q)
        wb = q8.dequantize(wq, ws, q).to(torch.bfloat16)
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = op_mod.torch_fp8_linear(x.float(), wq, ws, None, None, QuantSpec(activation="none"))
            res = {}
            for form, env in (("gemv", "1"), ("dot", "0")):
                os.environ["MOECOMP_FP8_GEMV"] = env
                fn = lambda: torch.ops.moecomp.fp8_linear(x, wq, ws, None, None, q.key)  # noqa: E731
                y = fn()
                err = float((y.float() - ref).norm() / ref.norm())
                res[form] = (tt.do_bench_cudagraph(fn, rep=30) * 1e3, err)
            t16 = tt.do_bench_cudagraph(lambda: torch.nn.functional.linear(x, wb), rep=30) * 1e3
            tbs = (N * K + ws.numel() * 4) / (res["gemv"][0] * 1e-6) / 1e12
            out.append(dict(shape=name, N=N, K=K, M=M, gemv_us=res["gemv"][0], dot_us=res["dot"][0], cublas_us=t16,
                            err_gemv=res["gemv"][1], err_dot=res["dot"][1], gemv_tbs=tbs))
            print(f"| {name} | {M} | {res['gemv'][0]:.1f} | {res['dot'][0]:.1f} | {t16:.1f} | "
                  f"{res['gemv'][0] / res['dot'][0]:.2f}x | {tbs:.2f} | {res['gemv'][1]:.1e} | {res['dot'][1]:.1e} |",
                  flush=True)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(rows=out, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           commit=os.environ.get("MOECOMP_COMMIT")), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
