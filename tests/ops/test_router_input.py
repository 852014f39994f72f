"""The router's own input and per-expert weight multipliers (``MoESpec.router_input`` / ``router_norm`` /
``router_in_scale`` / ``router_in_const`` / ``expert_scale``; op arguments ``router_x``, ``router_in_scale``,
``expert_scale``): the oracle's properties, the CPU path and the Triton kernels (interpreter) against it, opcheck,
bad input, and a bf16 GPU test.

Tolerances: fp32 op against the oracle 1e-5 relative to the output's largest value (tests/ops' TOL); properties of
the oracle alone 1e-5 as well (the same math in another order); bf16 on the GPU 2e-2 (tests/ops/test_gpu.py).
"""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.core.args import MOE_ARGS, OP_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_moe_args

TOL = 1e-5
BASE = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, activation="gelu_tanh")
GEMMA = BASE.replace(router_input=True, router_norm=True, router_in_scale=True, router_in_const=32 ** -0.5,
                     expert_scale=True)
SPECS = {
    "gemma": GEMMA,
    "own_input_only": BASE.replace(router_input=True),
    "norm_bias_sigmoid": BASE.replace(router_input=True, router_norm=True, router_norm_eps=1e-5, scoring="sigmoid",
                                      has_router_bias=True, renormalize=False, routed_scaling_factor=2.0),
    "scale_zero_shared": BASE.replace(router_in_scale=True, router_in_const=0.5, expert_scale=True, zero_experts=2,
                                      shared=SharedExpertSpec(16)),
}


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def extra_args(spec: MoESpec, T: int, seed: int = 0, dtype=torch.float32, device="cpu") -> dict:
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    if spec.router_input:
        out["router_x"] = (torch.randn(T, spec.hidden_size, generator=g) * 3).to(device=device, dtype=dtype)
    if spec.router_in_scale:
        out["router_in_scale"] = (torch.rand(spec.hidden_size, generator=g) + 0.5).to(device=device, dtype=dtype)
    if spec.expert_scale:
        out["expert_scale"] = (torch.rand(spec.router_width, generator=g) + 0.5).to(device=device, dtype=dtype)
    return out


def ref(args, spec, extra):
    return reference.moe_forward(*args, spec, **extra)


# ------------------------------------------------------------------------------------------------- the oracle
def test_own_input_is_x_when_given_x():
    """router_x = x, no prefix: the plain spec's output; any other router_x changes it."""
    spec = SPECS["own_input_only"]
    args = random_moe_args(spec, 24, seed=1)
    plain = ref(args, BASE, {})
    assert rel_err(ref(args, spec, {"router_x": args[0]}), plain) < TOL
    assert rel_err(ref(args, spec, {"router_x": args[0].flip(0)}), plain) > 1e-2


def test_norm_is_scale_invariant_and_const_is_a_logit_scale():
    """RMS norm (eps 0): router_x times any positive number routes the same; router_in_const c equals the router
    weight times c (the GEMM is linear)."""
    spec = GEMMA.replace(router_norm_eps=0.0)
    args = random_moe_args(spec, 24, seed=2)
    ex = extra_args(spec, 24, seed=2)
    want = ref(args, spec, ex)
    assert rel_err(ref(args, spec, {**ex, "router_x": ex["router_x"] * 37.0}), want) < TOL
    a = list(args)
    i = MOE_ARGS.index("router_w") + 1
    a[i] = args[i] * spec.router_in_const
    assert rel_err(ref(a, spec.replace(router_in_const=1.0), ex), want) < TOL
    assert rel_err(ref(args, spec.replace(router_norm=False), ex), want) > 1e-2  # the norm does something


def test_expert_scale_properties():
    """expert_scale of ones = none; of c everywhere = routed_scaling_factor c; a scale that differs per expert
    weighs each pair by its expert's entry (against routing by hand)."""
    spec = BASE.replace(expert_scale=True)
    args = random_moe_args(spec, 24, seed=3)
    E = spec.num_experts
    plain = ref(args, BASE, {})
    assert rel_err(ref(args, spec, {"expert_scale": torch.ones(E)}), plain) < TOL
    assert rel_err(ref(args, spec, {"expert_scale": torch.full((E,), 1.7)}),
                   ref(args, BASE.replace(routed_scaling_factor=1.7), {})) < TOL
    s = torch.rand(E) + 0.5
    logits = reference.router_logits(args[0], args[1], None, BASE)
    w, ids = reference.route(logits, None, BASE)
    w2, ids2 = reference.route(logits, None, spec, expert_scale=s)
    assert torch.equal(ids, ids2) and rel_err(w2, w * s[ids]) < TOL


def test_router_scale_vector_is_per_channel():
    """router_in_scale v = the router weight's columns times v (no norm: (x * v) W^T = x (W diag v)^T)."""
    spec = BASE.replace(router_in_scale=True)
    args = random_moe_args(spec, 24, seed=4)
    v = torch.rand(spec.hidden_size) + 0.5
    a = list(args)
    i = MOE_ARGS.index("router_w") + 1
    a[i] = args[i] * v
    assert rel_err(ref(args, spec, {"router_in_scale": v}), ref(a, BASE, {})) < TOL


# ------------------------------------------------------------------------------------------------- the op
FORWARD = [("torch", n, T) for n in sorted(SPECS) for T in (3, 40)] + [
    ("triton", "gemma", 3), ("triton", "gemma", 40), ("triton", "scale_zero_shared", 40)]


