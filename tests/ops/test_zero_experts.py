"""``MoESpec.zero_experts`` (LongCat-Flash: the router scores E + Z experts; an id >= E is a zero-computation
expert whose output is its token, so the pair adds ``weight * x``): the spec field, the reference against a
hand-written loop, then the op (torch path, and the Triton kernels under the interpreter, fp32) against the
reference with every torch.empty NaN-poisoned (``poison``: a y / h row of a zero expert's pair that were read would
show), at decode sizes T = 1..4 on both decode paths (fused down-combine, gemm2 DIRECT + combine) and aligned
T >= 16 on both alignment paths (one program, atomics), with routings where every pair picks a zero expert and
where none does; the routing kernel over E + Z logits, moe_experts with given ids, FP8 experts, weight_on_input,
opcheck, and (GPU only) CUDA-graph capture.

Tolerances: relative Frobenius error against the fp32 reference, as in test_moe_op.py: fp32 1e-5 (fp32 dots, no
tf32; the zero experts' term is one fp32 multiply-add per slot on every path). The reference against the fp64 loop:
1e-5. FP8 (w8a8, dynamic activations): 3e-5, test_fp8_op.py's fp32 tolerance (the zero experts' term is not
quantized on any path). A dropped zero-expert term moves every output here by more than 5e-2
(``test_the_zero_term_matters``), far outside these tolerances."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.testing import capture_moe_forward, check_replays, quantize_moe_args, random_moe_args, rel_err

TOL = 1e-5

SPECS = {
    # LongCat-Flash's routing: softmax scores, a correction bias for the choice only, scaled, not renormalised
    "longcat": MoESpec(num_experts=8, top_k=3, hidden_size=48, intermediate_size=40, zero_experts=4,
                       has_correction_bias=True, renormalize=False, routed_scaling_factor=2.0, router_fp32=True),
    # the general form: renormalised, router and expert biases, a sigmoid-gated shared expert (in the combine)
    "shared_bias": MoESpec(num_experts=6, top_k=2, hidden_size=33, intermediate_size=17, zero_experts=2,
                           has_router_bias=True, has_expert_bias=True, shared=SharedExpertSpec(24, gate="sigmoid")),
    # with the weights on the expert input (Llama 4 style): a zero expert is then the identity of w * x
    "on_input": MoESpec(num_experts=6, top_k=2, hidden_size=40, intermediate_size=24, zero_experts=3,
                        scoring="sigmoid", score_order="topk_then_score", renormalize=False, weight_on_input=True),
}


def _routing(spec: MoESpec, t: dict, xi: torch.Tensor):
    """(ids, weights) of one token, fp64, written out."""
    logits = t["router_w"] @ xi + (t["router_b"] if t["router_b"] is not None else 0)
    if spec.score_order == "topk_then_score":
        vals, ids = torch.topk(logits, spec.top_k)
        w = torch.sigmoid(vals) if spec.scoring == "sigmoid" else torch.softmax(vals, -1)
    else:
        probs = torch.softmax(logits, -1)
        choice = probs + (t["correction_bias"] if t["correction_bias"] is not None else 0)
        ids = torch.topk(choice, spec.top_k).indices
        w = probs[ids]
    if spec.renormalize:
        w = w / w.sum()
    return ids, w * spec.routed_scaling_factor


def _hand_loop(spec: MoESpec, args) -> torch.Tensor:
    """The block token by token and slot by slot in fp64, with nothing from moecomp.oracle.reference: a slot whose id is
    >= E adds weight * x."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    I, E = spec.intermediate_size, spec.num_experts
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        ids, w = _routing(spec, t, x[i])
        for j in range(spec.top_k):
            e = int(ids[j])
            if e >= E:  # a zero-computation expert
                out[i] += w[j] * x[i]
                continue
            xin = x[i] * w[j] if spec.weight_on_input else x[i]
            h = t["w13"][e] @ xin + (t["b13"][e] if t["b13"] is not None else 0)
            y = t["w2"][e] @ (silu(h[:I]) * h[I:]) + (t["b2"][e] if t["b2"] is not None else 0)
            out[i] += y if spec.weight_on_input else w[j] * y
        if spec.shared is not None:
            hs = silu(t["shared_w1"] @ x[i]) * (t["shared_w3"] @ x[i])
            out[i] += (t["shared_w2"] @ hs) * torch.sigmoid(t["shared_gate_w"] @ x[i])
    return out


