"""``MoESpec.weight_on_input`` (Llama 4: each routed expert runs on ``weight * x``, the combine sums unweighted) and
the routing it comes with (``score_order="topk_then_score"`` with sigmoid scoring): the reference against a
hand-written loop, then the op (torch path, and the Triton kernels under the interpreter) against the reference, with
every torch.empty NaN-poisoned (``poison``), on the aligned path and both decode paths, the TMA GEMMs, moe_experts
and FP8 experts.

Tolerances: relative Frobenius error against the fp32 reference, as in test_moe_op.py: fp32 1e-5, fp16 5e-3 (fp16
operands; the intermediate activation and the expert inputs rounded to fp16). The reference against the fp64 loop:
1e-5. FP8 (dynamic activations, w8a8, fp32): 1e-3, not test_fp8_op.py's 3e-5: the kernels quantize x and scale the
GEMM's result by the weight, the reference quantizes weight * x; the two can differ where w * x / (w * s) rounds to
the other side of an e4m3 rounding boundary (one e4m3 step on such an element; none did on these inputs, 3e-7)."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.testing import quantize_moe_args, random_moe_args

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}

SPECS = {
    # Llama 4: top-1 of the logits, sigmoid of the chosen one, on the input; a shared expert
    "llama4": MoESpec(num_experts=8, top_k=1, hidden_size=48, intermediate_size=40, scoring="sigmoid",
                      score_order="topk_then_score", renormalize=False, weight_on_input=True,
                      shared=SharedExpertSpec(24)),
    # the general form: top-3 softmax, renormalised and scaled, expert biases (added after the scaled input's GEMM)
    "k3_bias": MoESpec(num_experts=6, top_k=3, hidden_size=33, intermediate_size=17, routed_scaling_factor=1.5,
                       has_expert_bias=True, weight_on_input=True),
}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _hand_loop(spec: MoESpec, args) -> torch.Tensor:
    """The block written out token by token and slot by slot, in fp64, with nothing from moecomp.oracle.reference."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    I = spec.intermediate_size
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        logits = t["router_w"] @ x[i]
        if spec.score_order == "topk_then_score":
            vals, ids = torch.topk(logits, spec.top_k)
            w = torch.sigmoid(vals) if spec.scoring == "sigmoid" else torch.softmax(vals, -1)
        else:
            probs = torch.softmax(logits, -1)
            w, ids = torch.topk(probs, spec.top_k)
        if spec.renormalize:
            w = w / w.sum()
        w = w * spec.routed_scaling_factor
        for j in range(spec.top_k):
            e = int(ids[j])
            xe = w[j] * x[i]  # the expert's input
            h = t["w13"][e] @ xe + (t["b13"][e] if spec.has_expert_bias else 0)
            y = t["w2"][e] @ (silu(h[:I]) * h[I:]) + (t["b2"][e] if spec.has_expert_bias else 0)
            out[i] += y  # unweighted
        if spec.shared is not None:
            out[i] += t["shared_w2"] @ (silu(t["shared_w1"] @ x[i]) * (t["shared_w3"] @ x[i]))
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_is_the_hand_loop(name):
    spec = SPECS[name]
    args = random_moe_args(spec, 23, torch.float32, seed=3)
    ref = reference.moe_forward(*args, spec)
    assert rel_err(ref, _hand_loop(spec, args)) < 1e-5
    # the field is not a no-op on these inputs (so the op tests below would catch a kernel that ignored it)
    assert rel_err(reference.moe_forward(*args, spec.replace(weight_on_input=False)), ref) > 1e-2


def check(spec, T, dtype, seed=0):
    args = random_moe_args(spec, T, dtype, seed=seed)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    assert rel_err(out, ref) < TOL[dtype], f"rel err {rel_err(out, ref):.2e} for {spec.describe()} T={T}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_op_matches_reference(cpu_backend, poison, monkeypatch, name, dtype):
    """T=40: the aligned path (align, gemm1 with the weights, gemm2 unweighted, combine) on the Triton backend."""
    monkeypatch.delenv("MOECOMP_CONFIG", raising=False)
    monkeypatch.delenv("MOECOMP_DECODE_MAX_T", raising=False)
    check(SPECS[name], 40, dtype, seed=len(name))


