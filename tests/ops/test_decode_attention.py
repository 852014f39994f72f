"""torch.ops.moecomp.decode_attention against a float64 softmax attention (repeated K / V, explicit mask; with
attention sinks: one more logit per head in the denominator, written out as sums of exponentials), on the torch path
and on the Triton kernels under the interpreter (fp32 / fp16 on CPU; bf16 on the GPU in test_gpu and
tests/generate/test_sinks_gpu.py). Outputs are NaN-poisoned (the ``poison`` fixture) and every input is fresh
random."""

import pytest
import torch

from moecomp.ops import attention


def _ref(q, k, v, keep, n, scale, sinks=None, window=0):
    """float64: out[b, i] = sum_j e_j v_j / (sum_j e_j + e_sink), e_j = exp(s_j - m), m the max over the scores that
    take part and the sink (no sink: e_sink = 0); positions j < n (and j >= n - window with a window) where keep."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kk, vv = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    pos = torch.arange(L)
    ok = keep & (pos < n) & ((pos >= n - window) if window else True)  # [B, L]
    s = torch.einsum("bhd,bhld->bhl", q.double(), kk) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))  # [B, Hq, L]
    m = s.amax(-1)  # [B, Hq]
    sink = sinks.double()[None].expand(B, Hq) if sinks is not None else torch.full((B, Hq), float("-inf"))
    m = torch.maximum(m, sink).clamp_min(-1e300)  # a row with nothing taking part and no sink: m finite, e = 0
    e = torch.exp(s - m[..., None])
    den = e.sum(-1) + torch.exp(sink - m)
    return torch.einsum("bhl,bhld->bhd", e, vv) / torch.where(den == 0, 1.0, den)[..., None]


def _inputs(B, Hq, Hkv, L, Dk, Dv, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Dk, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, Dk, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, Dv, generator=g).to(dtype)
    keep = torch.rand(B, L, generator=g) > 0.2
    keep[:, n - 1] = True  # the current token always takes part
    return q, k, v, keep, torch.tensor(n)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("B,Hq,Hkv,L,Dk,Dv,n", [
    (1, 8, 2, 70, 16, 16, 37),  # GQA 4, n inside the second block
    (3, 4, 4, 200, 24, 16, 200),  # MHA, Dk != Dv (MLA-style), non-power-of-2 dims, every position
    (2, 6, 1, 130, 32, 32, 1),  # MQA, only the first position
])
def test_matches_sdpa(backend, dtype, tol, B, Hq, Hkv, L, Dk, Dv, n, monkeypatch, poison):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    q, k, v, keep, nn = _inputs(B, Hq, Hkv, L, Dk, Dv, n, dtype, seed=L + n)
    scale = Dk ** -0.5
    out = torch.ops.moecomp.decode_attention(q, k, v, keep, nn, scale)
    ref = _ref(q, k, v, keep, n, scale)
    assert out.shape == (B, Hq, Dv) and out.dtype == dtype and torch.isfinite(out).all()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= tol


def test_positions_beyond_n_are_never_read(monkeypatch):
    """Garbage (NaN) in cache positions >= n must not reach the output."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    q, k, v, keep, n = _inputs(2, 4, 2, 96, 16, 16, 40, torch.float32, seed=1)
    k[:, :, 40:] = float("nan")
    v[:, :, 40:] = float("nan")
    out = torch.ops.moecomp.decode_attention(q, k, v, keep, n, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _ref(q, k.nan_to_num(), v.nan_to_num(), keep, 40, 0.25),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("B,Hq,Hkv,L,n,window,sink_dtype", [
    (2, 8, 2, 150, 131, 0, torch.float32),  # GQA 4, full layer, sinks in fp32 (gpt-oss keeps them in the model dtype)
    (1, 4, 4, 200, 170, 70, "model"),  # MHA, window 70 crossing a block border, sinks in the model's dtype
    (3, 6, 2, 96, 5, 8, torch.float32),  # window longer than what is written (n 5 < 8): everything written is read
])
def test_sinks_and_window(backend, dtype, tol, B, Hq, Hkv, L, n, window, sink_dtype, monkeypatch, poison):
    """gpt-oss attention: sinks (one logit per query head with no value) and a sliding window (positions below
    n - window not read), over several splits of the cache; sinks of both signs, some larger than every score."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    q, k, v, keep, nn = _inputs(B, Hq, Hkv, L, 16, 16, n, dtype, seed=L + n + window)
    sinks = (torch.randn(Hq, generator=torch.Generator().manual_seed(n)) * 3).to(
        dtype if sink_dtype == "model" else sink_dtype)
    scale = 16 ** -0.5
    out = torch.ops.moecomp.decode_attention(q, k, v, keep, nn, scale, sinks, window)
    ref = _ref(q, k, v, keep, n, scale, sinks, window)
    assert out.shape == (B, Hq, 16) and out.dtype == dtype and torch.isfinite(out).all()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= tol
    # the sinks matter here, and the window where it is shorter than what is written: without them the output differs
    def off(other):
        return float((other - ref).abs().max() / ref.abs().max())

    assert off(_ref(q, k, v, keep, n, scale, None, window)) > 10 * tol
    assert not 0 < window < n or off(_ref(q, k, v, keep, n, scale, sinks, 0)) > 10 * tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_reads_only_the_window_and_empty_rows_give_zeros(backend, monkeypatch):
    """Triton: positions below n - window (and from n on) hold NaN: they are never read (the torch path reads the
    whole cache and masks). A row with no position taking part gives zeros, with sinks (the sink takes all the weight
    and has no value) or without."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    q, k, v, keep, n = _inputs(2, 4, 2, 160, 16, 16, 150, torch.float32, seed=3)
    if backend == "triton":
        for t in (k, v):
            t[:, :, :150 - 20] = float("nan")
            t[:, :, 150:] = float("nan")
    sinks = torch.randn(4)
    keep[1] = False  # row 1: nothing to attend to
    out = torch.ops.moecomp.decode_attention(q, k, v, keep, n, 0.25, sinks, 20)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(torch.ops.moecomp.decode_attention(q, k, v, keep, n, 0.25, None, 20)[1], out[1])
    torch.testing.assert_close(out.double(), _ref(q, k.nan_to_num(), v.nan_to_num(), keep, 150, 0.25, sinks, 20),
                               rtol=1e-5, atol=1e-6)


def test_opcheck_and_bad_inputs():
    q, k, v, keep, n = _inputs(2, 4, 2, 33, 8, 8, 20, torch.float32, seed=2)
    torch.library.opcheck(torch.ops.moecomp.decode_attention.default, (q, k, v, keep, n, 0.5))
    torch.library.opcheck(torch.ops.moecomp.decode_attention.default, (q, k, v, keep, n, 0.5, torch.randn(4), 7))
    with pytest.raises(ValueError, match="sinks must be a float"):
        torch.ops.moecomp.decode_attention(q, k, v, keep, n, 0.5, torch.randn(2))
    with pytest.raises(ValueError, match="window must be >= 0"):
        torch.ops.moecomp.decode_attention(q, k, v, keep, n, 0.5, None, -1)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        torch.ops.moecomp.decode_attention(q[:, :3], k, v, keep, n, 0.5)
    with pytest.raises(ValueError, match="keep must be a bool"):
        torch.ops.moecomp.decode_attention(q, k, v, keep.long(), n, 0.5)
    with pytest.raises(ValueError, match="q must be"):
        torch.ops.moecomp.decode_attention(q[:, :, None], k, v, keep, n, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hq,Hkv,L,Dk,Dv,n", [
    (1, 32, 4, 768, 128, 128, 530),  # Qwen3-30B-A3B decode, batch 1
    (32, 32, 4, 768, 128, 128, 576),  # batch 32
    (4, 128, 128, 640, 192, 128, 600),  # DeepSeek-V3 MLA as transformers caches it (Dk 192, Dv 128)
    (128, 16, 16, 768, 128, 128, 100),  # Qwen1.5-MoE, batch 128
])
def test_cuda_bf16_and_graph_replay(B, Hq, Hkv, L, Dk, Dv, n):
    q, k, v, keep, nn = (t.cuda() for t in _inputs(B, Hq, Hkv, L, Dk, Dv, n, torch.bfloat16, seed=B))
    scale = Dk ** -0.5
    ref = _ref(q.cpu(), k.cpu(), v.cpu(), keep.cpu(), n, scale).cuda()
    out = torch.ops.moecomp.decode_attention(q, k, v, keep, nn, scale)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = torch.ops.moecomp.decode_attention(q, k, v, keep, nn, scale)
    for m in (n // 2, n):  # the valid length is read on the device at replay
        nn.fill_(m)
        q.normal_()
        static.fill_(float("nan"))
        g.replay()
        want = _ref(q.cpu(), k.cpu(), v.cpu(), keep.cpu(), m, scale).cuda()
        assert float((static.double() - want).abs().max() / want.abs().max()) <= 1e-2
