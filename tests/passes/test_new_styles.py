"""MoE styles the FX pass learned with the spec's newer fields: clamped SwiGLU (DeepSeek-V4, HY-V4, GLM-5-Next; and
DeepSeek-V4's hash routing, ``MoESpec.hash_routing``, whose token ids are the whole model's input_ids),
relu² experts (Nemotron-H), gpt-oss-style concatenated experts and shared expert with the routed scaling applied to
the experts' output (MiniMax-M3-VL, Beam), a correction bias on the logits (Kolibri-1), a [1, E] bias and
clamp(sum, min) renormalisation (ERNIE-4.5), group masks of 0.0 (Mistral-4, AXK2), a post-MoE norm (AXK1).

Whole models: the tiny config of ``moecomp.coverage.families.build_tiny``, compiled with ``backend="moecomp"``,
``dynamic=True`` (rewritten graph run as is: ``moecomp.inner = "eager"``), logits within 1e-4 relative of eager on
fresh random token ids, one moe_forward per MoE block. Single blocks: ``detect_block`` / ``detect_moe`` + rewrite.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import moecomp
import tiny_models as tm
from moecomp.api import backend
from moecomp.recognise.capture import DetectError, capture_block, detect_block
from moecomp.ops.moe_op import MOE_ARGS
from moecomp.recognise.fx import detect_moe as dm
from moecomp.recognise.fx import moe_activation
from moecomp.recognise.fx.rewrite_moe import rewrite_moe

EAGER_INNER = {"moecomp.inner": "eager"}
MOE_CALL = "torch.ops.moecomp.moe_forward.default("


def _cfg(model):
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


CLAMP10 = dict(activation="silu", gated=True, activation_clamp=True, activation_limit=10.0)
# family -> (MoE blocks matched in the tiny model, spec fields of every match, shared-expert fields | None,
#            config fields the spec must equal: spec field -> config attribute)
FAMILIES = {
    # layer 0 hash-routed (MoESpec.hash_routing, no correction bias), layer 1 a biased top-k: checked apart below
    "deepseek_v4": (2, dict(CLAMP10, scoring="sqrtsoftplus", renorm_eps=1e-20),
                    dict(activation="silu", activation_clamp=True, activation_limit=10.0, layout="separate"),
                    {"routed_scaling_factor": "routed_scaling_factor"}),
    "hy_v4": (1, dict(CLAMP10, n_group=4, topk_group=2), dict(activation="silu", activation_clamp=False), {}),
    "hy_v4_vl": (1, dict(CLAMP10), dict(activation="silu", activation_clamp=False), {}),
    "glm5_next": (2, dict(CLAMP10), dict(activation="silu", activation_clamp=True, activation_limit=10.0), {}),
    "nemotron_h": (1, dict(activation="relu2", gated=False, activation_clamp=False),
                   dict(activation="relu2", gated=False), {}),
    "minimax_m3_vl": (2, dict(activation="swiglu_oai", gate_up="concat", activation_clamp=False,
                              has_correction_bias=True),
                      dict(activation="swiglu_oai", layout="concat", gated=True),
                      {"routed_scaling_factor": "routed_scaling_factor", "activation_limit": "swiglu_limit",
                       "activation_alpha": "swiglu_alpha"}),
    "beam": (2, dict(renorm_eps=1e-20, renormalize=True), None, {"routed_scaling_factor": "routed_scaling_factor"}),
    "kolibri1": (2, dict(scoring="sigmoid", has_correction_bias=True, bias_on_logits=True), dict(activation="silu"),
                 {}),
    "ernie4_5_moe": (1, dict(scoring="softmax", has_correction_bias=True, renormalize=True),
                     dict(activation="silu"), {"renorm_min": "moe_norm_min"}),
    "ernie4_5_vl_moe": (1, dict(scoring="softmax", has_correction_bias=True, renormalize=True), None,
                        {"renorm_min": "moe_norm_min"}),
    "mistral4": (2, dict(scoring="softmax", group_mask_zero=True, n_group=4, topk_group=2), dict(activation="silu"),
                 {}),
    "mistral_large4": (2, dict(scoring="softmax", group_mask_zero=True, n_group=4), None, {}),
    "axk2": (1, dict(group_mask_zero=True), None, {}),
    "axk1": (1, dict(scoring="sigmoid", n_group=4, has_correction_bias=True), dict(activation="silu"), {}),
}


def _logits(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.fixture
def recorded(monkeypatch):
    """The DetectResults of the backend's detect_moe calls."""
    results = []
    orig = backend.detect_moe

    def rec(*a, **k):
        res = orig(*a, **k)
        results.append(res)
        return res

    monkeypatch.setattr(backend, "detect_moe", rec)
    return results


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_compiled(family, recorded, poison):
    from moecomp.coverage.families import build_tiny

    n_blocks, fields, shared, from_cfg = FAMILIES[family]
    torch._dynamo.reset()
    moecomp.counters.clear()
    backend.last_results.clear()
    model, _ = build_tiny(family)
    cfg = _cfg(model)
    ids = torch.randint(3, 128, (2, 7))  # fresh random tokens
    with torch.no_grad():
        want = _logits(model(input_ids=ids))
        got = _logits(torch.compile(model, backend="moecomp", dynamic=True, options=EAGER_INNER)(input_ids=ids))
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4

    c = moecomp.counters
    assert c["backend"]["graphs"] == 1
    assert c["detect_moe"]["matched"] == n_blocks, [r["rejected"] for r in backend.last_results]
    assert c["rewrite_moe"]["replaced"] == n_blocks
    assert backend.last_results[-1]["code"].count(MOE_CALL) == n_blocks
    rejected = backend.last_results[-1]["rejected"]
    assert rejected == [], rejected

    matches = recorded[-1].matches
    assert len(matches) == n_blocks
    if family == "deepseek_v4":  # the hash layer reads the model's input_ids (a graph input)
        assert [(m.spec.hash_routing, m.spec.has_correction_bias) for m in matches] == [(True, False), (False, True)]
        tok = matches[0].bindings["token_ids"]
        assert tok is not None and "input_ids" in tok, matches[0].bindings
    for m in matches:
        sp = m.spec
        for k, v in fields.items():
            assert getattr(sp, k) == v, (k, getattr(sp, k), v)
        for k, attr in from_cfg.items():
            assert math.isclose(getattr(sp, k), float(getattr(cfg, attr)), rel_tol=1e-6), (k, getattr(sp, k))
        if shared is None:
            continue
        assert sp.shared is not None
        for k, v in shared.items():
            assert getattr(sp.shared, k) == v, (k, getattr(sp.shared, k), v)
        if "swiglu_oai" in (sp.activation, sp.shared.activation) or sp.activation_clamp:
            assert "clamps binding" in m.verified, m.verified


