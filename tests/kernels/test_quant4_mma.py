"""The 4-bit "mma" K-step form (``ops/w4_layout.py``, ``kernels/quant4_mma.py``; opt-in, MOECOMP_W4_FORM=mma or a
config's ``w4_form``) under the interpreter (CPU). GPU: tests/ops/test_quant4_mma_gpu.py.

* The layout: ``restore(relayout(q)) == q`` byte for byte (mxfp4 re-encoded, int4 as stored), every code placed as
  the docstring's diagram says, the cache made once per weight tensor; bad arguments -> ValueError naming them.
* The decode, as small ``@triton.jit`` kernels: every e2m1 code times every ue8m0 scale byte (0: the subnormal
  2^-127, 255: NaN) equals ``quant.dequantize`` bit for bit; every int4 code minus every zero point (and the
  symmetric 8) equals it exactly.
* The op (``moe_forward``) with the form against ``oracle/reference.py`` on fresh random inputs: mxfp4 and int4
  (symmetric, with zero points), gated (concat; gpt-oss's interleaved swiglu_oai with expert biases) and not gated,
  T on both sides of the CPU decode limit (both the decode path and the aligned path run the mma form: counted;
  the decode path's own cases: tests/kernels/test_quant4_mma_decode.py), outputs NaN-poisoned.

Tolerances (relative Frobenius error against the fp32 reference on the same packed tensors): fp32 3e-5 (the same
exact weights, sums in another order), fp16 2e-3 (h and the outputs stored in fp16), as the other forms'
tests (tests/kernels/test_quant4_gemm.py).
"""

import json

import pytest
import torch
import triton
import triton.language as tl

from moecomp.core import quant as q8
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.kernels import fp8, quant4_mma
from moecomp.ops import triton_quant4, tuning, w4_layout
from moecomp.oracle import reference
from moecomp.testing import quantize_moe_args, random_moe_args
from moecomp.testing.w4_launches import record_w4_forms

MX = QuantSpec.mxfp4()
TOL = {torch.float32: 3e-5, torch.float16: 2e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ the layout
@pytest.mark.parametrize("quant", [MX, QuantSpec.int4(64, True)], ids=["mxfp4", "int4"])
def test_relayout_round_trip(quant):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (3, 5, 24), generator=g, dtype=torch.uint8)
    r = w4_layout.relayout(q, quant)
    assert r.shape == q.shape and r.dtype == torch.uint8
    assert torch.equal(w4_layout.restore(r, quant), q)
    if quant.weight == "mxfp4":
        assert not torch.equal(r, q)  # re-encoded (random bytes: some word changes)


def test_mxfp4_layout_places_each_code_as_documented():
    """Column 8w + 4L + j: its em bits at lane L's bits 3j..3j+2, its sign at lane bit 15 - j."""
    for c in range(8):
        for code in (1, 5, 8, 15):
            codes = torch.zeros(1, 8, dtype=torch.uint8)
            codes[0, c] = code
            word = int(w4_layout.relayout(q8.pack_4bit(codes), MX).view(torch.int32)[0, 0]) & 0xFFFFFFFF
            lane, j = divmod(c, 4)
            assert word == ((code & 7) << (16 * lane + 3 * j)) | ((code >> 3) << (16 * lane + 15 - j))


def test_relaid_is_made_once_per_tensor():
    q = torch.randint(0, 256, (2, 4, 8), dtype=torch.uint8)
    a = w4_layout.relaid(q, MX)
    assert w4_layout.relaid(q, MX) is a
    q.add_(1)  # written to: made again
    b = w4_layout.relaid(q, MX)
    assert b is not a and torch.equal(w4_layout.restore(b, MX), q)


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="q: .*uint8"):
        w4_layout.relayout(torch.zeros(2, 8), MX)
    with pytest.raises(ValueError, match="q: .*K % 8"):
        w4_layout.relayout(torch.zeros(2, 6, dtype=torch.uint8), MX)
    with pytest.raises(ValueError, match="r: .*K % 8"):
        w4_layout.restore(torch.zeros(2, 6, dtype=torch.uint8), MX)
    with pytest.raises(ValueError, match="quant: "):
        w4_layout.relayout(torch.zeros(2, 8, dtype=torch.uint8), QuantSpec())  # fp8 e4m3 block scales
    with pytest.raises(ValueError, match="MOECOMP_W4_FORM='mmx'"):
        import os
        os.environ["MOECOMP_W4_FORM"] = "mmx"
        try:
            triton_quant4.options({})
        finally:
            del os.environ["MOECOMP_W4_FORM"]


# ------------------------------------------------------------------------------------------------ the decode
@triton.jit
def _mx_kernel(w_ptr, s_ptr, out_ptr, R: tl.constexpr, NW: tl.constexpr):
    rows, words = tl.arange(0, R)[:, None], tl.arange(0, NW)[None, :]
    v = quant4_mma.decode_mx(tl.load(w_ptr + rows * NW + words), fp8.ue8m0(tl.load(s_ptr + rows * NW + words)))
    tl.store(out_ptr + rows * (NW * 8) + tl.arange(0, NW * 8)[None, :], v)


def test_mxfp4_decode_every_code_and_scale_byte_is_dequantize():
    codes = torch.arange(16, dtype=torch.uint8).repeat(256, 2)  # row b: every code twice, scale byte b
    scale = torch.arange(256, dtype=torch.uint8)[:, None]
    want = q8.dequantize(q8.pack_4bit(codes), scale.view(q8.E8M0), MX)  # [256, 32]
    out = torch.full((256, 32), float("nan"))
    _mx_kernel[(1,)](w4_layout.relayout(q8.pack_4bit(codes), MX).view(torch.int32), scale.expand(256, 4).contiguous(),
                     out, 256, 4)
    nan = want.isnan()
    assert nan.sum() == 32 and torch.equal(out.isnan(), nan)  # byte 255
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bits: -0, subnormals, inf


