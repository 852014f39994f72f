#!/usr/bin/env python3
"""The dense FP8 linear (``torch.ops.moecomp.fp8_linear``, e4m3 weights with 128x128 block scales, activations
quantized per token and 128 columns) at prefill row counts, where the one-liner's prefill spent 51 us a launch on
Qwen3-30B-A3B's attention projections at M = 512 (cuBLAS bf16: ~12 us; BENCHMARKS.md, "FP8 generate at full depth").

Per shape and M, each timed in a CUDA graph (``triton.testing.do_bench_cudagraph``) and checked against the
dequantized reference (``reference.quantized_linear``, activation quantization counted; tolerance 2e-2):

    cuBLAS bf16        F.linear on the weights dequantized to bf16 (the peer: what the bf16 model runs)
    fp8 heuristic      the op as it runs today (``tuning.fp8_linear_config``, A quantized in every program's K loop)
    fp8 prequant       the same with MOECOMP_FP8_PREQUANT=1 (A quantized once, ``quantize_act``)
    fp8 best           the best of a tile sweep (MOECOMP_FP8_LINEAR_TILES), with or without prequant
    torch blockwise    torch's own block-scaled FP8 GEMM (``F.scaled_mm``, BlockWise1x128 activations x BlockWise128x128
                       weights; cuBLAS on CUDA >= 12.9) on the same codes and scales, activations quantized by our
                       ``quantize_act`` (its scales then made column-major): a candidate backend for prefill rows,
                       "-" with the reason printed where the stack refuses it

    PYTHONPATH=. python3 benchmarks/diag_fp8_linear.py --rows 64,512,2048 --out-json /tmp/fp8_linear.json
    PYTHONPATH=. python3 benchmarks/diag_fp8_linear.py --tiny      (CPU smoke run: the interpreter, small shapes)
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
}
TINY_SHAPES = {"tiny a": (256, 256), "tiny b": (128, 384)}
SWEEP = dict(BLOCK_M=(64, 128), BLOCK_N=(64, 128), GROUP_M=(8,), num_warps=(4, 8), num_stages=(3, 4))
if os.environ.get("FP8LIN_SHAPES"):  # a subset by name prefix, e.g. "qwen3"
    SHAPES = {n: s for n, s in SHAPES.items() if n.startswith(os.environ["FP8LIN_SHAPES"])}
TINY_SWEEP = dict(BLOCK_M=(16, 32), BLOCK_N=(32,), GROUP_M=(1,), num_warps=(4,), num_stages=(1,))


def _err(y, ref) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def torch_blockwise(x, w, ws):
    """y = x @ dequant(w).T through torch's block-scaled GEMM, or raise what the stack says."""
    import torch.nn.functional as F

    from moecomp.ops import triton_fp8

    qa = triton_fp8.quantize_act(x)
    sa = qa.s.t().contiguous().t()  # [M, K / 128], column-major: the layout BlockWise1x128 takes
    return F.scaled_mm(qa.q, w.t(), sa, F.ScalingType.BlockWise1x128, ws.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=x.dtype)


