"""Softcapped gated silu (MoESpec / SharedExpertSpec ``gate_softcap`` / ``up_softcap``, Inkling2's expert activation):
h = cg * tanh(g / cg) * sigmoid(g) * cu * tanh(u / cu).

The op (torch path and the Triton kernels under the interpreter, fp32) against reference.py, NaN-poisoned outputs,
relative Frobenius error < 1e-5 (fp32). The caps are small here (about the spread of g and u) so that tanh bends:
a test that passes with the caps ignored would prove nothing (``test_caps_change_the_output``)."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_moe_args, rel_err

SHARED = SharedExpertSpec(24, gate_softcap=1.5, up_softcap=0.7)
STYLES = {
    "routed_both": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, scoring="sigmoid",
                           has_correction_bias=True, renorm_eps=1e-20, routed_scaling_factor=2.5, router_fp32=True,
                           gate_softcap=1.0, up_softcap=0.5),
    "gate_only_interleaved_shared": MoESpec(num_experts=6, top_k=3, hidden_size=32, intermediate_size=24,
                                            gate_up="interleaved", gate_softcap=0.8, shared=SHARED),
    "up_only_in_out": MoESpec(num_experts=5, top_k=2, hidden_size=40, intermediate_size=16, w_layout="in_out",
                              has_expert_bias=True, up_softcap=0.6),
}


def check(spec, T, dtype=torch.float32, seed=0, tol=1e-5):
    args = random_moe_args(spec, T, dtype, seed=seed)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    assert rel_err(out, ref) < tol, f"rel err {rel_err(out, ref):.2e} for {spec.describe()} T={T}"
    return out


def test_reference_formula():
    g, u = torch.randn(64, 8) * 5, torch.randn(64, 8) * 30
    h = reference.gated_activation(g, u, "silu", 1.702, 7.0, False, 4.0, 25.0)
    want = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)
    torch.testing.assert_close(h, want, rtol=1e-6, atol=1e-6)
    # caps 0: plain silu(g) * u
    torch.testing.assert_close(reference.gated_activation(g, u, "silu", 1.702, 7.0, False, 0.0, 0.0),
                               torch.nn.functional.silu(g) * u)
    # one cap alone
    torch.testing.assert_close(reference.gated_activation(g, u, "silu", 1.702, 7.0, False, 0.0, 25.0),
                               torch.nn.functional.silu(g) * 25.0 * torch.tanh(u / 25.0))


@pytest.mark.parametrize("bad, match", [
    (dict(gate_softcap=-1.0), "gate_softcap"),
    (dict(up_softcap=float("inf")), "up_softcap"),
    (dict(up_softcap=True), "up_softcap"),
    (dict(gate_softcap=4.0, activation="gelu"), "activation 'silu'"),
    (dict(gate_softcap=4.0, gated=False), "gated"),
    (dict(up_softcap=4.0, activation_clamp=True), "activation_clamp"),
])
def test_bad_specs_name_the_field(bad, match):
    with pytest.raises(SpecError, match=match):
        MoESpec(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, **bad)
    with pytest.raises(SpecError, match=match):
        SharedExpertSpec(8, **bad).validate()


def test_key_roundtrip_and_describe():
    for spec in STYLES.values():
        assert MoESpec.from_key(spec.key) == spec
    d = json.loads(STYLES["routed_both"].key)
    assert (d["gate_softcap"], d["up_softcap"]) == (1.0, 0.5)
    assert "softcap g1/u0.5" in STYLES["routed_both"].describe()


@pytest.mark.parametrize("name", sorted(STYLES))
def test_caps_change_the_output(name):
    """The test sizes bend tanh: the same block without caps differs by far more than the tolerance."""
    spec = STYLES[name]
    args = random_moe_args(spec, 9, seed=1)
    plain = spec.replace(gate_softcap=0.0, up_softcap=0.0,
                         shared=None if spec.shared is None else spec.shared.__class__(24))
    assert rel_err(reference.moe_forward(*args, spec), reference.moe_forward(*args, plain)) > 1e-2


@pytest.mark.parametrize("cpu_backend", ["torch", "triton"], indirect=True)
@pytest.mark.parametrize("name", sorted(STYLES))
def test_op_matches_reference(cpu_backend, poison, name):
    check(STYLES[name], 33, seed=len(name))


@pytest.mark.parametrize("path", ["aligned", "fused"])
def test_triton_decode_and_aligned_paths(monkeypatch, poison, path):
    """The Triton decode path (gemm1 DIRECT, fused down + combine) and the aligned one, fp32 under the interpreter."""
    from moecomp.ops import tuning

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.delenv("MOECOMP_DECODE_MAX_T", raising=False)
    spec = STYLES["routed_both"]
    cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, 5, spec.top_k,
                            torch.float32, torch.device("cpu"))
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=0) if path == "aligned" else dict(max_t=8, g1=tile, g2=dict(tile, mode=path))
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(cfg, decode=dec)))
    check(spec, 5, seed=3)


def test_kernel_tanh_is_accurate(poison):
    """The kernels' tanh (softcap) against torch.tanh over small and large arguments, via the shared experts'
    act_mul kernel (interpreter, fp32): relative error < 1e-6 near 0, absolute < 1e-6 elsewhere."""
    from moecomp.kernels import activations as act_k
    from moecomp.kernels import combine as combine_k

    v = torch.cat([torch.logspace(-8, 1.5, 200), -torch.logspace(-8, 1.5, 200), torch.zeros(1)])
    n = v.numel()
    gu = torch.cat([v, torch.ones(n)]).unsqueeze(0)  # [1, 2n]: gate = v, up = 1
    out = torch.empty(1, n)
    combine_k.act_mul_kernel[(1, 1)](gu, out, n, gu.stride(0), out.stride(0), 0.0, 1.0,
                                     ACT=act_k.SILU_SOFTCAP, CLAMP=False, BLOCK=512)
    want = torch.sigmoid(v) * torch.tanh(torch.ones(n))  # gate uncapped (cap 0), up = 1 capped at 1
    torch.testing.assert_close(out[0], v * want, rtol=1e-6, atol=1e-7)
    # cap on the gate: v * sigmoid(v) with v -> tanh(v)
    out2 = torch.empty(1, n)
    combine_k.act_mul_kernel[(1, 1)](gu, out2, n, gu.stride(0), out2.stride(0), 1.0, 0.0,
                                     ACT=act_k.SILU_SOFTCAP, CLAMP=False, BLOCK=512)
    torch.testing.assert_close(out2[0], torch.tanh(v) * torch.sigmoid(v), rtol=2e-6, atol=1e-7)


GPU_STYLES = {**STYLES, "inkling_like_large": MoESpec(
    num_experts=32, top_k=4, hidden_size=512, intermediate_size=256, scoring="sigmoid", has_correction_bias=True,
    renorm_eps=1e-20, routed_scaling_factor=2.5, router_fp32=True, gate_softcap=1.0, up_softcap=0.5)}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [3, 300])
@pytest.mark.parametrize("name", sorted(GPU_STYLES))
def test_softcap_bf16_cuda(poison, name, T):
    """bf16 on the GPU (the decode and the prefill paths) against reference.py in fp32 on the same bf16 inputs,
    outputs NaN-poisoned (``poison``); relative Frobenius error < 2e-2 (tests/ops/test_gpu.py's bf16 bound)."""
    spec = GPU_STYLES[name]
    args = random_moe_args(spec, T, torch.bfloat16, device="cuda", std=0.05, seed=T)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = reference.moe_forward(*args, spec)
    assert rel_err(out, ref) < 2e-2, f"rel err {rel_err(out, ref):.2e} for {spec.describe()} T={T}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
@pytest.mark.parametrize("T", [3, 1024])
def test_softcap_fp8_cuda(poison, monkeypatch, mode, T):
    """FP8 block-quantized routed experts (the FP8 gemm1 epilogues, TMA ones at the larger T where the tuned table
    takes them) with softcaps, bf16 activations, against reference.py on the same quantized weights (w8a16: the
    weight-only reference); relative Frobenius error < 2e-2 (tests/ops/test_fp8_gpu.py's bound)."""
    from moecomp.core.spec import QuantSpec
    from moecomp.testing import quantize_moe_args

    spec = MoESpec(num_experts=32, top_k=4, hidden_size=1024, intermediate_size=512, scoring="sigmoid",
                   has_correction_bias=True, renorm_eps=1e-20, routed_scaling_factor=2.5, router_fp32=True,
                   gate_softcap=1.0, up_softcap=0.5, quant=QuantSpec())
    monkeypatch.setenv("MOECOMP_FP8_MODE", mode)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.bfloat16, device="cuda", std=0.05,
                                                           seed=T))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert torch.isfinite(out).all()
    ref_spec = spec if mode == "w8a8" else spec.replace(quant=QuantSpec(activation="none"))
    ref = reference.moe_forward(*args, ref_spec, **scales)
    assert rel_err(out, ref) < 2e-2, f"rel err {rel_err(out, ref):.2e} ({mode}, T={T})"
