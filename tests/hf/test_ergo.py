"""Ergo (transformers' ``ergo``, new in 5.25; skipped before): tiny, 3 layers (a dense one, then two ``ErgoMoE``
blocks), hidden 64, 8 experts of moe_intermediate 32, top-2, a shared expert of 32. Its ``ErgoMoE`` routes in fp32
(sigmoid of ``x @ W.T``, correction bias for the choice only, renormalised with eps 1e-20, times
``moe_routed_scaling_factor`` = sqrt(8), rounded to x's dtype), runs ungated relu2 experts stored [E, in, out]
(``is_transposed``) on one row per route, normalises each route's output with its expert's own RMSNorm weight
(``ErgoExpertNorm``, [E, H], fp32) before the routing weight, and adds a shared expert up -> relu2 -> down followed by
its own RMSNorm (``ErgoSharedExpert``).

``moecomp.optimize`` must rewrite both MoE blocks whole by the FX pass, and nothing else (the dense layer stays), with
the spec fields above (expert_norm "rms_per_expert", shared norm "rms"), one ``moe_forward`` per block call and no HF
experts call; the logits must equal the original's within 1e-4 relative (fp32, CPU, fresh token ids), on the torch
path and on the Triton kernels (interpreter), with the norms' weights and the correction bias drawn at random (they
start at ones / zeros, which would hide a per-expert row read wrong). Outputs of the op NaN-poisoned (``poison``)."""

import math

import pytest
import torch

import moecomp
from moecomp.coverage import families as F

from .conftest import rel_err

pytest.importorskip("transformers.models.ergo", reason="transformers < 5.25 has no Ergo")
TOL = 1e-4


def _randomise(model, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            moe = layer.mlp
            if not hasattr(moe, "experts"):
                continue
            for w in (moe.experts.post_expert_norm.weight, moe.shared_experts.norm.weight):
                w.copy_(1 + 0.3 * torch.randn(w.shape, generator=g))
            corr = moe.gate.e_score_correction_bias
            corr.copy_(0.05 * torch.randn(corr.shape, generator=g))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_optimize_rewrites_ergo_whole(monkeypatch, poison, backend):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    model, name = F.build_tiny("ergo")
    assert name == "ErgoForCausalLM"
    _randomise(model)
    cfg = model.config
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse"]
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(5))  # not the probes' tokens
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["model.layers.1.mlp", "model.layers.2.mlp"], str(rep)
    assert all(b.method == "fx" for b in rep.rewritten), str(rep)
    s = rep.rewritten[0].spec
    assert (s.num_experts, s.top_k, s.hidden_size, s.intermediate_size) == (8, 2, 64, 32)
    assert (s.scoring, s.has_correction_bias, s.router_fp32, s.renormalize, s.renorm_eps) == (
        "sigmoid", True, True, True, 1e-20), s.describe()
    assert s.routed_scaling_factor == pytest.approx(math.sqrt(8), rel=1e-6)
    assert (s.activation, s.gated, s.w_layout, s.has_expert_bias) == ("relu2", False, "in_out", False)
    assert (s.expert_norm, s.expert_norm_eps) == ("rms_per_expert", cfg.rms_norm_eps), s.describe()
    sh = s.shared
    assert (sh.intermediate_size, sh.activation, sh.gated, sh.gate, sh.norm, sh.norm_eps) == (
        32, "relu2", False, "none", "rms", cfg.rms_norm_eps), s.describe()
    counter = F.OpCounter()
    with torch.no_grad(), counter:
        out = model(input_ids=ids).logits
    assert counter.calls == 2 and counter.experts_calls == 0
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL, rel_err(out, ref)