def _forced(args, spec: MoESpec, to: str) -> tuple:
    """``args`` with a correction bias that sends every pair to a zero expert (``to="zero"``, top_k <= Z) or none
    (``to="none"``); the weights stay the scores (the bias steers only the choice)."""
    cb = args[MOE_ARGS.index("correction_bias") + 1].clone()
    E = spec.num_experts
    cb[:E], cb[E:] = (-10.0, 10.0) if to == "zero" else (0.0, -10.0)
    out = list(args)
    out[MOE_ARGS.index("correction_bias") + 1] = cb
    return tuple(out)


def _ids(spec: MoESpec, args) -> torch.Tensor:
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits = reference.router_logits(x, t["router_w"], t["router_b"], spec)
    return reference.route(logits, t["correction_bias"], spec)[1]


def _config(monkeypatch, decode: str | None) -> None:
    """A fixed kernel config: the decode path in ``decode``'s mode up to 8 tokens, or (None) the aligned path."""
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=8, g1=tile, g2=dict(tile, mode=decode)) if decode else dict(max_t=0)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dec)))


def check(args, spec: MoESpec) -> torch.Tensor:
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL, f"{spec.describe()}: rel err {err:.2e}"
    return out


# ------------------------------------------------------------------------------------------------- spec
def test_spec_field():
    spec = SPECS["longcat"]
    assert MoESpec.from_key(spec.key) == spec and '"zero_experts":4' in spec.key
    assert spec.router_width == 12 and "+4 zero" in spec.describe()
    plain = spec.replace(zero_experts=0)
    assert plain.key != spec.key and "zero" not in plain.describe() and plain.router_width == 8
    old = json.loads(plain.key)
    del old["zero_experts"]  # a key written before the field existed: the default
    assert MoESpec.from_key(json.dumps(old, sort_keys=True, separators=(",", ":"))) == plain
    assert spec.replace(top_k=12).top_k == 12  # k may reach past E: up to E + Z
    with pytest.raises(SpecError, match="top_k must be in"):
        spec.replace(top_k=13)
    for bad in (-1, True, 1.5):
        with pytest.raises(SpecError, match="zero_experts must be an int"):
            spec.replace(zero_experts=bad)
    with pytest.raises(SpecError, match="group-limited"):
        spec.replace(scoring="sigmoid", n_group=2, topk_group=1)
    with pytest.raises(SpecError, match="fused_shared_gate"):
        SPECS["shared_bias"].replace(has_router_bias=False, fused_shared_gate=True)
    assert not SPECS["shared_bias"].replace(has_router_bias=False).can_fuse_shared_gate


def test_arguments_are_checked_against_the_router_width():
    spec = SPECS["longcat"]
    args = list(random_moe_args(spec, 3, seed=0))
    assert args[1].shape == (12, 48) and args[3].shape == (12,)
    bad = list(args)
    bad[1] = args[1][:8]  # a router of the E experts only
    with pytest.raises(SpecError, match=r"router_w has shape \(8, 48\), the spec needs \(12, 48\)"):
        torch.ops.moecomp.moe_forward(*bad, spec.key)
    x, w13, w2 = args[0], args[4], args[6]
    ok = torch.tensor([[0, 11, 8]] * 3)
    torch.ops.moecomp.moe_experts(x, ok, torch.rand(3, 3), w13, None, w2, None, spec.key)
    with pytest.raises(SpecError, match=r"expected every id in \[0, num_experts=8 \+ zero_experts=4\)"):
        torch.ops.moecomp.moe_experts(x, ok + 1, torch.rand(3, 3), w13, None, w2, None, spec.key)


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_matches_hand_loop(name):
    spec = SPECS[name]
    args = random_moe_args(spec, 29, torch.float64, seed=3)
    ids = _ids(spec, args)
    assert (ids >= spec.num_experts).any() and (ids < spec.num_experts).any()  # both kinds taken
    assert rel_err(reference.moe_forward(*args, spec, acc=torch.float64), _hand_loop(spec, args)) < 1e-5


