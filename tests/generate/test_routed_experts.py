"""``model.generate(..., return_routed_experts=True)`` after ``moecomp.optimize`` (issue 43), on CPU: transformers'
loop under ``record_routing`` (the bound blocks record in the op), and the engine's path (``model.generate.cpu =
True``: the same steps the GPU captures, eager and with the layers compiled by Dynamo + AOTAutograd). The routes
equal a ``record_routing`` of the same generate (exactly: the same op routes both), and replaying them over the whole
sequence reproduces its logits (REPLAY_TOL = 1e-5 relative, fp32, NaN-poisoned); ``return_dict_in_generate`` missing
is a ValueError; a block that runs its original forward inside the engine's steps is counted and warned of."""

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
    assert model.generate.last["routes"].startswith("transformers' decode loop")  # said, not silently slow
    k = moe_blocks(model)[0][1]._moecomp.spec.top_k
    assert routes.shape == (len(moe_blocks(model)), 2, seq.shape[1], k) and routes.dtype == torch.int64
    assert bool((routes[:, 1, :2] == -1).all()) and bool((routes[:, :, -1] == -1).all())
    assert bool((routes[:, 0, :-1] >= 0).all())
    live = routes[:, :, :-1] >= 0
    ref = _recorded_by_transformers(model, ids, mask, seq)  # (this tiny config runs without a cache)
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


@pytest.fixture()
def engine_model():
    from generate.models import build  # (a cache on: the engine's path)

    m = moecomp.optimize(build("qwen3_moe", layers=3, seed=0), use_capture=False)
    m.generate.cpu = True
    yield m
    m.generate.release()


def _recorded_by_transformers(m, ids, mask, seq):
    with torch.no_grad(), moecomp.record_routing(m) as rec:
        again = _gen(m, ids, mask, return_dict_in_generate=True, moecomp_fast=False)
    assert torch.equal(again.sequences, seq)
    calls = rec.calls  # without a cache: each call the whole prefix; with one: one call per token
    return calls[-1] if calls[-1].shape[2] == seq.shape[1] - 1 else rec.routes


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_records_in_its_steps(engine_model, compiled, poison):
    """The engine's path records (``last["routes"]``), the routes equal transformers' loop's recording and replay to
    the same logits; compiled: the decoder layers through Dynamo and AOTAutograd (what Inductor receives), the sinks
    graph inputs the op mutates."""
    m = engine_model
    if compiled:
        eng = m.generate._engine()
        eng.cpu_compile, eng.compile_backend = True, "aot_eager"
    ids = torch.randint(3, 90, (3, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    out = _gen(m, ids, mask, return_dict_in_generate=True, return_routed_experts=True)
    last = m.generate.last
    assert last["path"] == "moecomp" and last["routes"] == "recorded in the engine's steps", last
    assert last["layers"] == ("compiled" if compiled else "eager"), last
    assert last["routes_missing"] == 0
    seq, routes = out.sequences, out.routed_experts
    k = moe_blocks(m)[0][1]._moecomp.spec.top_k
    assert routes.shape == (len(moe_blocks(m)), 3, seq.shape[1], k) and routes.dtype == torch.int64
    assert bool((routes[:, 2, :3] == -1).all()) and bool((routes[:, :, -1] == -1).all())
    live = routes[:, :, :-1] >= 0
    assert int(live.sum()) == len(moe_blocks(m)) * k * (3 * (seq.shape[1] - 1) - 3)
    ref = _recorded_by_transformers(m, ids, mask, seq)
    assert torch.equal(routes[:, :, :-1][live], ref[live])
    assert all(b._moecomp.route_sink is None for _, b in moe_blocks(m))  # detached after the call
    full_mask = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with torch.no_grad():
        want = m(input_ids=seq, attention_mask=full_mask).logits
        with moecomp.replay_routing(routes, m):
            got = m(input_ids=seq, attention_mask=full_mask).logits
    keep = full_mask.bool()
    assert float((got - want)[keep].abs().max() / want[keep].abs().max()) <= REPLAY_TOL
    again = _gen(m, ids, mask, return_dict_in_generate=True, return_routed_experts=True)  # the slot's buffers reused
    assert torch.equal(again.routed_experts, routes)
    plain = _gen(m, ids, mask)  # recording off: no sinks, the same tokens
    assert torch.equal(plain, seq) and m.generate.last["path"] == "moecomp"


def test_engine_fallback_block_is_counted(engine_model, monkeypatch):
    """A block that runs its original forward in the engine's steps writes no routes: -1 there, counted and warned
    of, not returned as if recorded."""
    from moecomp.bind import bind

    m = engine_model
    victim = moe_blocks(m)[1][1]
    real = bind._needs_original
    monkeypatch.setattr(bind, "_needs_original",
                        lambda block, *a: "test: original forward" if block is victim else real(block, *a))
    ids = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(6))
    with pytest.warns(UserWarning, match="no recorded expert ids"):
        out = _gen(m, ids, torch.ones_like(ids), return_dict_in_generate=True, return_routed_experts=True)
    r = out.routed_experts
    n = r.shape[2] - 1
    assert m.generate.last["routes_missing"] == n
    assert bool((r[1, :, :-1] == -1).all()) and bool((r[0, :, :-1] >= 0).all())


def test_engine_cannot_record_says_why(engine_model):
    """A model with a block the engine cannot record in (here: one block unbound) runs transformers' loop under
    record_routing, and says why."""
    from moecomp.bind.bind import unbind

    m = engine_model
    assert unbind(m.model.layers[0].mlp)
    blocks, why = type(m.generate).engine_blocks(m)
    assert blocks is None and "model.layers.0.mlp is not rewritten" in why
    ids = torch.randint(3, 90, (1, 5))
    out = _gen(m, ids, torch.ones_like(ids), return_dict_in_generate=True, return_routed_experts=True)
    assert m.generate.last["path"] == "transformers"
    assert why in m.generate.last["routes"] and bool((out.routed_experts[:, :, :-1] >= 0).all())
