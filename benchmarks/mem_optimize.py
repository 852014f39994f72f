#!/usr/bin/env python3
"""Peak extra memory of ``moecomp.optimize`` per weight format at real layer sizes (issue 39).

For each cell (a layer size x a weight format) a one-block model is built from random weights on the device
(``moecomp.testing.blocks.one_block``: transformers' block class, experts drawn and quantized a chunk at a time),
then measured with ``moecomp.testing.PeakMemory`` (on CUDA: ``torch.cuda.max_memory_allocated`` after a reset, less
what was allocated before):

    plain     one plain forward of the block on the verify probe (32 tokens): the working memory a forward needs
    optimize  ``moecomp.optimize(model)``: recognition (FX pass and its numeric check), verify, bind
    scan      ``moecomp.scan(model)`` (``--scan``)
    backend   the first call of ``torch.compile(model, backend="moecomp", dynamic=True)`` (``--backend``)

and checked against the bound: peak extra <= plain + ``policy.WORKING_MEMORY_BYTES`` (1 GiB). Layer sizes:

    deepseek   DeepSeek-V3 (E=256, H=7168, I=2048, top-8; its block: sigmoid + groups, one shared expert)
    gptoss     gpt-oss-120b (E=128, H=2880, I=2880, top-4; its block: swiglu_oai with clamp, biases)
    scout      Llama 4 Scout (E=16, H=5120, I=8192, top-1; a Qwen3-MoE block at those sizes)

Formats: bf16, fp8 (128 x 128 block scales; ``fp8-channel`` per output row), and 4-bit (gpt-oss: MXFP4, the others
int4 with zero points); gpt-oss in FP8 is a Qwen3-MoE block at its sizes (transformers' FP8Experts has no biases).

    PYTHONPATH=. python3 benchmarks/mem_optimize.py --out-json $OUT/mem-optimize.json           # every cell, CUDA
    PYTHONPATH=. python3 benchmarks/mem_optimize.py --cells gptoss:mxfp4,deepseek:fp8 --scan --backend
    python3 benchmarks/mem_optimize.py --device cpu --shrink 32                                  # CPU smoke run

Progress goes to the terminal (one line per stage); the JSON holds every cell, its report line, notes and verdict.
Exit status 1 when a cell exceeds the bound or fails.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SIZES = {  # name: (family, E, H, I, top-k)
    "deepseek": ("deepseek_v3", 256, 7168, 2048, 8),
    "gptoss": ("gpt_oss", 128, 2880, 2880, 4),
    "scout": ("qwen3_moe", 16, 5120, 8192, 1),
}
FOUR_BIT = {"deepseek": "int4", "gptoss": "mxfp4", "scout": "int4"}
DEFAULT_CELLS = [f"{s}:{f}" for s in SIZES for f in ("bf16", "fp8", FOUR_BIT[s])]


def log(msg: str) -> None:
    print(f"[mem] {time.strftime('%H:%M:%S')} {msg}", flush=True)


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB"


def family_of(size: str, fmt: str) -> str:
    fam = SIZES[size][0]
    return "qwen3_moe" if fam == "gpt_oss" and fmt.startswith("fp8") else fam


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device) -> tuple[int, int, float, object]:
    """(peak extra bytes, bytes still held, seconds, fn's result)."""
    from moecomp.testing import PeakMemory

    t = time.perf_counter()
    with PeakMemory(device) as m:
        out = fn()
    return m.peak, m.end, time.perf_counter() - t, out


def run_cell(cell: str, args, device) -> dict:
    import moecomp
    from moecomp.core import policy
    from moecomp.formats.fp8 import plain_fp8
    from moecomp.testing import forward_peak
    from moecomp.testing.blocks import one_block

    size, fmt = cell.split(":")
    fam, E, H, I, k = SIZES[size]
    fam = family_of(size, fmt)
    if args.shrink > 1:
        H, I = max(128, H // args.shrink // 128 * 128), max(128, I // args.shrink // 128 * 128)
    rec = dict(cell=cell, family=fam, format=fmt, E=E, H=H, I=I, top_k=k, bound=policy.working_bytes())
    t = time.perf_counter()
    model = one_block(fam, fmt, E=E, H=H, I=I, k=k, device=device, seed=args.seed)
    rec["build_s"] = round(time.perf_counter() - t, 1)
    rec["block_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    rec["all_experts_fp32_bytes"] = E * 3 * H * I * 4
    if device.type == "cuda":
        rec["device_free_after_build"] = torch.cuda.mem_get_info(device)[0]
    log(f"{cell}: built {fam} E={E} H={H} I={I} k={k} in {rec['build_s']} s: block {gib(rec['block_bytes'])} "
        f"(all experts in fp32 would be {gib(rec['all_experts_fp32_bytes'])})")
    x = policy.probe_input(H, device, torch.bfloat16)
    with plain_fp8(model):
        rec["plain"] = forward_peak(model.mlp, x)
    log(f"{cell}: plain forward {gib(rec['plain'])}")
    limit = rec["plain"] + rec["bound"]
    stages = [("optimize", lambda: moecomp.optimize(model, report=True, fast_generate=False)[1])]
    if args.scan:
        stages.insert(0, ("scan", lambda: moecomp.scan(model)))
    for name, fn in stages:
        release(device)
        peak, end, secs, rep = measure(fn, device)
        b = rep.blocks[0] if rep.blocks else None
        rec[name] = dict(peak=peak, held_after=end, seconds=round(secs, 1), within=peak <= limit,
                         status=b.status if b else None, reason=b.reason if b else None,
                         notes=list(b.notes) if b else [], method=b.method if b else None)
        log(f"{cell}: {name} peak extra {gib(peak)} (limit {gib(limit)}: "
            f"{'ok' if peak <= limit else 'OVER'}) in {secs:.1f} s -> {rec[name]['status']} "
            f"{rec[name]['reason'] or ''}")
        for n in rec[name]["notes"]:
            if "memory" in n or "numeric" in n:
                log(f"{cell}:    note: {n[:300]}")
    if args.backend:
        moecomp.unoptimize(model)
        release(device)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="moecomp", dynamic=True)

        def first_call():
            with torch.no_grad():
                return compiled(x)

        peak, end, secs, _ = measure(first_call, device)
        import moecomp.api.backend as B

        last = B.last_results[-1] if B.last_results else {}
        rec["backend"] = dict(peak=peak, held_after=end, seconds=round(secs, 1), within=peak <= limit,
                              matches=last.get("matches"), rejected=[str(r) for _, r in last.get("rejected", [])])
        log(f"{cell}: backend first call peak extra {gib(peak)} ({'ok' if peak <= limit else 'OVER'}) in {secs:.1f} s, "
            f"{len(last.get('matches') or [])} block(s) rewritten")
    del model
    release(device)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS), help="size:format,... (sizes: "
                    f"{', '.join(SIZES)}; formats: bf16, fp8, fp8-channel, int4, mxfp4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scan", action="store_true", help="measure moecomp.scan too")
    ap.add_argument("--backend", action="store_true", help="measure the compile backend's first call too")
    ap.add_argument("--shrink", type=int, default=1, help="divide H and I by this (CPU smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    from moecomp.core import policy

    result = dict(benchmark="mem-optimize", date=datetime.date.today().isoformat(), args=vars(args),
                  torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  bound=policy.working_bytes(), cells=[], errors=[])
    try:
        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=HERE).stdout.strip()
    except Exception:  # noqa: BLE001
        result["commit"] = None
    log(f"{result['device']}, torch {torch.__version__}, bound {gib(result['bound'])}, commit {result['commit']}")
    for cell in args.cells.split(","):
        try:
            result["cells"].append(run_cell(cell, args, device))
        except Exception as e:  # the cell records the failure; the run goes on
            result["errors"].append(f"{cell}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            result["cells"].append(dict(cell=cell, error=result["errors"][-1]))
            log(f"{cell}: FAILED {result['errors'][-1]}")
            traceback.print_exc()
            release(device)
        if args.out_json:  # after every cell: a run cut short keeps what it measured
            with open(args.out_json, "w") as f:
                json.dump(result, f, indent=2, default=str)
    over = [c["cell"] for c in result["cells"] for s in ("scan", "optimize", "backend")
            if isinstance(c.get(s), dict) and not c[s]["within"]]
    log("| cell | plain | optimize peak extra | within plain + bound | status | seconds |")
    for c in result["cells"]:
        o = c.get("optimize") or {}
        log(f"| {c['cell']} | {gib(c.get('plain'))} | {gib(o.get('peak'))} | {o.get('within')} | {o.get('status')} | "
            f"{o.get('seconds')} |")
    if over:
        log(f"over the bound: {', '.join(over)}")
    return 1 if over or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