@pytest.mark.parametrize("path", ["fused", "pairs"])
def test_decode_paths(monkeypatch, poison, path):
    """T=5 on the decode path: gemm1 DIRECT with the weights, then the fused down-combine (WEIGHTED off) or gemm2
    DIRECT (WEIGHTED off) + combine."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.delenv("MOECOMP_DECODE_MAX_T", raising=False)
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    cfg = dict(BLOCK_M=16, g1=tile, g2=tile, decode=dict(max_t=8, g1=tile, g2=dict(tile, mode=path)))
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(cfg))
    calls = []
    real = triton_moe.gemm2
    monkeypatch.setattr(triton_moe, "gemm2", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    check(SPECS["k3_bias"], 5, torch.float32, seed=7)
    assert len(calls) == (1 if path == "pairs" else 0)


def test_moe_experts_given_routing(cpu_backend, poison):
    spec = SPECS["k3_bias"]
    T = 19
    args = random_moe_args(spec, T, seed=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), dim=1)[:, :3]
    w = torch.rand(T, 3, generator=g) * 2 - 0.5  # negative weights too: the input is scaled, whatever the sign
    x, w13, b13, w2, b2 = args[0], args[4], args[5], args[6], args[7]
    out = torch.ops.moecomp.moe_experts(x, ids, w, w13, b13, w2, b2, spec.key)
    ref = reference.experts(x, ids, w, w13, b13, w2, b2, spec)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float32]


def test_tma_gemms(poison, monkeypatch):
    """The TMA gemm1 (A by TMA, W_ON_INPUT) and gemm2 (WEIGHTED off) where a config asks for them (fp16; launches
    counted so that a silent fall-back to the pointer kernels fails)."""
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=72, intermediate_size=48, weight_on_input=True,
                   has_expert_bias=True)
    tile = dict(BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    cfg = dict(BLOCK_M=16, g1=dict(tile, tma=1, tma_a=True), g2=dict(tile, tma=1), decode=dict(max_t=0))
    calls = []
    for fn in ("_gemm1_tma", "_gemm2_tma"):
        real = getattr(triton_moe, fn)
        monkeypatch.setattr(triton_moe, fn, lambda *a, _r=real, _n=fn, **k: (calls.append(_n), _r(*a, **k))[1])
    args = random_moe_args(spec, 21, torch.float16, seed=4)
    x, named = args[0], dict(zip(MOE_ARGS, args[1:]))
    ids, w = triton_moe.route(triton_moe.router_logits(x, named, spec)[0], None, spec, x.dtype)
    out = triton_moe.routed(x, ids, w, named, spec, torch.empty_like(x), cfg=cfg)
    ref = reference.moe_forward(*(a.float() if a is not None else a for a in args), spec)
    if triton_moe._TensorDescriptor() is not None:
        assert calls == ["_gemm1_tma", "_gemm2_tma"]
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float16]


def test_gemm1_needs_the_weights():
    spec = SPECS["k3_bias"]
    x = torch.randn(2, spec.hidden_size)
    with pytest.raises(ValueError, match="routing weights"):
        triton_moe.gemm1(x, torch.zeros(6, 34, 33), None, spec, triton_moe.direct(torch.zeros(2, 3, dtype=torch.int32)),
                         3, 16, dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_dynamic(monkeypatch, poison, backend):
    """FP8 routed experts (128x64 blocks, dynamic activations, w8a8 forced) with the weights on the input."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")
    monkeypatch.delenv("MOECOMP_CONFIG", raising=False)
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=136, intermediate_size=40, weight_on_input=True,
                   quant=QuantSpec(block_n=32, block_k=64))
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 11, torch.float32, seed=5))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    off = reference.moe_forward(*args, spec.replace(weight_on_input=False), **scales)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-3 < rel_err(off, ref)


def test_route_sigmoid_topk_then_score(poison):
    """The routing kernel's TOPK_THEN_SCORE + sigmoid against the reference, rows with NaN / inf logits included
    (the routing contract in moecomp.oracle.reference)."""
    spec = SPECS["llama4"].replace(top_k=2)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 8, generator=g) * 3
    logits[1, 2] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("nan")
    logits[4, :3] = float("-inf")
    ids, w = triton_moe.route(logits, None, spec, torch.float32)
    want_w, want_ids = reference.route(logits, None, spec)
    assert torch.equal(ids.long(), want_ids) and torch.allclose(w, want_w, rtol=1e-6, atol=0)
    assert torch.isfinite(w).all()


def test_spec_field():
    spec = SPECS["llama4"]
    assert MoESpec.from_key(spec.key) == spec and '"weight_on_input":true' in spec.key
    assert "on-input" in spec.describe() and "topk->sigmoid" in spec.describe()
    plain = spec.replace(weight_on_input=False)
    assert plain.key != spec.key and "on-input" not in plain.describe()
    old = json.loads(plain.key)
    del old["weight_on_input"]  # a key written before the field existed: the default
    assert MoESpec.from_key(json.dumps(old, sort_keys=True, separators=(",", ":"))) == plain
    with pytest.raises(SpecError, match="static activation scales"):
        spec.replace(quant=QuantSpec(activation="static"))
    spec.replace(quant=QuantSpec(activation="none"))  # weight-only and dynamic are fine
    with pytest.raises(SpecError, match="softmax and sigmoid only"):
        spec.replace(scoring="sqrtsoftplus")
