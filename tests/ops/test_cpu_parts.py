"""The torch path's own parts against the oracle, one at a time (issue 40: the op no longer calls the oracle's code, so
each part is checked where it is written): activations (``ops/cpu_act.py``), norms (``ops/norms.py``), the zero
experts' term (``zero_experts.zero_term``), the shared experts (``ops/cpu_shared.py``), the router's input
(``ops/router_input.py``), top-k with low-index ties (``cpu_route.ranked``) and the whole routing
(``cpu_route.route_all``) on capacity, hash, gamma and scale specs. The op-level tests (tests/ops/test_*.py) compare
whole forwards; these name the part that differs.

Tolerances: fp32 parts 1e-6 relative to the largest value (the same formula, another order of the same fp32
operations: a few ulps); bf16 outputs (norms rounded to bf16, the router input) 2 ** -7 relative elementwise (one
bf16 rounding step: an fp32 value a few ulps apart may round to the neighbouring bf16 value). Ids: exactly equal.
"""

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import cpu_act, cpu_route, cpu_shared, norms, router_input, zero_experts
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.testing import quantize_moe_args, random_hash_args, random_moe_args, random_weight_scale, rel_err

TOL = 1e-6
BF16 = 2 ** -7
BASE = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "relu2", "swiglu_oai", "clamped", "softcap",
                                 "clamped_after", "clamped_after_gelu"])
def test_activation(act):
    g = _gen(1)
    gate, up = torch.randn(64, 16, generator=g) * 6, torch.randn(64, 16, generator=g) * 6
    if act == "clamped":
        s = BASE.replace(activation_clamp=True, activation_limit=3.0)
    elif act == "softcap":
        s = BASE.replace(gate_softcap=2.5, up_softcap=4.0)
    elif act.startswith("clamped_after"):  # Step-3.7: min(act(gate), L) * clamp(up, +-L)
        s = BASE.replace(activation_clamp_after=True, activation_limit=1.5,
                         activation="gelu" if act.endswith("gelu") else "silu")
    else:
        s = BASE.replace(activation=act, activation_alpha=1.5, activation_limit=5.0)
    want = reference.spec_gated(gate, up, s)
    assert rel_err(cpu_act.gated(gate, up, s), want) < TOL
    h = torch.cat([gate, up], 1)
    assert rel_err(cpu_act.act_of(h, s, 16), want) < TOL  # concatenated halves
    inter = torch.stack([gate, up], -1).reshape(64, 32)
    assert rel_err(cpu_act.act_of(inter, s.replace(gate_up="interleaved"), 16), want) < TOL
    if act in cpu_act.ELEMENTWISE:
        assert rel_err(cpu_act.act_of(gate, s.replace(gated=False), 16), reference.activation(gate, act)) < TOL


