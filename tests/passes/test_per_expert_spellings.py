"""Each block of ``per_expert_spellings`` and ``sorted_spellings`` through the two public entry points:
``detect_moe`` on its real-values capture, and ``moecomp.optimize`` on a model holding it as ``mlp``.

Recognised: exactly 1 match; optimize rewrites exactly the one block, which then calls the op once per forward and
gives the block's output on fresh [3, 7, H] tokens within fp32 max |diff| / max |block| <= 1e-5. Blocks the FX pass
cannot read (not captured, or ids that select no expert by a constant index) are rewritten by the dispatch reader
(the expert modules observed) or, for stacked weights the block runs itself, by the attribute reader's fit on the
output; the report's notes then give the FX outcome. Refused: no match,
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
import sorted_spellings as ss
from moecomp.recognise.capture import capture_block
from moecomp.coverage import families as fam
from moecomp.recognise.fx.detect_moe import detect_moe
from moecomp.core.reject import RejectCode

TOL = 1e-5
NR, VF = RejectCode.NOT_RECOGNISED, RejectCode.VERIFICATION_FAILED
CF = "capture failed"
UNSELECTED = "select no expert by a constant index"
NOT_FOUND = "not found"  # optimize's block finder names per-expert parts: no candidate, no report entry
DISPATCH, ATTR = "dispatch", "fallback"  # rewritten by the dispatch reader / the attribute reader (its output fit)
# name -> (FX: None = 1 match, else (code, message part); optimize: None = rewritten by the FX pass, DISPATCH / ATTR =
# rewritten by that reader after the FX pass gave the FX outcome (said in the report's notes), else (code, message
# part))
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
    "dense_stacked": ((NR, UNSELECTED), DISPATCH),  # every expert on every token: weighted 0 off the top-k
    "slot_loop": (None, None),
    "repeat_interleave": (None, None),
    "unique_ids": (CF, DISPATCH),  # data-dependent loop: the expert modules observed
    "three_d_input": (None, None),
    "sigmoid_float_mask": (None, None),
    "skip_empty": (CF, DISPATCH),  # data-dependent branch
    "gather_weight": (None, None),
    # sorted dispatch (sorted_spellings)
    "sorted_split": (CF, DISPATCH),  # split(counts.tolist()): sizes Dynamo cannot capture
    "sorted_cumsum_index_copy": ((NR, UNSELECTED), DISPATCH),  # captured; slices select the experts, no ids == e
    "sorted_inverse_perm": (CF, DISPATCH),
    "sorted_scatter_reduce": (CF, DISPATCH),
    "skip_empty_continue": (None, None),  # traced again with real values (recognise._detect_fx)
    "stacked_sorted_slices": (CF, ATTR),  # stacked weights, no module to observe: fitted on the block's output
    "stacked_up_first": (CF, (NR, "no activation / gate split / layout / routing the spec knows reproduces")),
    "stacked_gather_einsum": (None, None),
    "stacked_gather_bmm": (None, None),
    "grouped_gemm_sorted": (None, None),  # in-place writes into slices of a fresh tensor (moe_region)
}
SPELLINGS = {**ps.SPELLINGS, **ss.SPELLINGS}


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
    assert set(OUTCOMES) == set(SPELLINGS)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_per_expert_spelling_outcome(name):
    """optimize first; detect_moe on its own capture only where optimize's report does not show the FX outcome
    (a block optimize does not hand to the FX pass, or one the attribute fallback refused after it)."""
    fx_want, opt_want = OUTCOMES[name]
    block = pb._redraw(SPELLINGS[name](), 0)
    model = Model(copy.deepcopy(block)).eval()
    _, rep = moecomp.optimize(model, report=True)
    xt = torch.randn(3, 7, pb.H)
    with torch.no_grad():
        got, _, calls = fam.count_calls_per_block(model, lambda: model(xt))
        want = block(xt)
    if opt_want in (None, DISPATCH, ATTR):  # rewritten: by the FX pass (it matched exactly this one block) or a reader
        [b] = rep.blocks
        assert b.status == "rewritten" and b.method == (opt_want or "fx"), str(rep)
        assert [r.name for r in rep.rewritten] == ["mlp"] and calls == 1, str(rep)
        assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
        if opt_want is not None:  # the FX pass's outcome, as the report's notes give it
            fx_note = "could not capture" if fx_want is CF else fx_want[1]
            assert any(fx_note in n for n in b.notes), b.notes
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
