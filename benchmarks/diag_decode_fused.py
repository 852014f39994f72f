#!/usr/bin/env python3
"""The one-launch decode path (MOECOMP_DECODE_FUSED=1, ``ops/decode_fused.py``) against the two-kernel decode path
of the kernel table, on the five layer presets (bf16, real sizes) at T = 1, 2, 4: the whole op
(``torch.ops.moecomp.moe_forward``, router and routing included) replayed in a CUDA graph
(``triton.testing.do_bench_cudagraph``), each output checked against ``moecomp.reference.moe_forward`` (fp32
reference; tolerance 2e-2 on bf16), and the floor (expert bytes the routing touched + router, at 4.25 TB/s).

    PYTHONPATH=. python3 benchmarks/diag_decode_fused.py --out-json /tmp/decode_fused.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COPY_BPS = 4.25e12


def main(argv=None) -> int:
    import triton.testing as tt

    from moecomp import reference
    from moecomp.ops.common import MOE_ARGS
    from moecomp.testing import LAYER_PRESETS, random_moe_args

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--presets", default=",".join(LAYER_PRESETS))
    ap.add_argument("--out-json", default=None)
    a = ap.parse_args(argv)
    rows = []
    print("| preset | T | two-kernel us | one-launch us | one / two | floor us | one-launch / floor | err two | err one |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.presets.split(","):
        spec = LAYER_PRESETS[name]
        for T in [int(t) for t in a.tokens.split(",")]:
            args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T)
            ref = reference.moe_forward(*args, spec=spec).float()
            res = {}
            for form, env in (("two", "0"), ("one", "1")):
                os.environ["MOECOMP_DECODE_FUSED"] = env
                fn = lambda: torch.ops.moecomp.moe_forward(*args, spec.key)  # noqa: E731
                y = fn().float()
                res[form] = (tt.do_bench_cudagraph(fn, rep=50) * 1e3, float((y - ref).norm() / ref.norm()))
            t = dict(zip(MOE_ARGS, args[1:]))
            logits = args[0].float() @ t["router_w"].float().T
            touched = len(set(torch.topk(logits, spec.top_k, dim=-1).indices.reshape(-1).tolist()))
            per_expert = (t["w13"][0].numel() + t["w2"][0].numel()) * 2
            shared = sum(t[n].numel() * 2 for n in ("shared_w1", "shared_w3", "shared_w2") if t.get(n) is not None)
            floor = (touched * per_expert + shared + t["router_w"].numel() * 2) / COPY_BPS * 1e6
            rows.append(dict(preset=name, T=T, two_us=res["two"][0], one_us=res["one"][0], floor_us=floor,
                             err_two=res["two"][1], err_one=res["one"][1]))
            print(f"| {name} | {T} | {res['two'][0]:.1f} | {res['one'][0]:.1f} | {res['one'][0] / res['two'][0]:.2f}x "
                  f"| {floor:.1f} | {res['one'][0] / floor:.2f}x | {res['two'][1]:.1e} | {res['one'][1]:.1e} |",
                  flush=True)
    os.environ.pop("MOECOMP_DECODE_FUSED", None)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(dict(rows=rows, gpu=torch.cuda.get_device_name(), commit=os.environ.get("MOECOMP_COMMIT")), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
