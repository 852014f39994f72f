"""The RMSNorm prologue of the skinny linears (``kernels/skinny_norm.py``, ``ops/skinny.skinny_norm_group``, the op
``moecomp::norm_group``), on CPU: the kernel under the interpreter against the formula in fp64 (fp32 inputs: 1e-5
relative, the GEMV's and the norm's fp32 summation order), with and without the residual, Gemma's 1 + w, e4m3
weights; in bf16 against transformers' RMSNorm-then-linear within the rounding bound that ``ops/norm_group.py``
states. Outputs NaN-poisoned first. The op: its CPU path, bad arguments, opcheck; its Triton path equals the
launcher's.
"""

from __future__ import annotations

import os

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERP, reason="runs the kernels under TRITON_INTERPRET=1 on CPU tensors")


def _formula(x, r, g, eps, offset, Ws, bs):
    """The fused computation in fp64: [linear(h / rms(h) * gw, W_i, b_i)], h = x + r rounded to x's dtype."""
    h = (x + r if r is not None else x).double()
    gw = g.double() + 1 if offset else g.double()
    a = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * gw
    return [a @ W.double().T + (b.double() if b is not None else 0) for W, b in zip(Ws, bs)], a


def _nan(M, ws, dt):
    return [torch.full((M, w.shape[0]), float("nan"), dtype=dt) for w in ws]


def _rel(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


@needs_triton
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [False, True])
def test_kernel_equals_formula_16bit(M, residual, offset):
    from moecomp.ops.skinny import skinny_norm_group

    torch.manual_seed(M + 2 * residual + 4 * offset)
    K, eps = 200, 1e-6  # K no multiple of BLOCK_K: the tail is masked
    sizes = (72, 24, 16) if M != 2 else (40,)  # q / k / v-like, and a group of one
    ws = [torch.randn(n, K) * 0.05 for n in sizes]
    bs = [torch.randn(n) if i % 2 == 0 else None for i, n in enumerate(sizes)]
    x, g = torch.randn(M, K), torch.randn(K)
    r = torch.randn(M, K) if residual else None
    outs = _nan(M, ws, x.dtype)
    ys, h = skinny_norm_group(x, r, g, eps, offset, ws, bs, outs=outs)
    assert all(y is o for y, o in zip(ys, outs))
    refs, _ = _formula(x, r, g, eps, offset, ws, bs)
    for y, ref in zip(ys, refs):
        assert torch.isfinite(y).all() and _rel(y, ref) < 1e-5
    assert (h is None) == (not residual)
    if residual:
        assert torch.equal(h, x + r)


@needs_triton
@pytest.mark.parametrize("scale", ["block", "channel"])
def test_kernel_equals_formula_fp8(scale):
    from moecomp.ops.skinny import skinny_norm_group

    torch.manual_seed(5)
    q = QuantSpec(scale=scale, activation="none", **(dict(block_n=32, block_k=32) if scale == "block" else {}))
    K, eps = 160, 1e-5
    wq = [q8.quantize(torch.randn(n, K) * 0.05, q) for n in (64, 32)]
    x, r, g = torch.randn(2, K), torch.randn(2, K), torch.randn(K)
    outs = _nan(2, [w for w, _ in wq], x.dtype)
    ys, h = skinny_norm_group(x, r, g, eps, True, [w for w, _ in wq], None, [s for _, s in wq], q, outs=outs)
    refs, _ = _formula(x, r, g, eps, True, [q8.dequantize(w, s, q) for w, s in wq], [None, None])
    for y, ref in zip(ys, refs):
        assert torch.isfinite(y).all() and _rel(y, ref) < 1e-5
    assert torch.equal(h, x + r)


def _hf_style(h, g, eps, W):
    """transformers' Llama / Qwen RMSNorm, then the linear, in h's dtype."""
    hf = h.float()
    n = (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)).to(h.dtype)
    return torch.nn.functional.linear(g * n, W)


@pytest.mark.parametrize("path", ["fallback", pytest.param("kernel", marks=needs_triton)])
def test_bf16_rounding_bound_against_transformers(path):
    """bf16: the op's two paths against transformers' norm-then-linear. Both differ by dropping transformers'
    roundings of the normalized row (two, each <= u relative) and by their own output rounding: |y - y_hf| <=
    2.5u * sum_k |a_k W_nk| + 2u |y_exact| (u = 2^-8; the interpreter's fp32 -> bf16 store truncates, one more u
    than the GPU's round-to-nearest), with a = h * g / rms(h) exact. The residual h is x + r in bf16 (within one
    rounding, the interpreter's store again)."""
    import moecomp.ops  # noqa: F401
    from moecomp.ops import linear16

    torch.manual_seed(11)
    dt, u, K, eps = torch.bfloat16, 2.0 ** -8, 256, 1e-6
    x, r = torch.randn(2, 1, K).to(dt), torch.randn(2, 1, K).to(dt)
    g = (1 + 0.1 * torch.randn(K)).to(dt)
    ws = [(torch.randn(n, K) * 0.05).to(dt) for n in (64, 32)]
    with pytest.MonkeyPatch.context() as mp:
        if path == "kernel":
            mp.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)
        out = torch.ops.moecomp.norm_group(x, r, g, eps, False, ws, [None, None], [None, None], "")
    ys, h = out[:2], out[2]
    hh = x + r
    assert torch.allclose(h.float(), hh.float(), rtol=2 * u, atol=0)
    refs, a = _formula(x, r, g, eps, False, ws, [None, None])
    for y, W, ref in zip(ys, ws, refs):
        y_hf = _hf_style(hh, g, eps, W).double()
        bound = 2.5 * u * (a.abs() @ W.double().abs().T) + 2 * u * ref.abs()
        assert ((y.double() - y_hf).abs() <= bound).all()
        # not vacuous: the paths do differ, and a wrong norm (the 1 + g form) breaks the bound
        assert not torch.equal(y.double(), y_hf)
        wrong = _hf_style(hh, g + 1, eps, W).double()
        assert not ((wrong - y_hf).abs() <= bound).all()


