"""``model.generate(..., return_routed_experts=True)`` after ``moecomp.optimize`` (issue 43), on CPU: transformers'
loop under ``record_routing`` (the bound blocks record in the op). The routes equal a ``record_routing`` of the same
generate, and replaying them over the whole sequence reproduces its logits (REPLAY_TOL = 1e-5 relative, fp32,
NaN-poisoned); ``return_dict_in_generate`` missing is a ValueError."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.api.routing import moe_blocks  # noqa: E402
from moecomp.coverage import families as F  # noqa: E402

REPLAY_TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    m = F.build_tiny("qwen3_moe", seed=0)[0].eval()
    moecomp.optimize(m)
    assert len(moe_blocks(m)) == m.config.num_hidden_layers
    return m


def _gen(m, ids, mask, **kw):
    return m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, **kw)


def test_routes_equal_record_and_replay_reproduces_logits(model, poison):
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: -1 routes there
    out = _gen(model, ids, mask, return_dict_in_generate=True, return_routed_experts=True)
    seq, routes = out.sequences, out.routed_experts
    assert model.generate.last["reason"].startswith("return_routed_experts=True")  # said, not silently slow
    k = moe_blocks(model)[0][1]._moecomp.spec.top_k
    assert routes.shape == (len(moe_blocks(model)), 2, seq.shape[1], k) and routes.dtype == torch.int64
    assert bool((routes[:, 1, :2] == -1).all()) and bool((routes[:, :, -1] == -1).all())
    assert bool((routes[:, 0, :-1] >= 0).all())
    with torch.no_grad(), moecomp.record_routing(model) as rec:
        again = _gen(model, ids, mask, return_dict_in_generate=True, moecomp_fast=False)
    assert torch.equal(again.sequences, seq)
    live = routes[:, :, :-1] >= 0
    calls = rec.calls  # this tiny config runs without a cache: each call the whole prefix; else one per token
    ref = calls[-1] if calls[-1].shape[2] == seq.shape[1] - 1 else rec.routes
    assert ref.shape[2] == seq.shape[1] - 1
    assert torch.equal(routes[:, :, :-1][live], ref[live])
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with torch.no_grad():
        want = model(input_ids=seq, attention_mask=full_mask).logits
        with moecomp.replay_routing(routes, model):
            got = model(input_ids=seq, attention_mask=full_mask).logits
    m = full_mask.bool()
    assert float((got - want)[m].abs().max() / want[m].abs().max()) <= REPLAY_TOL


def test_needs_return_dict(model):
    ids = torch.randint(3, 100, (1, 4))
    with pytest.raises(ValueError, match="return_dict_in_generate=True"):
        _gen(model, ids, torch.ones_like(ids), return_routed_experts=True)


def test_finished_rows_are_padding_from_their_eos(model):
    """A row that stops at EOS: its routes are -1 from that EOS on (transformers pads the row after it), the other
    row's stay; the EOS is the token the first row generates second (seen in a run without EOS)."""
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    free = _gen(model, ids, mask, return_dict_in_generate=True, return_routed_experts=True, eos_token_id=None)
    eos = int(free.sequences[0, 6])
    other = free.sequences[1, 5:]
    if (other == eos).any():
        pytest.skip("the second row generates the same token: pick another seed")
    out = _gen(model, ids, mask, return_dict_in_generate=True, return_routed_experts=True, eos_token_id=eos)
    r = out.routed_experts  # [layers, 2, L, k]
    first = 5 + int((out.sequences[0, 5:] == eos).nonzero()[0])
    assert first == 6 and bool((r[:, 0, first:] == -1).all()) and bool((r[:, 0, :first] >= 0).all())
    assert bool((r[:, 1, :-1] >= 0).all())