@pytest.mark.parametrize("form", ["rms", "rms_1p", "scaled_rms_1p", "rms_per_expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(form, dtype):
    g = _gen(2)
    v = (torch.randn(40, 24, generator=g) * 3).to(dtype)
    w = (torch.randn(40 if form == "rms_per_expert" else 1, 24, generator=g) * 0.5).squeeze(0).to(dtype)
    got, want = norms.rms_norm(v, w, form, 1e-6, dtype), reference.rms_norm(v, w, form, 1e-6, dtype)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(got, want) < TOL
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16, atol=0)


def test_zero_term_reads_only_zero_experts_weights():
    spec = BASE.replace(zero_experts=3)
    g = _gen(3)
    x, ids = torch.randn(10, 32, generator=g), torch.randint(0, 11, (10, 2), generator=g)
    w = torch.rand(10, 2, generator=g)
    w[ids < 8] = float("nan")  # a NaN in a real expert's weight must not leak in
    got = zero_experts.zero_term(x, ids, w, spec)
    assert torch.isfinite(got).all()
    assert rel_err(got, reference.zero_expert_term(x, ids, w, spec)) < TOL
    assert bool((ids >= 8).any()) and bool((ids < 8).any())


SHARED = {
    "gated_gate": BASE.replace(shared=SharedExpertSpec(24, gate="sigmoid", scale=0.75)),
    "concat_clamped": BASE.replace(shared=SharedExpertSpec(12, layout="concat", activation_clamp=True,
                                                           activation_limit=2.0)),
    "ungated": BASE.replace(shared=SharedExpertSpec(20, gated=False, activation="relu2")),
    "softcap": BASE.replace(shared=SharedExpertSpec(16, gate_softcap=3.0, up_softcap=5.0)),
    "clamped_after": BASE.replace(shared=SharedExpertSpec(16, layout="concat", activation_clamp_after=True,
                                                          activation_limit=0.3)),
    "norm": BASE.replace(shared=SharedExpertSpec(16, norm="rms", gate="sigmoid")),
    "stacked_gammas": BASE.replace(scoring="sigmoid", shared_gamma="joint_renorm", has_weight_scale=True,
                                   shared=SharedExpertSpec(12, stacked=3, scale=0.5)),
    "fp8": BASE.replace(shared=SharedExpertSpec(16, quant=QuantSpec(block_n=16, block_k=16))),
}


@pytest.mark.parametrize("name", list(SHARED))
def test_shared_experts(name):
    spec = SHARED[name]
    args = random_moe_args(spec, 12, torch.float32, seed=4)
    x, (s1, s3, s2, gw) = args[0], args[8:12]
    named = dict(shared_w1=s1, shared_w3=s3, shared_w2=s2, shared_gate_w=gw)
    extra = {}
    if spec.shared.quant is not None:
        args, scales = quantize_moe_args(spec, args, seed=4)
        x, (s1, s3, s2, gw) = args[0], args[8:12]
        named = dict(shared_w1=s1, shared_w3=s3, shared_w2=s2, shared_gate_w=gw, **scales)
        extra = {n: scales[n] for n in ("shared_w1_scale", "shared_w3_scale", "shared_w2_scale")}
    if spec.shared.norm != "none":
        named["shared_norm_w"] = extra["shared_norm_w"] = torch.randn(spec.hidden_size, generator=_gen(5)) * 0.3
    gammas = torch.rand(12, spec.shared.count, generator=_gen(6)) if spec.gamma_rows else None
    got = cpu_shared.shared_part(x, named, spec, gammas)
    want = reference.shared_experts(x, s1, s3, s2, gw, spec, gammas=gammas, **extra)
    assert got.dtype == torch.float32 and rel_err(got, want) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_input(dtype):
    spec = BASE.replace(router_input=True, router_norm=True, router_norm_eps=1e-5, router_in_scale=True,
                        router_in_const=0.25)
    g = _gen(7)
    x2, rx = torch.randn(9, 32, generator=g).to(dtype), (torch.randn(3, 3, 32, generator=g) * 4).to(dtype)
    scale = (torch.rand(32, generator=g) + 0.5).to(dtype)
    got = router_input.router_in(x2, {"router_x": rx, "router_in_scale": scale}, spec)
    want = reference.router_input(x2, rx, scale, spec)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL if dtype == torch.float32 else BF16, atol=0)
    assert router_input.router_in(x2, {}, BASE) is x2


def test_ranked_ties_go_to_the_lower_index():
    """Equal values (0 and -0 among them), -inf, NaN (above everything) and +inf: the order of a stable descending
    sort (the oracle's tie rule, stated there)."""
    nan, inf = float("nan"), float("inf")
    v = torch.tensor([[0.0, -0.0, 1.0, nan, -inf, 1.0, -2.0, inf, -inf, -2.0]])
    assert cpu_route.ranked(v, 10).tolist() == [[3, 7, 2, 5, 0, 1, 6, 9, 4, 8]]
    g = torch.randint(-3, 3, (50, 12), generator=_gen(8)).float()  # many exact ties
    assert torch.equal(cpu_route.ranked(g, 5), torch.sort(g, dim=1, descending=True, stable=True).indices[:, :5])


