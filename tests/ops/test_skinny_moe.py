"""The skinny routed experts (``ops/skinny_moe.py``, ``kernels/skinny_moe.py``): two GEMV launches at a few tokens.

The op under the interpreter (CPU, fp32 and fp16: the interpreter's bf16 is not trusted) with MOECOMP_SKINNY_MOE=1
against ``moecomp.reference`` on fresh random inputs, every torch.empty NaN-poisoned first (an unwritten h row or
output column shows), over the spec features the kernels read: gated concat / interleaved, ungated, expert biases,
a sigmoid-gated shared expert, weight_on_input, zero experts, FP8 experts with block / channel scales (a "dynamic"
spec runs weight-only here, so it is compared with the weight-only reference: ``weight_only_spec``) and ue8m0
scales; the tiles' BLOCK_K below and above the scale blocks; the rule's switches; and (GPU) bf16 against the
reference and the MMA decode path, with CUDA-graph capture.

Tolerances, relative Frobenius error against the fp32 reference: fp32 1e-5 (fp32 sums in another order); fp16 x
and weights 2e-3 (h and the output rounded to fp16 once each); FP8 fp32 1e-5 against the dequantized weight-only
reference (dequantization is exact in fp32). GPU bf16: 1e-2 (h and out rounded to bf16), the MMA path's own bound.
"""

import dataclasses

import pytest
import torch

from moecomp import reference
from moecomp.ops import skinny_moe
from moecomp.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.testing import quantize_moe_args, random_moe_args, rel_err

SPECS = {
    "gated": MoESpec(num_experts=8, top_k=3, hidden_size=72, intermediate_size=40),
    "interleaved_bias_shared": MoESpec(num_experts=6, top_k=2, hidden_size=48, intermediate_size=24,
                                       gate_up="interleaved", has_expert_bias=True,
                                       shared=SharedExpertSpec(32, gate="sigmoid")),
    "ungated_gelu": MoESpec(num_experts=5, top_k=2, hidden_size=40, intermediate_size=56, gated=False,
                            activation="gelu"),
    "on_input_zero": MoESpec(num_experts=6, top_k=3, hidden_size=40, intermediate_size=24, zero_experts=2,
                             scoring="sigmoid", score_order="topk_then_score", renormalize=False,
                             weight_on_input=True),
    "fp8_block": MoESpec(num_experts=6, top_k=2, hidden_size=160, intermediate_size=136,
                         quant=QuantSpec(block_n=32, block_k=32)),
    "fp8_channel_ue8m0": MoESpec(num_experts=6, top_k=2, hidden_size=96, intermediate_size=40,
                                 quant=QuantSpec(scale="channel", activation="none")),
}


def weight_only(spec: MoESpec) -> MoESpec:
    q = spec.quant
    return spec if q is None or q.activation != "dynamic" else spec.replace(quant=dataclasses.replace(q, activation="none"))


def _args(spec: MoESpec, T: int, dtype, seed: int):
    args = random_moe_args(spec, T, dtype, seed=seed)
    return quantize_moe_args(spec, args) if spec.quant is not None else (args, {})


