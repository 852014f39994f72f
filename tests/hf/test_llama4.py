"""Llama 4 (``Llama4ForCausalLM`` with a tiny ``Llama4TextConfig``): its MoE multiplies each routed expert's *input*
by the router score (sigmoid of the top-k logits, scattered densely) and runs every expert on every token
(``Llama4TextExperts``, not an ``@use_experts_implementation`` module), next to a shared expert.
``moecomp.optimize`` must rewrite exactly the MoE blocks (layers 0 and 2; layer 1 is a dense MLP) with
``weight_on_input`` specs, one ``moe_forward`` per block, and the logits must equal the original's within 1e-4
relative (fp32, CPU, fresh token ids)."""

import pytest
import torch

import moecomp
from moecomp.coverage import families as F

from .conftest import rel_err

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def tiny_llama4(top_k: int = 1, seed: int = 0):
    cfg = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=3, moe_layers=[0, 2], num_local_experts=8, num_experts_per_tok=top_k,
        vocab_size=128, max_position_embeddings=128, attention_chunk_size=16, use_cache=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the MoE's weights redrawn larger than the init's 0.02, so that routing and experts matter
        for layer in (model.model.layers[i] for i in cfg.moe_layers):
            for name, p in layer.feed_forward.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith("router") else 0.1))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("top_k", [1, 2])
def test_optimize_rewrites_the_moe_blocks(top_k):
    model = tiny_llama4(top_k)
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(2))  # not the probes' tokens
    ref = _logits(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["model.layers.0.feed_forward", "model.layers.2.feed_forward"], str(rep)
    assert len(rep.blocks) == 2 and all(b.method == "fx" for b in rep.rewritten), str(rep)
    for b in rep.rewritten:
        s = b.spec
        assert (s.weight_on_input, s.scoring, s.score_order, s.renormalize, s.top_k) == (
            True, "sigmoid", "topk_then_score", False, top_k), s.describe()
        assert (s.w_layout, s.shared.intermediate_size, s.shared.gate) == ("in_out", 32, "none")
    out, per, total = F.count_calls_per_block(model, lambda: _logits(model, ids))
    assert sorted(per) == ["model.layers.0.feed_forward", "model.layers.2.feed_forward"]
    assert all(n == 1 for n in per.values()) and total == 2
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
    moecomp.unoptimize(model)
    assert torch.equal(_logits(model, ids), ref)