def test_op_cpu_path_checks_and_opcheck():
    """On CPU: the norm (``norm_group.normalized``, rounded once to x's dtype) then each member's own op exactly;
    bad arguments are ValueErrors naming them; opcheck passes (16-bit, with and without the residual; e4m3)."""
    import moecomp.ops  # noqa: F401
    from moecomp.ops.norm_group import normalized

    torch.manual_seed(0)
    op = torch.ops.moecomp.norm_group
    x, r, g = torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.randn(16)
    ws, bs = [torch.randn(8, 16), torch.randn(4, 16)], [torch.randn(8), None]
    out = op(x, r, g, 1e-6, True, ws, bs, [None, None], "")
    assert [tuple(y.shape) for y in out] == [(2, 1, 8), (2, 1, 4), (2, 1, 16)]
    n = normalized(x + r, g, 1e-6, True)
    assert all(torch.equal(y, torch.nn.functional.linear(n, w, b)) for y, w, b in zip(out, ws, bs))
    assert torch.equal(out[2], x + r)
    assert len(op(x, None, g, 1e-6, False, ws[:1], [None], [None], "")) == 1  # a group of one, no h
    bad = [
        (dict(norm_weight=torch.randn(15)), "norm_weight must be a floating \\[16\\]"),
        (dict(residual=torch.randn(2, 1, 15)), "residual must have x's shape"),
        (dict(residual=r.double()), "residual must have x's shape .* dtype"),
        (dict(eps=-1.0), "eps must be a finite number >= 0"),
        (dict(eps=float("nan")), "eps must be"),
        (dict(weights=[], biases=[], scales=[]), "weights must hold 1..4"),
        (dict(weights=ws * 3, biases=[None] * 6, scales=[None] * 6), "weights must hold 1..4"),
        (dict(biases=[None]), "biases and scales must have one entry per weight"),
        (dict(weights=[ws[0], torch.randn(4, 15)]), "member 1: .*weight must be"),
        (dict(scales=[torch.ones(8), None]), "scales\\[0\\] must be None"),
        (dict(quant=QuantSpec(activation="static").key), "norm_group: .*without a static activation scale"),
    ]
    base = dict(x=x, residual=r, norm_weight=g, eps=1e-6, offset=False, weights=ws, biases=[None, None],
                scales=[None, None], quant="")
    for over, msg in bad:
        with pytest.raises(ValueError, match=msg):
            op(*{**base, **over}.values())
    torch.library.opcheck(op.default, (x, r, g, 1e-6, False, ws, bs, [None, None], ""))
    torch.library.opcheck(op.default, (x, None, g, 1e-5, True, ws[:1], [None], [None], ""))
    q = QuantSpec(scale="block", activation="none", block_n=32, block_k=32)
    wq = [q8.quantize(torch.randn(n, 64) * 0.05, q) for n in (64, 32)]
    xq, gq = torch.randn(1, 64), torch.randn(64)
    args = (xq, xq.clone(), gq, 1e-6, False, [w for w, _ in wq], [None, None], [s for _, s in wq], q.key)
    nq = normalized(xq + xq, gq, 1e-6, False)
    for y, (w, s) in zip(op(*args), wq):
        assert torch.equal(y, torch.ops.moecomp.fp8_linear(nq, w, s, None, None, q.key))
    torch.library.opcheck(op.default, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@needs_triton
@pytest.mark.parametrize("residual", [False, True])
def test_op_triton_path_is_the_launchers(monkeypatch, residual):
    """Where every member would take the skinny kernel, the op is one ``skinny_norm_group`` launch, its outputs the
    launcher's bit for bit."""
    import moecomp.ops  # noqa: F401
    from moecomp.ops import linear16, skinny
    from moecomp.testing import count_calls

    monkeypatch.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)
    torch.manual_seed(2)
    x, g = torch.randn(2, 1, 64), torch.randn(64)
    r = torch.randn(2, 1, 64) if residual else None
    ws = [torch.randn(n, 64) * 0.1 for n in (32, 16, 16)]
    want, h = skinny.skinny_norm_group(x.reshape(2, 64), None if r is None else r.reshape(2, 64), g, 1e-6, False,
                                       ws)
    calls = count_calls(monkeypatch, skinny, ["skinny_norm_group"])
    out = torch.ops.moecomp.norm_group(x, r, g, 1e-6, False, ws, [None] * 3, [None] * 3, "")
    assert calls == ["skinny_norm_group"] and len(out) == 3 + residual
    assert all(torch.equal(y.reshape(2, -1), w) for y, w in zip(out, want))
    if residual:
        assert torch.equal(out[3].reshape(2, 64), h)
