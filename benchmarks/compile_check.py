"""GPU check of the compile entry point: ``torch.compile(model, backend="moecomp", mode="reduce-overhead")``.

Builds random-weight models with real layer sizes (2 layers, smaller vocab), bf16:
  - Qwen3-MoE at Qwen3-30B-A3B sizes (E=128, top-8, no shared expert),
  - Qwen2-MoE at Qwen1.5-MoE-A2.7B sizes (E=60, top-4, gated shared expert: FSE + side-stream overlap),
and for a decode-like batch ([8, 1] tokens) and a prefill ([1, 128]) runs
  - eager (HF default experts),
  - torch.compile default backend, mode="reduce-overhead" (static shapes),
  - torch.compile backend="moecomp", mode="reduce-overhead" (static shapes),
  - torch.compile backend="moecomp", mode="reduce-overhead", dynamic=True (one compile serves both shapes),
checks that moecomp's logits match eager (bf16: relative error < 2e-2), that every MoE block became one
moe_forward (moecomp.counters), that Inductor recorded no cudagraph skips, and prints do_bench medians.
Exit status 1 if any check fails.

    PYTHONPATH=. python3 benchmarks/compile_check.py [qwen3 qwen2]
"""

from __future__ import annotations

import json
import os
import time

import torch
from triton.testing import do_bench


LAYERS = 2


def build(name):
    import transformers as tf

    if name == "qwen3":
        cfg = tf.Qwen3MoeConfig(
            hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
            num_experts_per_tok=8, num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, vocab_size=32000, norm_topk_prob=True, max_position_embeddings=4096,
        )
        cls = tf.Qwen3MoeForCausalLM
    elif name == "qwen2":
        cfg = tf.Qwen2MoeConfig(
            hidden_size=2048, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
            num_experts_per_tok=4, intermediate_size=5632, num_hidden_layers=LAYERS, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=32000, norm_topk_prob=False, max_position_embeddings=4096,
        )
        cls = tf.Qwen2MoeForCausalLM
    else:
        raise SystemExit(f"unknown model {name!r} (qwen3, qwen2)")
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16).eval()
    g = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    return model


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main(argv=None):
    import sys

    import moecomp
    from torch._dynamo.utils import counters as dyn_counters

    names = (sys.argv[1:] if argv is None else argv) or ["qwen3", "qwen2"]
    shapes = {"decode [8,1]": (8, 1), "prefill [1,128]": (1, 128)}
    res, failures = {}, []
    out_dir = os.environ.get("OUT")

    def run_compiled(cm, ids):
        for _ in range(3):
            out = cm(ids).logits.clone()
        torch.cuda.synchronize()
        return out

    for mname in names:
        model = build(mname)
        dyn_model = None
        with torch.no_grad():
            for sname, shp in shapes.items():
                ids = torch.randint(0, 32000, shp, device="cuda")
                eager = model(ids).logits
                row = {"eager_ms": do_bench(lambda: model(ids), return_mode="median")}
                for variant in ("inductor", "moecomp", "moecomp_dynamic"):
                    if variant != "moecomp_dynamic" or dyn_model is None:
                        torch._dynamo.reset()
                    moecomp.counters.clear()
                    dyn_counters.clear()
                    if variant == "moecomp_dynamic":
                        if dyn_model is None:  # one dynamic compile, reused for the second shape
                            dyn_model = torch.compile(model, backend="moecomp", mode="reduce-overhead", dynamic=True)
                        cm = dyn_model
                    else:
                        cm = torch.compile(model, backend=variant, mode="reduce-overhead")
                    t0 = time.time()
                    out = run_compiled(cm, ids)
                    row[f"{variant}_compile_s"] = round(time.time() - t0, 1)
                    row[f"{variant}_rel_err"] = rel(out, eager)
                    row[f"{variant}_ms"] = do_bench(lambda: cm(ids), return_mode="median")
                    row[f"{variant}_cudagraph_skips"] = dict(dyn_counters["inductor"]).get("cudagraph_skips", 0)
                    row[f"{variant}_recompiles"] = dict(dyn_counters["stats"]).get("unique_graphs", 0)
                    if variant != "inductor":
                        snap = moecomp.counters.snapshot()
                        row[f"{variant}_counters"] = snap
                        replaced = snap.get("rewrite_moe", {}).get("replaced", 0)
                        fresh = variant == "moecomp" or sname == next(iter(shapes))
                        if fresh and replaced != LAYERS:
                            failures.append(f"{mname} {sname} {variant}: {replaced} blocks replaced, want {LAYERS}")
                        # dynamic=True still specialises sizes 0 and 1 (torch's rule): [8,1] -> [1,128] flips both
                        # dims across 1, so a recompile there is expected and only recorded, not a failure.
                        first = shapes[next(iter(shapes))]
                        ones_same = [d == 1 for d in first] == [d == 1 for d in shp]
                        if not fresh and ones_same and snap.get("backend", {}).get("graphs", 0):
                            failures.append(f"{mname} {sname} {variant}: recompiled for a new shape")
                    if row[f"{variant}_rel_err"] > 2e-2:
                        failures.append(f"{mname} {sname} {variant}: rel err {row[f'{variant}_rel_err']:.2e}")
                    if row[f"{variant}_cudagraph_skips"]:
                        failures.append(f"{mname} {sname} {variant}: cudagraph skips")
                res[f"{mname} {sname}"] = row
                print(mname, sname, json.dumps(row, default=str), flush=True)
                if out_dir:
                    with open(os.path.join(out_dir, "compile_check.json"), "w") as f:
                        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                   "commit": os.environ.get("MOECOMP_COMMIT", "?"), "results": res,
                                   "failures": failures}, f, indent=1, default=str)
        del model, dyn_model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print("\n| model, shape | eager ms | inductor r-o ms | moecomp r-o ms | moecomp dynamic r-o ms | "
          "moecomp / inductor | rel err (static / dynamic) | cudagraph skips |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        skips = r["inductor_cudagraph_skips"] + r["moecomp_cudagraph_skips"] + r["moecomp_dynamic_cudagraph_skips"]
        print(f"| {name} | {r['eager_ms']:.3f} | {r['inductor_ms']:.3f} | {r['moecomp_ms']:.3f} | "
              f"{r['moecomp_dynamic_ms']:.3f} | {r['moecomp_ms'] / r['inductor_ms']:.2f}x | "
              f"{r['moecomp_rel_err']:.1e} / {r['moecomp_dynamic_rel_err']:.1e} | {skips} |")
    print("FAILURES:" if failures else "all checks passed", *failures, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
