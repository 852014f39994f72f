"""A bias on one expert GEMM only (``MoESpec.expert_bias``): the spec's rules, the op's argument checks, 4-bit experts
with one-sided biases on the torch path and the Triton kernels (interpreter: the decode path and the aligned grouped
GEMMs, and the dot-free 4-bit decode kernels), FP8's refusal naming it, gpt-oss's mxfp4 checkpoint writer's
refusal (its format holds both), ``torch.library.opcheck`` of both ops, and (GPU) bf16 at mid sizes.
(Unquantized experts: tests/reliability/test_expert_bias_properties.py.)

Tolerances: fp32 against ``moecomp.oracle.reference`` on the same (packed) tensors, relative Frobenius error 3e-5 (the
sums in another order; the 4-bit kernels' own bound, tests/kernels/test_quant4_gemm.py). Outputs NaN-poisoned.
"""

from __future__ import annotations

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_quant4, triton_quant4_gemv
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SpecError, expert_bias_fields
from moecomp.testing import quantize_moe_args, random_moe_args

TOL = 3e-5
BASE = dict(num_experts=5, top_k=2, hidden_size=12, intermediate_size=8)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_spec_fields_and_shapes():
    for side, b13, b2 in (("gemm1", True, False), ("gemm2", False, True), ("both", True, True)):
        s = MoESpec(**BASE, has_expert_bias=True, expert_bias=side, gated=False, activation="relu2")
        assert (s.has_b13, s.has_b2) == (b13, b2) and MoESpec.from_key(s.key) == s
        shapes = s.expert_weight_shapes()
        assert ("b13" in shapes, "b2" in shapes) == (b13, b2)
        assert shapes.get("b13", (5, 8)) == (5, 8) and shapes.get("b2", (5, 12)) == (5, 12)
        assert expert_bias_fields(b13, b2) == dict(has_expert_bias=True, expert_bias=side)
    plain = MoESpec(**BASE)
    assert (plain.has_b13, plain.has_b2, plain.expert_bias) == (False, False, "both")
    assert expert_bias_fields(False, False) == dict(has_expert_bias=False, expert_bias="both")


@pytest.mark.parametrize("fields, match", [
    (dict(expert_bias="gemm1"), "expert_bias='gemm1' says which expert GEMM has a bias, but has_expert_bias is False"),
    (dict(has_expert_bias=True, expert_bias="down"), r"expert_bias='down' is not one of \('both', 'gemm1', 'gemm2'\)"),
    (dict(has_expert_bias=True, expert_bias="gemm2", quant=QuantSpec()),
     r"fp8 experts with expert biases \(expert_bias='gemm2': b2 \(down\) only\) are not supported"),
    (dict(has_expert_bias=True, expert_bias="gemm1", quant=QuantSpec()), r"b13 \(gate / up\) only"),
])
def test_bad_specs(fields, match):
    with pytest.raises(SpecError, match=match):
        MoESpec(**BASE, **fields)


def test_argument_checks_name_the_bias():
    spec = MoESpec(**BASE, has_expert_bias=True, expert_bias="gemm2")
    args = list(random_moe_args(spec, 3, seed=0))
    b13 = torch.zeros(5, 16)
    with pytest.raises(SpecError, match="b13 was given but the spec has no use for it"):
        torch.ops.moecomp.moe_forward(*args[:5], b13, *args[6:], spec.key)
    with pytest.raises(SpecError, match=r"b2 is required by the spec .* expected a tensor of shape \(5, 12\)"):
        torch.ops.moecomp.moe_forward(*args[:7], None, *args[8:], spec.key)
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    with pytest.raises(SpecError, match=r"b2 has shape \(5, 11\), the spec needs \(5, 12\)"):
        torch.ops.moecomp.moe_experts(args[0], ids, w, args[4], None, args[6], torch.zeros(5, 11), spec.key)


# ------------------------------------------------------------------------------------------------------ 4-bit
def _packed(side: str, T: int, quant=QuantSpec.int4(32), **kw):
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, quant=quant, has_expert_bias=True,
                   expert_bias=side, **kw)
    pos, extra = quantize_moe_args(spec, random_moe_args(spec, T, seed=T, std=0.4))
    return spec, pos, extra


@pytest.mark.parametrize("T", [3, 40], ids=["decode", "aligned"])
@pytest.mark.parametrize("side", ["gemm1", "gemm2"])
def test_4bit_one_sided(cpu_backend, poison, side, T):
    spec, pos, extra = _packed(side, T, gate_up="interleaved", activation="swiglu_oai")
    assert (pos[5] is None, pos[7] is None) == (side == "gemm2", side == "gemm1")
    out = torch.ops.moecomp.moe_forward(*pos, spec.key, **extra)
    assert torch.isfinite(out).all() and rel(out, reference.moe_forward(*pos, spec, **extra)) < TOL
    t = dict(zip(MOE_ARGS, pos[1:]))
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    y = torch.ops.moecomp.moe_experts(pos[0], ids, w, t["w13"], t["b13"], t["w2"], t["b2"], spec.key, **extra)
    yr = reference.experts(pos[0], ids, w, t["w13"], t["b13"], t["w2"], t["b2"], spec, **extra)
    assert torch.isfinite(y).all() and rel(y, yr) < TOL


