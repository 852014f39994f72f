"""capture_block / detect_block on single blocks of tiny HF models (every experts implementation) and plain MoEs.

Equivalence: the op bound with the module tensors named by ``BlockMatch.bindings`` against the block's own forward,
outputs poisoned first (``poison`` fills torch.empty with NaN), fp32, within 1e-4 relative to the output's max.
"""

from __future__ import annotations

import operator

import pytest
import torch

import moecomp
import tiny_models as tm
from moecomp.recognise.capture import DetectError, capture_block, detect_block
from moecomp.ops.moe_op import MOE_ARGS

# What each family's block computes (the spec fields that tell them apart) and where its tensors live.
EXPECT = {
    "mixtral": dict(scoring="softmax", renormalize=True, round_weights=False, intermediate_size=96, shared=None,
                    w_layout="out_in", gate_up="concat", activation="silu"),
    "qwen2_moe": dict(scoring="softmax", renormalize=False, round_weights=True, intermediate_size=32),
    "qwen3_moe": dict(scoring="softmax", renormalize=True, round_weights=True, intermediate_size=32, shared=None),
    "olmoe": dict(scoring="softmax", renormalize=False, round_weights=True, intermediate_size=96, shared=None),
    "deepseek_v3": dict(scoring="sigmoid", renormalize=True, renorm_eps=1e-20, n_group=4, topk_group=2,
                        group_score="top2_sum", has_correction_bias=True, routed_scaling_factor=2.5, router_fp32=True,
                        intermediate_size=32),
    "glm4_moe": dict(scoring="sigmoid", renormalize=True, n_group=2, topk_group=1, has_correction_bias=True,
                     routed_scaling_factor=1.5, router_fp32=True, intermediate_size=32),
    "gpt_oss": dict(score_order="topk_then_score", activation="swiglu_oai", activation_alpha=1.702,
                    activation_limit=7.0, w_layout="in_out", gate_up="interleaved", has_expert_bias=True,
                    has_router_bias=True, intermediate_size=96, shared=None),
}
SHARED = {
    "qwen2_moe": dict(intermediate_size=48, gate="sigmoid", gated=True, layout="separate"),
    "deepseek_v3": dict(intermediate_size=32, gate="none", gated=True, layout="separate"),
    "glm4_moe": dict(intermediate_size=32, gate="none", gated=True, layout="separate"),
}
ROUTED = {"router_w": "gate.weight", "w13": "experts.gate_up_proj", "w2": "experts.down_proj"}
BINDINGS = {
    "mixtral": ROUTED,
    "qwen2_moe": {**ROUTED, "shared_w1": "shared_expert.gate_proj.weight", "shared_w3": "shared_expert.up_proj.weight",
                  "shared_w2": "shared_expert.down_proj.weight", "shared_gate_w": "shared_expert_gate.weight"},
    "qwen3_moe": ROUTED,
    "olmoe": ROUTED,
    "deepseek_v3": {**ROUTED, "correction_bias": "gate.e_score_correction_bias",
                    "shared_w1": "shared_experts.gate_proj.weight", "shared_w3": "shared_experts.up_proj.weight",
                    "shared_w2": "shared_experts.down_proj.weight"},
    "gpt_oss": {"router_w": "router.weight", "router_b": "router.bias", "w13": "experts.gate_up_proj",
                "b13": "experts.gate_up_proj_bias", "w2": "experts.down_proj", "b2": "experts.down_proj_bias"},
}
BINDINGS["glm4_moe"] = BINDINGS["deepseek_v3"]


def _tensor(module, path):
    return operator.attrgetter(path)(module)


def run_op(module, match, x):
    args = [None if match.bindings[k] is None else _tensor(module, match.bindings[k]) for k in MOE_ARGS]
    return torch.ops.moecomp.moe_forward(x, *args, match.spec.key)


def assert_close(got, want, tol=1e-4):
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= tol, err


@pytest.mark.parametrize("impl", tm.IMPLS)
@pytest.mark.parametrize("family", tm.FAMILIES)
def test_detect_block_hf(family, impl, poison):
    model = tm.hf_model(family, impl)
    block = tm.moe_blocks(model)[0]
    m = detect_block(block, torch.randn(1, 3, tm.H))

    spec = m.spec
    assert (spec.num_experts, spec.top_k, spec.hidden_size) == (tm.E, tm.K, tm.H)
    for k, v in EXPECT[family].items():
        assert getattr(spec, k) == v, (k, getattr(spec, k), v)
    if family in SHARED:
        for k, v in SHARED[family].items():
            assert getattr(spec.shared, k) == v, k
    else:
        assert spec.shared is None
    want = dict.fromkeys(MOE_ARGS)
    want.update(BINDINGS[family])
    assert m.bindings == want
    assert m.verified.startswith("numeric"), m.verified
    if family in ("deepseek_v3", "glm4_moe"):
        assert m.constants == {"routed_scaling_factor": "gate.routed_scaling_factor"}
    if family == "gpt_oss":
        assert m.constants == {"activation_alpha": "experts.alpha", "activation_limit": "experts.limit"}
        assert (m.output_index, m.num_outputs) == (0, 2)  # (hidden, router_scores)

    x = torch.randn(2, 5, tm.H)
    with torch.no_grad():
        want_out = block(x)
        want_out = want_out[m.output_index] if isinstance(want_out, tuple) else want_out
        got = run_op(block, m, x)
    assert_close(got, want_out)