@triton.jit
def _int4_kernel(w_ptr, z_ptr, out_ptr, R: tl.constexpr, NW: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    zh = (tl.load(z_ptr + rows).to(tl.float32) + 1024.0).to(tl.float16)
    v = quant4_mma.decode_int4(tl.load(w_ptr + rows * NW + tl.arange(0, NW)[None, :]), zh).to(tl.float32)
    tl.store(out_ptr + rows * (NW * 8) + tl.arange(0, NW * 8)[None, :], v)


def test_int4_decode_every_code_and_zero_is_dequantize():
    codes = torch.arange(16, dtype=torch.uint8).repeat(16, 2)  # row z: every code twice, zero point z
    zero = torch.arange(16, dtype=torch.uint8)[:, None]
    ones = torch.ones(16, 1)
    want = q8.dequantize(q8.pack_4bit(codes), ones, QuantSpec.int4(32, True), zero=zero)
    want_sym = q8.dequantize(q8.pack_4bit(codes), ones, QuantSpec.int4(32))
    out = torch.full((16, 32), float("nan"))
    words = w4_layout.relayout(q8.pack_4bit(codes), QuantSpec.int4(32)).view(torch.int32)
    _int4_kernel[(1,)](words, zero, out, 16, 4)
    assert torch.equal(out, want)
    _int4_kernel[(1,)](words, torch.full((16, 1), 8, dtype=torch.uint8), out, 16, 4)
    assert torch.equal(out, want_sym)


# ------------------------------------------------------------------------------------------------ the op
def _spec(quant, gate_up="concat", gated=True, H=64, I=32):
    oai = gate_up == "interleaved"
    return MoESpec(num_experts=4, top_k=2, hidden_size=H, intermediate_size=I, gated=gated, gate_up=gate_up,
                   activation="swiglu_oai" if oai else ("silu" if gated else "gelu"), has_expert_bias=oai,
                   quant=quant)


OP = {  # name: (spec, dtype, T)   T <= 8: the CPU decode path (DIRECT + down-combine); above: aligned
    "mxfp4-oai-fp32-T20": (_spec(MX, "interleaved"), torch.float32, 20),
    "mxfp4-concat-fp16-T20": (_spec(MX, H=96), torch.float16, 20),
    "mxfp4-ungated-fp32-T12": (_spec(MX, gated=False), torch.float32, 12),
    "mxfp4-oai-fp32-T3": (_spec(MX, "interleaved"), torch.float32, 3),
    "int4-g64-fp32-T20": (_spec(QuantSpec.int4(64)), torch.float32, 20),
    "int4zp-g32-oai-fp16-T20": (_spec(QuantSpec.int4(32, True), "interleaved"), torch.float16, 20),
    "int4zp-g64-ungated-fp32-T12": (_spec(QuantSpec.int4(64, True), gated=False), torch.float32, 12),
}


@pytest.fixture
def mma_backend(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOECOMP_W4_FORM", "mma")
    return monkeypatch


def _forms(monkeypatch):
    """The W4_FORM each gemm1 / gemm2 / decode_down launch got, and whether its weights were the mma layout."""
    return record_w4_forms(monkeypatch)


@pytest.mark.parametrize("case", sorted(OP))
def test_moe_forward_mma_form_matches_reference(mma_backend, poison, case):
    spec, dtype, T = OP[case]
    seen = _forms(mma_backend)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=len(case)))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{case}: rel err {err:.2e}"
    decode = T <= tuning.decode_config(tuning.get_config(4, spec.intermediate_size, spec.hidden_size, T, 2, dtype,
                                                         torch.device("cpu"), spec.quant), 0, torch.device("cpu"))["max_t"]
    want = [("gemm1", 4), ("decode_down", 4)] if decode else [("gemm1", 4), ("gemm2", 4)]
    assert seen == want


def test_mma_form_falls_back_where_the_layout_does_not_fit(mma_backend):
    """H or I not a multiple of 8: the device's default form (the layout needs whole 32-bit words)."""
    spec = _spec(MX, H=64, I=36)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 2, torch.float32, seed=1))
    named = dict(zip(MOE_ARGS, args[1:]))
    q1, q2 = triton_quant4.expert_kwargs(MX, dict(named, w13_scale=scales["w13_scale"], w2_scale=scales["w2_scale"]),
                                         None)
    assert "W4_FORM" not in q1 and "W4_FORM" not in q2  # interleave, the CPU default
    assert triton_quant4.direct_kwargs(dict(q1, W4_FORM=4), torch.device("cpu"), gemv=True) == q1  # packed
    assert triton_quant4.direct_kwargs(dict(q1, W4_FORM=4), torch.device("cpu"), gemv=False)["W4_FORM"] == 4


def test_config_key_selects_the_form(monkeypatch):
    monkeypatch.delenv("MOECOMP_W4_FORM", raising=False)
    assert triton_quant4.options({"w4_form": "mma"})["w4_form"] == "mma"
    kw = triton_quant4.quant4_kwargs(QuantSpec.int4(64), torch.zeros(1, 2, 2), None, {"w4_form": "mma", "w4_fold": 1})
    assert kw["W4_FORM"] == 4 and "W4_FOLD" not in kw  # int4 scales after the dot in this form
