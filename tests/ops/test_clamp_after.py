"""The activation clamped after it (MoESpec / SharedExpertSpec ``activation_clamp_after``, Step-3.7-Flash's
``limit_after_act``): h = min(act(g), L) * clamp(u, -L, L), against the clamped SwiGLU ``activation_clamp`` that
clamps the gate before the activation, act(min(g, L)) * clamp(u, -L, L).

The op (torch path and the Triton kernels under the interpreter, fp32: the aligned grouped gemm1, the DIRECT decode
gemm1 and the shared experts' act_mul) against reference.py, NaN-poisoned outputs, relative Frobenius error < 1e-5.
The limits are small here (about the spread of g and u, std ~1), so the clamps bind on most rows: the same block
unclamped, or clamped before the activation, differs by far more than the tolerance (``test_clamp_changes_the_output``).
Each of the other gemm1 epilogues (TMA, FP8 TMA, 4-bit dot and GEMV): tests/kernels/test_clamp_after_epilogues.py;
bf16 on the GPU: tests/ops/test_clamp_after_gpu.py."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from moecomp.oracle import reference
from moecomp.ops.act_args import act_args
from moecomp.kernels import activations as act_k
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_moe_args, rel_err

SHARED = SharedExpertSpec(24, activation_clamp_after=True, activation_limit=0.4)
STYLES = {
    # Step-3.7's layers 43-44: sigmoid + correction bias, renormalised, routed and shared experts clamped
    "step3p7_routed_and_shared": MoESpec(
        num_experts=8, top_k=2, hidden_size=32, intermediate_size=24, scoring="sigmoid", has_correction_bias=True,
        router_fp32=True, routed_scaling_factor=1.5, activation_clamp_after=True, activation_limit=0.5,
        shared=SharedExpertSpec(16, activation_clamp_after=True, activation_limit=0.3)),
    "gelu_interleaved_shared_concat": MoESpec(
        num_experts=6, top_k=3, hidden_size=24, intermediate_size=16, activation="gelu", gate_up="interleaved",
        activation_clamp_after=True, activation_limit=0.4,
        shared=SharedExpertSpec(24, layout="concat", activation_clamp_after=True, activation_limit=0.4)),
    "bias_in_out_shared_only": MoESpec(
        num_experts=5, top_k=2, hidden_size=20, intermediate_size=12, w_layout="in_out", has_expert_bias=True,
        shared=SHARED),
}


def check(spec, T, seed=0, tol=1e-5):
    args = random_moe_args(spec, T, seed=seed)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    assert rel_err(out, ref) < tol, f"rel err {rel_err(out, ref):.2e} for {spec.describe()} T={T}"
    return out


def test_reference_formula():
    g, u = torch.randn(64, 8) * 5, torch.randn(64, 8) * 5
    for name, fn in (("silu", F.silu), ("gelu", F.gelu), ("relu", F.relu)):
        h = reference.gated_activation(g, u, name, 1.702, 2.0, False, clamp_after=True)
        torch.testing.assert_close(h, torch.minimum(fn(g), torch.tensor(2.0)) * u.clamp(-2.0, 2.0), rtol=0, atol=0)
        before = reference.gated_activation(g, u, name, 1.702, 2.0, True)
        if name != "relu":  # (relu(min(g, L)) = min(relu(g), L): there the two clamps coincide)
            assert (h - before).abs().max() > 0.05  # a different function wherever g > L (act(L) < L)
    # the gate's activation is clamped from above only: silu's negative lobe is kept
    h = reference.gated_activation(torch.tensor([-1.0, 10.0]), torch.tensor([0.25, 0.25]), "silu", 1.702, 0.5,
                                   False, clamp_after=True)
    torch.testing.assert_close(h, torch.tensor([F.silu(torch.tensor(-1.0)).item() * 0.25, 0.5 * 0.25]))
    with pytest.raises(ValueError, match="exclude"):
        reference.gated_activation(g, u, "silu", 1.702, 2.0, True, clamp_after=True)
    with pytest.raises(ValueError, match="swiglu_oai"):
        reference.gated_activation(g, u, "swiglu_oai", 1.702, 2.0, False, clamp_after=True)


@pytest.mark.parametrize("bad, match", [
    (dict(activation_clamp_after=True, activation_clamp=True), "exclude each other"),
    (dict(activation_clamp_after=True, activation_limit=0.0), "activation_limit must be positive"),
    (dict(activation_clamp_after=True, gated=False), "gated"),
    (dict(activation_clamp_after=True, activation="swiglu_oai"), "swiglu_oai"),
    (dict(activation_clamp_after=1), "must be a bool"),
    (dict(activation_clamp_after=True, gate_softcap=2.0), "activation_clamp_after"),
])
def test_bad_specs_name_the_field(bad, match):
    with pytest.raises(SpecError, match=match):
        MoESpec(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, **bad)
    with pytest.raises(SpecError, match=match):
        SharedExpertSpec(8, **bad).validate()


def test_key_roundtrip_describe_and_kernel_code():
    for spec in STYLES.values():
        assert MoESpec.from_key(spec.key) == spec
    s = STYLES["step3p7_routed_and_shared"]
    d = json.loads(s.key)
    assert d["activation_clamp_after"] is True and d["shared"]["activation_clamp_after"] is True
    assert "act-clamp0.5" in s.describe()
    assert act_args(s).CLAMP == act_k.CLAMP_ACT and act_args(s.shared).CLAMP == act_k.CLAMP_ACT
    assert act_args(s.replace(activation_clamp_after=False, activation_clamp=True)).CLAMP == act_k.CLAMP_GATE
    assert act_args(s.replace(activation_clamp_after=False)).CLAMP == act_k.CLAMP_NONE


@pytest.mark.parametrize("name", sorted(STYLES))
def test_clamp_changes_the_output(name):
    """The test sizes make the clamps bind: the same block unclamped, or clamped before the activation, differs by
    far more than the tolerance (a kernel that ignored the new clamp, or took it for the other one, fails)."""
    spec = STYLES[name]
    args = random_moe_args(spec, 9, seed=1)
    want = reference.moe_forward(*args, spec)

    def unclamped(s):
        return dataclasses.replace(s, activation_clamp_after=False)

    def before(s):
        return dataclasses.replace(s, activation_clamp_after=False, activation_clamp=s.activation_clamp_after)

    for form in (unclamped, before):
        other = form(spec).replace(shared=None if spec.shared is None else form(spec.shared))
        assert rel_err(reference.moe_forward(*args, other), want) > 1e-2, (name, form.__name__)


@pytest.mark.parametrize("cpu_backend", ["torch", "triton"], indirect=True)
@pytest.mark.parametrize("name", sorted(STYLES))
def test_op_matches_reference(cpu_backend, poison, name):
    check(STYLES[name], 21, seed=len(name))


@pytest.mark.parametrize("path", ["aligned", "fused"])
def test_triton_decode_and_aligned_paths(monkeypatch, poison, path):
    """The Triton decode path (gemm1 DIRECT, fused down + combine) and the aligned one, fp32 under the interpreter."""
    from moecomp.ops import tuning

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.delenv("MOECOMP_DECODE_MAX_T", raising=False)
    spec = STYLES["step3p7_routed_and_shared"]
    cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, 5, spec.top_k,
                            torch.float32, torch.device("cpu"))
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=0) if path == "aligned" else dict(max_t=8, g1=tile, g2=dict(tile, mode=path))
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(cfg, decode=dec)))
    check(spec, 5, seed=3)


def test_experts_op_and_shared_kernel_exact(poison, monkeypatch):
    """``moe_experts`` (the experts interface's op) on the Triton path, and the shared experts' act_mul kernel
    alone on values around the limit (fp32: equal to the formula up to silu's own rounding)."""
    from moecomp.kernels import combine as combine_k

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    spec = STYLES["gelu_interleaved_shared_concat"].replace(shared=None)
    args = random_moe_args(spec, 7, seed=5)
    g = torch.Generator().manual_seed(5)
    ids = torch.argsort(torch.rand(7, spec.num_experts, generator=g), 1)[:, :spec.top_k]
    w = torch.rand(7, spec.top_k, generator=g)
    y = torch.ops.moecomp.moe_experts(args[0], ids, w, *args[4:8], spec.key)
    yr = reference.experts(args[0], ids, w, *args[4:8], spec)
    assert torch.isfinite(y).all() and rel_err(y, yr) < 1e-5
    v = torch.linspace(-6, 6, 301)
    gu = torch.stack([torch.cat([v, v.flip(0)])])  # gate = v, up = v reversed
    n = v.numel()
    out = torch.empty(1, n)
    combine_k.act_mul_kernel[(1, 1)](gu, out, n, gu.stride(0), out.stride(0), 1.702, 0.75, ACT=act_k.SILU,
                                     CLAMP=act_k.CLAMP_ACT, BLOCK=512)
    torch.testing.assert_close(out[0], F.silu(v).clamp(max=0.75) * v.flip(0).clamp(-0.75, 0.75), rtol=1e-6,
                               atol=1e-7)


def test_parallel_kernel_spec_keeps_the_clamp():
    """A rank's ``moe_experts`` spec (parallel/local.kernel_spec) carries the clamp after the activation."""
    from moecomp.parallel.local import kernel_spec
    from moecomp.core.spec_parallel import ParallelSpec

    spec = STYLES["step3p7_routed_and_shared"]
    par = spec.replace(parallel=ParallelSpec(mode="ep", world_size=2, rank=1, num_global_experts=8))
    ks = kernel_spec(par, spec.top_k, False)
    assert (ks.activation_clamp_after, ks.activation_limit) == (True, 0.5)