@pytest.mark.parametrize("side", ["gemm1", "gemm2"])
def test_4bit_gemv_one_sided(monkeypatch, poison, side):
    """The dot-free 4-bit decode kernels (``triton_quant4_gemv``), called directly: each bias pointer on its own."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    spec, pos, extra = _packed(side, 3, quant=QuantSpec.mxfp4())
    named = {**dict(zip(MOE_ARGS, pos[1:])), **extra}
    g = torch.Generator().manual_seed(1)
    ids = torch.argsort(torch.rand(3, 4, generator=g), 1)[:, :2].to(torch.int32)
    w = torch.rand(3, 2, generator=g)
    q1, q2 = triton_quant4.expert_kwargs(spec.quant, named, None)
    out = torch.empty_like(pos[0])
    triton_quant4_gemv.routed(pos[0], ids.reshape(-1), w, named, spec, out, None, None, {"gemv1": {}, "gemv2": {}},
                              q1, q2)
    ref = reference.experts(pos[0], ids, w, named["w13"], named["b13"], named["w2"], named["b2"], spec, **extra)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL


def test_mxfp4_checkpoint_needs_both_biases():
    """gpt-oss's checkpoint format holds both biases: one-sided 4-bit experts run, but are not written as it."""
    from moecomp.formats import mxfp4
    from moecomp.testing import mxfp4_write

    spec, pos, extra = _packed("gemm1", 2, quant=QuantSpec.mxfp4(), gate_up="interleaved", activation="swiglu_oai")
    t = dict(zip(MOE_ARGS, pos[1:]))
    ex = mxfp4.packed_experts(t["w13"], extra["w13_scale"], t["w2"], extra["w2_scale"], t["b13"], None, 1.702, 7.0)
    assert ex.spec(2).expert_bias == "gemm1"
    with pytest.raises(ValueError, match="biases b13 True / b2 False"):
        mxfp4_write.to_checkpoint(ex)


# ------------------------------------------------------------------------------------------------------ opcheck
@pytest.mark.parametrize("side", ["gemm1", "gemm2"])
def test_opcheck_one_sided(cpu_backend, side):
    spec = MoESpec(**BASE, has_expert_bias=True, expert_bias=side, scoring="sigmoid", has_correction_bias=True,
                   activation="relu2", gated=False, w_layout="in_out")
    for T in (0, 4):
        args = random_moe_args(spec, T, seed=T)
        torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key))
        ids, w = torch.randint(0, 5, (T, 2)), torch.rand(T, 2)
        torch.library.opcheck(torch.ops.moecomp.moe_experts.default, (args[0], ids, w, *args[4:8], spec.key))


# ------------------------------------------------------------------------------------------------------ GPU
GPU_SPECS = {  # mid sizes; in_out interleaved swiglu_oai (gpt-oss layout) and out_in relu2, each bias alone
    "oai-in_out": dict(num_experts=32, top_k=4, hidden_size=1024, intermediate_size=512, activation="swiglu_oai",
                       w_layout="in_out", gate_up="interleaved", score_order="topk_then_score", renormalize=False),
    "relu2-out_in": dict(num_experts=64, top_k=6, hidden_size=1024, intermediate_size=512, gated=False,
                         activation="relu2", scoring="sigmoid", has_correction_bias=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
@pytest.mark.parametrize("side", ["gemm1", "gemm2"])
@pytest.mark.parametrize("name", sorted(GPU_SPECS))
def test_gpu_one_sided_bf16(name, side, T):
    """bf16 on the GPU (the decode kernels at T = 1 / 4, the grouped GEMMs, TMA where the card has it, above), each
    bias alone, the caching allocator's free memory NaN-filled first, against the fp32 reference on the same bf16
    tensors within 2e-2 (tests/ops/test_gpu.py's bound); and one 4-bit (mxfp4) case per side."""
    spec = MoESpec(**GPU_SPECS[name], has_expert_bias=True, expert_bias=side)
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.05, seed=T)
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    assert torch.isfinite(out).all() and rel(out, reference.moe_forward(*args, spec)) < 2e-2
    if name == "oai-in_out":
        q = MoESpec(**{**GPU_SPECS[name], "w_layout": "out_in"}, has_expert_bias=True, expert_bias=side,
                    quant=QuantSpec.mxfp4())
        pos, extra = quantize_moe_args(q, random_moe_args(q, T, torch.bfloat16, "cuda", std=0.05, seed=T))
        out = torch.ops.moecomp.moe_forward(*pos, q.key, **extra)
        assert torch.isfinite(out).all() and rel(out, reference.moe_forward(*pos, q, **extra)) < 2e-2
