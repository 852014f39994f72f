"""detect_moe + rewrite_moe on captured graphs: what is matched, what is left alone, and what the rewrite leaves.

Equivalence: the rewritten GraphModule against the original one on the example inputs Dynamo recorded, every output,
fp32, within 1e-4 relative (poisoned empties).
"""

from __future__ import annotations

import copy

import pytest
import torch

from moecomp.core.reject import RejectCode
from moecomp.core.spec import MoESpec

import tiny_models as tm
from moecomp.recognise.capture import capture_block
from moecomp.recognise.fx import graph as _fx
from moecomp.recognise.fx.detect_moe import DetectResult, MoEMatch, detect_moe
from moecomp.recognise.fx.fse import fuse_shared_gate
from moecomp.recognise.fx.rewrite_moe import rewrite_moe

MOE_OP = torch.ops.moecomp.moe_forward.default
ROUTED_OPS = {"grouped_mm", "bmm", "sort", "histc", "cumsum", "repeat_interleave", "einsum", "index_add_", "where"}


def _ops(gm):
    return [_fx.op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _outputs(gm, inputs):
    with torch.no_grad():
        out = gm(*inputs)
    return out if isinstance(out, (tuple, list)) else (out,)


def _check_rewrite(cap, n_blocks=1, kept=()):
    gm = cap.gm
    inputs = cap.concrete_inputs()
    before = _outputs(copy.deepcopy(gm), inputs)
    res = detect_moe(gm, cap.example_inputs)
    assert isinstance(res, DetectResult) and len(res) == n_blocks, res.rejected
    assert all(isinstance(m, MoEMatch) for m in res)
    assert rewrite_moe(gm, res.matches) == n_blocks
    ops = _ops(gm)
    assert sum(1 for n in gm.graph.nodes if n.target is MOE_OP) == n_blocks
    assert not (set(ops) & ROUTED_OPS), set(ops) & ROUTED_OPS
    for op in kept:
        assert op in ops
    after = _outputs(gm, inputs)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert torch.isfinite(a).all()
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4
    return gm, res


@pytest.mark.parametrize("family, impl", [("qwen2_moe", "grouped_mm"), ("deepseek_v3", "eager"),
                                          ("olmoe", "batched_mm")])
def test_rewrite_block(family, impl, poison):
    block = tm.moe_blocks(tm.hf_model(family, impl))[0]
    cap = capture_block(block, torch.randn(2, 5, tm.H))
    gm, res = _check_rewrite(cap)
    # nothing of the routing is left either: the block's only output is the MoE result
    assert not ({"topk", "softmax", "sigmoid", "linear"} & set(_ops(gm)))


def test_rewrite_keeps_what_the_block_also_returns(poison):
    """gpt-oss returns (hidden, router_scores): the router stays for router_scores, the experts go."""
    block = tm.moe_blocks(tm.hf_model("gpt_oss", "grouped_mm"))[0]
    cap = capture_block(block, torch.randn(2, 5, tm.H))
    _check_rewrite(cap, kept=("linear", "topk", "softmax"))


def test_rewrite_expert_loop(poison):
    """The loop writes into a zeros buffer with index_add_: readers of the buffer get the op's result, the writes
    die with the block."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        cap = capture_block(tm.LoopMoE().eval(), torch.randn(9, tm.H))
    _check_rewrite(cap)


def test_detect_without_example_inputs():
    """Without example inputs the check draws random weights; scalar attributes cannot be read, so blocks that need
    one are rejected with a reason."""
    cap = capture_block(tm.moe_blocks(tm.hf_model("mixtral"))[0], torch.randn(1, 3, tm.H))
    res = detect_moe(cap.gm)
    assert len(res) == 1 and res[0].verified.startswith("numeric")
    cap = capture_block(tm.moe_blocks(tm.hf_model("deepseek_v3"))[0], torch.randn(1, 3, tm.H))
    res = detect_moe(cap.gm)
    assert len(res) == 0
    assert any("example inputs" in r.message for _, r in res.rejected), res.rejected
    assert all(r.code is RejectCode.NOT_RECOGNISED for _, r in res.rejected), res.rejected


def test_detect_verify_false_agrees():
    cap = capture_block(tm.moe_blocks(tm.hf_model("glm4_moe"))[0], torch.randn(1, 3, tm.H))
    a = detect_moe(cap.gm, cap.example_inputs)
    b = detect_moe(cap.gm, cap.example_inputs, verify=False)
    assert a[0].spec == b[0].spec and b[0].verified.startswith("skipped")


def test_numeric_check_catches_a_wrong_structural_reading(monkeypatch):
    """If the structure were misread (here: forced renormalize=False on Mixtral), the numeric check rejects."""
    import moecomp.recognise.fx.moe_routing as routing

    orig = routing._weight_chain

    def misread(ctx, R, w0):
        orig(ctx, R, w0)
        R.renormalize = False

    monkeypatch.setattr(routing, "_weight_chain", misread)
    cap = capture_block(tm.moe_blocks(tm.hf_model("mixtral"))[0], torch.randn(1, 3, tm.H))
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res) == 0 and res.rejected[0][1].code is RejectCode.VERIFICATION_FAILED, res.rejected
    assert "numeric check failed" in str(res.rejected[0][1])


def test_fse_fuses_router_and_shared_gate():
    """FSE: one moe_forward whose router_w is cat([router_w, shared_gate_w]); same output as the unfused graph."""
    block = tm.moe_blocks(tm.hf_model("qwen2_moe"))[0]
    x = torch.randn(1, 3, tm.H)
    cap = capture_block(block, x)
    gm = cap.gm
    rewrite_moe(gm, detect_moe(gm, cap.example_inputs).matches)
    inputs = cap.concrete_inputs()
    before = gm(*inputs)
    assert fuse_shared_gate(gm, count=False) == {"fused": 1}
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.moecomp.moe_forward.default]
    assert len(ops) == 1 and ops[0].args[11] is None  # shared_gate_w folded into router_w
    assert MoESpec.from_key(ops[0].args[-1]).fused_shared_gate
    assert any(n.target is torch.cat for n in gm.graph.nodes if n.op == "call_function")
    after = gm(*inputs)
    out_b = before[0] if isinstance(before, (tuple, list)) else before
    out_a = after[0] if isinstance(after, (tuple, list)) else after
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)

    block = tm.moe_blocks(tm.hf_model("mixtral"))[0]  # no shared gate: nothing to fuse
    cap = capture_block(block, torch.randn(1, 3, tm.H))
    rewrite_moe(cap.gm, detect_moe(cap.gm, cap.example_inputs).matches)
    assert fuse_shared_gate(cap.gm, count=False) == {}


def test_numeric_check_skipped_when_gathers_are_too_large(monkeypatch):
    """batched_mm gathers T*k expert matrices: past the budget the match rests on the structure and says so."""
    from moecomp.core import policy

    monkeypatch.setattr(policy, "WORKING_MEMORY_BYTES", 1000)
    cap = capture_block(tm.moe_blocks(tm.hf_model("mixtral", "batched_mm"))[0], torch.randn(1, 3, tm.H))
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res) == 1 and res[0].verified.startswith("skipped")
    cap = capture_block(tm.moe_blocks(tm.hf_model("mixtral", "grouped_mm"))[0], torch.randn(1, 3, tm.H))
    res = detect_moe(cap.gm, cap.example_inputs)  # no gathers: still checked
    assert len(res) == 1 and res[0].verified.startswith("numeric")


@pytest.mark.parametrize("family, impl", [("qwen3_moe", "grouped_mm"), ("gpt_oss", "batched_mm")])
def test_static_shapes_block_input_is_not_a_weight(family, impl, poison):
    """Static shapes: the block input [8, 1, H] has as many rows as there are experts, so by shape alone it is a
    stacked [E, ., .] weight. Dynamo's record of where each input came from (kept by capture_block) says it is the
    call's argument: one block is matched and rewritten."""
    block = tm.moe_blocks(tm.hf_model(family, impl))[0]
    cap = capture_block(block, torch.randn(tm.E, 1, tm.H), dynamic=False)
    phs = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    assert all(_fx.static_int(d) is not None for p in phs for d in _fx.shape_of(p) or ())  # really static
    roles = {cap.paths[p.name]: _fx.is_call_input(p) for p in phs}
    assert roles.pop("<input>") is True
    assert roles and not any(roles.values()), roles  # parameters / buffers are state
    _check_rewrite(cap)


def test_static_shapes_without_source_record_fall_back_to_shapes():
    """A graph that does not say where its inputs came from (not from Dynamo, or the record was dropped): static
    shapes decide, as before; a block whose input cannot pass for an expert weight is still matched."""
    cap = capture_block(tm.moe_blocks(tm.hf_model("mixtral"))[0], torch.randn(2, 5, tm.H), dynamic=False)
    for p in cap.gm.graph.nodes:
        p.meta.pop(_fx._CALL_INPUT_KEY, None)
        assert _fx.is_call_input(p) is None or isinstance(_fx.meta_val(p), torch.nn.Parameter)
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res) == 1, res.rejected