@pytest.fixture
def skinny(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv(skinny_moe.ENV, "1")
    calls = []
    real = skinny_moe.routed
    monkeypatch.setattr(skinny_moe, "routed", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_op_matches_reference(skinny, poison, name, T):
    spec = SPECS[name]
    args, scales = _args(spec, T, torch.float32, seed=T)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert skinny == [1], "the skinny path did not run"
    ref = reference.moe_forward(*args, weight_only(spec), **scales)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5, f"{name} T={T}: {rel_err(out, ref):.2e}"


def test_fp16_and_tiles(skinny, poison, monkeypatch):
    """fp16 inputs; BLOCK_K 16 (below the 32-column scale blocks: one scale per step) and 64 (two blocks a step),
    both reduction forms."""
    spec = SPECS["fp8_block"]
    args, scales = _args(spec, 2, torch.float16, seed=5)
    ref = reference.moe_forward(*args, weight_only(spec), **scales)
    for tiles in ("8,16,1,4,64,0", "4,64,0,8,16,1"):
        monkeypatch.setenv("MOECOMP_SKINNY_MOE_TILES", tiles)
        out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-3, (tiles, rel_err(out, ref))
    assert len(skinny) == 2


def test_ue8m0_scales(skinny, poison):
    """Power-of-two scales as ue8m0 bytes decode as the fp32 ones (the same weights)."""
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32,
                   quant=QuantSpec(block_n=32, block_k=32, activation="none"))
    args, scales = _args(spec, 2, torch.float32, seed=7)
    p2 = {n: torch.exp2(torch.round(torch.log2(s))) for n, s in scales.items()}
    e8 = {n: s.to(torch.float8_e8m0fnu) for n, s in p2.items()}
    ref = reference.moe_forward(*args, spec, **p2)
    out = torch.ops.moecomp.moe_forward(*args, spec.replace(quant=dataclasses.replace(spec.quant, scale_dtype="ue8m0")).key,
                                        **e8)
    assert rel_err(out, ref) < 1e-5


def test_rule_switches(monkeypatch):
    spec = SPECS["gated"]
    args = dict(zip(("w13", "w2"), (torch.empty(8, 80, 72), torch.empty(8, 72, 40))))
    x = torch.empty(1, 72)
    monkeypatch.setenv(skinny_moe.ENV, "1")
    assert skinny_moe.applies(spec, args, x, 1)
    static = spec.replace(quant=QuantSpec(activation="static"))
    assert not skinny_moe.applies(static, args, x, 1)  # static activation scales: w8a8 only
    assert not skinny_moe.applies(spec.replace(w_layout="in_out"), args, x, 1)
    monkeypatch.setenv(skinny_moe.ENV, "0")
    assert not skinny_moe.applies(spec, args, x, 1)
    monkeypatch.delenv(skinny_moe.ENV)
    assert skinny_moe.applies(spec, args, x, 1) == skinny_moe.use_skinny_experts(spec, 1)
    assert not skinny_moe.use_skinny_experts(spec, skinny_moe.MAX_T + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gated", "interleaved_bias_shared", "fp8_block", "on_input_zero"])
def test_gpu_bf16_against_reference_and_decode_path(monkeypatch, name):
    """bf16 on the H200 (T = 1, 4): against the fp32 reference of the same (dequantized) weights and against the MMA
    decode path; then captured in a CUDA graph and replayed on fresh inputs."""
    from moecomp.testing import capture_moe_forward

    spec = SPECS[name].replace(hidden_size=512, intermediate_size=384) if "fp8" in name else SPECS[name]
    if spec.quant is not None:
        spec = spec.replace(quant=dataclasses.replace(spec.quant, block_n=128, block_k=128))
    for T in (1, 4):
        args, scales = _args(spec, T, torch.bfloat16, seed=T)
        args = tuple(a.cuda() if torch.is_tensor(a) else a for a in args)
        scales = {n: s.cuda() for n, s in scales.items()}
        ref = reference.moe_forward(*args, weight_only(spec), **scales)
        monkeypatch.setenv(skinny_moe.ENV, "1")
        out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
        monkeypatch.setenv(skinny_moe.ENV, "0")
        mma = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
        assert rel_err(out, ref) < 1e-2 and rel_err(out, mma) < 1e-2, (T, rel_err(out, ref), rel_err(out, mma))
    monkeypatch.setenv(skinny_moe.ENV, "1")
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, extra=scales)
    for seed in (11, 12):
        x = torch.randn(args[0].shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda",
                        dtype=torch.bfloat16)
        static_x.copy_(x)
        static_out.fill_(float("nan"))
        graph.replay()
        want = reference.moe_forward(x, *args[1:], weight_only(spec), **scales)
        assert rel_err(static_out, want) < 1e-2
