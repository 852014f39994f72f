"""Inkling (``InklingForCausalLM`` built tiny by ``moecomp.hf.families.build_tiny``): its MoE (``InklingMoE``, the
``mlp`` of each MoE decoder layer) has a router ``[E + S, H]`` whose last S rows score the S shared experts; the k
chosen routed logits and the S shared ones are renormalised together (``exp(logsigmoid - logsumexp)``), times
``route_scale`` and the learned ``global_scale`` Parameter [1]; the S shared experts are stacked ``[S, I, H]`` and
run by bmm, each scaled by its gamma (``MoESpec.shared_gamma`` "joint_renorm", ``SharedExpertSpec.stacked``,
``has_weight_scale``).

``moecomp.optimize`` must rewrite every MoE block whole (one ``moe_forward`` per block, read by the FX pass), binding
the stacked shared weights and the global scale in place (no copies), and the logits must equal the original's within
1e-4 relative (fp32, CPU, fresh token ids) on the torch path and on the Triton kernels (interpreter); a later write
to ``global_scale`` must reach the op."""

import pytest
import torch

import moecomp
from moecomp.hf import families as F

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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_optimize_rewrites_inkling_whole(monkeypatch, backend):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    model = tiny_inkling()
    blocks = [n for n, m in model.named_modules() if type(m).__name__ == "InklingMoE"]
    assert blocks
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))  # not the probes' tokens
    ref = _logits(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    assert sorted(b.name for b in rep.rewritten) == sorted(blocks) and not rep.experts_only, str(rep)
    assert all(b.method == "fx" for b in rep.rewritten), str(rep)
    for name in blocks:
        blk = model.get_submodule(name)
        s = next(b.spec for b in rep.rewritten if b.name == name)
        S = blk.config.n_shared_experts
        assert (s.shared_gamma, s.shared.stacked, s.has_weight_scale, s.scoring, s.router_fp32) == (
            "joint_renorm", S, True, "sigmoid", True), s.describe()
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
