#!/usr/bin/env python3
"""The opt-in "mma" K-step form of the 4-bit experts (MOECOMP_W4_FORM=mma: ``ops/w4_layout.py``,
``kernels/quant4_mma.py``) against the default MXFP4 forms and bf16, on a gpt-oss-120b layer (E 128, H = I = 2880,
top-4, swiglu_oai, biases). CUDA only; prints a markdown table (us, CUDA-graph replay, ``do_bench`` median) and
writes JSON with --out-json.

    paths   w4 (the default: the tuned table / heuristic, GEMV decode up to 8 tokens, else the aligned dot_scaled
            form), w4 direct (the decode path's DIRECT gemm1 + down-combine or gemm2 DIRECT, MOECOMP_W4_DECODE=dot,
            with the device's default K-step form), w4 direct mma (the same with MOECOMP_W4_FORM=mma: the re-laid
            weights into a swap-AB tl.dot, N side 16 rows, row 0 the pair), w4 scaled / interleave (the aligned
            path's forms, MOECOMP_DECODE_MAX_T=0), w4 mma (MOECOMP_W4_FORM=mma, MOECOMP_DECODE_MAX_T=0: the aligned
            path at every T), w4 gemv (the GEMV decode kernels forced, MOECOMP_W4_DECODE=gemv, on the packed
            weights), w4 gemv mma (the same on the weights held in the mma layout: ``QuantSpec.layout`` "mma",
            re-laid once as ``optimize`` does with MOECOMP_W4_FORM=mma), w4 held mma (no switch, the weights held in
            the mma layout: what the op runs once the layout is held, the GEMV up to the decode limit and the mma
            form above it; against "w4" the question whether mma becomes the default layout), bf16 (the same layer
            unquantized). The "direct" and "gemv" paths force the decode path at every T
            (MOECOMP_DECODE_MAX_T=1024); --paths picks some.
    err     each 4-bit path against ``moecomp.oracle.reference`` (fp32, the same packed tensors), rel. Frobenius

    PYTHONPATH=. python3 benchmarks/diag_w4_mma.py --tokens 1,4,16,64,128 --out-json /tmp/w4mma.json
    PYTHONPATH=. python3 benchmarks/diag_w4_mma.py --decode --out-json /tmp/w4mma-decode.json
            (= --tokens 1,2,4,8 --paths "w4,w4 gemv,w4 gemv mma,w4 held mma,w4 direct,w4 direct mma,w4 mma,bf16":
            the batch-1 question, issue 42)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from diag_quant4 import env, gpt_oss, pack, time_op  # noqa: E402

from moecomp.core.args import MOE_ARGS  # noqa: E402
from moecomp.oracle import reference  # noqa: E402
from moecomp.testing import random_moe_args  # noqa: E402

ALIGNED = {"MOECOMP_DECODE_MAX_T": "0"}
DIRECT = {"MOECOMP_DECODE_MAX_T": "1024", "MOECOMP_W4_DECODE": "dot"}
GEMV = {"MOECOMP_DECODE_MAX_T": "1024", "MOECOMP_W4_DECODE": "gemv"}
PATHS = {  # label -> environment (4-bit paths); "bf16" is the unquantized layer
    "w4": {},
    "w4 gemv": GEMV,
    "w4 gemv mma": GEMV,
    "w4 held mma": {},
    "w4 direct": DIRECT,
    "w4 direct mma": {"MOECOMP_W4_FORM": "mma", **DIRECT},
    "w4 scaled": {"MOECOMP_W4_FORM": "dot_scaled", **ALIGNED},
    "w4 interleave": {"MOECOMP_W4_FORM": "interleave", **ALIGNED},
    "w4 mma": {"MOECOMP_W4_FORM": "mma", **ALIGNED},
}
HELD_MMA = ("w4 gemv mma", "w4 held mma")  # run on the weights held in the mma layout (spec layout "mma")
LABELS = (*PATHS, "bf16")
DECODE = dict(tokens="1,2,4,8", paths="w4,w4 gemv,w4 gemv mma,w4 held mma,w4 direct,w4 direct mma,w4 mma,bf16")
RATIOS = ("w4", "w4 held mma", "w4 direct mma", "w4 mma")  # bf16's time over theirs


def held_mma(spec, t4: dict) -> tuple:
    """(spec with layout "mma", tensors with w13 / w2 in the mma layout: ``w4_layout.relayout`` copies, as
    ``optimize`` re-lays them in place)."""
    import dataclasses

    from moecomp.ops import w4_layout

    t = dict(t4, w13=w4_layout.relayout(t4["w13"], spec.quant), w2=w4_layout.relayout(t4["w2"], spec.quant))
    return spec.replace(quant=dataclasses.replace(spec.quant, layout="mma")), t


def _err(x, t4: dict, spec, extra: dict, kv: dict) -> float:
    with env(**kv):
        out = torch.ops.moecomp.moe_forward(x, *(t4[n] for n in MOE_ARGS), spec.key, **extra)
    ref = reference.moe_forward(x, *(t4[n] for n in MOE_ARGS), spec, **extra)
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run(tokens: list[int], check: bool, labels=LABELS) -> list[dict]:
    spec = gpt_oss(128)
    raw = random_moe_args(spec, max(tokens), torch.bfloat16, "cuda", std=0.02, seed=0)
    t16 = dict(zip(MOE_ARGS, raw[1:]))
    t4, extra4 = pack(spec, t16)
    spec_m, t4m = held_mma(spec, t4) if any(n in HELD_MMA for n in labels) else (None, None)
    rows = []
    for T in tokens:
        x = raw[0][:T].contiguous()
        rec = {"T": T}
        for label, kv in [(n, PATHS.get(n)) for n in labels]:
            try:
                if kv is None:
                    rec[label] = time_op(x, t16, spec.replace(quant=None), {})
                    continue
                s, t = (spec_m, t4m) if label in HELD_MMA else (spec, t4)
                with env(**kv):
                    rec[label] = time_op(x, t, s, extra4)
                if check:
                    rec[f"{label} err"] = _err(x, t, s, extra4, kv)
            except Exception as e:  # one path failing (compile, memory) is reported, the rest still run
                rec[label] = None
                rec[f"{label} error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    return rows


def table(rows: list[dict], labels=LABELS) -> str:
    """us per path (err under it when checked), then bf16's time over each of ``RATIOS``' (those timed)."""
    ratios = [a for a in RATIOS if a in labels and "bf16" in labels]
    head = [*labels, *(f"bf16 / {a}" for a in ratios)]
    out = ["| T | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for r in rows:
        cells = []
        for k in labels:
            err = r.get(f"{k} err")
            cells.append((f"{r[k]:.1f}" if r.get(k) else "fail") + (f" ({err:.1e})" if err is not None else ""))
        cells += [f"{r['bf16'] / r[a]:.2f}x" if r.get(a) and r.get("bf16") else "-" for a in ratios]
        out.append(f"| {r['T']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="default 1,4,16,64,128 (--decode: 1,2,4,8)")
    ap.add_argument("--paths", default=None, help=f"comma-separated labels of {list(LABELS)} (default all)")
    ap.add_argument("--decode", action="store_true", help=f"the decode question's preset: {DECODE}")
    ap.add_argument("--no-check", action="store_true", help="skip the error against the reference")
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    tokens = a.tokens or (DECODE["tokens"] if a.decode else "1,4,16,64,128")
    labels = tuple((a.paths or (DECODE["paths"] if a.decode else ",".join(LABELS))).split(","))
    unknown = [n for n in labels if n not in LABELS]
    if unknown:
        ap.error(f"--paths: unknown {unknown}; expected labels of {list(LABELS)}")
    if not torch.cuda.is_available():
        print("diag_w4_mma.py needs CUDA")
        return 1
    import moecomp.ops  # noqa: F401  (registers torch.ops.moecomp)

    rows = run([int(t) for t in tokens.split(",")], not a.no_check, labels)
    print(f"\n{torch.cuda.get_device_name()}, gpt-oss-120b layer, us (CUDA-graph replay, median; rel. err against "
          "the fp32 reference)\n")
    print(table(rows, labels))
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "paths": {n: PATHS.get(n) for n in labels},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
