"""The o_proj + residual add + RMSNorm launch (``kernels/linear_add_norm.py``, ``ops/linear_add_norm.launch``, the op
``moecomp::linear_add_norm``) on CPU: the kernel under the interpreter against the formula in fp64 (fp32 inputs: 1e-5
relative, the GEMV's and the norm's fp32 summation orders) at 1, 2 and 4 rows, N a multiple of the interpreter's
8-row tile or not, one program (no counter) or many, with and without a bias, Gemma's 1 + w, e4m3 weights; in fp16
(the interpreter rounds fp16 to nearest, as the GPU does) h equal bit for bit to the unfused skinny linear + add, n
within one fp16 unit of transformers' norm on that h (Llama / Qwen, Gemma and gpt-oss roundings). Outputs
NaN-poisoned first. The counter back at zero after each launch, and a wrong counter visibly breaking n. The op: its
CPU path against a plain-torch formula, bad arguments, opcheck, the counted fallbacks, its one-launch path equal to
the launcher."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERP, reason="runs the kernel under TRITON_INTERPRET=1 on CPU tensors")


def _mod():
    import moecomp.ops  # noqa: F401

    return sys.modules["moecomp.ops.linear_add_norm"]


FORMS = {"llama": (False, True), "gemma": (True, False), "gptoss": (False, False)}  # (offset, round_unit)


def _hf_norm(h, g, eps, form):
    """transformers' RMSNorm forms on h (Qwen3 / Llama, Gemma, gpt-oss), written as they are."""
    hf = h.to(torch.float32)
    unit = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if form == "llama":
        return g * unit.to(h.dtype)
    if form == "gemma":
        return (unit * (1.0 + g.float())).type_as(h)
    return (g * unit).to(h.dtype)


def _formula(x, W, b, r, g, eps, offset):
    """(h, n) in fp64 with no rounding: h = r + x W^T + b, n = h / rms(h) * (g or 1 + g)."""
    h = r.double() + x.double() @ W.double().T + (b.double() if b is not None else 0)
    gw = g.double() + 1 if offset else g.double()
    return h, h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * gw


def _nan(M, N, dt):
    return torch.full((M, N), float("nan"), dtype=dt), torch.full((M, N), float("nan"), dtype=dt)


