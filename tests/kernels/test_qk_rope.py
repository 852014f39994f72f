"""``moecomp::qk_norm_rope_cache`` (``ops/qk_rope.py``, ``kernels/qk_rope.py``) on CPU against transformers' own
steps written here in plain torch: per-head RMSNorm (Qwen3's ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(dt)``, or
Gemma's ``(x32 * rsqrt(..) * (1 + w32)).to(dt)``), ``q * cos + rotate_half(q) * sin`` in the model dtype, and
``index_copy_`` of k / v into the cache; gpt-oss's chunked form (cos / sin of D / 2) against its
``cat(x1 c - x2 s, x2 c + x1 s)``. GQA head counts, B 1 and 3, with and without the norms; the kernel under the
interpreter and the op's torch path. Outputs and caches NaN-poisoned first (cache positions not written must stay
NaN). Tolerances: fp32 1e-5 relative to the largest value (the kernel's 1 / sqrt against torch.rsqrt and fp32
sums); bf16 2 units of roundoff (2^-7) of the largest value (one rounding step landing the other way, twice).
"""

from __future__ import annotations

import os

import pytest
import torch

import moecomp.ops  # noqa: F401

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERP, reason="runs the kernel under TRITON_INTERPRET=1 on CPU tensors")
EPS = 1e-6


def _norm(x, w, offset):
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    if offset:
        return (x32 * r * (1.0 + w.float())).type_as(x)
    return w * (x32 * r).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rope(x, cos, sin):  # x [B, H, T, D], cos / sin [B, T, D] or [B, T, D / 2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if c.shape[-1] == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _reference(q, k, v, qw, kw, offset, cos, sin, kc, vc, idx, D):
    B, T = q.shape[:2]
    heads = lambda t: t.view(B, T, -1, D)  # noqa: E731  [B, T, H, D]
    qs, ks = heads(q), heads(k)
    if qw is not None:
        qs = _norm(qs, qw, offset)
    if kw is not None:
        ks = _norm(ks, kw, offset)
    qe = _rope(qs.transpose(1, 2), cos, sin)
    ke = _rope(ks.transpose(1, 2), cos, sin)
    kc.index_copy_(2, idx, ke)
    vc.index_copy_(2, idx, heads(v).transpose(1, 2))
    return qe


def _case(B, T, Hq, Hkv, D, L, dt, norms, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    q, k, v = r(B, T, Hq * D), r(B, T, Hkv * D), r(B, T, Hkv * D)
    qw, kw = (r(D), r(D)) if norms else (None, None)
    ang = torch.rand(B, T, D // 2 if half else D // 2, generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    if not half:
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    idx = torch.randperm(L, generator=g)[:T]
    return q, k, v, qw, kw, cos.to(dt), sin.to(dt), idx


def _run(backend, monkeypatch, case, offset, L, D):
    q, k, v, qw, kw, cos, sin, idx = case
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    B, Hkv = q.shape[0], k.shape[-1] // D
    kc = torch.full((B, Hkv, L, D), float("nan"), dtype=q.dtype)
    vc = kc.clone()
    out = torch.ops.moecomp.qk_norm_rope_cache(q, k, v, qw, kw, EPS, offset, cos, sin, kc, vc, idx)
    return out, kc, vc


def _check(got, ref, dt):
    tol = 1e-5 if dt == torch.float32 else 2 * 2.0 ** -7
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.isnan(), b.isnan())  # the positions not written stay NaN, and only those
        scale = float(b.nan_to_num(0).abs().max())
        assert float((a - b).float().nan_to_num(0).abs().max()) <= tol * scale


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,norms,offset,half,dt", [
    (1, 1, 4, 2, 16, True, False, False, torch.float32),
    (3, 1, 8, 2, 32, True, False, False, torch.bfloat16),
    (3, 1, 4, 4, 16, False, False, False, torch.float32),
    (1, 1, 6, 2, 64, False, False, True, torch.bfloat16),
    (3, 2, 4, 1, 16, True, True, False, torch.float32),
    (3, 1, 4, 2, 24, True, True, False, torch.bfloat16),  # D not a power of two: masked lanes
])
def test_op_against_transformers_steps(backend, B, T, Hq, Hkv, D, norms, offset, half, dt, monkeypatch):
    L = 12
    case = _case(B, T, Hq, Hkv, D, L, dt, norms, half)
    q, k, v, qw, kw, cos, sin, idx = case
    kc = torch.full((B, Hkv, L, D), float("nan"), dtype=dt)
    vc = kc.clone()
    ref = (_reference(q, k, v, qw, kw, offset, cos, sin, kc, vc, idx, D), kc, vc)
    got = _run(backend, monkeypatch, case, offset, L, D)
    _check(got, ref, dt)
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=0, equal_nan=True)  # v: a copy


def test_op_bad_arguments():
    q, k, v = torch.randn(1, 1, 64), torch.randn(1, 1, 32), torch.randn(1, 1, 32)
    c = torch.randn(1, 1, 16)
    kc = torch.zeros(1, 2, 8, 16)
    op = torch.ops.moecomp.qk_norm_rope_cache
    with pytest.raises(ValueError, match="v must be"):
        op(q, k, v[..., :16], None, None, EPS, False, c, c, kc, kc.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="q_weight"):
        op(q, k, v, torch.ones(8), None, EPS, False, c, c, kc, kc.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="cos must be"):
        op(q, k, v, None, None, EPS, False, c[..., :5], c, kc, kc.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="index must be"):
        op(q, k, v, None, None, EPS, False, c, c, kc, kc.clone(), torch.tensor([0, 1]))


@pytest.mark.parametrize("T,norms", [(1, True), (2, False)])
def test_opcheck(T, norms):
    case = _case(2, T, 4, 2, 16, 8, torch.float32, norms, False)
    q, k, v, qw, kw, cos, sin, idx = case
    kc, vc = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    torch.library.opcheck(torch.ops.moecomp.qk_norm_rope_cache, (q, k, v, qw, kw, EPS, False, cos, sin, kc, vc, idx))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dt,norms,half", [(torch.bfloat16, True, False), (torch.bfloat16, False, True),
                                           (torch.float16, True, False)])
def test_op_gpu(dt, norms, half):
    """The kernel on the GPU against transformers' steps (Qwen3-30B-A3B's heads: 32 q, 4 kv, D 128; B 1 and 32)."""
    for B in (1, 32):
        L = 256
        case = [t.cuda() if t is not None else None for t in _case(B, 1, 32, 4, 128, L, dt, norms, half)]
        q, k, v, qw, kw, cos, sin, idx = case
        kc = torch.full((B, 4, L, 128), float("nan"), dtype=dt, device="cuda")
        vc = kc.clone()
        ref = (_reference(q, k, v, qw, kw, False, cos, sin, kc, vc, idx, 128), kc, vc)
        kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
        out = torch.ops.moecomp.qk_norm_rope_cache(q, k, v, qw, kw, EPS, False, cos, sin, kc2, vc2, idx)
        _check((out, kc2, vc2), ref, torch.bfloat16)
