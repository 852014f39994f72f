#!/usr/bin/env python3
"""Where an FP8 model's optimized forward leaves its dequantized reference, module by module (issue 19).

The model of ``bench_generate_fp8.py`` (random weights, real layer sizes, depth cut) is quantized in place
(``to_fp8``) and optimized; one forward over a prompt records every interesting module's inputs and output
(the FP8 linears, the attention blocks, the MoE / dense MLP blocks, the decoder layers). Then ``unoptimize`` and
``plain_fp8`` (every FP8 module in plain PyTorch, activations quantized the same way) rerun each module alone on
the recorded inputs: the relative error of each module's output against its reference, with its own inputs (no
upstream error carried). A kernel error shows as one module far above the rest; the format's own error is not in
these numbers (both sides quantize the same way), only summation order and the bf16 roundings.

    PYTHONPATH=. python3 benchmarks/diag_fp8_modules.py --model deepseek --tokens 1,16
    python3 benchmarks/diag_fp8_modules.py --model deepseek --tiny --device cpu    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_generate as bg  # noqa: E402

# decoder layers, attention blocks and their projections, MLP blocks; nothing inside an MoE block (a hook on its
# router, experts or shared experts makes the bound block run its original forward)
WATCH = re.compile(r"layers\.\d+(\.self_attn(\.[a-z_]+proj[a-z_]*)?|\.mlp)?$")


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _clone(v):
    if torch.is_tensor(v):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


def run(args) -> dict:
    import moecomp
    from moecomp.formats.fp8 import plain_fp8
    from moecomp.testing.fp8_convert import to_fp8

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = bg.build(args.model, device, dtype, args.depth, args.tiny, args.seed)
    to_fp8(model)
    report = moecomp.optimize(model)
    names = {m: n for n, m in model.named_modules() if WATCH.search(n)}
    result = dict(model=args.model, report=str(report)[:1500], tokens={})
    for T in args.tokens:
        g = torch.Generator(device="cpu").manual_seed(args.seed + T)
        ids = torch.randint(3, model.config.vocab_size, (1, T), generator=g).to(device)
        rec = {}

        def hook(mod, a, kw, out):
            rec[names[mod]] = (_clone(a), _clone(kw), _clone(_first(out)))

        hs = [m.register_forward_hook(hook, with_kwargs=True) for m in names]
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits
        finally:
            for h in hs:
                h.remove()
        moecomp.unoptimize(model)
        rows = {}
        with torch.no_grad(), plain_fp8(model):
            ref_logits = model(input_ids=ids, use_cache=False).logits
            for m, n in names.items():
                if n not in rec:
                    continue
                a, kw, out = rec[n]
                try:
                    want = _first(m(*a, **kw))
                except Exception as e:  # a module that cannot run alone (reported, the others go on)
                    rows[n] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                    continue
                rows[n] = dict(rel=_rel(out, want), kind=type(m).__name__, shape=list(out.shape))
        moecomp.optimize(model)
        agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        result["tokens"][T] = dict(modules=rows, logits_rel=_rel(logits, ref_logits), argmax_agreement=agree)
        print(f"[T={T}] logits rel err {result['tokens'][T]['logits_rel']:.2e}, argmax agreement {agree:.3f}")
        for n, r in rows.items():
            flag = "  <<<" if r.get("rel", 0) > args.flag else ""
            print(f"  {n:48s} {r.get('kind', ''):28s} {r.get('rel', float('nan')):9.2e} "
                  f"{r.get('error', '')}{flag}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flag", type=float, default=2e-2, help="mark modules further than this from the reference")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    res = run(args)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