ROUTED = {
    "capacity_seq": BASE.replace(capacity_factor=0.2, capacity_per="sequence", renorm_after_drop=True),
    "capacity_call": BASE.replace(top_k=3, capacity=2, round_weights=True),
    "hash": BASE.replace(hash_routing=True, scoring="sqrtsoftplus", routed_scaling_factor=1.5),
    "gammas": SHARED["stacked_gammas"].replace(round_weights=True, renorm_eps=1e-3, renorm_min=0.5),
    "expert_scale_zero": BASE.replace(expert_scale=True, zero_experts=2, scoring="sigmoid", renormalize=False),
    "groups": BASE.replace(num_experts=16, top_k=4, n_group=4, topk_group=2, scoring="sigmoid",
                           has_correction_bias=True, router_fp32=True, router_scale=1.5),
}


@pytest.mark.parametrize("name", list(ROUTED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_all(name, dtype):
    """The whole routing on x [2, 12, H]: the oracle's ids (dropped pairs -1 on both) and weights (fp32 1e-6; bf16
    weights rounded through bf16 where the spec says: one rounding step)."""
    spec = ROUTED[name]
    args = random_moe_args(spec, 24, dtype, seed=9)
    x = args[0].reshape(2, 12, -1)
    rw, cb = args[1], args[3]
    extra = {**random_weight_scale(spec, seed=9)}
    if spec.hash_routing:
        extra.update(random_hash_args(spec, 24, seed=9))
    if spec.expert_scale:
        extra["expert_scale"] = torch.rand(spec.router_width, generator=_gen(10)) + 0.5
    r = cpu_route.route_all(x.reshape(24, -1), {"router_w": rw, "router_b": None, "correction_bias": cb, **extra},
                            spec, x.shape)
    logits = reference.router_logits(x.reshape(24, -1), rw, None, spec)
    given = reference.hash_ids(extra["hash_table"], extra["token_ids"]) if spec.hash_routing else None
    w, ids, gam = reference.route_with_gammas(logits, cb, spec, weight_scale=extra.get("weight_scale"), ids=given,
                                              group=reference.group_size(x.shape, spec),
                                              expert_scale=extra.get("expert_scale"))
    if spec.round_weights:
        w = reference.round_weights(w, dtype)
        gam = None if gam is None else reference.round_weights(gam, dtype)
    assert torch.equal(r.ids, ids)
    if spec.has_capacity:
        assert bool((ids == -1).any()) and bool((ids >= 0).any())  # the capacity drops some pairs, not all
    tol = BF16 if spec.round_weights and dtype == torch.bfloat16 else TOL
    torch.testing.assert_close(r.weights, w, rtol=tol, atol=1e-7)
    assert (r.gammas is None) == (gam is None)
    if gam is not None:
        torch.testing.assert_close(r.gammas, gam, rtol=tol, atol=1e-7)


@pytest.mark.parametrize("name", list(ROUTED) + ["sparsemixer"])
def test_route_all_no_tokens(name):
    """Zero tokens: empty ids [0, k] and weights, no error (the op's T = 0 calls)."""
    spec = ROUTED.get(name) or BASE.replace(score_order="sparsemixer", jitter_eps=0.1)
    args = random_moe_args(spec, 0, seed=11)
    extra = {**random_weight_scale(spec, seed=11)}
    if spec.hash_routing:
        extra.update(random_hash_args(spec, 0, seed=11))
    if spec.expert_scale:
        extra["expert_scale"] = torch.ones(spec.router_width)
    r = cpu_route.route_all(args[0], {"router_w": args[1], "router_b": None, "correction_bias": args[3], **extra},
                            spec, (2, 0, spec.hidden_size))
    assert r.ids.shape == (0, spec.top_k) and r.weights.shape == (0, spec.top_k)
