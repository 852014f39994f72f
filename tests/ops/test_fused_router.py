"""The router GEMV and the routing in one launch (``kernels/router.router_topk_kernel``, ``ops/triton_router.py``),
the op's routing at decode sizes (T <= 4) on the Triton path, under the interpreter in fp32 (fp16 where the weights are
rounded). Every routing feature the two-kernel path (router_gemv, then route_topk) has, against that path and the
oracle (``moecomp.oracle.reference``), with every torch.empty NaN-poisoned (``poison``). Both the one-program form
and the split form (the counter: the last program routes; forced by FUSED_SINGLE_BYTES = 0) run.

Tolerances: ids equal (both paths and the oracle pick from the same fp32 logits up to their summation order; cases
have no near-ties at 1e-5, checked with ``reference.near_tie_tokens``); weights / gate / gammas within 1e-6 relative of
the two-kernel path's and 1e-5 of the oracle's (fp32; fp16 cases round the weights through fp16: 1e-3); the op's
output within 1e-5 of the oracle (fp32) as tests/ops/test_moe_op.py states."""

from __future__ import annotations

import pytest
import torch

from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.oracle import reference as ref
from moecomp.ops import triton_moe, triton_router
from moecomp.testing import count_calls, random_hash_args, random_moe_args, random_weight_scale, rel_err

@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """The fusion is opt-in until measured on a GPU: these tests turn it on (a test may set it off again)."""
    monkeypatch.setenv("MOECOMP_FUSED_ROUTER", "1")


B = dict(hidden_size=40, intermediate_size=24)
SPECS = {
    "mixtral": MoESpec(num_experts=8, top_k=2, **B),
    "qwen2_shared_gate": MoESpec(num_experts=8, top_k=2, **B, shared=SharedExpertSpec(16, gate="sigmoid")),
    "fse_gate_row": MoESpec(num_experts=8, top_k=2, **B, shared=SharedExpertSpec(16, gate="sigmoid"),
                            fused_shared_gate=True),
    "deepseek_v3": MoESpec(num_experts=16, top_k=4, **B, scoring="sigmoid", has_correction_bias=True, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, renorm_eps=1e-20, router_fp32=True),
    "groups_not_3d_max": MoESpec(num_experts=12, top_k=3, **B, n_group=4, topk_group=2, group_score="max",
                                 renormalize=False, routed_scaling_factor=1.5),
    "group_mask_zero": MoESpec(num_experts=16, top_k=4, **B, n_group=4, topk_group=2, group_mask_zero=True),
    "gpt_oss": MoESpec(num_experts=8, top_k=2, **B, score_order="topk_then_score", renormalize=False,
                       has_router_bias=True),
    "bias_on_logits": MoESpec(num_experts=8, top_k=2, **B, scoring="sigmoid", has_correction_bias=True,
                              bias_on_logits=True),
    "sqrtsoftplus_renorm_min": MoESpec(num_experts=8, top_k=2, **B, scoring="sqrtsoftplus", renorm_min=0.6),
    "sparsemixer": MoESpec(num_experts=6, top_k=3, **B, score_order="sparsemixer", jitter_eps=0.3,
                           routed_scaling_factor=2.0, has_router_bias=True),
    "hash": MoESpec(num_experts=8, top_k=2, **B, scoring="sqrtsoftplus", renorm_eps=1e-20, hash_routing=True),
    "gammas_weight_scale": MoESpec(num_experts=8, top_k=2, **B, scoring="sigmoid", has_correction_bias=True,
                                   router_fp32=True, shared_gamma="joint_renorm", has_weight_scale=True,
                                   shared=SharedExpertSpec(12, stacked=2)),
    "expert_scale_zero": MoESpec(num_experts=8, top_k=3, **B, zero_experts=3, expert_scale=True,
                                 has_correction_bias=True, renormalize=False, routed_scaling_factor=2.0),
    "capacity": MoESpec(num_experts=4, top_k=2, **B, renorm_after_drop=True, router_fp32=True, capacity=1,
                        capacity_per="sequence"),
    "round_fp16": MoESpec(num_experts=8, top_k=3, **B, renormalize=False, round_weights=True),
}


def _inputs(name: str, T: int, seed: int = 0):
    spec = SPECS[name]
    dt = torch.float16 if name.endswith("fp16") else torch.float32
    args = random_moe_args(spec, T, dt, seed=seed)
    extra = random_weight_scale(spec, seed=seed)
    if spec.hash_routing:
        extra.update(random_hash_args(spec, T, seed=seed + 1))
    if spec.expert_scale:
        g = torch.Generator().manual_seed(seed + 2)
        extra["expert_scale"] = (torch.rand(spec.router_width, generator=g) + 0.5).to(dt)
    return spec, args, extra


def _route(spec, args, extra, fused: str, monkeypatch):
    monkeypatch.setenv("MOECOMP_FUSED_ROUTER", fused)
    named = {**dict(zip(MOE_ARGS, args[1:])), **extra}
    x = args[0]
    return triton_moe.route_all(x, named, spec, x.shape)