@pytest.mark.parametrize("backend,name,T", FORWARD)
def test_forward(poison, monkeypatch, backend, name, T):
    """The CPU path and the Triton kernels (the prefix in torch, the multiplier in the routing kernel) against the
    oracle; T=3 on the decode path, 40 on the aligned one."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=8, g1=tile, g2=dict(tile, mode="fused")) if T <= 4 else dict(max_t=0)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dec)))
    spec = SPECS[name]
    args = random_moe_args(spec, T, seed=T)
    ex = extra_args(spec, T, seed=T)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **ex)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref(args, spec, ex)) < TOL


def test_routing_kernel_multiplier(monkeypatch):
    """The routing kernel's per-expert multiplier against the oracle's route, with weights rounded through bf16
    after it (round_weights: the multiplier comes first)."""
    from moecomp.ops import triton_moe

    spec = BASE.replace(expert_scale=True, round_weights=True)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(20, 8, generator=g)
    s = torch.rand(8, generator=g) + 0.5
    ids, w = triton_moe.route(logits, None, spec, torch.bfloat16, expert_scale=s)
    w_ref, ids_ref = reference.route(logits, None, spec, expert_scale=s)
    w_ref = reference.round_weights(w_ref, torch.bfloat16)
    assert torch.equal(ids.long(), ids_ref)
    assert torch.equal(w, w.bfloat16().float())  # rounded last: every weight a bf16 value
    assert torch.allclose(w, w_ref, rtol=2 ** -7, atol=0)  # within a bf16 rounding (the fp32 softmax may differ)
    assert not torch.allclose(w, reference.round_weights(w_ref / s[ids_ref], torch.bfloat16), rtol=0.05)


def test_bad_arguments():
    spec = GEMMA
    args = random_moe_args(spec, 3, seed=1)
    ex = extra_args(spec, 3, seed=1)
    op = torch.ops.moecomp.moe_forward
    with pytest.raises(SpecError, match=r"router_x is required by the spec"):
        op(*args, spec.key, **{k: v for k, v in ex.items() if k != "router_x"})
    with pytest.raises(SpecError, match=r"router_x has shape \(4, 32\); expected the shape of x"):
        op(*args, spec.key, **{**ex, "router_x": torch.zeros(4, 32)})
    with pytest.raises(SpecError, match=r"router_x has dtype torch.float64"):
        op(*args, spec.key, **{**ex, "router_x": ex["router_x"].double()})
    with pytest.raises(SpecError, match=r"expert_scale has shape \(7,\), the spec needs \(8,\)"):
        op(*args, spec.key, **{**ex, "expert_scale": torch.ones(7)})
    with pytest.raises(SpecError, match=r"router_in_scale is required by the spec"):
        op(*args, spec.key, **{k: v for k, v in ex.items() if k != "router_in_scale"})
    with pytest.raises(SpecError, match=r"router_x was given but the spec's router reads x"):
        op(*random_moe_args(BASE, 3, seed=1), BASE.key, router_x=args[0])
    with pytest.raises(SpecError, match=r"expert_scale was given but the spec has no use for it"):
        op(*random_moe_args(BASE, 3, seed=1), BASE.key, expert_scale=torch.ones(8))
    for bad, msg in ((dict(router_in_const=0.0), "router_in_const must be finite and positive"),
                     (dict(router_norm_eps=-1.0), "router_norm_eps must be finite"),
                     (dict(router_input=True, shared=SharedExpertSpec(16, gate="sigmoid")), "sigmoid-gated shared"),
                     (dict(expert_scale=True, capacity=4), "an expert capacity is not supported")):
        with pytest.raises(SpecError, match=msg):
            BASE.replace(**bad)


@pytest.mark.parametrize("backend,T", [("torch", 0), ("torch", 5), ("triton", 0)])  # triton T > 0: test_forward
def test_opcheck(monkeypatch, backend, T):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    spec = GEMMA
    args = random_moe_args(spec, T, seed=T)
    ex = extra_args(spec, T, seed=T)
    between = [None] * (OP_ARGS.index("router_x") - len(MOE_ARGS))  # scales, latent projections, hash routing
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default,
                          (*args, spec.key, *between, ex["router_x"], ex["router_in_scale"], ex["expert_scale"]))


# ------------------------------------------------------------------------------------------------- GPU
GEMMA_GPU = MoESpec(num_experts=128, top_k=8, hidden_size=1024, intermediate_size=512, activation="gelu_tanh",
                    router_input=True, router_norm=True, router_in_scale=True, router_in_const=1024 ** -0.5,
                    expert_scale=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_bf16(T):
    """bf16 on the GPU (Triton path: the prefix in torch, the multiplier in the routing kernel) against the oracle
    on the same tensors; output poisoned with NaN first (the op writes a fresh tensor: a NaN-filled caching
    allocator block is reused). Tolerance: relative Frobenius error 2e-2, as tests/ops/test_gpu.py (a bf16 routing
    near-tie may send a token elsewhere)."""
    spec = GEMMA_GPU
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1)
    ex = extra_args(spec, T, seed=1, dtype=torch.bfloat16, device="cuda")
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # NaNs left in the caching allocator's free blocks
    del junk
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **ex)
    torch.cuda.synchronize()
    want = reference.moe_forward(*args, spec, **ex)
    assert torch.isfinite(out).all()
    assert float((out.double() - want.double()).norm() / want.double().norm()) < 2e-2