def test_axk1_block_post_norm(poison):
    """AXK1's block returns post_mlp_layernorm(moe + shared): the MoE output is the node before the norm."""
    from moecomp.coverage.families import build_tiny

    model, _ = build_tiny("axk1")
    block = [m for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "post_mlp_layernorm")][0]
    x = torch.randn(2, 5, _cfg(model).hidden_size)
    with pytest.raises(DetectError) as e:
        detect_block(block, x)
    assert "post-processes" in e.value.reason and e.value.match is not None
    assert not e.value.match.output_is_graph_output
    m = detect_block(block, x, allow_tail=True)
    assert not m.output_is_graph_output and m.output_node and "rsqrt" in m.tail_ops
    x = torch.randn_like(x)
    args = [None if m.bindings[k] is None else _get(block, m.bindings[k]) for k in MOE_ARGS]
    with torch.no_grad():
        got = block.post_mlp_layernorm(torch.ops.moecomp.moe_forward(x, *args, m.spec.key))
        want = block(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4

    # the rewrite replaces the MoE and keeps the norm
    cap = capture_block(block, torch.randn(2, 5, x.shape[-1]))
    res = dm.detect_moe(cap.gm, cap.example_inputs)
    assert len(res) == 1 and not res[0].output_is_final and res[0].tail
    _rewrite_equal(cap, res, kept=("rsqrt",))


def _get(mod, path):
    import operator

    t = operator.attrgetter(path)(mod)
    return t.reshape(-1) if t.dim() == 2 and t.shape[0] == 1 else t


def _rewrite_equal(cap, res, kept=()):
    gm = cap.gm
    inputs = cap.concrete_inputs()
    with torch.no_grad():
        before = copy.deepcopy(gm)(*inputs)
        assert rewrite_moe(gm, res.matches) == len(res.matches)
        after = gm(*inputs)
    ops = [dm.op_name(n) for n in gm.graph.nodes]
    assert ops.count("moe_forward") == len(res.matches)
    for op in kept:
        assert op in ops, ops
    before = before if isinstance(before, (tuple, list)) else (before,)
    after = after if isinstance(after, (tuple, list)) else (after,)
    for a, b in zip(after, before):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("cls, fields", [
    (tm.ClampedSwiGLUMoE, dict(activation="silu", activation_clamp=True, activation_limit=0.5)),
    (tm.Relu2MoE, dict(activation="relu2", gated=False, bias_on_logits=True, scoring="sigmoid", renorm_min=0.05,
                       routed_scaling_factor=1.25, has_correction_bias=True)),
    (tm.ScaledOutMoE, dict(routed_scaling_factor=0.5, activation="silu")),
])
def test_plain_modules(cls, fields, poison):
    block = cls().eval()
    x = torch.randn(6, tm.H) if cls is tm.Relu2MoE else torch.randn(2, 3, tm.H)
    m = detect_block(block, x)
    for k, v in fields.items():
        assert getattr(m.spec, k) == v, (k, getattr(m.spec, k))
    x = torch.randn_like(x)
    args = [None if m.bindings[k] is None else _get(block, m.bindings[k]) for k in MOE_ARGS]
    with torch.no_grad():
        got, want = torch.ops.moecomp.moe_forward(x, *args, m.spec.key), block(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    cap = capture_block(block, torch.randn_like(x))
    _rewrite_equal(cap, dm.detect_moe(cap.gm, cap.example_inputs))


def test_tail_is_kept_by_the_rewrite(poison):
    """tanh(3 * moe(x)): the scale is folded, the tanh stays after the op."""
    cap = capture_block(tm.TanhOutMoE().eval(), torch.randn(2, 3, tm.H))
    res = dm.detect_moe(cap.gm, cap.example_inputs)
    assert len(res) == 1 and res[0].spec.routed_scaling_factor == 3.0 and not res[0].output_is_final
    _rewrite_equal(cap, res, kept=("tanh",))


def test_clamp_limit_is_checked_with_binding_clamps(monkeypatch):
    """Were the clamp limit misread, random weights (clamps idle) would not tell; the check with the clamped
    projections scaled up does."""
    block = tm.ClampedSwiGLUMoE().eval()
    block.limit = 8.0  # rarely reached by x @ w13 with random weights
    orig = moe_activation._clamp_limit
    monkeypatch.setattr(moe_activation, "_clamp_limit", lambda *a: orig(*a) * 4)
    with pytest.raises(DetectError) as e:
        detect_block(block, torch.randn(2, 3, tm.H))
    assert "clamps bind" in e.value.reason, e.value.reason
    monkeypatch.setattr(moe_activation, "_clamp_limit", orig)
    assert detect_block(block, torch.randn(2, 3, tm.H)).spec.activation_limit == 8.0


def test_hy_v4_clamp_is_not_ignored():
    """HY-V4's experts clamp at 10, which tiny random weights never reach: the spec must say so anyway."""
    from moecomp.coverage.families import build_tiny

    model, _ = build_tiny("hy_v4")
    block = [m for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "experts")][0]
    m = detect_block(block, torch.randn(2, 5, _cfg(model).hidden_size))
    assert m.spec.activation_clamp and m.spec.activation_limit == 10.0
    assert m.constants.get("activation_limit") == "experts.swiglu_limit"


def test_view_only_tail_is_returned():
    """ERNIE-4.5-VL's sparse block returns result.flatten(): detect_block returns the match (the block's output is
    the op's, reshaped) and says so."""
    from moecomp.coverage.families import build_tiny

    model, _ = build_tiny("ernie4_5_vl_moe")
    block = [m for n, m in model.named_modules() if n.endswith("text_moe")][0]
    m = detect_block(block, torch.randn(2, 5, _cfg(model).hidden_size))
    assert not m.output_is_graph_output and m.tail_ops == ("flatten",)
    assert m.spec.has_correction_bias and m.spec.renorm_min > 0
