"""The FP8 TMA GEMMs (``kernels/grouped_gemm_tma_fp8.py`` through ``ops/triton_fp8_tma.py``) against
``moecomp.oracle.reference`` with the quantized spec (dynamic w8a8: activation quantization counted), under the interpreter
(CPU; the GPU tests run them in bf16 at real sizes). Configs ask for them (``"tma": 1``, w8a8 + prequant); the
launchers are counted, so a silent fall-back to the pointer GEMMs fails the test; every torch.empty is NaN-poisoned
(padding rows of the gathered A and of h hold NaN codes and scales: they must never reach a stored row).

Shapes: H = 272 (two 128-column groups and a partial third; K steps past H read zeros), I = 48 against 32-wide
tiles (tiles straddle the end of an expert's rows), or I = 144 with 128-wide tiles (gemm1's Q_OUT epilogue writes h
quantized: two groups, the second partial). Tolerance: relative Frobenius error against the fp32 reference on the
same quantized tensors, fp32 3e-5 (the interpreter's fp8 dot decodes e4m3 exactly: what is left is fp32 order and
the rare h element within that rounding of an e4m3 rounding boundary), fp16 2e-3 (h and y stored in fp16)."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_fp8_tma, triton_moe
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.testing import count_calls, quantize_moe_args, random_moe_args

TOL = {torch.float32: 3e-5, torch.float16: 2e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def fp8_tma_calls(monkeypatch):
    return count_calls(monkeypatch, triton_fp8_tma, ("gemm1", "gemm2"))


def _cfg(bn: int, g1: dict) -> dict:
    tile = dict(BLOCK_N=bn, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=1, tma=1)
    return dict(BLOCK_M=16, fp8="w8a8", fp8_prequant=1, g1=dict(tile, **g1), g2=tile, decode=dict(max_t=0))


# name: (spec fields, quant fields, I, BLOCK_N, gemm1 options, x dtype)
CASES = {
    "block-gated-a_ptr": (dict(), dict(), 48, 32, dict(), torch.float32),
    "block-gated-a_tma": (dict(), dict(), 48, 32, dict(tma_a=1), torch.float32),
    "block16-per-column": (dict(), dict(block_n=16), 48, 32, dict(tma_a=1), torch.float32),
    "block-q_out-a_tma-fp16": (dict(), dict(), 144, 128, dict(tma_a=1, per_sm=2), torch.float16),
    "block64-ue8m0": (dict(), dict(block_n=32, block_k=64, scale_dtype="ue8m0"), 48, 32, dict(tma_a=1),
                      torch.float32),
    "channel-relu2-plain": (dict(gated=False, activation="relu2"), dict(scale="channel"), 48, 32, dict(),
                            torch.float32),
    "tensor-weight_on_input": (dict(weight_on_input=True, top_k=1), dict(scale="tensor"), 48, 32, dict(tma_a=1),
                               torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_tma_gemms_match_reference(poison, fp8_tma_calls, monkeypatch, case):
    fields, qfields, I, bn, g1, dtype = CASES[case]
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(_cfg(bn, g1)))
    for var in ("MOECOMP_FP8_MODE", "MOECOMP_FP8_PREQUANT", "MOECOMP_DECODE_MAX_T"):
        monkeypatch.delenv(var, raising=False)
    spec = MoESpec(**dict(dict(num_experts=6, top_k=2, hidden_size=272, intermediate_size=I,
                               quant=QuantSpec(**qfields)), **fields))
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 29, dtype, seed=len(case)))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    assert fp8_tma_calls == ["gemm1", "gemm2"]
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype], f"{case}: rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("block_n", [16, 128])
def test_fp8_tma_mutation_fails(poison, monkeypatch, block_n):
    """The check can fail: with the up rows' block scales read from the gate rows' (no gate / up split of the scale
    rows) the same comparison misses by far, with scales read per column (block_n 16 < BLOCK_N 32) and per tile
    (WS_SCALAR)."""
    real = triton_fp8_tma._scale_args

    def gate_scales_only(q, bn):
        a = real(q, bn)
        assert a["WS_SCALAR"] == (block_n == 128)
        rows = -(-48 // block_n)  # w13's gate scale rows (then as many up rows); w2's scales are left alone
        if a["ws_ptr"].shape[1] == 2 * rows:
            a["ws_ptr"] = a["ws_ptr"].clone()
            a["ws_ptr"][:, rows:] = a["ws_ptr"][:, :rows]
        return a

    monkeypatch.setattr(triton_fp8_tma, "_scale_args", gate_scales_only)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(_cfg(32, {})))
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=272, intermediate_size=48, quant=QuantSpec(block_n=block_n))
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 29, torch.float32, seed=1))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) > 1e-2


def test_fp8_tma_operand_rules():
    """``gemm1_ok`` / ``gemm2_ok``: only w8a8 prequant calls (A_QUANT 3), e4m3 contiguous weights with 16-byte rows,
    x with unit-stride rows, a BLOCK_K dividing the activation group and the weight blocks (other layouts and
    interleaved gate / up: ``MoESpec`` refuses them for quantized experts)."""
    spec = MoESpec(num_experts=2, top_k=1, hidden_size=64, intermediate_size=32, quant=QuantSpec())
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 64, 64, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(2, 64, 32, dtype=torch.float8_e4m3fn)
    h = torch.zeros(16, 32, dtype=torch.bfloat16)
    q = dict(A_QUANT=3, W_SCALE=1, Q_BLOCK_K=128)
    c = dict(BLOCK_K=128)
    want = triton_moe._TensorDescriptor() is not None
    assert triton_fp8_tma.gemm1_ok(spec, x, w13, q, c) == want and triton_fp8_tma.gemm2_ok(spec, h, w2, q, c) == want
    assert not triton_fp8_tma.gemm1_ok(spec, x, w13, dict(q, A_QUANT=1), c)  # quantized in the A loads
    assert not triton_fp8_tma.gemm1_ok(spec, x, w13, None, c)  # 16-bit experts: the 16-bit TMA kernels
    assert not triton_fp8_tma.gemm1_ok(spec, x, w13.to(torch.bfloat16), q, c)
    x_cols = torch.zeros(64, 4, dtype=torch.bfloat16).t()  # [4, 64] without unit-stride rows
    assert not triton_fp8_tma.gemm1_ok(spec, x_cols, w13, q, c)
    assert not triton_fp8_tma.gemm1_ok(spec, x, w13, dict(q, Q_BLOCK_K=64), c)  # BLOCK_K 128 over 64-column blocks
    odd = MoESpec(num_experts=2, top_k=1, hidden_size=64, intermediate_size=40, quant=QuantSpec())
    assert not triton_fp8_tma.gemm2_ok(odd, torch.zeros(16, 40, dtype=torch.bfloat16),
                                       torch.zeros(2, 64, 40, dtype=torch.float8_e4m3fn), q, c)  # 40-byte rows