def test_reference_all_zero_and_none():
    """Every pair on a zero expert: out = (sum of the weights) * x; none: the routed experts alone (nothing added)."""
    spec = SPECS["longcat"]
    E = spec.num_experts
    args = _forced(random_moe_args(spec, 17, seed=4), spec, "zero")
    assert (_ids(spec, args) >= E).all()
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits = reference.router_logits(x, t["router_w"], None, spec)
    w, _ = reference.route(logits, t["correction_bias"], spec)
    assert torch.allclose(reference.moe_forward(*args, spec), w.sum(-1, keepdim=True) * x, rtol=1e-6, atol=1e-7)
    args = _forced(random_moe_args(spec, 17, seed=4), spec, "none")
    t = dict(zip(MOE_ARGS, args[1:]))
    w, ids = reference.route(reference.router_logits(x, t["router_w"], None, spec), t["correction_bias"], spec)
    assert (ids < E).all()
    want = reference.experts(x, ids, w, t["w13"], None, t["w2"], None, spec.replace(zero_experts=0))
    assert rel_err(reference.moe_forward(*args, spec), want) < 1e-6


def test_the_zero_term_matters():
    """What the tolerances guard: dropping the zero experts' term moves the output far more than any of them."""
    spec = SPECS["longcat"]
    args = random_moe_args(spec, 40, seed=5)
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    w, ids = reference.route(reference.router_logits(x, t["router_w"], None, spec), t["correction_bias"], spec)
    full = reference.experts(x, ids, w, t["w13"], None, t["w2"], None, spec)
    dropped = full - reference.zero_expert_term(x, ids, w, spec)
    assert rel_err(dropped, full) > 5e-2


# ------------------------------------------------------------------------------------------------- the op
@pytest.mark.parametrize("route", ["mixed", "zero", "none"])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 16, 37])
def test_forward_longcat(cpu_backend, poison, monkeypatch, T, route):
    """Decode sizes on the fused down-combine, aligned sizes on the one-program alignment."""
    spec = SPECS["longcat"]
    _config(monkeypatch, "fused" if T <= 4 else None)
    args = random_moe_args(spec, T, seed=T)
    if route != "mixed":
        args = _forced(args, spec, route)
    ids = _ids(spec, args)
    E = spec.num_experts
    assert {"mixed": True, "zero": (ids >= E).all(), "none": (ids < E).all()}[route]
    check(args, spec)


