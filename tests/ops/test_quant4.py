"""4-bit weights in the one quantization spec (``QuantSpec.mxfp4()`` / ``QuantSpec.int4(...)``): the format's
definition checked against values written out independently of ``moecomp.core.quant``, the checks of packed arguments,
and the CPU op against the dequantized reference.

Tolerances: dequantization is exact (compared with ==); the CPU op against ``reference.moe_forward`` on the same
packed tensors in fp32 within 1e-5 relative (the same dequantized values, another summation order), in bf16 within
1e-2 relative (the output's rounding). The quantization itself (``quantize_4bit`` on N(0, std) weights) puts the
block's output 5-20% from the unquantized block; that is reported by a loose sanity bound (< 30%), not a target.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.testing import quantize_moe_args, random_moe_args

QUANTS = {"mxfp4": QuantSpec.mxfp4(), "int4": QuantSpec.int4(), "int4_zp64": QuantSpec.int4(64, zero_point=True),
          "int4_bf16": QuantSpec.int4(32, scale_dtype="bf16")}


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _e2m1(code: int) -> float:
    """OCP e2m1, from its bits: sign (bit 3), exponent (bits 2..1, bias 1), mantissa (bit 0); exponent 0 is
    subnormal (0 or 0.5)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def test_e2m1_table_is_the_ocp_format():
    assert list(q8.E2M1) == [_e2m1(c) for c in range(16)]


def test_packing_order_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = q8.pack_4bit(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(q8.unpack_4bit(packed), codes)


def test_mxfp4_dequantize_by_hand():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 64), generator=g, dtype=torch.uint8)  # [rows, cols]
    exps = torch.randint(120, 135, (3, 2), generator=g, dtype=torch.uint8)  # [rows, cols / 32] biased exponents
    w = q8.dequantize(q8.pack_4bit(codes), exps.view(q8.E8M0), QuantSpec.mxfp4())
    for r in range(3):
        for c in range(64):
            assert w[r, c].item() == _e2m1(int(codes[r, c])) * 2.0 ** (int(exps[r, c // 32]) - 127)


def test_int4_dequantize_by_hand():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (2, 128), generator=g, dtype=torch.uint8)
    scale = torch.rand(2, 2, generator=g).half() + 0.01
    zero = torch.randint(0, 16, (2, 2), generator=g, dtype=torch.uint8)
    qz, qs = QuantSpec.int4(64, zero_point=True), QuantSpec.int4(64)
    wz = q8.dequantize(q8.pack_4bit(codes), scale, qz, zero=zero)
    ws = q8.dequantize(q8.pack_4bit(codes), scale, qs)
    for r in range(2):
        for c in range(0, 128, 7):
            s = float(scale[r, c // 64])
            assert wz[r, c].item() == (int(codes[r, c]) - int(zero[r, c // 64])) * s
            assert ws[r, c].item() == (int(codes[r, c]) - 8) * s


@pytest.mark.parametrize("name", list(QUANTS))
def test_quantize_round_trip_reproduces_codes(name):
    """quantize_4bit's codes dequantize to values that quantize back to the same codes (the grid is fixed)."""
    q = QUANTS[name]
    w = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(3))
    packed, scale, zero = q8.quantize_4bit(w, q)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 16, 64)
    assert scale.shape == (4, 16, 128 // q.block_k) and scale.dtype == q8.scale_dtype(q)
    assert (zero is not None) == q.zero_point
    deq = q8.dequantize(packed, scale, q, zero=zero)
    assert rel(deq, w) < 0.2  # 4-bit grid error on N(0, 1): about 0.1
    packed2, scale2, zero2 = q8.quantize_4bit(deq, q)
    assert torch.equal(q8.dequantize(packed2, scale2, q, zero=zero2), deq)


@pytest.mark.parametrize("bad,match", [
    (dict(weight="mxfp4", scale="group", block_k=64, scale_dtype="ue8m0", activation="none"), "block_k=32"),
    (dict(weight="mxfp4", scale="group", block_k=32, scale_dtype="fp16", activation="none"), "ue8m0"),
    (dict(weight="int4", scale="block", block_k=128, scale_dtype="fp16", activation="none"), "group"),
    (dict(weight="int4", scale="group", block_k=128, scale_dtype="fp16", activation="dynamic"), "weight-only"),
    (dict(weight="int4", scale="group", block_k=48, scale_dtype="fp16", activation="none"), "multiple of 32"),
    (dict(weight="fp8_e4m3", scale="group"), "fp8 weights"),
    (dict(weight="fp8_e4m3", zero_point=True), "zero"),
])
def test_bad_4bit_specs(bad, match):
    with pytest.raises(SpecError, match=match):
        MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, quant=QuantSpec(**bad))


def test_4bit_spec_rules():
    ok = MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, gate_up="interleaved",
                 has_expert_bias=True, activation="swiglu_oai", quant=QuantSpec.mxfp4())
    assert MoESpec.from_key(ok.key) == ok and "mxfp4 g32" in ok.describe()
    assert ok.expert_weight_shapes()["w13"] == (4, 128, 64) and ok.quant_shapes()["w2_scale"] == (4, 128, 2)
    assert ok.bytes_per_expert() == (128 * 128 + 128 * 64) // 2 + 128 * 4 + 128 * 2  # codes + one-byte scales
    with pytest.raises(SpecError, match="even"):
        MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=63, gated=False, quant=QuantSpec.int4(32))
    with pytest.raises(SpecError, match="out_in"):
        MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, w_layout="in_out",
                quant=QuantSpec.int4())
    with pytest.raises(SpecError, match="4-bit shared"):
        SharedExpertSpec(64, quant=QuantSpec.int4(32)).validate()
    zp = MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, quant=QuantSpec.int4(zero_point=True))
    assert zp.quant_shapes()["w13_zero"] == (4, 128, 1)


def _packed_call(name: str, dtype=torch.float32, T: int = 24, **kw):
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=128, intermediate_size=64, quant=QUANTS[name], **kw)
    args = random_moe_args(spec, T=T, dtype=dtype, seed=T)
    pos, extra = quantize_moe_args(spec, args)
    return spec, args, pos, extra


