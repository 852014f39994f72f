#!/usr/bin/env python3
"""Does the FP8 format alone give low greedy agreement on a random-weight DeepSeek-V3-width model? (CPU, ~5 min)

Real hidden / attention / vocab sizes, 16 routed experts instead of 256, 2 layers, bf16, random N(0, 0.02) weights
(``bench_generate.build``). On CPU the op's path is the dequantized reference with activations quantized, so the
agreement printed is the format's own effect, no kernel's. Prints the top-1 margin of the bf16 model's logits (in
units of their std) and the FP8 model's teacher-forced agreement with the bf16 model's greedy tokens.

    python3 benchmarks/diag_fp8_agreement.py
"""
import sys, time, torch
import os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE); sys.path.insert(0, os.path.dirname(HERE))
import bench_generate as bg
import bench_generate_fp8 as bf
import moecomp
from moecomp.testing.fp8_convert import to_fp8
torch.set_num_threads(2)
sizes = dict(bg.MODELS["deepseek"][3]); sizes.update(n_routed_experts=16, n_group=4, topk_group=2)
bg.MODELS["deepseek"] = (bg.MODELS["deepseek"][0], bg.MODELS["deepseek"][1], 2, sizes)
t = time.time()
model = bg.build("deepseek", "cpu", torch.bfloat16, 2, False, 0)
print("built", time.time() - t, flush=True)
S, n = 24, 16
for B in (1, 4):
    ids = torch.randint(3, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(B))
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        logits = model(input_ids=seq[:, :-1]).logits[:, S - 1:].float()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]) / logits.std(dim=-1)
    print(f"B={B} bf16 top-1 margin / logit std: median {margin.median():.3f}", flush=True)
    if B == 1:
        seqs = {}
    seqs[B] = seq
to_fp8(model)
moecomp.optimize(model)
for B, seq in seqs.items():
    print(f"B={B} fp8 (CPU path: dequantized reference, activations quantized) teacher-forced agreement "
          f"{bf.teacher_forced_agreement(model, seq, S):.3f}", flush=True)
