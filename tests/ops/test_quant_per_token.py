"""Per-token dynamic activation quantization (``QuantSpec(activation="dynamic", act_group=0)``: one scale per token
over the whole row, compressed-tensors' FP8-dynamic "token" strategy): the spec's checks, the oracle's own formula
(``moecomp.oracle.reference_quant``) by value and against the op's codec (``moecomp.core.quant``), the CPU op
(``moe_forward`` with routed and shared experts, ``moe_experts``, ``fp8_linear``) against the oracle, and the Triton
path, which runs a per-token spec weight-only (``tuning.fp8_mode``).

Tolerances: the CPU op against the oracle on the same quantized tensors, fp32, within 1e-5 relative (the same
dequantized values and codes, different summation order); the Triton path (interpreter, fp32) against the weight-only
oracle within 3e-5 (tests/ops/test_fp8_op.py's bound). Per-token and per-128-group quantization of the small group
must differ by more than 0.1 relative on rows whose groups differ 10^5-fold in size (else a test could not tell them
apart).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.oracle import reference, reference_quant
from moecomp.ops import tuning
from moecomp.testing import quantize_moe_args, random_moe_args

TOKEN = QuantSpec(scale="channel", act_group=0)  # compressed-tensors FP8-dynamic: channel weights, per-token acts


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bad,match", [
    (dict(act_group=-1), "act_group=-1"), (dict(act_group=64), "act_group=64"),
    (dict(act_group=True), "act_group=True"), (dict(act_group=0, activation="static"), "act_group=0"),
    (dict(act_group=0, activation="none"), "act_group=0"),
])
def test_bad_per_token_specs_name_act_group(bad, match):
    with pytest.raises(SpecError, match=match):
        QuantSpec(scale="channel", **bad).validate()
    with pytest.raises(ValueError, match="act_group"):  # (SpecError is a ValueError)
        MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, quant=QuantSpec(**bad))


def test_per_token_spec_round_trips():
    assert TOKEN.per_token and not QuantSpec().per_token and not QuantSpec(activation="none").per_token
    assert QuantSpec.from_key(TOKEN.key) == TOKEN
    s = MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, quant=TOKEN)
    assert MoESpec.from_key(s.key) == s


def test_per_token_formula_by_value():
    """s = max|x over the row| / 448 (1e-10 at least), x_q = e4m3(x * (1 / s)) * s: the oracle by value, and the op's
    codec gives the same scales and codes."""
    x = torch.zeros(3, 300)
    x[0, 5], x[0, 250], x[1, 7] = 3.3, -896.0, 1e-3
    s = reference_quant.per_token_scales(x)
    assert torch.equal(s, torch.tensor([[896.0], [1e-3], [1e-10]]) / 448)
    fq = reference_quant.fake_quant_act(x, TOKEN)
    assert fq[0, 250] == -896.0 and fq[1, 7] == 1e-3 and fq[2].abs().sum() == 0
    assert fq[0, 5] == 3.25  # 3.3 / 2 = 1.65 rounds to e4m3's 1.625 (per 128 columns it would be 3.3 / 3.3 * 3.3)
    q, s2 = q8.quantize_act(x, TOKEN)
    assert s2.shape == (3, 1) and torch.equal(s2, s)
    assert torch.equal(q8.fake_quant_act(x, TOKEN), fq)


def test_per_token_differs_from_per_group():
    """On rows whose 128-column groups differ 10^5-fold, one scale per row puts the small group among e4m3's subnormals: the two
    schemes give different numbers (a spec read as the other would show)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g) * 0.01
    x[:, 128:] *= 1e5
    tok = reference_quant.fake_quant_act(x, TOKEN)
    grp = reference_quant.fake_quant_act(x, dataclasses.replace(TOKEN, act_group=128))
    assert rel(tok[:, :128], x[:, :128]) > 5 * rel(grp[:, :128], x[:, :128])
    assert rel(tok[:, :128], grp[:, :128]) > 0.1