@pytest.mark.parametrize("cls", [tm.EinsumMoE, tm.BmmMoE])
def test_detect_block_plain_pytorch(cls, poison):
    block = cls().eval()
    x = torch.randn(6, tm.H) if cls is tm.BmmMoE else torch.randn(2, 3, tm.H)
    m = detect_block(block, x)
    if cls is tm.EinsumMoE:
        assert m.bindings["w13"] == "w13" and m.bindings["w2"] == "w2" and m.bindings["router_w"] == "gate.weight"
        assert (m.spec.scoring, m.spec.renormalize, m.spec.activation, m.spec.w_layout) == (
            "softmax", True, "silu", "out_in")
    else:
        assert m.bindings["w13"] == "w_in" and m.bindings["router_w"] == "router"
        assert (m.spec.scoring, m.spec.renormalize, m.spec.activation, m.spec.w_layout) == (
            "sigmoid", False, "gelu_tanh", "in_out")
    x = torch.randn(*x.shape[:-1], tm.H)
    with torch.no_grad():
        assert_close(run_op(block, m, x), block(x))


def test_detect_block_expert_loop(poison):
    block = tm.LoopMoE().eval()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        m = detect_block(block, torch.randn(5, tm.H))
    assert m.bindings["w13"] == "w13" and m.spec.renormalize
    x = torch.randn(7, tm.H)
    with torch.no_grad():
        assert_close(run_op(block, m, x), block(x))


@pytest.mark.parametrize(
    "cls, why",
    [
        (tm.SeparateW1W3MoE, "separate gate / up"),
        (tm.CapacityMoE, "numeric check failed"),  # equal on spread-out tokens, not on a crowd of identical ones
        (tm.TanhOutMoE, "post-processes the MoE result"),
        (tm.TwoSidedGateClampMoE, "not one gate clamp(max=L) and one up clamp(-L, L)"),
        (tm.JitterMoE, "between the router logits and the top-k"),
        (tm.DenseMLP, "no top-k routing"),
    ],
)
def test_detect_block_rejects(cls, why):
    with pytest.raises(DetectError) as e:
        detect_block(cls().eval(), torch.randn(2, 3, tm.H))
    assert e.value.kind == "detect" and not e.value.capture_failed
    assert why in e.value.reason, e.value.reason


def test_capture_failure_is_reported_as_capture():
    with pytest.raises(DetectError) as e:
        detect_block(tm.DataDependentBlock().eval(), torch.randn(2, 3, tm.H))
    assert e.value.kind == "capture" and e.value.capture_failed


def test_capture_block_maps_placeholders():
    model = tm.hf_model("deepseek_v3")
    block = tm.moe_blocks(model)[0]
    x = torch.randn(1, 3, tm.H)
    cap = capture_block(block, x)
    paths = set(cap.paths.values())
    assert "<input>" in paths
    assert {"gate.weight", "gate.e_score_correction_bias", "gate.routed_scaling_factor", "experts.gate_up_proj",
            "experts.down_proj", "shared_experts.down_proj.weight"} <= paths
    for name, path in cap.paths.items():
        if path not in (None, "<input>", "gate.routed_scaling_factor"):
            ph = cap.example_inputs[[n.name for n in cap.gm.graph.nodes if n.op == "placeholder"].index(name)]
            assert ph is _tensor(block, path)  # identity, not just equal values


def test_capture_many_blocks_of_one_class_never_recompiles():
    """Capturing more blocks of one class than Dynamo's recompile limit works (fresh code object per capture).

    The limit is set to 2 here (4 blocks): the process-wide value is not a constant in a test run
    (``moecomp.generate``'s engine raises it to 16 per decoder layer and leaves it raised), and at 64 it made this
    test capture 66 blocks."""
    limit = 2
    blocks = [tm.EinsumMoE(seed=s).eval() for s in range(limit + 2)]
    with torch._dynamo.config.patch(error_on_recompile=True, recompile_limit=limit):
        specs = {detect_block(b, torch.randn(2, 3, tm.H)).spec for b in blocks}
    assert len(specs) == 1


def test_eager_experts_unchanged_outside_capture():
    """The eager-experts dispatcher runs the class's own loop unless tracing for moecomp."""
    model = tm.hf_model("mixtral", "eager")
    block = tm.moe_blocks(model)[0]
    x = torch.randn(2, 3, tm.H)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import moecomp.api.backend  # noqa: F401 (registered, the compile backend keeps the dispatcher installed)

    detect_block(block, x)  # installs the dispatcher
    with torch.no_grad():
        out = block(x)
        fn = ALL_EXPERTS_FUNCTIONS.get_interface("eager", None)
        assert fn is moecomp.recognise.capture._eager_or_grouped
        calls = []
        orig = type(block.experts).forward.__wrapped__
        type(block.experts).forward.__wrapped__ = lambda *a, **k: calls.append(1) or orig(*a, **k)
        try:
            again = block(x)
        finally:
            type(block.experts).forward.__wrapped__ = orig
    assert calls == [1]
    assert torch.equal(out, again)


def test_block_that_transforms_its_input_first_is_rejected():
    """An MoE reading norm(x) inside the block: the block is not moe_forward(x), so detect_block refuses."""

    class NormThenMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(tm.H)
            self.moe = tm.EinsumMoE()

        def forward(self, x):
            return self.moe(self.norm(x))

    with pytest.raises(DetectError) as e:
        detect_block(NormThenMoE().eval(), torch.randn(2, 3, tm.H))
    assert "block input" in e.value.reason
