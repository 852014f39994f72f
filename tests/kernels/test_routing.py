"""route_topk_kernel against moecomp.oracle.reference.route: same experts chosen, same weights (fp32 logits)."""

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.spec import MoESpec

CASES = [
    dict(num_experts=8, top_k=2),
    dict(num_experts=60, top_k=4, renormalize=False),
    dict(num_experts=128, top_k=8),
    dict(num_experts=7, top_k=7),
    dict(num_experts=32, top_k=8, scoring="sigmoid", has_correction_bias=True, n_group=8, topk_group=4,
         routed_scaling_factor=2.5, renorm_eps=1e-20),
    dict(num_experts=24, top_k=6, n_group=8, topk_group=3, group_score="max", renormalize=False),
    dict(num_experts=16, top_k=2, scoring="sigmoid"),
    dict(num_experts=16, top_k=3, scoring="sqrtsoftplus", has_correction_bias=True),
    dict(num_experts=16, top_k=4, scoring="none", renormalize=False),
    dict(num_experts=32, top_k=4, score_order="topk_then_score", renormalize=False),
    dict(num_experts=16, top_k=2, scoring="sigmoid", has_correction_bias=True, bias_on_logits=True),
    # sigmoid(logit) + bias goes negative here (logits ~ N(0, 3^2), bias ~ N(0, 0.1^2)): a 0.0 mask can win
    dict(num_experts=32, top_k=8, scoring="sigmoid", has_correction_bias=True, n_group=8, topk_group=2,
         group_mask_zero=True),
    dict(num_experts=32, top_k=4, scoring="none", n_group=4, topk_group=2, group_mask_zero=True,
         renormalize=False),
    dict(num_experts=16, top_k=2, renorm_min=0.6),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: MoESpec(hidden_size=8, intermediate_size=8, **c).describe())
@pytest.mark.parametrize("T", [1, 37])
def test_route_matches_reference(case, T):
    spec = MoESpec(hidden_size=8, intermediate_size=8, **case)
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, spec.num_experts, generator=g) * 3
    bias = torch.randn(spec.num_experts, generator=g) * 0.1 if spec.has_correction_bias else None
    ids, w = triton_moe.route(logits, bias, spec, torch.float32)
    rw, rids = reference.route(logits, bias, spec)
    # same set of experts per token; weights compared in a canonical (expert id) order
    assert torch.equal(ids.long().sort(1).values, rids.sort(1).values)
    o1, o2 = ids.long().argsort(1), rids.argsort(1)
    torch.testing.assert_close(w.gather(1, o1), rw.gather(1, o2), rtol=1e-5, atol=1e-6)


def test_route_strided_logits_and_rounding():
    """FSE hands the kernel a [T, E] view of a [T, E + 1] buffer; round_weights rounds through bf16."""
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, round_weights=True)
    both = torch.randn(5, 9)
    ids, w = triton_moe.route(both[:, :8], None, spec, torch.bfloat16)
    rw, rids = reference.route(both[:, :8].contiguous(), None, spec)
    assert torch.equal(ids.long().sort(1).values, rids.sort(1).values)
    torch.testing.assert_close(w, w.to(torch.bfloat16).float())  # exactly representable in bf16
    torch.testing.assert_close(w.sum(1), rw.sum(1), rtol=1e-2, atol=1e-2)


def test_ties_go_to_lower_index():
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8)
    logits = torch.zeros(3, 8)
    logits[:, 5] = 1.0
    ids, _ = triton_moe.route(logits, None, spec, torch.float32)
    assert ids[:, 0].tolist() == [5, 5, 5] and ids[:, 1].tolist() == [0, 0, 0]


@pytest.mark.parametrize("field,value", [("group_mask_zero", True), ("bias_on_logits", True), ("renorm_min", 0.6)])
def test_new_routing_fields_change_the_routing(field, value):
    """The data of the cases above is such that each of these fields changes the result (so the tests can fail)."""
    base = dict(num_experts=32, top_k=8, scoring="sigmoid", has_correction_bias=True, n_group=8, topk_group=2)
    if field == "renorm_min":
        base = dict(num_experts=16, top_k=2)
    spec = MoESpec(hidden_size=8, intermediate_size=8, **base)
    g = torch.Generator().manual_seed(37)
    logits = torch.randn(37, spec.num_experts, generator=g) * 3
    bias = torch.randn(spec.num_experts, generator=g) * 0.1 if spec.has_correction_bias else None
    w0, ids0 = reference.route(logits, bias, spec)
    spec1 = spec.replace(**{field: value})
    ids1, w1 = triton_moe.route(logits, bias, spec1, torch.float32)
    rw1, rids1 = reference.route(logits, bias, spec1)
    assert torch.equal(ids1.long().sort(1).values, rids1.sort(1).values)
    changed = not torch.equal(ids0.sort(1).values, rids1.sort(1).values) or not torch.allclose(w0.sum(1), rw1.sum(1))
    assert changed, f"{field}={value} made no difference on this data"


GROUPED = [CASES[4], CASES[5], CASES[11], CASES[12], dict(num_experts=64, top_k=6, n_group=8, topk_group=3,
                                                              group_score="max", scoring="sigmoid")]


@pytest.mark.parametrize("case", GROUPED, ids=lambda c: MoESpec(hidden_size=8, intermediate_size=8, **c).describe())
@pytest.mark.parametrize("block_t,group_3d", [(1, False), (4, True), (16, True), (16, False), (2, True)])
def test_routing_tiles_change_nothing(case, block_t, group_3d):
    """Tokens per program and the two group-selection forms (3-D view / one pass per group; the 3-D form only
    where E fills its power of two, E=24 falls back): the reference's ids and weights whatever the launch shape
    (T=21: a partial last tile)."""
    spec = MoESpec(hidden_size=8, intermediate_size=8, **case)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(21, spec.num_experts, generator=g) * 3
    bias = torch.randn(spec.num_experts, generator=g) * 0.1 if spec.has_correction_bias else None
    tiles = dict(block_t=block_t, group_3d=group_3d, num_warps=2)
    ids, w = triton_moe.route(logits, bias, spec, torch.float32, tiles=tiles)
    rw, rids = reference.route(logits, bias, spec)
    assert torch.equal(ids.long().sort(1).values, rids.sort(1).values)
    order_k, order_r = ids.long().argsort(1), rids.argsort(1)
    torch.testing.assert_close(w.gather(1, order_k), rw.gather(1, order_r), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("elems,block_t", [(32, 1), (64, 2), (4096, 16)])
def test_route_tiles(monkeypatch, elems, block_t):
    """One token per one-warp program up to ROUTE_ONE_TOKEN_T tokens, and at any T past 128 experts; above, many-token
    programs whose tile MOECOMP_ROUTE_ELEMS caps (32 experts here). The 3-D group form only where E fills its power
    of two."""
    monkeypatch.setenv("MOECOMP_ROUTE_ELEMS", str(elems))
    many = triton_moe.ROUTE_ONE_TOKEN_T + 1
    assert triton_moe.route_tiles(many, 32, 8)["block_t"] == block_t
    assert triton_moe.route_tiles(triton_moe.ROUTE_ONE_TOKEN_T, 32, 8) == dict(block_t=1, num_warps=1, group_3d=True)
    assert triton_moe.route_tiles(many, 256, 8) == dict(block_t=1, num_warps=1, group_3d=True)
    assert triton_moe.route_tiles(many, 24, 8)["group_3d"] is False
    assert triton_moe.route_tiles(1, 512, 1) == dict(block_t=1, num_warps=2, group_3d=False)
