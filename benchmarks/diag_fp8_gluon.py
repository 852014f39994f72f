"""Issue 42 item 2: the Gluon FP8 gemm2 (kernels/gluon_fp8.py: the previous K step promoted while the next wgmma
runs) against the Triton TMA fp8 gemm2 (kernels/grouped_gemm_tma_fp8.py: every wgmma waited for) and a bf16 dense
matmul of the same FLOPs, on synthetic sorted rows (``probe_gluon.make_case``: balanced random expert loads) at
Qwen3-30B-A3B / DeepSeek-V3 / Mixtral-8x7B gemm2 sizes, T = 1024 and 8192 tokens. ``triton.testing.do_bench``
(median ms); TFLOP/s counts the real rows' 2 * P * H * I; "% fp8" is of a measured peak (``torch._scaled_mm``,
8192^3 e4m3, per-tensor scales). Also checks the Gluon output against the TMA kernel's (max relative difference).

    PYTHONPATH=. python3 benchmarks/diag_fp8_gluon.py --out-json /tmp/gluon.json       (~1 min on an H100)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_gluon import make_case, run_gluon, run_tma  # noqa: E402

SIZES = {  # name: (E, H, I, top_k) of the gemm2 (down projection)
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "deepseek_v3": (256, 7168, 2048, 8),
    "mixtral_8x7b": (8, 4096, 14336, 2),
}


def fp8_peak() -> float:
    """TFLOP/s of torch._scaled_mm on an 8192^3 e4m3 product (bf16 out), or 0 where it does not run."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).T
    one = torch.ones((), device="cuda")
    try:
        ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    except (RuntimeError, TypeError) as e:
        print(f"fp8 peak: torch._scaled_mm failed ({e})")
        return 0.0
    return 2 * n**3 / ms / 1e9


def counts_for(E: int, P: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (P,), generator=g)
    return torch.bincount(idx, minlength=E).tolist()


def bench_one(name: str, T: int, bm: int, peak: float) -> dict:
    E, H, I, k = SIZES[name]
    c = make_case(E, H, I, counts_for(E, T * k, T), bm, seed=T)
    flops = 2 * c["P"] * H * I
    y_g = torch.empty(c["P"], H, dtype=torch.bfloat16, device="cuda")
    y_t = torch.empty_like(y_g)
    run_gluon(c, y_g)
    run_tma(c, y_t)
    torch.cuda.synchronize()
    diff = ((y_g.float() - y_t.float()).abs().max() / y_t.float().abs().max()).item()
    a16 = torch.randn(c["P"], I, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(I, H, device="cuda", dtype=torch.bfloat16)
    row = dict(model=name, T=T, BLOCK_M=bm, rows=c["P"], gluon_vs_tma=diff)
    for label, fn in (("gluon", lambda: run_gluon(c, y_g)), ("tma", lambda: run_tma(c, y_t)),
                      ("bf16_dense", lambda: torch.mm(a16, b16))):
        ms = triton.testing.do_bench(fn, warmup=10, rep=40)
        row[f"{label}_ms"] = ms
        row[f"{label}_tflops"] = flops / ms / 1e9
        row[f"{label}_pct_fp8"] = 100 * flops / ms / 1e9 / peak if peak else None
    del c
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(SIZES))
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--out-json")
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    peak = fp8_peak()
    print(f"{dev}, triton {triton.__version__}: fp8 peak (torch._scaled_mm 8192^3) {peak:.0f} TFLOP/s")
    rows = []
    head = f"{'model':15s} {'T':>5s} {'gluon ms':>9s} {'TF/s':>6s} {'%fp8':>5s} {'tma ms':>8s} {'TF/s':>6s} " \
           f"{'%fp8':>5s} {'bf16 ms':>8s} {'speedup':>7s} {'diff':>8s}"
    print(head)
    for name in a.models.split(","):
        for T in map(int, a.tokens.split(",")):
            r = bench_one(name, T, a.block_m, peak)
            rows.append(r)
            pct = lambda v: f"{v:5.1f}" if v is not None else "    -"  # noqa: E731
            print(f"{name:15s} {T:5d} {r['gluon_ms']:9.3f} {r['gluon_tflops']:6.0f} {pct(r['gluon_pct_fp8'])} "
                  f"{r['tma_ms']:8.3f} {r['tma_tflops']:6.0f} {pct(r['tma_pct_fp8'])} {r['bf16_dense_ms']:8.3f} "
                  f"{r['tma_ms'] / r['gluon_ms']:7.2f} {r['gluon_vs_tma']:8.1e}")
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(device=dev, triton=triton.__version__, fp8_peak_tflops=peak, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
