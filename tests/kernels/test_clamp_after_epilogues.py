"""The activation clamped after it (``MoESpec.activation_clamp_after``: h = min(act(g), L) * clamp(u, -L, L)) in each
gemm1 epilogue the pointer paths of tests/ops/test_clamp_after.py do not reach, under the interpreter (CPU): the 16-bit
TMA gemm1 (fp16; x by pointer loads and gathered, ``tma_a``), the FP8 TMA gemm1 (w8a8 prequant, fp32), the FP8
pointer gemm1, and the 4-bit experts' DIRECT dot gemm1 and dot-free GEMV gemm1 (mxfp4 and int4). Each config asks
for its path and the launches are counted (a silent fall-back to another kernel fails), every torch.empty is
NaN-poisoned, and the same call with the clamp dropped from the spec misses the reference by far (the clamps bind:
limits about a third of the pre-activations' spread).

Tolerances (relative Frobenius error against the fp32 reference on the same (quantized) tensors): fp32 3e-5 (the same
products summed in another order; FP8 w8a8: the reference quantizes the activations as the kernels do), fp16 5e-3
(h and y stored in fp16), as tests/kernels/test_grouped_gemm_tma*.py and test_quant4_gemv.py."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_fp8_tma, triton_moe, triton_quant4_gemv
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.testing import count_calls, quantize_moe_args, random_moe_args, rel_err

TOL = {torch.float32: 3e-5, torch.float16: 5e-3}
TILE = dict(BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
ENV = ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_FP8_MODE", "MOECOMP_FP8_PREQUANT", "MOECOMP_W4_FOLD",
       "MOECOMP_W4_FORM", "MOECOMP_W4_DECODE", "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM")


@pytest.fixture
def triton_env(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _missing_clamp_misses(args, spec, out, scales=None):
    """The clamp binds on these inputs: the spec without it is far from what the kernels computed."""
    plain = spec.replace(activation_clamp_after=False)
    assert rel_err(out, reference.moe_forward(*args, plain, **(scales or {}))) > 1e-2


@pytest.mark.parametrize("g1", ["ptr", "a"])
def test_tma_gemm1(poison, triton_env, g1):
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=72, intermediate_size=48, scoring="sigmoid",
                   has_correction_bias=True, activation_clamp_after=True, activation_limit=0.6)
    calls = count_calls(triton_env, triton_moe, ("_gemm1_tma", "_gemm2_tma"))
    cfg = dict(BLOCK_M=16, g1=dict(TILE, tma=1, tma_a=g1 == "a"), g2=dict(TILE, tma=1), decode=dict(max_t=0))
    args = random_moe_args(spec, 37, torch.float16, seed=4)
    x, named = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits, _ = triton_moe.router_logits(x, named, spec)
    ids, w = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    out = triton_moe.routed(x, ids, w, named, spec, torch.empty_like(x), cfg=cfg)
    assert calls == ["_gemm1_tma", "_gemm2_tma"]
    assert torch.isfinite(out).all()
    f32 = tuple(a.float() if a is not None and a.is_floating_point() else a for a in args)
    assert rel_err(out, reference.moe_forward(*f32, spec)) < TOL[torch.float16]
    _missing_clamp_misses(f32, spec, out.float())


@pytest.mark.parametrize("tma", [True, False])
def test_fp8_gemm1(poison, triton_env, tma):
    """FP8 block-quantized experts, w8a8 prequant: the TMA gemm1 (``"tma": 1``) or the pointer one."""
    tile = dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=1, **({"tma": 1} if tma else {}))
    triton_env.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, fp8="w8a8", fp8_prequant=1, g1=dict(tile),
                                                        g2=tile, decode=dict(max_t=0))))
    calls = count_calls(triton_env, triton_fp8_tma, ("gemm1", "gemm2"))
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=272, intermediate_size=48, activation_clamp_after=True,
                   activation_limit=1.0, quant=QuantSpec())
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 29, torch.float32, seed=2))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert calls == (["gemm1", "gemm2"] if tma else [])
    assert torch.isfinite(out).all()
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL[torch.float32]
    _missing_clamp_misses(args, spec, out, scales)


def _count_4bit(monkeypatch):
    calls = dict.fromkeys(("dot gemm1", "gemv gemm1"), 0)
    for mod, tag in ((triton_moe, "dot"), (triton_quant4_gemv, "gemv")):
        real = mod.gemm1

        def counted(*a, _real=real, _key=f"{tag} gemm1", **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, "gemm1", counted)
    return calls


@pytest.mark.parametrize("mode", ["dot", "gemv"])
@pytest.mark.parametrize("quant", ["mxfp4", "int4zp"])
def test_4bit_decode_gemm1(poison, triton_env, mode, quant):
    """4-bit experts at decode sizes (T=3): MOECOMP_W4_DECODE picks the DIRECT dot gemm1 or the GEMV one."""
    q = QuantSpec.mxfp4() if quant == "mxfp4" else QuantSpec.int4(32, zero_point=True)
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, activation_clamp_after=True,
                   activation_limit=0.5, quant=q)
    triton_env.setenv("MOECOMP_W4_DECODE", mode)
    calls = _count_4bit(triton_env)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 3, torch.float32, seed=6))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert calls == {"dot gemm1": int(mode == "dot"), "gemv gemm1": int(mode == "gemv")}
    assert torch.isfinite(out).all()
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL[torch.float32]
    _missing_clamp_misses(args, spec, out, scales)