@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_cpu_op_against_reference(name, gpt_oss):
    kw = dict(gate_up="interleaved", has_expert_bias=True, activation="swiglu_oai") if gpt_oss else {}
    spec, args, pos, extra = _packed_call(name, **kw)
    out = torch.ops.moecomp.moe_forward(*pos, spec.key, **extra)
    ref = reference.moe_forward(*pos, spec, **extra)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    unq = reference.moe_forward(*args, dataclasses.replace(spec, quant=None))
    assert rel(out, unq) < 0.3  # the quantization's own error (reported, not a target)
    ids = torch.randint(0, 6, (pos[0].shape[0], 2))
    w = torch.rand(ids.shape)
    t = dict(zip(("w13", "b13", "w2", "b2"), pos[4:8]))
    y = torch.ops.moecomp.moe_experts(pos[0], ids, w, t["w13"], t["b13"], t["w2"], t["b2"], spec.key, **extra)
    yr = reference.experts(pos[0], ids, w, t["w13"], t["b13"], t["w2"], t["b2"], spec, **extra)
    assert rel(y, yr) < 1e-5


def test_cpu_op_bf16():
    spec, args, pos, extra = _packed_call("int4_zp64", dtype=torch.bfloat16)
    out = torch.ops.moecomp.moe_forward(*pos, spec.key, **extra)
    assert out.dtype == torch.bfloat16 and rel(out, reference.moe_forward(*pos, spec, **extra)) < 1e-2


def test_packed_argument_errors():
    spec, args, pos, extra = _packed_call("int4_zp64")
    bad_scale = dict(extra, w13_scale=extra["w13_scale"][:, :, :1])
    with pytest.raises(SpecError, match=r"w13_scale has shape \(6, 128, 1\).*need \(6, 128, 2\)"):
        torch.ops.moecomp.moe_forward(*pos, spec.key, **bad_scale)
    with pytest.raises(SpecError, match="w2_zero is required"):
        torch.ops.moecomp.moe_forward(*pos, spec.key, **{k: v for k, v in extra.items() if k != "w2_zero"})
    with pytest.raises(SpecError, match="zero points are torch.uint8"):
        torch.ops.moecomp.moe_forward(*pos, spec.key, **dict(extra, w2_zero=extra["w2_zero"].float()))
    unpacked = list(pos)
    unpacked[4] = torch.zeros(6, 128, 128, dtype=torch.uint8)  # w13 not packed: [E, N, H]
    with pytest.raises(SpecError, match=r"w13 has shape \(6, 128, 128\), the spec needs \(6, 128, 64\)"):
        torch.ops.moecomp.moe_forward(*unpacked, spec.key, **extra)
    unpacked[4] = pos[4].view(torch.int8)
    with pytest.raises(SpecError, match="uint8 \\(two 4-bit codes a byte\\)"):
        torch.ops.moecomp.moe_forward(*unpacked, spec.key, **extra)


@pytest.mark.parametrize("name", ["mxfp4", "int4_zp64"])
def test_opcheck_4bit(name):
    spec, args, pos, extra = _packed_call(name, T=5, gate_up="interleaved", has_expert_bias=True,
                                          activation="swiglu_oai")
    kw = dict(extra)
    if "w13_scale" in kw and kw["w13_scale"].dtype == q8.E8M0:  # allclose has no e8m0 kernel: test_schema skipped
        tests = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    else:
        tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    before = [t.clone() for t in pos if isinstance(t, torch.Tensor)]
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*pos, spec.key), kw, test_utils=tests)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in pos if isinstance(t, torch.Tensor)]))
