"""NemotronH with ``moe_latent_size`` (the tiny variant ``nemotron_h:latent`` of ``moecomp.coverage.families``: hidden 64,
latent 48, 8 experts of moe_intermediate 32, top-2): its ``NemotronHMoE`` routes on x (fp32 sigmoid router,
correction bias, groups, renormalised, scaled), runs the relu2 experts on ``fc1_latent_proj(x)`` and sends their
combined output through ``fc2_latent_proj`` before adding the shared expert, which reads x.

``moecomp.optimize`` must rewrite exactly the one MoE block of the tiny model, by the FX pass, with a latent spec
(L = 48, no biases: mlp_bias is off), one ``moe_forward`` per block call; the logits must equal the original's within
1e-4 relative (fp32, CPU, fresh token ids); the attribute reader must derive the same spec."""

import pytest
import torch

import moecomp
from moecomp.coverage import families as F
from moecomp.recognise.recognise import match_block

from .conftest import rel_err

pytest.importorskip("transformers")
TOL = 1e-4


def test_optimize_rewrites_the_latent_block():
    model, _ = F.build_tiny("nemotron_h:latent")
    block = model.model.layers[1].mixer
    assert block.fc1_latent_proj.weight.shape == (48, 64) and block.experts.up_proj.shape == (8, 32, 48)
    fallback = match_block(block, use_fx=False).match.spec  # before binding: the attribute reader's reading
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(5))  # not the probes' tokens
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["model.layers.1.mixer"] and len(rep.blocks) == 1, str(rep)
    b = rep.rewritten[0]
    s = b.spec
    assert b.method == "fx" and (s.hidden_size, s.latent_size, s.latent_bias, s.intermediate_size) == (
        64, 48, False, 32), s.describe()
    assert (s.gated, s.activation, s.scoring, s.has_correction_bias) == (False, "relu2", "sigmoid", True)
    assert s.shared is not None and s.shared.intermediate_size == 32
    assert fallback == s, (fallback.describe(), s.describe())
    counter = F.OpCounter()
    with torch.no_grad(), counter:
        out = model(input_ids=ids).logits
    assert counter.calls == 1 and counter.experts_calls == 0
    assert rel_err(out, ref) <= TOL
