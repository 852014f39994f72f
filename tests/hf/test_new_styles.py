"""Styles the spec gained (clamped SwiGLU, relu², shared gpt-oss SwiGLU, bias on logits, 0.0 group mask, renorm
minimum, post-experts scaling), a post-MoE norm (epilogue), experts-only rewrites and separate 3-D gate / up
weights: what optimize derives and that the optimized model equals the original (fp32, CPU, 1e-4 relative, fresh
random inputs, exactly one op call per block)."""

import inspect

import pytest
import torch
from torch import nn

import moecomp
from moecomp.coverage import families as F
from moecomp.api.optimize import experts_only_modules, rewritten_blocks
from moecomp.testing import SplitBlock

from .conftest import rel_err

TOL = 1e-4


def _fields(spec, want):
    out = {}
    for k in want:
        obj = spec
        for a in k.split("."):
            obj = getattr(obj, a)
        out[k] = obj
    return out


def _run(model, ids):
    kw = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        return F._logits(model(input_ids=ids, **kw))


# family: (blocks rewritten whole, blocks experts only, spec fields of the rewritten blocks; callables get config)
CASES = {
    # DeepSeek-V4: its hash layer too (recognise/hash_reader.py: MoESpec.hash_routing), no longer experts only
    "deepseek_v4": (2, 0, {"activation_clamp": True, "activation_limit": 10.0, "scoring": "sqrtsoftplus",
                           "renorm_eps": 1e-20, "shared.activation_clamp": True, "shared.activation_limit": 10.0}),
    "hy_v4": (1, 0, {"activation_clamp": True, "activation_limit": lambda c: float(c.swiglu_limit),
                     "shared.activation_clamp": False}),
    "hy_v4_vl": (1, 0, {"activation_clamp": True, "shared.activation_clamp": False}),
    "glm5_next": (2, 0, {"activation_clamp": True, "activation_limit": 10.0, "shared.activation_clamp": True,
                         "shared.activation": "silu"}),
    "nemotron_h": (1, 0, {"activation": "relu2", "gated": False, "shared.activation": "relu2",
                          "shared.gated": False}),
    "minimax_m3_vl": (2, 0, {"activation": "swiglu_oai", "gate_up": "concat", "shared.activation": "swiglu_oai",
                             "shared.layout": "concat",
                             "routed_scaling_factor": lambda c: float(c.routed_scaling_factor)}),
    "kolibri1": (2, 0, {"bias_on_logits": True, "has_correction_bias": True, "scoring": "sigmoid"}),
    "ernie4_5_moe": (1, 0, {"renorm_min": lambda c: float(c.moe_norm_min), "renormalize": True}),
    "ernie4_5_vl_moe": (2, 0, {"renorm_min": lambda c: float(c.moe_norm_min)}),
    "mistral4": (2, 0, {"group_mask_zero": True, "scoring": "softmax"}),
    "mistral_large4": (2, 0, {"group_mask_zero": True}),
    "axk2": (1, 0, {"group_mask_zero": True, "has_correction_bias": True}),
    "beam": (2, 0, {"routed_scaling_factor": lambda c: float(c.routed_scaling_factor), "renorm_eps": 1e-20}),
    "axk1": (1, 0, {"has_correction_bias": True}),
}


def _text_config(model):
    c = model.config
    return getattr(c, "text_config", None) or c


@pytest.mark.parametrize("family", sorted(CASES))
def test_fallback_alone_rewrites_and_equals(family):
    """optimize(use_capture=False): the attribute fallback derives the spec; the model stays equal."""
    n_full, n_exp, want = CASES[family]
    model, _ = F.build_tiny(family)
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(11))
    ref = _run(model, ids)
    _, rep = moecomp.optimize(model, report=True, use_capture=False)
    assert len(rep.rewritten) == n_full and len(rep.experts_only) == n_exp, str(rep)
    assert len(rep.blocks) == n_full + n_exp
    cfg = _text_config(model)
    want = {k: (v(cfg) if callable(v) else v) for k, v in want.items()}
    for b in rep.rewritten:
        assert _fields(b.spec, want) == want, b.name
    (out, per, total, runs), eper, etotal, eruns = F.count_experts_calls(
        model, lambda: F.count_calls_per_block(model, lambda: _run(model, ids), with_forwards=True))
    # one call per block run (ernie4_5_vl_moe's vision experts do not run on text)
    assert set(per) == {b.name for b in rep.rewritten} and all(per[n] == runs[n] for n in per), (per, runs)
    assert total == sum(runs.values()) >= 1
    assert len(eper) == n_exp and all(eper[n] == eruns[n] == 1 for n in eper) and etotal == n_exp
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL


