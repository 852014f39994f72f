"""MuseSpark (transformers' ``muse_spark``, tiny: hidden 64, 8 experts of moe_intermediate 32, top-2; here with
moe_hidden_size 48 and routed_scaling_factor 2.5, and the default 4096 as the coverage tool builds it): its
``MuseSparkMoE`` routes on x (fp32 logits times output_multiplier, sigmoid, correction bias, top-k, renormalised with
eps 1e-15, scaled), runs the experts on ``pre_expert_norm(pre_expert_proj(x))`` (a (1 + w) RMSNorm), normalises each
expert's output with ``post_expert_norm`` (the scale (1 + w) first, then the RMS) before its routing weight, and
sends the weighted sum through ``post_expert_proj``.

``moecomp.optimize`` must rewrite both MoE blocks whole, by the FX pass (router_scale, latent_size, latent_norm
"rms_1p", expert_norm "scaled_rms_1p"), one ``moe_forward`` per block call and no HF experts call; the logits must
equal the original's within 1e-4 relative (fp32, CPU, fresh token ids) with the norms' weights drawn at random (they
start at zero, which would hide the (1 + w)); the attribute reader must derive the same spec."""

import pytest
import torch

import moecomp
from moecomp.coverage import families as F
from moecomp.recognise.recognise import match_block

from .conftest import rel_err

pytest.importorskip("transformers")
TOL = 1e-4


def _randomise_norms(model, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.mlp.pre_expert_norm, layer.mlp.experts.post_expert_norm):
                norm.weight.copy_(0.3 * torch.randn(norm.weight.shape, generator=g))
            corr = layer.mlp.gate.e_score_correction_bias
            corr.copy_(0.05 * torch.randn(corr.shape, generator=g))


@pytest.mark.parametrize("sizes", [dict(moe_hidden_size=48, routed_scaling_factor=2.5), None],
                         ids=["L48", "default"])
def test_optimize_rewrites_muse_spark_whole(sizes):
    model, _ = F.build_tiny("muse_spark", sizes=sizes)
    _randomise_norms(model)
    L = model.config.moe_hidden_size
    block = model.layers[0].mlp
    fallback = match_block(block, use_fx=False).match.spec  # before binding: the attribute reader's reading
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(5))  # not the probes' tokens
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["layers.0.mlp", "layers.1.mlp"] and len(rep.blocks) == 2, str(rep)
    s = rep.rewritten[0].spec
    assert rep.rewritten[0].method == "fx", str(rep)
    cfg = model.config
    assert (s.hidden_size, s.latent_size, s.intermediate_size, s.num_experts, s.top_k) == (64, L, 32, 8, 2)
    assert (s.scoring, s.has_correction_bias, s.router_fp32, s.renorm_eps) == ("sigmoid", True, True, 1e-15)
    assert s.router_scale == pytest.approx(cfg.output_multiplier, rel=1e-6)
    assert s.routed_scaling_factor == pytest.approx(cfg.routed_scaling_factor, rel=1e-6)
    assert (s.latent_norm, s.latent_norm_eps, s.expert_norm, s.expert_norm_eps) == (
        "rms_1p", cfg.rms_norm_eps, "scaled_rms_1p", cfg.post_norm_eps), s.describe()
    assert fallback == s, (fallback.describe(), s.describe())
    counter = F.OpCounter()
    with torch.no_grad(), counter:
        out = model(input_ids=ids).last_hidden_state
    assert counter.calls == 2 and counter.experts_calls == 0
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
