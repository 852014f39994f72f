"""Each block of ``per_expert_spellings`` through the two public entry points: ``detect_moe`` on its real-values
capture, and ``moecomp.optimize`` on a model holding it as ``mlp``.

Recognised: exactly 1 match; optimize rewrites exactly the one block, which then calls the op once per forward and
gives the block's output on fresh [3, 7, H] tokens within fp32 max |diff| / max |block| <= 1e-5. Refused: no match,
the block untouched (0 op calls), with the reason code and a message naming the part not understood.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._subclasses.meta_utils as meta_utils

import moecomp
import per_expert_blocks as pb
import per_expert_spellings as ps
from moecomp.capture import capture_block
from moecomp.hf import families as fam
from moecomp.passes.detect_moe import detect_moe
from moecomp.reject import RejectCode

TOL = 1e-5
NR, NB, VF = RejectCode.NOT_RECOGNISED, RejectCode.NOT_A_BLOCK, RejectCode.VERIFICATION_FAILED
UNSELECTED = "select no expert by a constant index"
UNNAMED = "modules of identical 2-D weights next to a router"
# name -> (FX: None = 1 match, else (code, message part)); optimize: None = rewritten, else (code, message part))
OUTCOMES = {
    "nonzero": (None, None),
    "mask_any": (None, None),
    "index_add_out_of_place": (None, (NB, UNNAMED)),  # Sequential experts: optimize finds experts by names
    "scatter_add": (None, None),
    "index_put_add": (None, None),
    "weight_on_hidden": (None, None),
    "weight_on_input": (None, None),
    "one_hot_token_major": (None, (NB, UNNAMED)),  # ModuleDict experts
    "one_hot_summed": (None, None),
    "fused_gate_up": (None, (NB, UNNAMED)),  # gate_up / down names
    "dense_scattered": (None, None),
    "dense_stacked": ((NR, UNSELECTED), (NR, UNSELECTED)),
    "slot_loop": (None, None),
    "repeat_interleave": (None, None),
    "unique_ids": ((NR, UNSELECTED), (VF, "op output differs")),  # FX refuses; the attribute fallback's check too
    "three_d_input": (None, None),
}


@pytest.fixture(autouse=True)
def real_parameter_values(monkeypatch):
    """As in test_per_expert: real-value capture copies Parameters' values too."""
    orig = meta_utils._safe_copy
    monkeypatch.setattr(meta_utils, "_safe_copy",
                        lambda dst, src: orig(dst, src.detach() if isinstance(src, torch.nn.Parameter) else src))


class Model(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.mlp = block

    def forward(self, x):
        return self.mlp(x)


def test_every_spelling_has_an_outcome():
    assert set(OUTCOMES) == set(ps.SPELLINGS)


@pytest.mark.parametrize("name", sorted(ps.SPELLINGS))
def test_per_expert_spelling_outcome(name):
    fx_want, opt_want = OUTCOMES[name]
    block = pb._redraw(ps.SPELLINGS[name](), 0)
    x = torch.randn((2, 24, pb.H), generator=torch.Generator().manual_seed(0))
    cap = capture_block(block, x, real_values=True)
    res = detect_moe(cap.gm, cap.example_inputs)
    if fx_want is None:
        assert len(res.matches) == 1, res.rejected
        assert res.matches[0].verified.startswith("numeric"), res.matches[0].verified
    else:
        assert len(res.matches) == 0
        [(_, r)] = res.rejected
        assert r.code is fx_want[0] and fx_want[1] in r.message, r

    model = Model(copy.deepcopy(block)).eval()
    _, rep = moecomp.optimize(model, report=True)
    [b] = rep.blocks
    xt = torch.randn(3, 7, pb.H)
    with torch.no_grad():
        got, _, calls = fam.count_calls_per_block(model, lambda: model(xt))
        want = block(xt)
    if opt_want is None:
        assert b.status == "rewritten" and b.method == "fx" and [r.name for r in rep.rewritten] == ["mlp"], str(rep)
        assert calls == 1
        assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
    else:
        assert b.status == "skipped" and opt_want[0] in b.codes and opt_want[1] in b.reason, (b.codes, b.reason)
        assert calls == 0 and torch.equal(got, want)
