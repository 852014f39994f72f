"""GPU check of the compile entry point: ``torch.compile(model, backend="moecomp", mode="reduce-overhead")``.

Builds a random-weight Qwen3-MoE model with the real layer sizes of Qwen3-30B-A3B (2 layers, smaller vocab), bf16,
and for a decode-like batch ([8, 1] tokens) and a prefill ([1, 128]):
  - eager logits (HF default experts),
  - torch.compile default backend, mode="reduce-overhead",
  - torch.compile backend="moecomp", mode="reduce-overhead",
checks that moecomp's logits match eager (bf16: relative error < 2e-2), that every MoE block became one
moe_forward (moecomp.counters), that Inductor recorded no cudagraph skips, and prints do_bench medians.

    PYTHONPATH=. python3 benchmarks/compile_check.py
"""

from __future__ import annotations

import json
import os
import time

import torch
from triton.testing import do_bench


def build(layers=2):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=32000, norm_topk_prob=True, max_position_embeddings=4096,
    )
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    return model


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main():
    import moecomp
    from torch._dynamo.utils import counters as dyn_counters

    model = build()
    shapes = {"decode [8,1]": (8, 1), "prefill [1,128]": (1, 128)}
    res = {}
    with torch.no_grad():
        for name, shp in shapes.items():
            ids = torch.randint(0, 32000, shp, device="cuda")
            eager = model(ids).logits
            row = {"eager_ms": do_bench(lambda: model(ids), return_mode="median")}
            for backend in ("inductor", "moecomp"):
                torch._dynamo.reset()
                moecomp.counters.clear()
                dyn_counters.clear()
                cm = torch.compile(model, backend=backend, mode="reduce-overhead")
                t0 = time.time()
                for _ in range(3):
                    out = cm(ids).logits.clone()
                torch.cuda.synchronize()
                row[f"{backend}_compile_s"] = round(time.time() - t0, 1)
                row[f"{backend}_rel_err"] = rel(out, eager)
                row[f"{backend}_ms"] = do_bench(lambda: cm(ids), return_mode="median")
                row[f"{backend}_cudagraph_skips"] = dict(dyn_counters["inductor"]).get("cudagraph_skips", 0)
                if backend == "moecomp":
                    row["moecomp_counters"] = {k: dict(v) for k, v in moecomp.counters.items()}
            res[name] = row
            print(name, json.dumps(row, indent=1, default=str), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "compile_check.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("\n| shape | eager ms | inductor r-o ms | moecomp r-o ms | moecomp rel err | cudagraph skips (ind/moe) |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['eager_ms']:.3f} | {r['inductor_ms']:.3f} | {r['moecomp_ms']:.3f} | "
              f"{r['moecomp_rel_err']:.1e} | {r['inductor_cudagraph_skips']}/{r['moecomp_cudagraph_skips']} |")


if __name__ == "__main__":
    main()
