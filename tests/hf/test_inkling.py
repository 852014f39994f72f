"""Inkling (``InklingForCausalLM`` built tiny by ``moecomp.coverage.families.build_tiny``): its MoE (``InklingMoE``, the
``mlp`` of each MoE decoder layer) has a router ``[E + S, H]`` whose last S rows score the S shared experts; the k
chosen routed logits and the S shared ones are renormalised together (``exp(logsigmoid - logsumexp)``), times
``route_scale`` and the learned ``global_scale`` Parameter [1]; the S shared experts are stacked ``[S, I, H]`` and
run by bmm, each scaled by its gamma (``MoESpec.shared_gamma`` "joint_renorm", ``SharedExpertSpec.stacked``,
``has_weight_scale``).

``moecomp.optimize`` must rewrite every MoE block whole (one ``moe_forward`` per block), read by the FX pass and by
the attribute reader alone (``use_capture=False``: gammas from the router's extra rows, the weight scale found by
what doubling it does), binding the stacked shared weights and the global scale in place (no copies), and the logits
must equal the original's within 1e-4 relative (fp32, CPU, fresh token ids) on the torch path and on the Triton
kernels (interpreter); a later write to ``global_scale`` must reach the op."""

import pytest
import torch

import moecomp
from moecomp.coverage import families as F

from .conftest import rel_err

pytest.importorskip("transformers")
TOL = 1e-4


def tiny_inkling(seed: int = 0):
    model, _ = F.build_tiny("inkling", seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a learned global scale and correction bias away from their inits (1, 0)
        for m in model.modules():
            if type(m).__name__ == "InklingMoE":
                m.gate.global_scale.fill_(1.0 + float(torch.rand(1, generator=g)))
                m.gate.e_score_correction_bias.copy_(torch.randn(m.gate.e_score_correction_bias.shape, generator=g)
                                                     * 0.05)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("backend, use_capture", [("torch", True), ("triton", True), ("torch", False)])
def test_optimize_rewrites_inkling_whole(monkeypatch, backend, use_capture):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    model = tiny_inkling()
    blocks = [n for n, m in model.named_modules() if type(m).__name__ == "InklingMoE"]
    assert blocks
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))  # not the probes' tokens
    ref = _logits(model, ids)
    _, rep = moecomp.optimize(model, report=True, use_capture=use_capture)
    assert sorted(b.name for b in rep.rewritten) == sorted(blocks) and not rep.experts_only, str(rep)
    assert all(b.method == ("fx" if use_capture else "fallback") for b in rep.rewritten), str(rep)
    for name in blocks:
        blk = model.get_submodule(name)
        s = next(b.spec for b in rep.rewritten if b.name == name)
        S = blk.config.n_shared_experts
        # (router_fp32 is not pinned: 5.17's router runs in the model's dtype, later ones in fp32)
        assert (s.shared_gamma, s.shared.stacked, s.has_weight_scale, s.scoring) == (
            "joint_renorm", S, True, "sigmoid"), s.describe()
        assert s.routed_scaling_factor == blk.config.route_scale and s.num_experts == blk.config.n_routed_experts
    out, per, total = F.count_calls_per_block(model, lambda: _logits(model, ids))
    assert sorted(per) == sorted(blocks) and all(n == 1 for n in per.values()) and total == len(blocks)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
    # the learned global scale is read at every call: a write reaches the op
    blk = model.get_submodule(blocks[0])
    with torch.no_grad():
        blk.gate.global_scale.mul_(1.7)
    moved = _logits(model, ids)
    moecomp.unoptimize(model)
    want = _logits(model, ids)
    assert rel_err(moved, want) <= TOL and rel_err(moved, out) > 10 * TOL
    with torch.no_grad():
        blk.gate.global_scale.div_(1.7)
    assert torch.equal(_logits(model, ids), ref)



def test_compile_backend_rewrites_inkling(poison):
    """torch.compile(backend="moecomp") on the whole model: the FX pass rewrites every MoE block in the model's graph
    (one moe_forward each, nothing rejected), the logits equal the original's."""
    import torch._dynamo

    model = tiny_inkling(1)
    n_blocks = sum(type(m).__name__ == "InklingMoE" for m in model.modules())
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    moecomp.counters.clear()
    try:
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits
            got = torch.compile(model, backend="moecomp")(input_ids=ids, use_cache=False).logits
        c = moecomp.counters
        assert (c["detect_moe"]["matched"], c["detect_moe"]["rejected"], c["rewrite_moe"]["replaced"]) == (
            n_blocks, 0, n_blocks), dict(c)
        assert torch.isfinite(got).all() and rel_err(got, want) <= TOL
    finally:
        torch._dynamo.reset()


def _first_block(model):
    return next(m for m in model.modules() if type(m).__name__ == "InklingMoE")


def _read_alone(block):
    """The attribute reader's answer for ``block`` (measured on the probe input), and the block's parts."""
    from moecomp.core import policy
    from moecomp.recognise import fallback
    from moecomp.recognise.structure import find_parts

    parts = find_parts(block)
    return fallback.recognise(block, parts, policy.probe_input(parts.hidden_size, torch.device("cpu"),
                                                               torch.float32)), parts


def test_attribute_reader_finds_the_weight_scale_by_what_it_does():
    """A second one-element Parameter of the router that the routing does not read (named to come first) is not
    taken for the weight scale; the global scale, which multiplies the weights, is (and the routed scale is the
    config's route_scale, not route_scale times the global scale's value)."""
    from moecomp.core.reject import Reject

    model = tiny_inkling(2)
    blk = _first_block(model)
    blk.gate.register_parameter("a_unused_scale", torch.nn.Parameter(torch.full((1,), 3.0)))
    m, _ = _read_alone(blk)
    assert not isinstance(m, Reject), m
    assert m.bindings["weight_scale"] == "gate.global_scale" and m.spec.has_weight_scale, m.describe()
    assert (m.spec.shared_gamma, m.spec.shared.stacked) == ("joint_renorm", blk.config.n_shared_experts)
    assert m.spec.routed_scaling_factor == blk.config.route_scale, m.describe()


def test_attribute_reader_refuses_gammas_renormalised_apart():
    """A router whose extra rows are not renormalised together with the chosen weights (the routed weights summing to
    one on their own): no routing the spec knows gives the experts' weights, and the reader says so."""
    import types

    import torch.nn.functional as Fn

    from moecomp.core.reject import Reject, RejectCode

    model = tiny_inkling(3)
    blk = _first_block(model)
    gate = blk.gate

    def forward(self, hidden_states):
        logits = Fn.linear(hidden_states.reshape(-1, self.hidden_dim).float(), self.weight.float())
        scores = logits.sigmoid()
        routed = scores[..., : -self.n_shared_experts]
        ids = torch.topk(routed + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        w = routed.gather(-1, ids)
        w = w / w.sum(-1, keepdim=True) * self.route_scale * self.global_scale
        gammas = scores[..., -self.n_shared_experts:] * self.route_scale * self.global_scale
        return logits[..., : -self.n_shared_experts], w, ids, gammas

    gate.forward = types.MethodType(forward, gate)
    m, parts = _read_alone(blk)
    assert parts.gamma_rows == blk.config.n_shared_experts
    assert isinstance(m, Reject) and m.code is RejectCode.UNSUPPORTED_ROUTING, m
    assert "renormalised together" in m.message and f"{parts.gamma_rows} rows past the experts" in m.message, m

