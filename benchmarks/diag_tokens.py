"""Why do greedy tokens of an optimized bf16 model differ from transformers' at the first step? One forward of the
bench models (real layer sizes, random weights, depth cut), logits of the last position per experts implementation,
and the first MoE block's output against ``reference.py`` in fp32 on the same inputs.

    PYTHONPATH=. python3 benchmarks/diag_tokens.py --models mixtral,qwen3 --layers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import build  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main():
    import moecomp
    from moecomp.oracle import reference
    from moecomp.bind.bind import resolve as _resolve

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mixtral,qwen3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run")
    args = ap.parse_args()
    out = {}
    for name in args.models.split(","):
        dev = torch.device("cpu" if args.tiny else "cuda")
        m = build(name, dev, torch.float32 if args.tiny else torch.bfloat16, args.layers, args.tiny, 0)
        ids = torch.randint(3, m.config.vocab_size, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(1)).to(dev)
        mlp = m.model.layers[0].mlp
        seen = {}
        def grab(mod, a, kw):
            seen.setdefault("x", a[0] if a else kw["hidden_states"])

        h = mlp.register_forward_pre_hook(grab, with_kwargs=True)
        logits, block = {}, {}
        with torch.no_grad():
            for impl in ("eager", "grouped_mm"):
                m.set_experts_implementation(impl)
                seen.clear()
                logits[impl] = m(ids).logits[:, -1].float()
                if impl == "eager":
                    x0 = seen["x"].clone()
                r = mlp(x0)
                block[impl] = (r[0] if isinstance(r, tuple) else r).float()
            m.set_experts_implementation("grouped_mm")
            moecomp.optimize(m, fast_generate=False)
            logits["moecomp"] = m(ids).logits[:, -1].float()
            r = mlp(x0)
            block["moecomp"] = (r[0] if isinstance(r, tuple) else r).float()
            st = mlp._moecomp
            tensors = [None if p is None else _resolve(mlp, p) for p in st.paths]
            ref = reference.moe_forward(x0, *tensors, st.op_spec or st.spec).float()
        h.remove()
        res = {"spec": (st.op_spec or st.spec).key,
               "block_rel_err_vs_fp32_reference": {k: rel(v, ref) for k, v in block.items()},
               "logits_max_abs_diff_vs_eager": {k: float((v - logits["eager"]).abs().max()) for k, v in logits.items()},
               "argmax_same_as_eager": {k: float((v.argmax(-1) == logits["eager"].argmax(-1)).float().mean())
                                        for k, v in logits.items()},
               "logits_std": float(logits["eager"].std()),
               "top2_gap_mean": float((logits["eager"].topk(2).values.diff(dim=-1).abs()).mean())}
        out[name] = res
        print(name, json.dumps(res, indent=1), flush=True)
        del m, seen, x0, tensors, ref
    return out


if __name__ == "__main__":
    main()