def main(argv=None) -> int:
    import triton

    from moecomp.core import quant as q8
    from moecomp.oracle import reference
    from moecomp.core.spec import QuantSpec
    from moecomp.testing import host_us

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="64,512,2048")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.tiny else "cuda")
    shapes, sweep = (TINY_SHAPES, TINY_SWEEP) if a.tiny else (SHAPES, SWEEP)
    dtype = torch.float32 if a.tiny else torch.bfloat16  # the interpreter's bf16 dot is not trusted
    if a.tiny:
        import time as _t

        def bench(fn):
            t0 = _t.perf_counter()
            fn()
            return (_t.perf_counter() - t0) * 1e6
    else:
        import triton.testing as tt

        def bench(fn):
            return tt.do_bench_cudagraph(fn, rep=25) * 1e3
    q = QuantSpec()  # e4m3, 128x128 fp32 block scales, dynamic activations
    rows, out, t_end = [int(r) for r in a.rows.split(",")], [], time.time() + a.budget_s
    print("| shape | M | cuBLAS bf16 us | fp8 heuristic us | fp8 prequant us | fp8 best us | best tiles | "
          "best / cuBLAS | best TFLOP/s | torch blockwise us | op host us | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, (N, K)), M in itertools.product(shapes.items(), rows):
        if time.time() > t_end:
            out.append(dict(shape=name, M=M, skipped="budget"))
            continue
        g = torch.Generator(device=dev).manual_seed(M + N)
        w, ws = q8.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02, q)
        x = torch.randn(M, K, device=dev, generator=g).to(dtype)
        ref = reference.quantized_linear(x, w, ws, q)
        w16 = q8.dequantize(w, ws, q).to(dtype)
        times, errs = {}, []

        def run(tiles: str | None, prequant: bool):
            for var, val in (("MOECOMP_FP8_LINEAR_TILES", tiles), ("MOECOMP_FP8_PREQUANT", "1" if prequant else None)):
                if val is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = val
            fn = lambda: torch.ops.moecomp.fp8_linear(x, w, ws, None, None, q.key)  # noqa: E731
            errs.append(_err(fn(), ref))
            return bench(fn)

        t_blas = bench(lambda: torch.nn.functional.linear(x, w16))
        t_torch, torch_err = None, None
        if dev.type == "cuda":
            try:
                torch_err = _err(torch_blockwise(x, w, ws), ref)
                t_torch = bench(lambda: torch_blockwise(x, w, ws))
            except Exception as e:  # the stack's refusal, said once per shape
                print(f"  torch blockwise refused at {name} M={M}: {type(e).__name__}: {str(e)[:160]}")
        times["heuristic"] = run(None, False)
        host = host_us(lambda: torch.ops.moecomp.fp8_linear(x, w, ws, None, None, q.key)) if dev.type == "cuda" \
            else None
        times["prequant"] = run(None, True)
        for vals in itertools.product(*sweep.values()):
            if time.time() > t_end:
                break
            c = dict(zip(sweep, vals))
            tiles = ",".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages"))
            for pq in (False, True):
                try:
                    times[f"{tiles}{' prequant' if pq else ''}"] = run(tiles, pq)
                except Exception as e:  # a config the compiler refuses: said, skipped
                    print(f"  skipped {tiles}: {type(e).__name__}: {str(e)[:80]}")
        for var in ("MOECOMP_FP8_LINEAR_TILES", "MOECOMP_FP8_PREQUANT"):
            os.environ.pop(var, None)
        best = min(times, key=times.get)
        tflops = 2 * M * N * K / (times[best] * 1e-6) / 1e12
        out.append(dict(shape=name, N=N, K=K, M=M, cublas_bf16_us=t_blas, times=times, best=best,
                        best_us=times[best], max_err=max(errs), torch_blockwise_us=t_torch,
                        torch_blockwise_err=torch_err, op_host_us=host))
        print(f"| {name} | {M} | {t_blas:.1f} | {times['heuristic']:.1f} | {times['prequant']:.1f} | "
              f"{times[best]:.1f} | {best} | {times[best] / t_blas:.2f}x | {tflops:.0f} | "
              f"{'-' if t_torch is None else f'{t_torch:.1f} ({torch_err:.1e})'} | "
              f"{'-' if host is None else f'{host:.0f}'} | {max(errs):.1e} |",
              flush=True)
    bad = [r for r in out if r.get("max_err", 0) > 2e-2]
    if a.out_json:
        env = dict(torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("MOECOMP_COMMIT"),
                   gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", date=time.strftime("%Y-%m-%d"))
        with open(a.out_json, "w") as f:
            json.dump(dict(env=env, rows=out, sweep=sweep), f, indent=1)
    if bad:
        print(f"CHECK FAILED (max err > 2e-2): {[(r['shape'], r['M'], r['max_err']) for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
