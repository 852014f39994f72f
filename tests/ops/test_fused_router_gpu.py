"""The fused router GEMV + routing (``ops/triton_router.router_topk``) on CUDA at real layer sizes, bf16: Qwen3-30B-A3B
(E 128, k 8, H 2048: the split form, the counter), gpt-oss-120b (router bias, top-k then softmax), DeepSeek-V3 (256
experts, groups, correction bias, fp32 router), Mixtral (8 rows: 8 programs) and a small router (8 x 512: one
program, no counter), T = 1..4.

    logits        within one bf16 ulp of ``router_gemv``'s (the same rounding; the fp32 sums differ in order)
    routing       the fused launch's ids / weights equal, bit for bit, the routing kernel's on the fused logits (the
                  same body, ``routing.route_tile``); ids equal the oracle's on tokens not near a tie (rel 1e-2)
    capture       captured in a CUDA graph 48 times in a row (a decode step's layers), replayed on new inputs: every
                  launch's routing as eager, the counter back to 0 after each replay
"""

from __future__ import annotations

import pytest
import torch

from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec
from moecomp.oracle import reference as ref
from moecomp.ops import triton_moe, triton_router
from moecomp.testing import random_moe_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """The fusion is opt-in until measured on a GPU: these tests turn it on (a test may set it off again)."""
    monkeypatch.setenv("MOECOMP_FUSED_ROUTER", "1")


B = dict(intermediate_size=256)
SPECS = {
    "qwen3": MoESpec(num_experts=128, top_k=8, hidden_size=2048, **B),
    "gpt_oss": MoESpec(num_experts=128, top_k=4, hidden_size=2880, score_order="topk_then_score", renormalize=False,
                       has_router_bias=True, **B),
    "deepseek_v3": MoESpec(num_experts=256, top_k=8, hidden_size=7168, scoring="sigmoid", has_correction_bias=True,
                           n_group=8, topk_group=4, routed_scaling_factor=2.5, renorm_eps=1e-20, router_fp32=True, **B),
    "mixtral": MoESpec(num_experts=8, top_k=2, hidden_size=4096, **B),
    "small_one_program": MoESpec(num_experts=8, top_k=2, hidden_size=512, **B),
}


def _inputs(spec, T, seed):
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", seed=seed)
    return args, {**dict(zip(MOE_ARGS, args[1:]))}


def _fused(x, named, spec):
    logits = triton_router.logits_buffer(x, named, spec)
    assert logits is not None
    ids, w, _, ra, rk = triton_moe.route_args(logits, named["correction_bias"], spec, x.dtype)
    triton_router.router_topk(x, named, spec, logits, ra, rk)
    return logits, ids, w


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_router_at_layer_sizes(name, T):
    spec = SPECS[name]
    args, named = _inputs(spec, T, seed=T)
    x = args[0]
    logits, ids, w = _fused(x, named, spec)
    torch.cuda.synchronize()
    gemv = triton_router.router_gemv(x, named["router_w"], named["router_b"], None,
                                     torch.float32 if spec.router_fp32 else x.dtype)
    ulp = 2.0 ** -7 if logits.dtype == torch.bfloat16 else 1e-5
    assert ((logits.float() - gemv.float()).abs() <= ulp * gemv.float().abs() + 1e-6).all()
    ids2, w2 = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    ok = ~ref.near_tie_tokens(x, named["router_w"], named["router_b"], named["correction_bias"], spec, 1e-2)
    w_ref, ids_ref = ref.route(ref.router_logits(x, named["router_w"], named["router_b"], spec),
                               named["correction_bias"], spec)
    assert torch.equal(ids.long()[ok], ids_ref[ok])
    torch.testing.assert_close(w[ok], w_ref.float()[ok], rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("name", ["qwen3", "small_one_program"])
def test_fused_router_in_a_cuda_graph(name):
    spec = SPECS[name]
    T, L = 2, 48
    args, named = _inputs(spec, T, seed=0)
    xs = [torch.randn_like(args[0]) for _ in range(L)]
    _fused(xs[0], named, spec)  # outside the capture: the counter exists
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [_fused(x, named, spec)[1:] for x in xs]
    counter = triton_router._counter(xs[0].device)
    for rep in range(3):
        for x in xs:
            x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert int(counter) == 0
        for x, (ids, w) in zip(xs, outs):
            ids_e, w_e = _fused(x, named, spec)[1:]
            assert torch.equal(ids, ids_e) and torch.equal(w, w_e)