def _close(a, b, rtol):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("single", [True, False], ids=["one_program", "split"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_routing_equals_two_kernels_and_oracle(poison, monkeypatch, name, T, single):
    if not single:
        monkeypatch.setattr(triton_router, "FUSED_SINGLE_BYTES", 0)
    spec, args, extra = _inputs(name, T, seed=T + 7 * len(name))
    ties = ref.near_tie_tokens(args[0].float(), args[1].float(), None if args[2] is None else args[2].float(),
                               args[3], spec, 1e-5)
    assert not ties.any(), "inputs near a routing tie: pick another seed"
    calls = count_calls(monkeypatch, triton_router, ["router_topk"])
    counter = triton_router._counter(args[0].device)
    got = _route(spec, args, extra, "1", monkeypatch)
    assert calls == ["router_topk"] and int(counter) == 0  # one launch; the last program put the counter back
    two = _route(spec, args, extra, "0", monkeypatch)
    assert calls == ["router_topk"]  # the two kernels ran the second time
    tol = 1e-3 if args[0].dtype == torch.float16 else 1e-6
    assert torch.equal(got.ids, two.ids), (got.ids, two.ids)
    _close(got.weights, two.weights, tol)
    _close(got.gate, two.gate, tol)
    _close(got.gammas, two.gammas, tol)
    # the oracle's routing of the same logits
    x2 = args[0]
    rw = args[1][: spec.router_width + spec.gamma_rows] if spec.fused_shared_gate else args[1]
    logits = ref.router_logits(x2, rw, args[2], spec)
    given = ref.hash_ids(extra["hash_table"], extra["token_ids"]) if spec.hash_routing else None
    w_ref, ids_ref, g_ref = ref.route_with_gammas(logits, args[3], spec, torch.float32, extra.get("weight_scale"),
                                                  ids=given, group=ref.group_size(x2.shape, spec),
                                                  expert_scale=extra.get("expert_scale"))
    kept = ids_ref >= 0  # an expert capacity's drops: -1 in the oracle, the selection in ids (weight 0)
    assert torch.equal(got.ids.long()[kept], ids_ref[kept])
    if spec.round_weights:
        w_ref = ref.round_weights(w_ref, x2.dtype)
    _close(got.weights, w_ref, max(tol, 1e-5))
    if g_ref is not None:
        _close(got.gammas, g_ref, max(tol, 1e-5))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gammas_weight_scale", "capacity", "hash"])
def test_op_decode_equals_oracle(poison, monkeypatch, name):
    """The whole op at T = 2 on the Triton path (the fused routing inside) against the oracle, 1e-5 (fp32)."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setattr(triton_router, "FUSED_SINGLE_BYTES", 0)
    spec, args, extra = _inputs(name, 2, seed=5)
    calls = count_calls(monkeypatch, triton_router, ["router_topk"])
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **extra)
    assert calls == ["router_topk"]
    want = ref.moe_forward(*args, spec, **extra)
    assert torch.isfinite(out).all() and rel_err(out, want) < 1e-5


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "capacity"])
@pytest.mark.parametrize("single", [True, False], ids=["one_program", "split"])
def test_record_and_replay_in_the_fused_launch(poison, monkeypatch, name, single):
    """Routes record (REC_IDS / REC_W) and replay (GIVEN) in the fused launch: the recorded ids / weights are the
    two-kernel path's; replaying other ids gives the two-kernel path's output and the oracle's (1e-5)."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    if not single:
        monkeypatch.setattr(triton_router, "FUSED_SINGLE_BYTES", 0)
    spec, args, extra = _inputs(name, 3, seed=11)
    T, k = 3, spec.top_k
    rec = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MOECOMP_FUSED_ROUTER", fused)
        out = torch.full((T, k), -7, dtype=torch.int32)
        wout = torch.full((T, k), float("nan"))
        y = torch.ops.moecomp.moe_forward_routes(out, wout, *args, spec.key, **extra)
        rec[fused] = (y, out, wout)
    assert torch.equal(rec["1"][1], rec["0"][1]) and (rec["1"][1] >= 0).all()
    _close(rec["1"][2], rec["0"][2], 1e-6)
    _close(rec["1"][0], rec["0"][0], 1e-6)
    g = torch.Generator().manual_seed(3)
    replay = torch.stack([torch.randperm(spec.num_experts, generator=g)[:k] for _ in range(T)])
    calls = count_calls(monkeypatch, triton_router, ["router_topk"])
    ys = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MOECOMP_FUSED_ROUTER", fused)
        ys[fused] = torch.ops.moecomp.moe_forward(*args, spec.key, **extra, routes_in=replay)
    assert calls == ["router_topk"]
    _close(ys["1"], ys["0"], 1e-6)
    want = ref.moe_forward(*args, spec, **extra, routes_in=replay)
    assert rel_err(ys["1"], want) < 1e-5


def test_falls_back_to_two_kernels(monkeypatch):
    """router_scale (logits scaled between the two kernels), more than four tokens, MOECOMP_FUSED_ROUTER=0: the two
    kernels run, and ``fused_refusal`` says why."""
    spec = MoESpec(num_experts=8, top_k=2, **B, router_scale=0.5)
    x = torch.randn(2, 40)
    assert "router_scale" in triton_router.fused_refusal(x, spec)
    assert "5 tokens" in triton_router.fused_refusal(torch.randn(5, 40), SPECS["mixtral"])
    monkeypatch.setenv("MOECOMP_FUSED_ROUTER", "0")
    assert triton_router.fused_refusal(x, SPECS["mixtral"]) == "off (MOECOMP_FUSED_ROUTER=1 turns it on)"
    monkeypatch.setenv("MOECOMP_FUSED_ROUTER", "1")
    assert triton_router.fused_refusal(x, SPECS["mixtral"]) is None
    calls = count_calls(monkeypatch, triton_router, ["router_topk", "router_gemv"])
    args = random_moe_args(spec, 2, seed=1)
    got = triton_moe.route_all(args[0], dict(zip(MOE_ARGS, args[1:])), spec, args[0].shape)
    assert calls == ["router_gemv"]
    w_ref, ids_ref = ref.route(ref.router_logits(args[0], args[1], None, spec), None, spec)
    assert torch.equal(got.ids.long(), ids_ref)