def _rel(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


@needs_triton
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("N", [8, 200, 203])
@pytest.mark.parametrize("offset", [False, True])
def test_kernel_equals_formula_fp32(M, N, offset):
    lan = _mod()
    torch.manual_seed(M + N + offset)
    K, eps = 96, 1e-6
    x, W, r, g = torch.randn(M, K), torch.randn(N, K) * 0.1, torch.randn(M, N), torch.randn(N)
    b = torch.randn(N) if N != 200 else None
    counter = torch.zeros(1, dtype=torch.int32)
    out = _nan(M, N, x.dtype)
    h, n = lan.launch(x, W, b, None, None, r, g, eps, offset, not offset, counter=counter, out=out)
    assert h is out[0] and n is out[1]
    rh, rn = _formula(x, W, b, r, g, eps, offset)
    assert torch.isfinite(h).all() and torch.isfinite(n).all()
    assert _rel(h, rh) < 1e-5 and _rel(n, rn) < 1e-5
    assert int(counter) == 0  # the last program put it back (N = 8: one program, never touched)


@needs_triton
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("form", list(FORMS))
def test_kernel_rounding_fp16(M, form):
    """h = fp16(r + fp16(a)) bit for bit against the unfused skinny linear then torch's add (same K steps); n within
    one fp16 unit (2^-10 relative, 2^-14 absolute near zero) of transformers' norm of that form on that h: only the
    sum of squares' order and the rsqrt differ."""
    from moecomp.ops import skinny

    lan = _mod()
    torch.manual_seed(7 + M)
    dt, K, N, eps = torch.float16, 128, 72, 1e-6
    x, W = torch.randn(M, K).to(dt), (torch.randn(N, K) * 0.1).to(dt)
    b, r, g = torch.randn(N).to(dt), torch.randn(M, N).to(dt), (1 + 0.1 * torch.randn(N)).to(dt)
    h, n = lan.launch(x, W, b, None, None, r, g, eps, *FORMS[form], out=_nan(M, N, dt))
    h_ref = r + skinny.skinny_linear(x, W, b)
    assert torch.equal(h, h_ref)
    n_ref = _hf_norm(h_ref, g, eps, form)
    torch.testing.assert_close(n, n_ref, rtol=2.0 ** -10, atol=2.0 ** -14)
    assert torch.equal(lan.normalized(h_ref, g, eps, *FORMS[form]), n_ref)  # the op's torch path: the same roundings


@needs_triton
@pytest.mark.parametrize("scale", ["block", "channel"])
def test_kernel_equals_formula_fp8(scale):
    lan = _mod()
    torch.manual_seed(9)
    q = QuantSpec(scale=scale, activation="none", **(dict(block_n=32, block_k=32) if scale == "block" else {}))
    K, N, eps = 160, 100, 1e-5
    w, s = q8.quantize(torch.randn(N, K) * 0.05, q)
    x, r, g, b = torch.randn(2, K), torch.randn(2, N), torch.randn(N), torch.randn(N)
    h, n = lan.launch(x, w, b, s, q, r, g, eps, True, False, out=_nan(2, N, x.dtype))
    rh, rn = _formula(x, q8.dequantize(w, s, q), b, r, g, eps, True)
    assert _rel(h, rh) < 1e-5 and _rel(n, rn) < 1e-5


@needs_triton
def test_a_wrong_counter_breaks_n():
    """Not vacuous: a counter left at 1 makes a program that is not the last normalize while the last tile's h is
    still the NaN poison, so n holds NaNs; the counter with 0 gives a finite n."""
    lan = _mod()
    torch.manual_seed(1)
    x, W, r, g = torch.randn(1, 64), torch.randn(64, 64) * 0.1, torch.randn(1, 64), torch.randn(64)
    _, n = lan.launch(x, W, None, None, None, r, g, 1e-6, False, True, counter=torch.ones(1, dtype=torch.int32),
                      out=_nan(1, 64, x.dtype))
    assert not torch.isfinite(n).all()
    _, n = lan.launch(x, W, None, None, None, r, g, 1e-6, False, True, counter=torch.zeros(1, dtype=torch.int32),
                      out=_nan(1, 64, x.dtype))
    assert torch.isfinite(n).all()


def _torch_ref(x, W, b, r, g, eps, form):
    """The unfused computation written out: linear, add, transformers' norm of that form."""
    h = r + F.linear(x, W, b)
    return h, _hf_norm(h, g, eps, form)


def test_op_cpu_path_checks_and_opcheck():
    """On CPU: the unfused computation, equal to the plain-torch formula (fp32 and bf16), each call counted as
    unfused with its reason; bad arguments are ValueErrors naming them; opcheck passes (16-bit with and without a
    bias, e4m3 block scales)."""
    import moecomp
    from moecomp.core.counters import counters

    _mod()
    torch.manual_seed(0)
    op = torch.ops.moecomp.linear_add_norm
    for dt in (torch.float32, torch.bfloat16):
        x, W, b = torch.randn(2, 1, 24).to(dt), torch.randn(16, 24).to(dt), torch.randn(16).to(dt)
        r, g = torch.randn(2, 1, 16).to(dt), torch.randn(16).to(dt)
        for form in FORMS:
            moecomp.counters.clear()
            h, n = op(x, W, b, None, "", r, g, 1e-6, *FORMS[form])
            rh, rn = _torch_ref(x, W, b, r, g, 1e-6, form)
            assert torch.equal(h, rh) and torch.equal(n, rn)
            assert sum(counters["linear_add_norm"].values()) == 1
            assert "does not take the skinny kernel" in next(iter(counters["linear_add_norm"]))
    x, W, b, r, g = torch.randn(2, 1, 24), torch.randn(16, 24), torch.randn(16), torch.randn(2, 1, 16), torch.randn(16)
    base = dict(x=x, weight=W, bias=b, weight_scale=None, quant="", residual=r, norm_weight=g, eps=1e-6,
                offset=False, round_unit=True)
    bad = [
        (dict(residual=torch.randn(2, 1, 15)), "residual must be \\[2, 1, 16\\]"),
        (dict(residual=r.double()), "residual must be .* of torch.float32"),
        (dict(norm_weight=torch.randn(24)), "norm_weight must be a floating \\[16\\]"),
        (dict(eps=-1.0), "eps must be a finite number >= 0"),
        (dict(eps=float("inf")), "eps must be"),
        (dict(weight=torch.randn(16, 23)), "member 0: .*weight must be"),
        (dict(bias=torch.randn(15)), "bias must be \\[16\\]"),
        (dict(weight_scale=torch.ones(16)), "scales\\[0\\] must be None"),
        (dict(quant=QuantSpec(activation="static").key), "linear_add_norm: .*without a static activation scale"),
    ]
    for over, msg in bad:
        with pytest.raises(ValueError, match=msg):
            op(*{**base, **over}.values())
    torch.library.opcheck(op.default, tuple(base.values()))
    torch.library.opcheck(op.default, (x, W, None, None, "", r, g, 1e-5, True, False))
    q = QuantSpec(scale="block", activation="none", block_n=16, block_k=16)
    wq, sq = q8.quantize(torch.randn(16, 32) * 0.1, q)
    xq = torch.randn(1, 32)
    args = (xq, wq, None, sq, q.key, torch.randn(1, 16), g, 1e-6, False, True)
    h, n = op(*args)
    assert torch.equal(h, args[5] + torch.ops.moecomp.fp8_linear(xq, wq, sq, None, None, q.key))
    torch.library.opcheck(op.default, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@needs_triton
def test_op_one_launch_is_the_launchers_and_rows_limit(monkeypatch):
    """Where the linear takes the skinny kernel, the op is one launch whose outputs are the launcher's bit for bit
    (counted "fused"); with MOECOMP_FUSE_OPROJ_ROWS=1 a two-row call takes the unfused path (counted with the rows)."""
    import moecomp
    from moecomp.core.counters import counters
    from moecomp.ops import linear16
    from moecomp.testing import count_calls

    lan = _mod()
    monkeypatch.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)
    torch.manual_seed(2)
    x, W, r, g = torch.randn(2, 1, 64), torch.randn(40, 64) * 0.1, torch.randn(2, 1, 40), torch.randn(40)
    want = lan.launch(x.reshape(2, 64), W, None, None, None, r.reshape(2, 40), g, 1e-6, True, False)
    calls = count_calls(monkeypatch, lan, ["launch"])
    moecomp.counters.clear()
    h, n = torch.ops.moecomp.linear_add_norm(x, W, None, None, "", r, g, 1e-6, True, False)
    assert calls == ["launch"] and dict(counters["linear_add_norm"]) == {"fused": 1}
    assert torch.equal(h.reshape(2, 40), want[0]) and torch.equal(n.reshape(2, 40), want[1])
    monkeypatch.setenv("MOECOMP_FUSE_OPROJ_ROWS", "1")
    moecomp.counters.clear()
    h, n = torch.ops.moecomp.linear_add_norm(x, W, None, None, "", r, g, 1e-6, True, False)
    assert calls == ["launch"]
    assert list(counters["linear_add_norm"]) == ["unfused: 2 rows (one launch takes 1..1, MOECOMP_FUSE_OPROJ_ROWS)"]
    rh = r + torch.ops.moecomp.skinny_linear(x, W, None)  # the linear through its own op (the skinny kernel)
    assert torch.equal(h, rh) and torch.equal(n, _hf_norm(rh, g, 1e-6, "gemma"))
