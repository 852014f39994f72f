"""The Gluon FP8 GEMMs asked for (``MOECOMP_FP8_GLUON=1``, or a config's "gluon" key; ops/triton_fp8_gluon.py) on
this CPU machine: every call the Gluon gemm1 does not take names its reason (``unsupported1``: the data reasons before
the device one), and the op asked either way runs the Triton TMA GEMMs under the interpreter, each fall-back counted
once under "gemm1: ..." / "gemm2: ...", its output still the reference's (tolerance as
tests/kernels/test_grouped_gemm_tma_fp8.py: fp32 3e-5)."""

import dataclasses
import json

import pytest
import torch

from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.oracle import reference
from moecomp.ops import triton_fp8_gluon, triton_fp8_tma
from moecomp.testing import count_calls, quantize_moe_args, random_moe_args
from test_grouped_gemm_tma_fp8 import TOL, _cfg, rel_err  # (tests/kernels is on sys.path)

pytest.importorskip("triton.experimental.gluon")

SPEC = MoESpec(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
Q = dict(A_QUANT=3, W_SCALE=1, Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False)
REASONS = {  # name: (spec fields, q fields, BLOCK_M, H, the reason's start)
    "supported-but-cpu": ({}, {}, 64, 256, "not a CUDA compute capability 9.x"),
    "channel-scales": ({}, dict(W_SCALE=2), 64, 256, "not w8a8 prequant with block weight scales"),
    "static-activations": ({}, dict(A_QUANT=2), 128, 256, "not w8a8 prequant"),
    "ungated": (dict(gated=False, activation="relu2"), {}, 64, 256, "not gated"),
    "swiglu_oai": (dict(activation="swiglu_oai"), {}, 64, 256, "activation code 4"),
    "clamped": (dict(activation_clamp=True), {}, 64, 256, "activation code 0 / clamp 1"),
    "softcap": (dict(gate_softcap=30.0), {}, 64, 256, "activation code 6"),
    "bm32": ({}, {}, 32, 256, "BLOCK_M 32"),
    "block64": ({}, dict(Q_BLOCK_N=64), 64, 256, "block scales 64x128"),
    "h-272": ({}, {}, 128, 272, "H not a multiple of 128"),
}


@pytest.mark.parametrize("case", sorted(REASONS))
def test_gluon_gemm1_reasons(case):
    fields, qf, bm, H = REASONS[case][:4]
    spec = dataclasses.replace(SPEC, hidden_size=H, **fields)
    w13 = torch.zeros(4, 256 if spec.gated else 128, H, dtype=torch.float8_e4m3fn)
    why = triton_fp8_gluon.unsupported1(spec, torch.zeros(3, H), w13, dict(Q, **qf), bm)
    assert why is not None and why.startswith(REASONS[case][4]), f"{case}: {why}"


@pytest.mark.parametrize("asked", ["env", "config"])
def test_gluon_env_on_falls_back_counted(asked, poison, monkeypatch):
    """Asked by MOECOMP_FP8_GLUON=1, or by the config's "gluon" key on both GEMMs (what a tuned table holds)."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    cfg = _cfg(32, dict(tma_a=1))
    if asked == "config":
        cfg["g1"]["gluon"] = cfg["g2"]["gluon"] = 1
        monkeypatch.delenv("MOECOMP_FP8_GLUON", raising=False)
    else:
        monkeypatch.setenv("MOECOMP_FP8_GLUON", "1")
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(cfg))
    for var in ("MOECOMP_FP8_MODE", "MOECOMP_FP8_PREQUANT", "MOECOMP_DECODE_MAX_T"):
        monkeypatch.delenv(var, raising=False)
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=256, intermediate_size=48, quant=QuantSpec())
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 29, torch.float32, seed=3))
    triton_fp8_gluon.FALLBACKS.clear()
    tma_calls = count_calls(monkeypatch, triton_fp8_tma, ("gemm1", "gemm2"))
    gluon_calls = count_calls(monkeypatch, triton_fp8_gluon, ("gemm1", "gemm2"))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    fb = triton_fp8_gluon.fallbacks()
    assert tma_calls == ["gemm1", "gemm2"] and gluon_calls == [], (tma_calls, gluon_calls)
    assert sorted(fb) == ["gemm1: BLOCK_M 16 (64 or 128)",  # (the interpreter's tiles; gemm2 checks the device first)
                          "gemm2: not a CUDA compute capability 9.x device (wgmma)"], fb
    assert sum(fb.values()) == 2, fb
    ref = reference.moe_forward(*args, spec, **scales)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float32], rel_err(out, ref)


def test_gluon_api_names_what_is_missing(monkeypatch):
    """``gluon_api`` (uncached) on a Gluon stripped of both TMA load spellings (3.9's ``async_load``, 3.6's
    ``async_copy_global_to_shared``) and with a ``warpgroup_mma_wait`` that takes no ``num_outstanding``: the reason
    names both; the untouched Gluon of this Triton passes, gemm1's names too."""
    from triton.experimental.gluon.language.nvidia import hopper

    assert triton_fp8_gluon.gluon_api.__wrapped__() is None
    assert triton_fp8_gluon.gluon_api.__wrapped__(gemm1=True) is None
    for name in triton_fp8_gluon.TMA_LOADS:
        monkeypatch.delattr(hopper.tma, name, raising=False)
    monkeypatch.setattr(hopper, "warpgroup_mma_wait", lambda deps=None: deps)
    why = triton_fp8_gluon.gluon_api.__wrapped__()
    want = "Gluon lacks tma.async_load / async_copy_global_to_shared, warpgroup_mma_wait(num_outstanding=)"
    assert why == want, why
