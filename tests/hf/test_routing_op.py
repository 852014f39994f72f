"""Routing replay and record on models ``moecomp.optimize`` rewrote (issue 43): the bound blocks' op replays
(``routes_in``) and records (``moe_forward_routes``), read through the routing session (``core/replay.py``).

Tiny random-weight models (fp32, CPU; the op runs its vectorised torch path): Mixtral, Qwen3-MoE, DeepSeek-V3.
Tolerances: logits within REPLAY_TOL = 1e-5 relative (max |diff| / max |ref|), gradients within GRAD_TOL = 1e-4
relative per parameter; outputs NaN-poisoned (``poison``). Recorded ids are compared as sets per token (the op
records in its slot order, transformers' path in score order); rows that differ are ties between scores, counted:
random fp32 weights have none, so the tests assert zero. Each test asserts the op ran (the blocks' op-call counter)
or, for autograd, that the block fell back (its fallback counter) and still used the routes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moecomp
from moecomp.api.routing import moe_blocks
from moecomp.coverage import families as F

from .conftest import rel_err

REPLAY_TOL = 1e-5
GRAD_TOL = 1e-4
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def pairs():
    """family -> (the plain model, an optimized copy): every MoE block bound."""
    out = {}
    for fam in FAMILIES:
        m = F.build_tiny(fam, seed=0)[0].eval()
        o = copy.deepcopy(m)
        moecomp.optimize(o, fast_generate=False)
        blocks = moe_blocks(o)
        assert len(blocks) == m.config.num_hidden_layers
        assert all(getattr(b, "_moecomp", None) is not None for _, b in blocks)
        out[fam] = (m, o)
    return out


def _ids(B=2, S=5, seed=0):
    return torch.randint(3, 100, (B, S), generator=torch.Generator().manual_seed(seed))


def _counts(model, what="calls"):
    return [getattr(b._moecomp, what) for _, b in moe_blocks(model)]


def _tie_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens whose id sets differ."""
    return int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_record_on_optimized_equals_unoptimized(pairs, family, poison):
    m, o = pairs[family]
    ids = _ids()
    with torch.no_grad(), moecomp.record_routing(m) as ref:
        want = m(input_ids=ids).logits
    before = _counts(o)
    with torch.no_grad(), moecomp.record_routing(o) as rec:
        got = o(input_ids=ids).logits
    assert [p.op for p in rec.plans] == [True] * len(rec.plans)
    assert [a - b for a, b in zip(_counts(o), before)] == [1] * len(rec.plans)  # the op ran, and recorded
    assert rec.routes.shape == ref.routes.shape and rec.routes.dtype == torch.int64
    assert _tie_rows(rec.routes, ref.routes) == 0
    assert rel_err(got, want) <= REPLAY_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_recorded_on_optimized_equals_original(pairs, family, poison):
    m, o = pairs[family]
    ids = _ids(seed=3)
    with torch.no_grad(), moecomp.record_routing(m) as rec:
        want = m(input_ids=ids).logits
    before = _counts(o)
    with torch.no_grad(), moecomp.replay_routing(rec.routes, o) as ctx:
        got = o(input_ids=ids).logits
    assert [p.op for p in ctx.plans] == [True] * len(ctx.plans)
    assert [a - b for a, b in zip(_counts(o), before)] == [1] * len(ctx.plans)
    assert rel_err(got, want) <= REPLAY_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_op_replay_of_other_routes_equals_transformers_path(pairs, family, poison):
    """Routes no router chose (random ids, distinct per token; some rows padding): the op's replay on the optimized
    model equals transformers' path's replay on the plain one."""
    m, o = pairs[family]
    ids = _ids(seed=4)
    spec = moe_blocks(o)[0][1]._moecomp.spec
    n, E, k = len(moe_blocks(m)), spec.num_experts, spec.top_k
    g = torch.Generator().manual_seed(5)
    routes = torch.rand(n, 2, 5, E, generator=g).argsort(-1)[..., :k]
    routes[:, 1, 3] = -1  # padding: the block's own choice on both paths
    with torch.no_grad(), moecomp.replay_routing(routes, m):
        want = m(input_ids=ids).logits
    with torch.no_grad():
        plain = m(input_ids=ids).logits
    before = _counts(o)
    with torch.no_grad(), moecomp.replay_routing(routes, o):
        got = o(input_ids=ids).logits
    assert [a - b for a, b in zip(_counts(o), before)] == [1] * n
    assert rel_err(got, want) <= REPLAY_TOL
    assert rel_err(want, plain) > 1e-3  # the routes changed the result (the test can fail)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_gradients_on_optimized_equal_original(pairs, family):
    """Training with autograd: the bound block falls back (the op has no backward) to the replay's torch forward,
    with the routes: loss and gradients those of the plain model's recorded run."""
    m, o = pairs[family]
    a, b = copy.deepcopy(m).train(), copy.deepcopy(o).train()
    ids, labels = _ids(seed=1), _ids(seed=2)
    with moecomp.record_routing(a) as rec:
        ref = a(input_ids=ids, labels=labels).loss
    ref.backward()
    before = _counts(b, "fallbacks")
    with moecomp.replay_routing(rec.routes, b):
        loss = b(input_ids=ids, labels=labels).loss
        loss.backward()
    assert [x - y for x, y in zip(_counts(b, "fallbacks"), before)] == [1] * len(rec.plans)
    assert abs(loss.item() - ref.item()) <= REPLAY_TOL * abs(ref.item())
    checked = 0
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is None or not pa.grad.abs().max() > 0:
            continue
        assert rel_err(pb.grad, pa.grad) <= GRAD_TOL, (name, rel_err(pb.grad, pa.grad))
        checked += 1
    assert checked >= 3 * len(rec.plans)  # the routers' and experts' weights of every block, at least


def test_record_while_training_on_optimized_uses_fallback(pairs):
    """The bound forward's fallback records too (ids recomputed beside the original forward)."""
    m, o = pairs["mixtral"]
    b = copy.deepcopy(o).train()
    ids = _ids(seed=6)
    with moecomp.record_routing(m) as ref:
        m(input_ids=ids)
    before = _counts(b, "fallbacks")
    with moecomp.record_routing(b) as rec:
        b(input_ids=ids).logits.sum().backward()
    assert [x - y for x, y in zip(_counts(b, "fallbacks"), before)] == [1] * len(rec.plans)
    assert _tie_rows(rec.routes, ref.routes) == 0
