"""LongCat-Flash (``LongcatFlashForCausalLM`` with a tiny ``LongcatFlashConfig``): its MoE (``LongcatFlashMoE``, the
``mlp`` of each decoder layer) routes over ``n_routed_experts + zero_expert_num`` outputs of an fp32 router
(softmax scores, a correction bias for the choice only, times ``routed_scaling_factor``, no renormalisation) and an
id >= n_routed_experts is a zero-computation expert: the token itself times its weight. Two spellings, by
transformers version:

* up to 5.24 the experts module does it: its loop over the experts hit (``int(idx.item())``) adds the token for ids
  >= E, so the FX pass traces it with real values; ``gate_up_proj`` holds E + Z experts, ``down_proj`` E: the op
  reads a view of gate_up_proj's first E (no copy);
* from 5.25 the block does it: the identity term is the weights at ids >= E summed, times x; those slots go to the
  experts (decorated, traced as grouped_mm) as dummy ids ``(id - E) * E // Z`` with weight 0; both weights hold E
  experts and are bound as they are (the router [E + Z, H] next to experts of E: ``BlockParts.extra_rows``).
  That spelling in modules of our own, independent of transformers' version: tests/passes/test_detect_zero_remap.py.

``moecomp.optimize`` must rewrite exactly the two MoE blocks with ``zero_experts`` specs, one ``moe_forward`` per
block, and the logits must equal the original's within 1e-4 relative (fp32, CPU, fresh token ids, on routings where
zero experts are taken), on the torch path and on the Triton kernels (interpreter)."""

import copy

import pytest
import torch

import moecomp
from moecomp.core.derived import get_path
from moecomp.coverage import families as F

from .conftest import rel_err

transformers = pytest.importorskip("transformers")
TOL = 1e-4
E = 8


def tiny_longcat(top_k: int, zero: int, seed: int = 0):
    cfg = transformers.LongcatFlashConfig(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=96,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
        moe_topk=top_k, n_routed_experts=E, zero_expert_num=zero, expert_ffn_hidden_size=32, vocab_size=128,
        max_position_embeddings=128, routed_scaling_factor=2.5, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LongcatFlashForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the MoE's weights redrawn larger than the init's 0.02, so that routing and experts matter
        for layer in model.model.layers:
            for name, p in layer.mlp.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith("router") else 0.1))
            bias = layer.mlp.router.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _picked(model, ids) -> torch.Tensor:
    """Every expert id the routers pick on ``ids`` (the original forward): the router's one integer output (its
    position in the output tuple differs between transformers versions)."""
    got = []

    def ids_of(out):
        (t,) = [o for o in out if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        return t.reshape(-1)

    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: got.append(ids_of(out)))
             for layer in model.model.layers]
    try:
        _logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(got)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("top_k,zero", [(2, 2), (3, 4)])
def test_optimize_rewrites_the_moe_blocks(monkeypatch, backend, top_k, zero):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    model = tiny_longcat(top_k, zero)
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(2))  # not the probes' tokens
    picked = _picked(model, ids)
    assert (picked >= E).any() and (picked < E).any(), "the input must reach zero experts and real ones"
    ref = _logits(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["model.layers.0.mlp", "model.layers.1.mlp"], str(rep)
    assert len(rep.blocks) == 2 and all(b.method == "fx" for b in rep.rewritten), str(rep)
    for b in rep.rewritten:
        s = b.spec
        assert (s.num_experts, s.zero_experts, s.top_k, s.scoring, s.has_correction_bias, s.renormalize) == (
            E, zero, top_k, "softmax", True, False), s.describe()
        assert (s.routed_scaling_factor, s.router_fp32, s.shared) == (2.5, True, None), s.describe()
    assert all(b.extra_bytes == 0 for b in rep.rewritten), str(rep)
    for layer in model.model.layers:  # w13: gate_up_proj itself, or (E + Z experts held) a view of its first E
        blk = layer.mlp
        src = blk.experts.gate_up_proj
        w13 = get_path(blk, blk._moecomp.bindings["w13"])
        assert src.shape[0] in (E, E + zero) and (w13 is src) == (src.shape[0] == E)
        assert w13.shape == (E,) + tuple(src.shape[1:])
        assert w13.data_ptr() == src.data_ptr() and w13.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    out, per, total = F.count_calls_per_block(model, lambda: _logits(model, ids))
    assert sorted(per) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(n == 1 for n in per.values()) and total == 2
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
    moecomp.unoptimize(model)
    assert torch.equal(_logits(model, ids), ref)


def test_weight_writes_reach_the_op():
    """The view follows in-place writes to gate_up_proj; a replaced Parameter is picked up on the next call."""
    model = tiny_longcat(2, 2)
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(3))
    moecomp.optimize(model)
    outs = []
    for m in (model, twin):
        blk = m.model.layers[0].mlp
        with torch.no_grad():
            blk.experts.gate_up_proj.mul_(1.5)
            first = _logits(m, ids)
            blk.experts.gate_up_proj = torch.nn.Parameter(blk.experts.gate_up_proj.detach() * 0.5)
            outs.append((first, _logits(m, ids)))
    (a, b), (ra, rb) = outs
    assert rel_err(a, ra) <= TOL and rel_err(b, rb) <= TOL and rel_err(a, b) > 10 * TOL
