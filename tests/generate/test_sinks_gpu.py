"""On CUDA (cheap, a few seconds): the decode kernel with attention sinks and a sliding window in bf16 against the
float64 reference, captured in a CUDA graph; a tiny gpt-oss through the engine (its eager attention recognised, the
decode steps on the sink kernel, captured and replayed) with transformers' eager greedy tokens exactly (fp32).

bf16 tokens of gpt-oss on the kernel are checked by test_sliding_window.py's GPU test (teacher forcing, the op's
bf16 tolerance, routing near-ties excused): run it with this file.
"""

import copy

import pytest
import torch

import moecomp

from .models import prompts
from .test_sliding_window import WINDOW, _gen, build

pytestmark = pytest.mark.gpu


def _ref(q, k, v, keep, n, scale, sinks, window):
    """float64 on the CPU: softmax over [scores of positions max(0, n - window) .. n - 1 kept, the head's sink]."""
    q, k, v, keep = q.double().cpu(), k.double().cpu(), v.double().cpu(), keep.cpu()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # [B, Hq, L, D]
    pos = torch.arange(k.shape[2])
    ok = keep & (pos < n) & ((pos >= n - window) if window else True)  # [B, L]
    s = (torch.einsum("bhd,bhld->bhl", q, k) * scale).masked_fill(~ok[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().cpu()[None, :, None].expand(s.shape[0], -1, 1)], -1)
    p = torch.softmax(s, -1)[..., :k.shape[2]]
    return torch.einsum("bhl,bhld->bhd", p, v)


def _inputs(B, Hq, Hkv, L, D, n, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g).to(torch.bfloat16).cuda() for s in
               ((B, Hq, D), (B, Hkv, L, D), (B, Hkv, L, D)))
    keep = torch.rand(B, L, generator=g) > 0.2
    keep[:, n - 1] = True
    return q, k, v, keep.cuda(), torch.tensor(n).cuda()


@pytest.mark.parametrize("B,L,n,window", [
    (1, 1024, 700, 128),  # gpt-oss-120b's sliding layers at batch 1: 64 query heads on 8 kv heads, head dim 64
    (1, 1024, 700, 0),  # its full layers
    (16, 512, 300, 128),  # batch 16
])
def test_sink_kernel_bf16_and_graph_replay(B, L, n, window):
    """Sinks in bf16 (the model's dtype, as gpt-oss keeps them), of both signs, some above every score: within 1e-2
    of the largest output against float64 (leaving the sinks out is off by more than 0.1); in a CUDA graph, n moved
    on the device (the window moves with it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    Hq, Hkv, D = 64, 8, 64
    q, k, v, keep, nn = _inputs(B, Hq, Hkv, L, D, n, seed=B + window)
    sinks = (torch.randn(Hq, generator=torch.Generator().manual_seed(n)) * 2 + 3).to(torch.bfloat16).cuda()
    scale = D ** -0.5

    def ref(m):
        return _ref(q, k, v, keep, m, scale, sinks, window).cuda()

    def err(out, want):
        return float((out.double() - want).abs().max() / want.abs().max())

    out = torch.ops.moecomp.decode_attention(q, k, v, keep, nn, scale, sinks, window)
    assert err(out, ref(n)) <= 1e-2
    assert err(_ref(q, k, v, keep, n, scale, None, window).cuda(), ref(n)) > 0.1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = torch.ops.moecomp.decode_attention(q, k, v, keep, nn, scale, sinks, window)
    for m in (n // 2, n, L):
        nn.fill_(m)
        keep[:, m - 1] = True
        q.normal_()
        static.fill_(float("nan"))
        g.replay()
        assert err(static, ref(m)) <= 1e-2, m


def test_tiny_gpt_oss_engine_equals_eager_generate_fp32():
    """Tiny gpt-oss (4 layers, window 8, sinks N(0, 0.5)) in fp32 on CUDA, batch 3 with left padding, 24 new tokens:
    the decode step runs the sink kernel (the probe recognised the eager attention) under Inductor and a CUDA graph;
    greedy tokens equal transformers' eager generate exactly, the second call replaying from step 1. (fp32 on both
    sides: a flip would need two logits within ~1e-5 of each other; none in this draw.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref = build("gpt_oss", "cuda")
    opt = moecomp.optimize(copy.deepcopy(ref))
    ids, mask = prompts(ref.config.vocab_size, 3, 12, seed=7, left_pad=(0, 3, 5))
    ids, mask = ids.cuda(), mask.cuda()
    want = _gen(ref, ids, mask, 24)
    for _ in range(2):
        assert torch.equal(_gen(opt, ids, mask, 24), want)
        last = opt.generate.last
        assert last["path"] == "moecomp" and last["attention"] == "moecomp decode kernel", last
    assert last["graphs"] == "replayed" and last["layers"] == "compiled", last
    # the second call compiles the prefill (dynamic shapes): on torch 2.11 it once failed in moecomp's snapshot guard
    # (``symint is object``), leaving the prefill eager
    assert last["prefill_layers"] == "compiled", last
    eng = opt.generate.engine
    assert eng.eager_swapped and eng.kernel_window == WINDOW and eng.stats["capture_failures"] == 0
