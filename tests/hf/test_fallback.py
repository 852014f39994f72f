"""The attribute fallback: block discovery, static and measured specs, agreement with the FX pass, meta scans."""

import pytest
import torch

import moecomp
from moecomp.coverage import families as F
from moecomp.recognise import fallback as fb
from moecomp.probe.activations import activation_mismatch
from moecomp.recognise.structure import iter_blocks
from moecomp.core.match import Match
from moecomp.recognise.recognise import fx_available, recognise
from moecomp.verify.verify import fit_routed_scale, verify


def fallback_spec(block, parts, x):
    """The attribute reader's spec, measured on ``x`` (routed scale fitted as the verify stage does)."""
    m = fb.recognise(block, parts, x)
    assert isinstance(m, Match), m
    return fit_routed_scale(block, m, x, fb.numeric_consts(fb.attr_sources(block, parts), m.spec.top_k))

# one family per router / expert style: softmax renorm, softmax no renorm + sigmoid-gated shared, sigmoid + bias +
# groups + scaling + shared, softmax group-limited (max), top-k->softmax with router bias + gpt-oss gate,
# top-k->softmax, sigmoid + bias without groups, fp32 router + rounded weights, /top_k scaled router
STYLES = ["mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2", "gpt_oss", "granitemoe", "minimax_m2",
          "hunyuan_v1_moe", "openai_privacy_filter", "aria", "afmoe", "jamba"]


def first_block(model):
    name, block, parts, reason = iter_blocks(model)[0]
    assert parts is not None, reason
    return name, block, parts


@pytest.mark.parametrize("family", STYLES)
def test_fallback_spec_equals_fx_spec(family):
    """Where the FX pass proves a block, the attribute fallback must derive the same MoESpec."""
    why = fx_available()
    if why:
        pytest.skip(why)
    model, _ = F.build_tiny(family)
    name, block, parts = first_block(model)
    block.eval()
    probe = moecomp.core.policy.probe_input(parts.hidden_size, "cpu", next(block.parameters()).dtype)
    m, notes = recognise(block, parts, probe)
    assert isinstance(m, Match) and m.method == "fx", (m, notes)
    spec_fx = verify(block, m, probe, fb.numeric_consts(fb.attr_sources(block, parts), 1), notes).match.spec
    x = torch.randn(2, 16, parts.hidden_size, generator=torch.Generator().manual_seed(3))
    assert fallback_spec(block, parts, x) == spec_fx


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "granitemoe"])
def test_static_guess_equals_measured(family):
    """Without running (meta device), attributes and source already give the measured spec for common families."""
    model, _ = F.build_tiny(family)
    name, block, parts = first_block(model)
    x = torch.randn(2, 16, parts.hidden_size, generator=torch.Generator().manual_seed(3))
    static = fb.static_extract(block, parts).spec
    assert static == fallback_spec(block, parts, x)


def test_block_parts_named():
    model, _ = F.build_tiny("qwen2_moe")
    name, block, parts = first_block(model)
    assert name == "model.layers.0.mlp"
    assert (parts.router_weight, parts.experts, parts.w13, parts.w2) == (
        "gate.weight", "experts", "experts.gate_up_proj", "experts.down_proj")
    assert parts.shared.gate == "shared_expert.gate_proj.weight" and parts.shared_gate == "shared_expert_gate.weight"
    m = fb.static_extract(block, parts)
    assert m.bindings["shared_gate_w"] == "shared_expert_gate.weight" and m.spec.shared.gate == "sigmoid"


