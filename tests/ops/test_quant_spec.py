"""The quantization part of the spec (``QuantSpec``), its oracle (``moecomp.core.quant``), the CPU path of quantized ops,
and the checks of scale arguments.

Tolerances: dequantize(quantize(w)) is within half an e4m3 step of each block's scale (|err| <= 2^-4 |w| for normal
values, plus the subnormal step); the torch path against the reference in fp32 within 1e-5 relative (the same
dequantized values, different summation order); quantization error of the oracle against the unquantized block is
reported (random N(0, 0.2) weights, 256-wide: 4-7%), not asserted beyond a loose 10% sanity bound.
"""

from __future__ import annotations

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.testing import quantize_moe_args, random_moe_args

QUANTS = [QuantSpec(), QuantSpec(scale="channel"), QuantSpec(scale="tensor", activation="static"),
          QuantSpec(activation="none"), QuantSpec(scale_dtype="ue8m0"), QuantSpec(block_n=64, block_k=64)]


def _spec(q: QuantSpec, shared=True, **kw) -> MoESpec:
    sh = SharedExpertSpec(128, gate="sigmoid", quant=QuantSpec(activation=q.activation if q.activation != "static"
                                                                 else "dynamic")) if shared else None
    return MoESpec(num_experts=6, top_k=2, hidden_size=256, intermediate_size=kw.pop("I", 192), quant=q, shared=sh,
                   **kw)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_spec_key_round_trip_and_describe():
    for q in QUANTS:
        s = _spec(q)
        assert MoESpec.from_key(s.key) == s
        assert QuantSpec.from_key(q.key) == q
        assert "fp8" in s.describe()


@pytest.mark.parametrize("bad,match", [
    (dict(scale="rows"), "quant.scale"), (dict(activation="fp4"), "quant.activation"),
    (dict(scale_dtype="fp16"), "scale_dtype"), (dict(block_n=0), "positive"), (dict(act_group=64), "act_group"),
])
def test_bad_quant_specs(bad, match):
    with pytest.raises(SpecError, match=match):
        MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, quant=QuantSpec(**bad))


def test_quantized_experts_need_the_checkpoint_layout():
    for kw in (dict(w_layout="in_out"), dict(gate_up="interleaved"), dict(has_expert_bias=True)):
        with pytest.raises(SpecError):
            MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, quant=QuantSpec(), **kw)


def test_scale_shapes():
    s = MoESpec(num_experts=4, top_k=2, hidden_size=300, intermediate_size=200, quant=QuantSpec())
    assert s.quant_shapes() == {"w13_scale": (4, 4, 3), "w2_scale": (4, 3, 2)}  # gate and up blocked apart
    s = MoESpec(num_experts=4, top_k=2, hidden_size=256, intermediate_size=64, quant=QuantSpec())
    assert s.quant_shapes()["w13_scale"] == (4, 2, 2)  # I < 128: one block per half (transformers: max(., 2))
    s = s.replace(quant=QuantSpec(scale="channel", activation="static"))
    assert s.quant_shapes() == {"w13_scale": (4, 128), "w2_scale": (4, 256), "a13_scale": (4,), "a2_scale": (4,)}


