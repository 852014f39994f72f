"""Issue 42 item 2: the Gluon FP8 GEMMs (kernels/gluon_fp8.py gemm2, gluon_fp8_gemm1.py gemm1: the previous K step
promoted while the next wgmma runs) against the Triton TMA fp8 GEMMs (kernels/grouped_gemm_tma_fp8.py: every wgmma
waited for), ``triton.testing.do_bench`` (median ms), T = 1024 and 8192 tokens:

    gemm2  synthetic sorted rows (``probe_gluon.make_case``: balanced random loads) at Qwen3-30B-A3B / DeepSeek-V3 /
           Mixtral-8x7B sizes, and a bf16 dense matmul of the same FLOPs; TFLOP/s of the real rows' 2 * P * H * I
    gemm1  ``testing.gluon_gemm1_case`` at Qwen3-30B-A3B / DeepSeek-V3 sizes (gated silu, gemm2 reading h
           quantized): the Gluon gemm1 vs the Triton TMA gemm1 at BLOCK_N 64 and 128, each through
           ``triton_fp8_tma.gemm1`` with x gathered and quantized in sorted order first (tma_a: the same pass in
           every row); TFLOP/s of 2 * P * H * 2I
    op     the whole op (``torch.ops.moecomp.moe_forward``, the TMA fp8 config) with MOECOMP_FP8_GLUON on vs off, at
           Qwen3-30B-A3B (``--op-models``)

"% fp8" is of a measured peak (``torch._scaled_mm``, 8192^3 e4m3, per-tensor scales); "diff" the max relative
difference of the Gluon output to the Triton one.

    PYTHONPATH=. python3 benchmarks/diag_fp8_gluon.py --out-json /tmp/gluon.json       (~1.5 min on an H100)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_gluon import make_case, run_gluon, run_tma  # noqa: E402

SIZES = {  # name: (E, H, I, top_k) of the layer
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


def bench_gemm1(name: str, T: int, bm: int, peak: float) -> dict:
    """One gemm1 row: Gluon vs the Triton TMA gemm1 (BLOCK_N 64 / 128), h quantized where the tile allows."""
    from moecomp.testing import gluon_gemm1_case as g1

    E, H, I, k = SIZES[name]
    c = g1.make_case1(E, H, I, counts_for(E, T * k, T), bm, top_k=k, h_quant=True, seed=T)
    flops = 2 * c["P"] * H * 2 * I
    rows = g1.valid_rows(c)
    h_g = g1.dense_h(g1.run1(c, gluon=True))[rows]
    h_t = g1.dense_h(g1.run1(c, gluon=False, bn=128))[rows]
    row = dict(model=name, T=T, BLOCK_M=bm, rows=c["P"],
               gluon_vs_tma=((h_g - h_t).abs().max() / h_t.abs().max()).item())
    del h_g, h_t
    for label, fn in (("gluon", lambda: g1.run1(c, gluon=True)), ("tma64", lambda: g1.run1(c, gluon=False, bn=64)),
                      ("tma128", lambda: g1.run1(c, gluon=False, bn=128))):
        ms = triton.testing.do_bench(fn, warmup=10, rep=40)
        row[f"{label}_ms"] = ms
        row[f"{label}_tflops"] = flops / ms / 1e9
        row[f"{label}_pct_fp8"] = 100 * flops / ms / 1e9 / peak if peak else None
    del c
    torch.cuda.empty_cache()
    return row


def bench_op(name: str, T: int, bm: int) -> dict:
    """The whole op, the TMA fp8 config, MOECOMP_FP8_GLUON on vs off (fallbacks of the Gluon launchers counted)."""
    from moecomp.core.spec import QuantSpec
    from moecomp.ops import triton_fp8_gluon
    from moecomp.testing import LAYER_PRESETS, quantize_moe_args, random_moe_args
    from moecomp.testing.gluon_gemm1_case import gluon_env

    spec = LAYER_PRESETS[name].replace(quant=QuantSpec())
    if spec.shared is not None:
        spec = spec.replace(shared=dataclasses.replace(spec.shared, quant=QuantSpec(activation="dynamic")))
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T))
    g1c = dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, tma=1, tma_a=1)
    g2c = dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4, tma=1)
    os.environ["MOECOMP_CONFIG"] = json.dumps(dict(BLOCK_M=bm, fp8="w8a8", fp8_prequant=1, g1=g1c, g2=g2c,
                                                   decode=dict(max_t=0)))
    row, outs = dict(model=name, T=T, BLOCK_M=bm), {}
    triton_fp8_gluon.FALLBACKS.clear()
    for on in (True, False):
        with gluon_env(on):
            fn = lambda: torch.ops.moecomp.moe_forward(*args, spec.key, **scales)  # noqa: E731
            outs[on] = fn().float()
            row[f"{'gluon' if on else 'tma'}_ms"] = triton.testing.do_bench(fn, warmup=10, rep=40)
    row["fallbacks"] = triton_fp8_gluon.fallbacks()
    row["gluon_vs_tma"] = ((outs[True] - outs[False]).abs().max() / outs[False].abs().max()).item()
    del args, scales, outs
    torch.cuda.empty_cache()
    return row


def _report_extra(a, peak: float, rows: list) -> None:
    """The gemm1 and whole-op rows (printed, appended to ``rows``)."""
    pct = lambda v: f"{v:5.1f}" if v is not None else "    -"  # noqa: E731
    print(f"\ngemm1 {'model':15s} {'T':>5s} {'gluon ms':>9s} {'%fp8':>5s} {'tma64 ms':>9s} {'tma128 ms':>10s} "
          f"{'%fp8':>5s} {'speedup':>7s} {'diff':>8s}")
    for name in a.gemm1_models.split(","):
        for T in map(int, a.tokens.split(",")):
            r = bench_gemm1(name, T, a.block_m, peak)
            rows.append(dict(kind="gemm1", **r))
            best = min(r["tma64_ms"], r["tma128_ms"])
            print(f"gemm1 {name:15s} {T:5d} {r['gluon_ms']:9.3f} {pct(r['gluon_pct_fp8'])} {r['tma64_ms']:9.3f} "
                  f"{r['tma128_ms']:10.3f} {pct(r['tma128_pct_fp8'])} {best / r['gluon_ms']:7.2f} "
                  f"{r['gluon_vs_tma']:8.1e}")
    print(f"\nop    {'model':15s} {'T':>5s} {'gluon ms':>9s} {'tma ms':>8s} {'speedup':>7s} {'diff':>8s} fallbacks")
    for name in filter(None, a.op_models.split(",")):
        for T in map(int, a.tokens.split(",")):
            r = bench_op(name, T, a.block_m)
            rows.append(dict(kind="op", **r))
            print(f"op    {name:15s} {T:5d} {r['gluon_ms']:9.3f} {r['tma_ms']:8.3f} {r['tma_ms'] / r['gluon_ms']:7.2f} "
                  f"{r['gluon_vs_tma']:8.1e} {r['fallbacks'] or '-'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(SIZES))
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--gemm1-models", default="qwen3_30b_a3b,deepseek_v3")
    ap.add_argument("--op-models", default="qwen3_30b_a3b", help="comma-separated presets; empty: no op rows")
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
            rows.append(dict(kind="gemm2", **r))
            pct = lambda v: f"{v:5.1f}" if v is not None else "    -"  # noqa: E731
            print(f"{name:15s} {T:5d} {r['gluon_ms']:9.3f} {r['gluon_tflops']:6.0f} {pct(r['gluon_pct_fp8'])} "
                  f"{r['tma_ms']:8.3f} {r['tma_tflops']:6.0f} {pct(r['tma_pct_fp8'])} {r['bf16_dense_ms']:8.3f} "
                  f"{r['tma_ms'] / r['gluon_ms']:7.2f} {r['gluon_vs_tma']:8.1e}")
    _report_extra(a, peak, rows)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(device=dev, triton=triton.__version__, fp8_peak_tflops=peak, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