def _spec(shared: bool = True) -> MoESpec:
    sh = SharedExpertSpec(96, gate="sigmoid", quant=TOKEN) if shared else None
    return MoESpec(num_experts=6, top_k=2, hidden_size=256, intermediate_size=160, quant=TOKEN, shared=sh)


@pytest.mark.parametrize("T", [1, 9])
def test_cpu_op_matches_oracle(T, poison):
    spec = _spec()
    args = random_moe_args(spec, T, torch.float32, seed=T)
    qargs, scales = quantize_moe_args(spec, args)
    out = torch.ops.moecomp.moe_forward(*qargs, spec.key, **scales)
    ref = reference.moe_forward(*qargs, spec, **scales)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    grp = spec.replace(quant=dataclasses.replace(TOKEN, act_group=128),
                       shared=dataclasses.replace(spec.shared, quant=dataclasses.replace(TOKEN, act_group=128)))
    assert rel(reference.moe_forward(*qargs, grp, **scales), ref) > 0  # the scheme reaches the numbers


def test_moe_experts_and_fp8_linear_per_token(poison):
    spec = _spec(shared=False)
    qargs, scales = quantize_moe_args(spec, random_moe_args(spec, 7, torch.float32, seed=3))
    x, w13, w2 = qargs[0], qargs[4], qargs[6]
    g = torch.Generator().manual_seed(1)
    ids = torch.argsort(torch.rand(7, 6, generator=g), dim=1)[:, :2]
    wts = torch.rand(7, 2, generator=g)
    out = torch.ops.moecomp.moe_experts(x, ids, wts, w13, None, w2, None, spec.key, scales["w13_scale"],
                                        scales["w2_scale"])
    ref = reference.experts(x, ids, wts, w13, None, w2, None, spec, **scales)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    w = torch.randn(200, 300, generator=g) * 0.1
    qw, s = q8.quantize(w, TOKEN)
    xl = torch.randn(2, 5, 300, generator=g)
    y = torch.ops.moecomp.fp8_linear(xl, qw, s, None, None, TOKEN.key)
    want = reference.quantized_linear(xl.reshape(-1, 300), qw, s, TOKEN)
    assert rel(y.reshape(-1, 200), want) < 1e-6


def test_per_token_opcheck():
    """opcheck without its schema test (allclose has no fp8 kernel on CPU); the inputs' bytes are unchanged."""
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    qw, s = q8.quantize(torch.randn(128, 256) * 0.1, TOKEN)
    before = qw.view(torch.uint8).clone()
    torch.library.opcheck(torch.ops.moecomp.fp8_linear, (torch.randn(3, 256), qw, s, None, None, TOKEN.key),
                          test_utils=utils)
    spec = _spec(shared=False)
    qargs, scales = quantize_moe_args(spec, random_moe_args(spec, 3, torch.float32, seed=2))
    torch.library.opcheck(torch.ops.moecomp.moe_forward, (*qargs, spec.key), scales, test_utils=utils)
    assert torch.equal(qw.view(torch.uint8), before)


def test_triton_runs_per_token_weight_only(monkeypatch, poison):
    """The kernels quantize activations in 128-column groups only: a per-token spec runs w8a16 whatever the token
    count, the forced mode or a config says, and matches the weight-only oracle (interpreter, fp32)."""
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")
    assert [tuning.fp8_mode(TOKEN, T, {"fp8": "w8a8"}) for T in (1, 4096)] == ["w8a16", "w8a16"]
    monkeypatch.delenv("MOECOMP_FP8_MODE")
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, quant=TOKEN)
    qargs, scales = quantize_moe_args(spec, random_moe_args(spec, 5, torch.float32, seed=5))
    out = torch.ops.moecomp.moe_forward(*qargs, spec.key, **scales)
    ref = reference.moe_forward(*qargs, spec.replace(quant=q8.weight_only(TOKEN)), **scales)
    assert torch.isfinite(out).all() and rel(out, ref) < 3e-5