def test_axk1_epilogue():
    """AXK1 ends its MoE block with post_mlp_layernorm: bound as norm(moe_forward(x)), one op call, equal."""
    model, _ = F.build_tiny("axk1")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    ref = _run(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["rewritten"], str(rep)
    assert rep.blocks[0].epilogue == ["post_mlp_layernorm"]
    assert any("epilogue" in n for n in rep.blocks[0].notes)
    out, per, total = F.count_calls_per_block(model, lambda: _run(model, ids))
    assert total == 1 and list(per.values()) == [1]
    assert rel_err(out, ref) <= TOL
    moecomp.unoptimize(model)
    assert torch.equal(_run(model, ids), ref)


@pytest.mark.parametrize("family,n", [("zaya", 2)])  # (inkling: rewritten whole since MoESpec.shared_gamma,
# tests/hf/test_inkling.py; gemma4 / diffusion_gemma: the pair rewrite, tests/hf/test_pair.py)
def test_experts_only(family, n):
    """Routing moecomp cannot express: only the experts module runs moe_experts. (gemma4 / diffusion_gemma, router
    and experts in a decoder layer, were here until the pair rewrite took them whole: tests/hf/test_pair.py.)"""
    model, _ = F.build_tiny(family)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(9))
    ref = _run(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["experts only"] * n, str(rep)
    assert all(b.reason and b.method == "experts interface" for b in rep.blocks)
    assert not rewritten_blocks(model) and len(experts_only_modules(model)) == n
    (out, per, total), eper, etotal, eruns = F.count_experts_calls(
        model, lambda: F.count_calls_per_block(model, lambda: _run(model, ids)))
    assert total == 0 and etotal == n and all(eper[k] == eruns[k] == 1 for k in eper)
    assert rel_err(out, ref) <= TOL
    scan = moecomp.scan(model)
    assert [b.status for b in scan.blocks] == ["experts only"] * n
    moecomp.unoptimize(model)
    assert not experts_only_modules(model)
    assert all("forward" not in m.__dict__ for m in model.modules() if F.is_experts_class(type(m)))
    assert torch.equal(_run(model, ids), ref)
    _, rep2 = moecomp.optimize(model, report=True, experts_only=False)
    assert [b.status for b in rep2.blocks] == ["skipped"] * n


class _OddGate(nn.Module):
    """exp(-g^2) * up: a gate no spec activation computes."""

    def forward(self, gate, up):
        return torch.exp(-gate * gate) * up


def odd_gate_model():
    """inkling2 tiny, each experts module's gate swapped for ``_OddGate`` (neither the whole block nor its experts
    can be described)."""
    model, _ = F.build_tiny("inkling2")
    for m in model.modules():
        if hasattr(m, "act_fn") and hasattr(m, "_apply_gate"):
            m.act_fn = _OddGate()
    return model


def test_experts_only_refused_with_reason():
    """Experts whose gate is no activation the spec knows (inkling2's experts with their softcapped SwiGLU swapped
    for exp(-g^2) * up): left alone, the reason says both why not. (muse_spark and inkling2 were the examples
    before their features joined the spec.)"""
    pytest.importorskip("transformers.models.inkling2.modeling_inkling2")  # (not in transformers 5.17)
    model = odd_gate_model()
    _, rep = moecomp.optimize(model, report=True)
    assert rep.blocks and all(b.status == "skipped" and "experts only not possible" in b.reason for b in rep.blocks)
    assert not experts_only_modules(model)


# ------------------------------------------------------------------------------ separate 3-D gate / up weights


def test_separate_3d_gate_up_detected_and_equal():
    torch.manual_seed(0)
    net = nn.Sequential(SplitBlock(), SplitBlock()).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        ref = net(x)
    _, rep = moecomp.optimize(net, report=True, use_capture=False)
    assert [b.status for b in rep.blocks] == ["rewritten"] * 2, str(rep)
    E, I, H = 6, 24, 32
    assert all(b.intermediate == I and b.extra_bytes == 2 * E * I * H * 4 for b in rep.blocks)  # one [E, 2I, H] copy
    assert "extra memory" in str(rep)
    with torch.no_grad():  # (grad mode on with weights requiring grad runs the original forward)
        out, per, total = F.count_calls_per_block(net, lambda: net(x))
    assert total == 2 and rel_err(out, ref) <= TOL
    # an in-place weight update reaches the concatenated copy
    with torch.no_grad():
        net[0].experts.up_proj.mul_(1.5)
        ref2 = moecomp.optimize.__globals__["_bind"].original_forward(net[0])(x)
        assert rel_err(net[0](x), ref2) <= TOL


def test_experts_only_compiled_does_not_recompile_per_call():
    """A compiled experts-only model: the experts forward counts eager calls only (a counter Dynamo guarded on made
    every call recompile). Fails on a recompile; same output as eager."""
    model, _ = F.build_tiny("zaya")
    moecomp.optimize(model)
    assert len(experts_only_modules(model)) == 2
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    ref = _run(model, ids)
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            first = compiled(ids).logits
            torch.compiler.set_stance("fail_on_recompile")
            for _ in range(3):
                again = compiled(ids).logits
    finally:
        torch.compiler.set_stance("default")
    assert rel_err(first, ref) <= TOL and torch.equal(first, again)


# ----------------------------------------------------------------------- routed and shared outputs averaged
def _cohere2(strategy: str):
    mod = pytest.importorskip("transformers.models.cohere2_moe.modeling_cohere2_moe")
    mc = F._model_candidates(mod)[0]
    cfg = F.tiny_config(mc.config_class, "cohere2_moe", {"num_shared_experts": 1,
                                                         "shared_expert_combination_strategy": strategy})
    torch.manual_seed(0)
    model = mc(cfg).eval()
    F._randomize_biases(model, 0)
    return model


@pytest.mark.parametrize("use_capture", [True, False], ids=["fx", "attributes"])
def test_cohere2_shared_average(use_capture):
    """Cohere2-MoE's "average" strategy, (routed + shared) / 2: shared.scale 0.5 and routed scale 0.5, rewritten
    whole by either recogniser, one op call per block, equal to the original (fp32, 1e-4, fresh inputs)."""
    model = _cohere2("average")
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(13))
    ref = _run(model, ids)
    _, rep = moecomp.optimize(model, report=True, use_capture=use_capture, fast_generate=False)
    assert [b.status for b in rep.blocks] == ["rewritten"] * len(rep.blocks) and rep.blocks, str(rep)
    assert {b.method for b in rep.blocks} == {"fx" if use_capture else "fallback"}
    for b in rep.blocks:
        assert (b.spec.shared.scale, b.spec.routed_scaling_factor) == (0.5, 0.5), b.spec
    out, per, total = F.count_calls_per_block(model, lambda: _run(model, ids))
    assert total == len(rep.blocks) and set(per.values()) == {1}
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL


def test_shared_width_equal_to_expert_count():
    """A DeepSeek-V3 block whose shared expert is as wide as there are experts ([E, H] shared projections): the FX
    pass must not take those projections for per-expert biases (they are GEMM weights, never gathered by id)."""
    mod = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    mc = F._model_candidates(mod)[0]
    cfg = F.tiny_config(mc.config_class, "deepseek_v3", {"n_routed_experts": 32, "moe_intermediate_size": 32,
                                                        "n_group": 4, "topk_group": 2})
    torch.manual_seed(0)
    model = mc(cfg).eval()
    F._randomize_biases(model, 0)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(17))
    ref = _run(model, ids)
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    assert rep.blocks and {(b.status, b.method) for b in rep.blocks} == {("rewritten", "fx")}, str(rep)
    assert all(not b.spec.has_expert_bias and b.spec.shared.intermediate_size == 32 for b in rep.blocks)
    out = _run(model, ids)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
