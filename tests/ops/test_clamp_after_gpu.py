"""GPU tests (H200 / H100 class; skipped without CUDA) of the activation clamped after it (``activation_clamp_after``:
h = min(act(g), L) * clamp(u, -L, L), Step-3.7-Flash's ``limit_after_act``) in bf16 through ``moe_forward``: the
decode path (DIRECT gemm1, T <= 16, MOECOMP_DECODE_MAX_T=16) and the grouped aligned path (T = 300), each launch's
form recorded so the test fails if the path it names did not run; the TMA gemm1 forced on at T = 2048; FP8 block-quantized experts (w8a8 and
w8a16; pointer and, at T = 1024 where the tuned table takes them, TMA epilogues); 4-bit experts (mxfp4 / int4, the
dot-free GEMV decode and the DIRECT dot one); a shared expert clamped with its own limit (the act_mul kernel).

Sizes: Step-3.7-like mid layers (E=64, k=6 or 8, H=1024, I=512, sigmoid + correction bias, renormalised), weights
std 0.05, so the pre-activations spread about +-1.6 and L = 0.5 / 0.3 bind on most of them (L = 2 on a few): each
test also checks that the spec without the clamp misses the output by far more than the bound (a kernel that ignored
CLAMP 2 fails). Bounds (relative Frobenius error against moecomp.oracle.reference in fp32 on the same bf16 tensors): 2e-2,
tests/ops/test_gpu.py's bf16 bound (h and the per-pair outputs are rounded to bf16); 4-bit 1e-2 and FP8 2e-2 as
tests/ops/test_quant4_gpu.py / test_fp8_gpu.py."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.testing import quantize_moe_args, random_moe_args
from test_gpu import poison_cache, rel_err  # (tests/ops is on sys.path, no package)

pytestmark = pytest.mark.gpu

BOUND = 2e-2
STEP37 = MoESpec(num_experts=64, top_k=8, hidden_size=1024, intermediate_size=512, scoring="sigmoid",
                 has_correction_bias=True, router_fp32=True, routed_scaling_factor=1.5, activation_clamp_after=True,
                 activation_limit=0.5, shared=SharedExpertSpec(512, activation_clamp_after=True, activation_limit=0.3))
STYLES = {
    "step37_routed_and_shared": STEP37,
    "gelu_interleaved_L2": MoESpec(num_experts=64, top_k=6, hidden_size=1024, intermediate_size=512,
                                   activation="gelu", gate_up="interleaved", activation_clamp_after=True,
                                   activation_limit=2.0, has_expert_bias=True),
}
ENV = ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_FP8_MODE", "MOECOMP_W4_DECODE", "MOECOMP_W4_FOLD",
       "MOECOMP_W4_FORM", "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM")


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _gemm1_forms(monkeypatch) -> list:
    """Record each triton_moe.gemm1 launch as "direct" (the decode path) or "aligned" (the grouped one)."""
    forms, real = [], triton_moe.gemm1

    def recorded(x, w13, b13, spec, aligned, *a, **kw):
        forms.append("direct" if aligned[1] is None else "aligned")
        return real(x, w13, b13, spec, aligned, *a, **kw)

    monkeypatch.setattr(triton_moe, "gemm1", recorded)
    return forms


def _check(spec, args, out, scales=None, bound=BOUND):
    scales = scales or {}
    assert torch.isfinite(out).all(), f"{spec.describe()}: non-finite (unwritten) output"
    err = rel_err(out, reference.moe_forward(*args, spec, **scales))
    assert err < bound, f"{spec.describe()}: rel err {err:.2e}"
    plain = spec.replace(activation_clamp_after=False)
    assert rel_err(out, reference.moe_forward(*args, plain, **scales)) > 5 * bound  # the clamp binds


@pytest.mark.parametrize("T", [1, 3, 16, 300])
@pytest.mark.parametrize("name", sorted(STYLES))
def test_clamp_after_bf16_decode_and_grouped(clean_env, name, T):
    spec = STYLES[name]
    clean_env.setenv("MOECOMP_DECODE_MAX_T", "0" if T == 300 else "16")  # the path each T names, whatever the table
    forms = _gemm1_forms(clean_env)
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.05, seed=T)
    poison_cache()
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    torch.cuda.synchronize()
    assert forms and set(forms) == {"aligned" if T == 300 else "direct"}, forms
    _check(spec, args, out)


def test_clamp_after_tma_gemm1_bf16(clean_env):
    """The TMA gemm1 forced on (x gathered and read by TMA), T = 2048; its launch counted."""
    spec = STEP37.replace(shared=None)
    calls = []
    real = triton_moe._gemm1_tma
    clean_env.setattr(triton_moe, "_gemm1_tma", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    g1 = dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, tma=1, tma_a=True)
    g2 = dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, tma=1)
    args = random_moe_args(spec, 2048, torch.bfloat16, "cuda", std=0.05, seed=7)
    x, named = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits, _ = triton_moe.router_logits(x, named, spec)
    ids, w = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    poison_cache()
    out = triton_moe.routed(x, ids, w, named, spec, torch.empty_like(x),
                            cfg=dict(BLOCK_M=128, g1=g1, g2=g2, decode=dict(max_t=0)))
    torch.cuda.synchronize()
    assert calls == [1]
    _check(spec, args, out)


@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
@pytest.mark.parametrize("T", [3, 1024])
def test_clamp_after_fp8(clean_env, mode, T):
    """FP8 block-quantized routed experts (the FP8 gemm1 epilogues) against the reference on the same quantized
    weights (w8a16: the weight-only reference)."""
    spec = STEP37.replace(shared=None, quant=QuantSpec())
    clean_env.setenv("MOECOMP_FP8_MODE", mode)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.05, seed=T))
    poison_cache()
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    torch.cuda.synchronize()
    ref_spec = spec if mode == "w8a8" else spec.replace(quant=QuantSpec(activation="none"))
    _check(ref_spec, args, out, scales)


@pytest.mark.parametrize("decode", ["gemv", "dot"])
@pytest.mark.parametrize("quant", ["mxfp4", "int4_g128_zp"])
def test_clamp_after_4bit(clean_env, quant, decode):
    """4-bit experts at T = 1 and 4 (the GEMV decode or the DIRECT dot one, MOECOMP_W4_DECODE) and T = 64 (aligned)."""
    from test_quant4_gpu import packed_args

    q = QuantSpec.mxfp4() if quant == "mxfp4" else QuantSpec.int4(128, zero_point=True)
    spec = STEP37.replace(shared=None, quant=q)
    clean_env.setenv("MOECOMP_W4_DECODE", decode)
    args, extra = packed_args(spec, 64, torch.bfloat16, seed=3)
    for T in (1, 4, 64):
        a = (args[0][:T],) + args[1:]
        poison_cache()
        out = torch.ops.moecomp.moe_forward(*a, spec.key, **extra)
        torch.cuda.synchronize()
        _check(spec, a, out, extra, bound=1e-2)
