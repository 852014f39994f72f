"""The FX numeric check and 16-bit routing ties (``moecomp/recognise/fx/ties.py``).

A Qwen3-MoE block of random weights at E = 128, k = 4, H = I = 128 in bf16: the check's crowd token (a quarter of
the 48 check tokens are one repeated token) has its 4th and 5th router logits equal in bf16, and ``torch.topk``
breaks that tie one way in the block and another in the reference. Before, the check failed (71% of tokens within
tolerance) and the block fell to experts-only; now the exact-tie tokens are left out, counted in the report, and the
block is rewritten whole. The rewritten model is then compared with the unoptimized block on fresh inputs (tokens
whose 4th and 5th bf16 logits are equal left out; tolerance per token: max |diff| / max |ref| <= 0.03, bf16's
verify tolerance). The excuse cannot hide a wrong match: a spec that differs from the block
(no renormalisation) still fails, and more tie tokens than ``policy.max_tie_tokens`` excuse nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import moecomp
from moecomp.core import policy
from moecomp.oracle import reference
from moecomp.recognise.fx import numeric as _numeric, ties as _ties
from moecomp.testing.blocks import one_block

E, H, K = 128, 128, 4


@pytest.fixture(scope="module")
def tied_block():
    return one_block("qwen3_moe", "bf16", E=E, H=H, I=H, k=K, seed=0)


def test_tied_crowd_token_no_longer_refuses_the_block(tied_block):
    m = copy.deepcopy(tied_block)
    m, rep = moecomp.optimize(m, report=True)
    assert rep.summary() == {"blocks": 1, "rewritten": 1}, str(rep)
    text = " ".join(str(n) for n in rep.blocks[0].notes) + rep.blocks[0].reason
    assert "at a 16-bit routing tie left out" in text, text
    torch.manual_seed(1)
    x = torch.randn(4, 16, H, dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    with torch.no_grad():
        out.copy_(m(x))
        ref = tied_block(x)
    x2, o2, r2 = x.reshape(-1, H), out.float().reshape(-1, H), ref.float().reshape(-1, H)
    top = (x2 @ tied_block.mlp.gate.weight.t()).float().topk(K + 1, -1).values  # bf16 logits, as the block's
    near = top[:, K - 1] == top[:, K]  # exact ties: torch.topk and the op may break them differently
    err = (o2 - r2).abs().amax(-1) / r2.abs().amax()
    assert torch.isfinite(o2).all()
    assert int(near.sum()) < x2.shape[0] // 4
    assert float(err[~near].max()) <= 0.03, float(err[~near].max())


def _captured_check(block):
    """The check's inputs as the FX pass builds them: (x, tensors, spec) of the first candidate it compares."""
    seen = {}
    orig = _numeric._agree

    def spy(got, xin, tensors, spec, arg_shapes, dtype):
        seen.setdefault("args", (got, xin, dict(tensors), spec, arg_shapes, dtype))
        return orig(got, xin, tensors, spec, arg_shapes, dtype)

    _numeric._agree = spy
    try:
        moecomp.optimize(copy.deepcopy(block))
    finally:
        _numeric._agree = orig
    return seen["args"]


def test_a_wrong_spec_still_fails_with_ties_left_out(tied_block):
    got, xin, tensors, spec, shapes, dtype = _captured_check(tied_block)
    ok, msg = _numeric._agree(got, xin, tensors, spec, shapes, dtype)
    assert ok and "tie left out" in msg, msg
    wrong = spec.replace(renormalize=False)
    ok, msg = _numeric._agree(got, xin, tensors, wrong, shapes, dtype)
    assert not ok, msg


def test_tie_tokens_marks_exact_ties_only_and_bounds_them(tied_block, monkeypatch):
    _, xin, tensors, spec, _, dtype = _captured_check(tied_block)
    x2 = xin.reshape(-1, H)
    near = _ties.tie_tokens(x2, tensors, spec, dtype)
    assert near is not None and 0 < int(near.sum()) < x2.shape[0]
    logits = reference.router_logits(x2, tensors["router_w"], None, spec).float()
    top = logits.topk(K + 1, -1).values
    assert torch.equal(near, top[:, K - 1] == top[:, K])
    assert _ties.tie_tokens(x2.float(), tensors, spec, torch.float32) is None  # fp32 routers: nothing excused
    distinct = torch.unique(x2[near], dim=0).shape[0]
    monkeypatch.setattr(policy, "max_tie_tokens", lambda n: distinct - 1)  # one distinct tie token too many
    assert _ties.tie_tokens(x2, tensors, spec, dtype) is None
    ok, msg = _numeric._agree(*_captured_check(tied_block))
    assert not ok and "tie" not in msg, msg