def test_clamped_swiglu_detected():
    """Clamped SwiGLU (limit 10) in the experts' _apply_gate and in the shared MLP's forward (glm5_next) is measured
    on inputs that reach the clamps; hy_v4's shared MLP is not clamped."""
    model, _ = F.build_tiny("glm5_next")
    name, block, parts = first_block(model)
    spec = fb.static_extract(block, parts).spec
    assert (spec.activation, spec.activation_clamp, spec.activation_limit) == ("silu", True, 10.0)
    assert (spec.shared.activation, spec.shared.activation_clamp, spec.shared.activation_limit) == ("silu", True, 10.0)
    model, _ = F.build_tiny("hy_v4")
    name, block, parts = first_block(model)
    spec = fb.static_extract(block, parts).spec
    assert spec.activation_clamp and spec.activation_limit == model.config.swiglu_limit
    assert not spec.shared.activation_clamp
    # a spec without the clamp is refused by optimize's activation check
    assert "differs" in activation_mismatch(block, parts, spec.replace(activation_clamp=False))
    assert activation_mismatch(block, parts, spec) is None


def test_activation_probe():
    assert fb.probe_activation(torch.nn.SiLU()) == "silu"
    assert fb.probe_activation(torch.nn.GELU()) == "gelu"
    assert fb.probe_activation(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert fb.probe_activation(torch.nn.ReLU()) == "relu"
    assert fb.probe_activation(lambda t: torch.relu(t) ** 2) == "relu2"
    assert fb.probe_activation(lambda t: torch.tanh(t) * 3) is None
    assert fb.probe_activation(None) is None


def test_meta_scan_reads_spec_without_weights():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=3, first_k_dense_replace=1, hidden_size=256, moe_intermediate_size=64,
                           intermediate_size=512, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=256, q_lora_rank=64,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    rep = moecomp.scan(model)
    assert [b.name for b in rep.blocks] == ["model.layers.1.mlp", "model.layers.2.mlp"]
    b = rep.blocks[0]
    assert b.status == "unverified" and b.method == "fallback (meta)"
    s = b.spec
    assert (s.num_experts, s.top_k, s.hidden_size, s.intermediate_size) == (32, 4, 256, 64)
    assert (s.scoring, s.has_correction_bias, s.n_group, s.topk_group, s.group_score, s.renormalize) == (
        "sigmoid", True, 4, 2, "top2_sum", True)
    assert s.routed_scaling_factor == cfg.routed_scaling_factor and s.router_fp32
    assert s.shared.intermediate_size == 64
    # bf16 weights: 4 experts x 3 x 256 x 64 x 2 B + router 32 x 256 (x2 B) + shared 3 x 64 x 256 x 2 B
    assert b.bytes_per_token == 4 * 3 * 256 * 64 * 2 + 32 * 256 * 2 + 3 * 64 * 256 * 2
    _, rep2 = moecomp.optimize(model, report=True)  # nothing can be checked on meta: nothing is rewritten
    assert {b.status for b in rep2.blocks} == {"unverified"}
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_sqrt_softplus_routing_measured():
    """DeepSeek-V4's top-k layers: sqrt(softplus) scores + correction bias, renormalised, scaled. Its experts use a
    clamped SwiGLU the spec lacks, so the gate is swapped for transformers' plain one to reach the routing. The
    attribute reader alone rewrites the hash layer too (``MoESpec.hash_routing``)."""
    import types

    from transformers.integrations.moe import _default_apply_gate

    model, _ = F.build_tiny("deepseek_v4")
    blocks = iter_blocks(model)
    hash_block, topk_block = blocks[0][1], blocks[1][1]
    assert hash_block.is_hash and not topk_block.is_hash
    parts = blocks[1][2]
    topk_block.experts._apply_gate = types.MethodType(_default_apply_gate, topk_block.experts)
    x = torch.randn(2, 16, parts.hidden_size, generator=torch.Generator().manual_seed(3))
    spec = fallback_spec(topk_block, parts, x)
    assert (spec.scoring, spec.has_correction_bias, spec.renormalize, spec.n_group) == ("sqrtsoftplus", True, True, 1)
    assert spec.routed_scaling_factor == model.config.routed_scaling_factor
    _, rep = moecomp.optimize(model, report=True, use_capture=False)
    assert [b.status for b in rep.blocks] == ["rewritten", "rewritten"], str(rep)  # the hash layer: hf/hash_reader
    assert [b.spec.hash_routing for b in rep.blocks] == [True, False]
