"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, tiny: ``coverage/families.py``'s config, ``mlp_layer_types = [hash_moe, moe]``):
layer 0's MoE block routes by its router's frozen table ``tid2eid[input_ids]`` (the weights its sqrt(softplus)
scores there, renormalised, x1.5), layer 1's by a biased top-k. ``moecomp.optimize`` must rewrite both, layer 0 with
a ``hash_routing`` spec found by the FX pass, the table bound as the router's buffer and the token ids as the block
forward's ``input_ids`` (which the decoder layer passes it), exactly one ``moe_forward`` per block, and the logits
within 1e-4 relative of the original's (fp32, CPU, fresh token ids). Writes to the table reach the op (a buffer of
the block, read on every call); under ``torch.compile`` the bound block reads the ids as a graph input (two calls of
one compiled graph with different ids give each call's own result)."""

import copy

import pytest
import torch

import moecomp
from moecomp.coverage import families as F
from moecomp.core.match import forward_arg

from .conftest import rel_err

pytest.importorskip("transformers")
TOL = 1e-4


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_optimize_rewrites_the_hash_and_the_topk_block(poison):
    model, _ = F.build_tiny("deepseek_v4")  # the table gets random experts (its init is zeros)
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(21))  # not the probes' tokens
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["model.layers.0.mlp", "model.layers.1.mlp"], str(rep)
    assert len(rep.blocks) == 2
    hb, tb = rep.rewritten
    assert hb.method == "fx" and hb.spec.hash_routing and not tb.spec.hash_routing, str(rep)
    s = hb.spec
    assert (s.scoring, s.renormalize, s.renorm_eps, s.routed_scaling_factor, s.top_k, s.has_correction_bias) == (
        "sqrtsoftplus", True, 1e-20, 1.5, 2, False), s.describe()
    st = model.model.layers[0].mlp._moecomp
    assert (st.bindings["hash_table"], st.bindings["token_ids"]) == ("gate.tid2eid", forward_arg("input_ids"))
    out, per, total = F.count_calls_per_block(model, lambda: _logits(model, ids))
    assert per == {"model.layers.0.mlp": 1, "model.layers.1.mlp": 1} and total == 2
    assert torch.isfinite(out).all() and rel_err(out, _logits(ref, ids)) <= TOL
    # the table is read on every call: a write to it changes both models alike
    for m in (model, ref):
        with torch.no_grad():
            m.model.layers[0].mlp.gate.tid2eid.copy_(m.model.layers[0].mlp.gate.tid2eid.roll(1, -1).flip(0))
    out2, ref2 = _logits(model, ids), _logits(ref, ids)
    assert rel_err(out2, ref2) <= TOL and rel_err(out2, out) > 10 * TOL
    # compiled, the bound block takes the ids as a graph input
    blk, orig = model.model.layers[0].mlp, ref.model.layers[0].mlp
    graphs = []
    compiled = torch.compile(blk, backend=lambda gm, ex: (graphs.append(gm), gm.forward)[1], fullgraph=True,
                             dynamic=False)
    x = torch.randn(2, 4, blk.gate.weight.shape[1], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for seed in (1, 2):
            tok = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(seed))
            assert rel_err(compiled(x, input_ids=tok), orig(x, input_ids=tok)) <= TOL
    op = torch.ops.moecomp.moe_forward
    ops = [n for n in graphs[0].graph.nodes if n.target in (op, op.default)]
    assert len(graphs) == 1 and len(ops) == 1
    assert ops[0].args[-1].op == "placeholder" and "input_ids" in ops[0].args[-1].name  # token_ids: a graph input