@pytest.mark.parametrize("q", QUANTS, ids=lambda q: f"{q.scale}-{q.scale_dtype}-{q.activation}-{q.block_n}")
def test_quantize_round_trip(q):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 300, generator=g) * 0.1
    qw, s = q8.quantize(w, q, halves=2)
    assert qw.dtype == torch.float8_e4m3fn and s.dtype == q8.scale_dtype(q)
    want = {"block": (3, 2 * -(-100 // q.block_n), -(-300 // q.block_k)), "channel": (3, 200), "tensor": (3,)}
    assert tuple(s.shape) == want[q.scale]
    deq = q8.dequantize(qw, s, q, halves=2)
    step = q8.expand_scales(s, 200, 300, q, halves=2)  # the scale of each element
    err = (deq - w).abs()
    assert bool((err <= w.abs() * 2.0**-4 + step * 2.0**-9 * 1.01).all()), err.max()
    if q.scale_dtype == "ue8m0":
        sf = s.float()
        assert torch.equal(sf, torch.exp2(torch.log2(sf).round()))  # powers of two


def test_gate_and_up_blocks_are_apart():
    """w13 rows [0, I) and [I, 2I) use their own scale rows: scaling the up half's weights leaves the gate half's
    codes and scales alone."""
    q = QuantSpec()
    w = torch.randn(1, 128, 256) * 0.1  # I = 64 < block_n
    w2 = w.clone()
    w2[:, 64:] *= 100
    a, sa = q8.quantize(w, q, halves=2)
    b, sb = q8.quantize(w2, q, halves=2)
    assert torch.equal(a[:, :64].view(torch.uint8), b[:, :64].view(torch.uint8)) and torch.equal(sa[:, 0], sb[:, 0])
    assert not torch.equal(sa[:, 1], sb[:, 1])


def test_activation_quantization_formula():
    """s = max|x| / 448 per 128 columns (1e-10 at least), x_q = e4m3(clamp(x * (1 / s))): checked by value."""
    x = torch.zeros(2, 200)
    x[0, 5], x[0, 130], x[1, 7] = 3.5, -896.0, 1e-3
    q, s = q8.quantize_act(x, QuantSpec())
    assert torch.equal(s, torch.tensor([[3.5, 896.0], [1e-3, 1e-10]]) / 448)  # fp32 division
    assert q.float()[0, 5] == 448 and q.float()[0, 130] == -448 and q.float()[1, 7] == 448
    assert q.float()[1, 150] == 0
    fq = q8.fake_quant_act(x, QuantSpec())
    assert fq[0, 5] == 3.5 and fq[0, 130] == -896.0 and fq[1, 150] == 0


@pytest.mark.parametrize("q", QUANTS, ids=lambda q: f"{q.scale}-{q.scale_dtype}-{q.activation}-{q.block_n}")
@pytest.mark.parametrize("T", [1, 9])
def test_torch_path_matches_reference(q, T, poison):
    """The CPU path (dequantize for the call, quantize activations) against the oracle, fp32; and the oracle's
    quantization error against the unquantized block (reported in the assertion message)."""
    spec = _spec(q, n_group=1)
    args = random_moe_args(spec, T, torch.float32, seed=T)
    qargs, scales = quantize_moe_args(spec, args)
    out = torch.ops.moecomp.moe_forward(*qargs, spec.key, **scales)
    ref = reference.moe_forward(*qargs, spec, **scales)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-5
    bf = reference.moe_forward(*args, spec.replace(quant=None, shared=SharedExpertSpec(128, gate="sigmoid")))
    assert rel(ref, bf) < 0.1, f"quantization error {rel(ref, bf):.3f}"


def test_moe_experts_quantized():
    spec = _spec(QuantSpec(), shared=False)
    args = random_moe_args(spec, 7, torch.float32, seed=3)
    qargs, scales = quantize_moe_args(spec, args)
    x, w13, w2 = qargs[0], qargs[4], qargs[6]
    ids = torch.randint(0, 6, (7, 2))
    ids[:, 1] = (ids[:, 0] + 1) % 6
    wts = torch.rand(7, 2)
    out = torch.ops.moecomp.moe_experts(x, ids, wts, w13, None, w2, None, spec.key, scales["w13_scale"],
                                        scales["w2_scale"])
    ref = reference.experts(x, ids, wts, w13, None, w2, None, spec, w13_scale=scales["w13_scale"],
                            w2_scale=scales["w2_scale"])
    assert rel(out, ref) < 1e-5


def _call(spec, qargs, scales):
    return torch.ops.moecomp.moe_forward(*qargs, spec.key, **scales)


def test_bad_scales_name_the_scale_and_the_weight():
    spec = _spec(QuantSpec(), shared=True)
    qargs, scales = quantize_moe_args(spec, random_moe_args(spec, 3, torch.float32, seed=1))
    bad = dict(scales, w13_scale=scales["w13_scale"][:, :1])
    with pytest.raises(ValueError, match=r"w13_scale has shape \(6, 1, 2\).*w13 \(6, 384, 256\).*\(6, 4, 2\)"):
        _call(spec, qargs, bad)
    with pytest.raises(ValueError, match=r"w2_scale has dtype torch.float16.*w2's scales are torch.float32"):
        _call(spec, qargs, dict(scales, w2_scale=scales["w2_scale"].half()))
    with pytest.raises(ValueError, match=r"shared_w2_scale is required"):
        _call(spec, qargs, {k: v for k, v in scales.items() if k != "shared_w2_scale"})
    with pytest.raises(ValueError, match=r"a13_scale was given but the spec has no use for it"):
        _call(spec, qargs, dict(scales, a13_scale=torch.ones(6)))
    qa = list(qargs)
    qa[4] = qa[4].float()  # w13 not fp8
    with pytest.raises(ValueError, match=r"w13 has dtype torch.float32; .*float8_e4m3fn"):
        _call(spec, tuple(qa), scales)
    plain = spec.replace(quant=None, shared=None)
    a = random_moe_args(plain, 3, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"w13_scale was given but the spec has no use for it"):
        torch.ops.moecomp.moe_forward(*a, plain.key, w13_scale=scales["w13_scale"])


def test_fp8_linear_cpu_and_checks():
    q = QuantSpec()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * 0.1
    qw, s = q8.quantize(w, q)
    x = torch.randn(2, 5, 300, generator=g)
    b = torch.randn(200, generator=g)
    y = torch.ops.moecomp.fp8_linear(x, qw, s, b, None, q.key)
    ref = reference.quantized_linear(x.reshape(-1, 300), qw, s, q) + b
    assert y.shape == (2, 5, 200) and rel(y.reshape(-1, 200), ref) < 1e-6
    assert rel(y.reshape(-1, 200), x.reshape(-1, 300) @ w.T + b) < 0.1  # the quantization error, loosely
    with pytest.raises(ValueError, match=r"weight_scale has shape \(2, 3\); block scales for weight \(200, 300\) need"
                                         r" \(2, 3\)|weight_scale has shape"):
        torch.ops.moecomp.fp8_linear(x, qw, s[:, :2], b, None, q.key)
    with pytest.raises(ValueError, match="act_scale"):
        torch.ops.moecomp.fp8_linear(x, qw, s, b, torch.ones(1), q.key)
    with pytest.raises(ValueError, match="in_features"):
        torch.ops.moecomp.fp8_linear(x[..., :299], qw, s, b, None, q.key)


def test_fp8_ops_opcheck():
    """opcheck's schema test compares inputs with allclose, which has no fp8 kernel on CPU: the other utilities run,
    and the inputs' bytes are compared here instead (nothing mutated)."""
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    q = QuantSpec()
    qw, s = q8.quantize(torch.randn(128, 256) * 0.1, q)
    x = torch.randn(3, 256)
    before = qw.view(torch.uint8).clone()
    torch.library.opcheck(torch.ops.moecomp.fp8_linear, (x, qw, s, None, None, q.key), test_utils=utils)
    spec = _spec(q, shared=False)
    qargs, scales = quantize_moe_args(spec, random_moe_args(spec, 3, torch.float32, seed=2))
    w13 = qargs[4].view(torch.uint8).clone()
    torch.library.opcheck(torch.ops.moecomp.moe_forward, (*qargs, spec.key), scales, test_utils=utils)
    assert torch.equal(qw.view(torch.uint8), before) and torch.equal(qargs[4].view(torch.uint8), w13)


@pytest.mark.parametrize("scale,halves", [("block", 1), ("block", 2), ("channel", 1), ("tensor", 1)])
def test_quantize_in_chunks_is_the_same(scale, halves, monkeypatch):
    """Stacked experts quantized a few at a time (the bound on fp32 temporaries) give the same codes and scales as
    all at once: 7 experts in chunks of 2 (the last one shorter)."""
    from moecomp.core import quant as q8

    q = QuantSpec(scale=scale, block_n=32, block_k=64)
    w = torch.randn(7, 96, 200, generator=torch.Generator().manual_seed(1)) * 0.02
    whole = q8.quantize(w, q, halves)
    monkeypatch.setattr(q8, "QUANTIZE_CHUNK_BYTES", 2 * w[0].numel() * 4)
    parts = q8.quantize(w, q, halves)
    assert parts[0].shape == whole[0].shape and parts[1].shape == whole[1].shape
    assert torch.equal(parts[0].view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(parts[1], whole[1])
