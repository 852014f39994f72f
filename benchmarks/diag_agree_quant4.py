#!/usr/bin/env python3
"""Is moecomp's gpt-oss-120b exact, where greedy tokens cannot tell? (issue 22)

bench_generate_quant4's random-weight gpt-oss-120b disagrees with itself: its bf16 argmax matches its own fp32 copy's
at no position of a 128-token prompt, so greedy tokens and teacher-forced agreement measure bf16 noise there, not
moecomp. This compares logits instead, on the first L layers (default 4) of the same random model, one 128-token
prompt, on CUDA:

    bf16: the forward without moecomp, then after ``moecomp.optimize``: logits and every hidden state, max |diff|;
          and layer 0's MoE block alone on a random input
    fp32: the same model in fp32 without moecomp (bf16's own noise: argmax agreement, max |diff|), and with moecomp

    PYTHONPATH=. python3 benchmarks/diag_agree_quant4.py 4
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moecomp  # noqa: E402
from moecomp.testing.mxfp4_write import gpt_oss_config, random_packed_model  # noqa: E402
L = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = gpt_oss_config("120b")
cfg.num_hidden_layers, cfg.layer_types = L, cfg.layer_types[:L]
model = random_packed_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
ids = torch.randint(3, cfg.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).cuda()
def fwd():
    with torch.no_grad():
        o = model(input_ids=ids, output_hidden_states=True)
    return o.logits.float(), [h.float() for h in o.hidden_states]
ref, hr = fwd()
mlp0 = model.model.layers[0].mlp
x0 = torch.randn(1, 16, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    m_ref = mlp0(x0)
m_ref = m_ref[0] if isinstance(m_ref, tuple) else m_ref
moecomp.optimize(model)
got, hg = fwd()
with torch.no_grad():
    m_got = mlp0(x0)
m_got = m_got[0] if isinstance(m_got, tuple) else m_got
print("mlp0 random x: max diff", (m_got.float() - m_ref.float()).abs().max().item(), "max", m_ref.float().abs().max().item())
print("logit max abs diff", (got - ref).abs().max().item(), "ref max", ref.abs().max().item())
print("argmax agree", (got.argmax(-1) == ref.argmax(-1)).float().mean().item())
t2 = ref.topk(2, -1).values
print("ref top2 margin median", (t2[..., 0] - t2[..., 1]).median().item())
for i, (a, b) in enumerate(zip(hr, hg)):
    print(i, "hidden max", a.abs().max().item(), "rms", a.pow(2).mean().sqrt().item(), "diff", (a - b).abs().max().item())
del model
torch.cuda.empty_cache()
m32 = random_packed_model(cfg, device="cuda", dtype=torch.float32, seed=0).eval()
with torch.no_grad():
    r32 = m32(input_ids=ids).logits.float()
print("fp32 (no moecomp) vs bf16 (no moecomp): argmax agree", (r32.argmax(-1) == ref.argmax(-1)).float().mean().item(),
      "max diff", (r32 - ref).abs().max().item())
print("fp32 (no moecomp) vs bf16 moecomp: argmax agree", (r32.argmax(-1) == got.argmax(-1)).float().mean().item(),
      "max diff", (r32 - got).abs().max().item())
moecomp.optimize(m32)
with torch.no_grad():
    g32 = m32(input_ids=ids).logits.float()
print("fp32 moecomp vs fp32 no moecomp: argmax agree", (r32.argmax(-1) == g32.argmax(-1)).float().mean().item(),
      "max diff", (r32 - g32).abs().max().item())
