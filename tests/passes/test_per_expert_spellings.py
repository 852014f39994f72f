"""Each block of ``per_expert_spellings`` through the two public entry points: ``detect_moe`` on its real-values
capture, and ``moecomp.optimize`` on a model holding it as ``mlp``.

Recognised: exactly 1 match; optimize rewrites exactly the one block, which then calls the op once per forward and
gives the block's output on fresh [3, 7, H] tokens within fp32 max |diff| / max |block| <= 1e-5. Refused: no match,
the block untouched (0 op calls), with the reason code and a message naming the part not understood. A block whose part names optimize's block
finder (``hf/structure.iter_blocks``) does not know is still a candidate when its shapes say it routes
(``structural_parts``: the FX pass reads it; ``NOT_FOUND`` would mark one that is not a candidate, untouched and not
in the report: none is left).
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
NR, VF = RejectCode.NOT_RECOGNISED, RejectCode.VERIFICATION_FAILED
CF = "capture failed"
UNSELECTED = "select no expert by a constant index"
NOT_FOUND = "not found"  # optimize's block finder names per-expert parts: no candidate, no report entry
# name -> (FX: None = 1 match, else (code, message part)); optimize: None = rewritten, else (code, message part))
OUTCOMES = {
    "nonzero": (None, None),
    "mask_any": (None, None),
    "index_add_out_of_place": (None, None),  # Sequential experts: found by shapes (hf/structure.structural_parts)
    "scatter_add": (None, None),
    "index_put_add": (None, None),
    "weight_on_hidden": (None, None),
    "weight_on_input": (None, None),
    "one_hot_token_major": (None, None),  # ModuleDict experts: found by shapes
    "one_hot_summed": (None, None),
    "fused_gate_up": (None, None),  # gate_up / down names, a bare router Parameter: found by shapes
    "dense_scattered": (None, None),
    "dense_stacked": ((NR, UNSELECTED), (NR, UNSELECTED)),
    "slot_loop": (None, None),
    "repeat_interleave": (None, None),
    "unique_ids": ((NR, UNSELECTED), (VF, "op output differs")),  # FX refuses; the attribute fallback's check too
    "three_d_input": (None, None),
    "sigmoid_float_mask": (None, None),
    "skip_empty": (CF, (VF, "op output differs")),  # not captured; the attribute fallback's check refuses it
    "gather_weight": (None, None),
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
    """optimize first; detect_moe on its own capture only where optimize's report does not show the FX outcome
    (a block optimize does not hand to the FX pass, or one the attribute fallback refused after it)."""
    fx_want, opt_want = OUTCOMES[name]
    block = pb._redraw(ps.SPELLINGS[name](), 0)
    model = Model(copy.deepcopy(block)).eval()
    _, rep = moecomp.optimize(model, report=True)
    xt = torch.randn(3, 7, pb.H)
    with torch.no_grad():
        got, _, calls = fam.count_calls_per_block(model, lambda: model(xt))
        want = block(xt)
    if opt_want is None:  # rewritten by the FX pass: it matched exactly this one block
        [b] = rep.blocks
        assert b.status == "rewritten" and b.method == "fx" and [r.name for r in rep.rewritten] == ["mlp"], str(rep)
        assert calls == 1
        assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
        return
    assert calls == 0 and torch.equal(got, want)
    if opt_want is NOT_FOUND:
        assert rep.blocks == [], str(rep)
    else:
        [b] = rep.blocks
        assert b.status == "skipped" and opt_want[0] in b.codes and opt_want[1] in b.reason, (b.codes, b.reason)
    if opt_want[0] is NR:  # the FX pass's own refusal, reported by optimize
        return
    if fx_want is CF:  # Dynamo could not capture it: optimize says so in its notes
        assert any("could not capture" in n for n in b.notes), b.notes
        return
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
