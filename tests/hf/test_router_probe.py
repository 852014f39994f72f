"""The measured reason for a block found by its experts that has no plain [E, H] router (``recognise/router_probe.py``).

ZAYA (``zaya``, tiny): its router is an MLP (down_proj [R, H] -> RMS norm -> fc1, fc2 with GELU -> out_proj [E + 1, R],
one class past the E experts) whose input adds the previous layer's router state, and the block returns its own
(the down projection's output) as a second tensor. The report must say exactly that (the linear maps in call order,
the E + 1 outputs, the state in and out), and the experts module still runs ``moe_experts`` with the logits equal to
the original's. A block with a plain router (Mixtral) gets no added text."""

import pytest
import torch

import moecomp
from moecomp.coverage import families as F
from moecomp.recognise import router_probe

from .conftest import rel_err

pytest.importorskip("transformers")


def _has(family: str) -> bool:
    import os

    return bool(F.transformers_dir()) and os.path.isdir(os.path.join(F.transformers_dir(), "models", family))


@pytest.mark.skipif(not _has("zaya"), reason="this transformers has no ZAYA")
def test_zaya_reason_names_the_mlp_router_and_the_state():
    model, _ = F.build_tiny("zaya")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    _, rep = moecomp.optimize(model, report=True)
    E = model.config.num_experts
    R = model.config.router_hidden_size
    assert len(rep.experts_only) == len(rep.blocks) == model.config.num_hidden_layers and not rep.rewritten, str(rep)
    for b in rep.blocks:
        r = b.reason
        assert r.startswith(f"no router weight [{E}, H]: "), r
        assert f"gate.router_mlp.out_proj's {E + 1} outputs ({E} experts + 1)" in r, r
        assert "after an MLP router (down_proj -> fc1 -> fc2 -> out_proj)" in r, r
        assert "the block returns gate.down_proj's output as a 2nd tensor and takes a 2nd input" in r, r
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.isfinite(out).all() and rel_err(out, ref) <= F.TOL
    # the second tensor is the router's R-wide state: the diagnosis read it from the linear map that made it
    blk = model.model.layers[1].mlp
    x = torch.randn(2, 5, model.config.hidden_size)
    moecomp.unoptimize(model)
    with torch.no_grad():
        _, state = blk(x)
        assert state.shape[-1] == R and torch.equal(state, blk.gate.down_proj(x))


def test_plain_router_gets_no_added_reason():
    model, _ = F.build_tiny("mixtral")
    blk = next(m for m in model.modules() if type(m).__name__ == "MixtralSparseMoeBlock")
    assert router_probe.explain(blk, "kept as it is") == "kept as it is"
