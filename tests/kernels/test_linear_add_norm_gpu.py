"""The o_proj + residual add + post-attention RMSNorm launch on CUDA at Qwen3-30B-A3B's sizes (o_proj 4096 -> 2048, no
bias) and gpt-oss-120b's (4096 -> 2880, a bias): ``moecomp::linear_add_norm`` against the unfused path it replaces
(the o_proj's own op, torch's add, transformers' norm), bf16 at 1 and 2 rows and e4m3 128x128 blocks weight-only at
1, 2 and 4 rows, transformers' Llama / Qwen, Gemma (1 + w) and gpt-oss norm roundings. h equal bit for bit (the
skinny kernel's K steps, the add's one rounding), n within one bf16 unit (2^-7 relative, 2^-10 absolute near zero:
the sum of squares' order and the rsqrt); one ``linear_add_norm_kernel`` launch and nothing else; at 4 rows in bf16
(the linear is cuBLAS's there) the unfused path, counted. A CUDA-graph replay on new inputs equal to the eager call,
the counter at zero between launches."""

from __future__ import annotations

import sys

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SIZES = {"qwen3": (4096, 2048, False), "gpt-oss-120b": (4096, 2880, True)}  # K (heads * head dim), N, bias
EPS = 1e-6


def _case(model, fmt, M, seed):
    K, N, has_bias = SIZES[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, 1, K, device="cuda", generator=g).bfloat16()
    r = torch.randn(M, 1, N, device="cuda", generator=g).bfloat16()
    w32 = torch.randn(N, K, device="cuda", generator=g) * 0.02
    b = (torch.randn(N, device="cuda", generator=g) * 0.1).bfloat16() if has_bias else None
    nw = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()
    if fmt == "bf16":
        return x, w32.bfloat16(), b, None, "", r, nw
    q = QuantSpec(activation="none")
    w, s = q8.quantize(w32, q)
    return x, w, b, s, q.key, r, nw


FORMS = {"llama": (False, True), "gemma": (True, False), "gptoss": (False, False)}  # (offset, round_unit)


def _unfused(x, w, b, s, key, r, nw, form):
    a = (torch.ops.moecomp.skinny_linear(x, w, b) if not key else
         torch.ops.moecomp.fp8_linear(x, w, s, b, None, key))
    h = r + a
    hf = h.float()
    unit = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    if form == "llama":  # transformers' forms, written as they are
        return h, nw * unit.to(h.dtype)
    if form == "gemma":
        return h, (unit * (1.0 + nw.float())).type_as(h)
    return h, (nw * unit).to(h.dtype)


@pytest.mark.parametrize("model", list(SIZES))
@pytest.mark.parametrize("fmt,M", [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2), ("fp8", 4)])
@pytest.mark.parametrize("form", list(FORMS))
def test_op_against_unfused(model, fmt, M, form):
    import moecomp
    from torch.profiler import ProfilerActivity, profile

    args = _case(model, fmt, M, seed=M + 10 * len(form))
    want_h, want_n = _unfused(*args, form)
    moecomp.counters.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        h, n = torch.ops.moecomp.linear_add_norm(*args, EPS, *FORMS[form])
        torch.cuda.synchronize()
    assert dict(moecomp.counters["linear_add_norm"]) == {"fused": 1}
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [k for k in kernels if "linear_add_norm_kernel" in k] and len(kernels) == 1, kernels
    assert torch.equal(h, want_h)
    torch.testing.assert_close(n, want_n, rtol=2.0 ** -7, atol=2.0 ** -10)


def test_bf16_four_rows_takes_the_unfused_path():
    import moecomp

    args = _case("qwen3", "bf16", 4, seed=3)
    moecomp.counters.clear()
    h, n = torch.ops.moecomp.linear_add_norm(*args, EPS, False, True)
    (why,) = moecomp.counters["linear_add_norm"]
    assert why.startswith("unfused: the linear does not take the skinny kernel")
    want_h, want_n = _unfused(*args, "llama")
    assert torch.equal(h, want_h) and torch.equal(n, want_n)


@pytest.mark.parametrize("model", list(SIZES))
def test_cuda_graph_replay(model):
    """Captured once, replayed on two new inputs: each replay equal to the eager call on them; the counter is zero
    after every launch (so the next replay counts from zero)."""
    lan = sys.modules["moecomp.ops.linear_add_norm"]
    x, w, b, s, key, r, nw = _case(model, "bf16", 1, seed=5)
    torch.ops.moecomp.linear_add_norm(x, w, b, s, key, r, nw, EPS, False, True)  # the counter, made outside a capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.moecomp.linear_add_norm(x, w, b, s, key, r, nw, EPS, False, True)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        h, n = torch.ops.moecomp.linear_add_norm(x, w, b, s, key, r, nw, EPS, False, True)
    for seed in (6, 7):
        x2, _, _, _, _, r2, _ = _case(model, "bf16", 1, seed=seed)
        x.copy_(x2)
        r.copy_(r2)
        graph.replay()
        torch.cuda.synchronize()
        eh, en = torch.ops.moecomp.linear_add_norm(x, w, b, s, key, r, nw, EPS, False, True)
        assert torch.equal(h, eh) and torch.equal(n, en)
        assert int(lan._counters[("cuda", x.device.index)]) == 0