@pytest.mark.parametrize("name", ["shared_bias", "on_input"])
@pytest.mark.parametrize("path", ["fused", "pairs", "aligned", "atomics"])
def test_forward_paths(monkeypatch, poison, name, path):
    """The Triton paths one by one: decode fused / pairs (T=3), aligned (T=40) with the one-program alignment or the
    atomic one (MOECOMP_ALIGN_SMALL_P=0)."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    spec = SPECS[name]
    _config(monkeypatch, path if path in ("fused", "pairs") else None)
    if path == "atomics":
        monkeypatch.setenv("MOECOMP_ALIGN_SMALL_P", "0")
    T = 3 if path in ("fused", "pairs") else 40
    args = random_moe_args(spec, T, seed=len(name))
    ids = _ids(spec, args)
    assert (ids >= spec.num_experts).any() and (ids < spec.num_experts).any()
    calls = []
    real = triton_moe.gemm2
    monkeypatch.setattr(triton_moe, "gemm2", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    check(args, spec)
    assert len(calls) == (0 if path == "fused" else 1)


def test_route_kernel_over_the_router_width(poison):
    """The routing kernel reads E + Z logits and returns ids in [0, E + Z), as the reference (NaN / inf rows too)."""
    spec = SPECS["longcat"]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 12, generator=g) * 3
    logits[1, 10] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("nan")
    bias = torch.randn(12, generator=g) * 0.1
    ids, w = triton_moe.route(logits, bias, spec, torch.float32)
    want_w, want_ids = reference.route(logits, bias, spec)
    assert torch.equal(ids.long(), want_ids) and torch.allclose(w, want_w, rtol=1e-6, atol=0)
    assert int(ids.max()) >= spec.num_experts and int(ids.max()) < spec.router_width


@pytest.mark.parametrize("T", [2, 19])
def test_moe_experts_given_ids(cpu_backend, poison, monkeypatch, T):
    """Routing given: ids over E + Z (every slot of token 0 a zero expert), weights of both signs."""
    spec = SPECS["shared_bias"]
    _config(monkeypatch, "pairs" if T <= 4 else None)
    args = random_moe_args(spec, T, seed=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.argsort(torch.rand(T, spec.router_width, generator=g), dim=1)[:, :2]
    ids[0] = torch.tensor([6, 7])
    w = torch.rand(T, 2, generator=g) * 2 - 0.5
    x, w13, b13, w2, b2 = args[0], args[4], args[5], args[6], args[7]
    out = torch.ops.moecomp.moe_experts(x, ids, w, w13, b13, w2, b2, spec.key)
    ref = reference.experts(x, ids, w, w13, b13, w2, b2, spec)
    assert torch.allclose(ref[0], (w[0].sum() * x[0]).float(), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("T", [3, 21])
def test_fp8_experts(monkeypatch, poison, backend, T):
    """FP8 routed experts (128x64 blocks, dynamic activations, w8a8 forced) with zero experts: the term is not
    quantized."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")
    monkeypatch.delenv("MOECOMP_CONFIG", raising=False)
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=136, intermediate_size=40, zero_experts=2,
                   has_correction_bias=True, renormalize=False, quant=QuantSpec(block_n=32, block_k=64))
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.float32, seed=5))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    assert (_ids(spec, args) >= 4).any()
    assert torch.isfinite(out).all() and rel_err(out, ref) < 3e-5


@pytest.mark.parametrize("T", [0, 5])
def test_opcheck(cpu_backend, T):
    spec = SPECS["shared_bias"]
    args = random_moe_args(spec, T, seed=T)
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key))
    ids = torch.randint(0, spec.router_width, (T, 2), generator=torch.Generator().manual_seed(T))
    torch.library.opcheck(torch.ops.moecomp.moe_experts.default,
                          (args[0], ids, torch.rand(T, 2), args[4], args[5], args[6], args[7], spec.key))


# ------------------------------------------------------------------------------------------------- GPU
LONGCAT_GPU = MoESpec(num_experts=64, top_k=8, hidden_size=1024, intermediate_size=512, zero_experts=32,
                      has_correction_bias=True, renormalize=False, routed_scaling_factor=6.0, router_fp32=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_cuda_graph_capture_and_replay(T):
    """bf16 on the GPU: the decode path (T = 1, 4) and the aligned one, captured once and replayed on new inputs
    (no host sync, no data-dependent size: the zero experts' pairs are skipped on the device). Tolerance 2e-2, as
    tests/ops/test_gpu.py."""
    spec = LONGCAT_GPU
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1))
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec)
    xs = [torch.randn(T, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
          for seed in range(3)]
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec), 2e-2)
