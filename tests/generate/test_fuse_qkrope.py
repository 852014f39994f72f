"""The decode step's q / k norm + rotary + cache-write pass (``generate/fuse_qkrope.py``): what it folds into
``moecomp::qk_norm_rope_cache`` (found from the attention call and its caches' writes, checked on probes: never by
names), what it leaves and why, the counts; and the engine's decode with the pass on against off on tiny fp32 models
(tokens equal, every step's logits within 1e-5 of the largest: the op's fp32 steps against the unfused ones, the
kernel's 1 / sqrt against torch.rsqrt).

Graph-level cases are small functions compiled with ``fullgraph=True`` whose projections are ``skinny_linear`` calls
(the decode step's leaves); outputs compared with the function run eagerly (1e-5); the cache position written is
NaN-poisoned first (the attention reads it)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import moecomp
from moecomp.generate import fuse_linears as fl
from moecomp.generate import fuse_qkrope as fq

from .models import build, greedy_cpu_engine, logits_close, prompts

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6
B, HQ, HKV, D, L, K = 2, 4, 2, 16, 8, 32


def _norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _half(x, c, s):  # transformers' rotate_half form
    return x * c + torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1) * s


def _chunk(x, c, s):  # gpt-oss's form: c, s of D / 2
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def _interleaved(x, c, s):  # GPT-J's pairs (2i, 2i + 1): not the kernel's rotation, the probe must refuse it
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c[..., ::2] - x2 * s[..., ::2], x2 * c[..., ::2] + x1 * s[..., ::2]), -1).flatten(-2)


def _layer(rope, norms=True, read_early=False):
    def f(h, wq, wk, wv, qn, kn, cos, sin, kc, vc, idx, keep, n):
        sl = torch.ops.moecomp.skinny_linear
        q = sl(h, wq, None).view(B, 1, -1, D)
        k = sl(h, wk, None).view(B, 1, -1, D)
        v = sl(h, wv, None).view(B, 1, -1, D).transpose(1, 2)
        if norms:
            q, k = _norm(q, qn), _norm(k, kn)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rope(q.transpose(1, 2), c, s), rope(k.transpose(1, 2), c, s)
        kc.index_copy_(2, idx, k)
        early = vc.sum() if read_early else None  # v's cache read after k's write, before its own
        vc.index_copy_(2, idx, v)
        out = torch.ops.moecomp.decode_attention(q[:, :, 0], kc, vc, keep, n, D ** -0.5, None, 0)
        return out if early is None else (out, early)
    return f


def _inputs(half_table=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    Dc = D // 2 if half_table else D
    ang = torch.rand(B, 1, Dc, generator=g) * 6
    kc, vc = r(B, HKV, L, D), r(B, HKV, L, D)
    kc[:, :, 3], vc[:, :, 3] = float("nan"), float("nan")  # the position written: poisoned
    return [r(B, 1, K), r(HQ * D, K) * 0.2, r(HKV * D, K) * 0.2, r(HKV * D, K) * 0.2, r(D), r(D), ang.cos(),
            ang.sin(), kc, vc, torch.tensor([3]), torch.arange(L)[None].repeat(B, 1) < 4, torch.tensor(4)]


def _compile(f, args):
    p = fq.QkRopePass()
    be = fl.FusingBackend("eager", linears=False, after=[p])
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return be(gm, ex)

    torch._dynamo.reset()
    out = torch.compile(f, backend=capture, fullgraph=True)(*args)
    return graphs[0], p.found[0], out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("rope,norms,half_table", [(_half, True, False), (_half, False, False),
                                                    (_chunk, True, True), (_chunk, False, True)])
def test_pass_folds_norm_rope_and_writes(rope, norms, half_table):
    """Both rotary spellings, with and without the q / k norms: one fold, no index_copy_, rsqrt, cat or neg left;
    outputs and caches as the function's own."""
    f = _layer(rope, norms)
    args = _inputs(half_table)
    ref_args = [a.clone() for a in args]
    moecomp.counters.clear()
    gm, rec, out = _compile(f, args)
    assert rec["attentions"] == 1 and len(rec["folded"]) == 1 and rec["left"] == [], rec
    t = _targets(gm)
    assert t.count(torch.ops.moecomp.qk_norm_rope_cache.default) == 1
    assert not {"index_copy_", torch.rsqrt, torch.cat, "neg"} & set(t), t
    assert dict(moecomp.counters["fuse_qkrope"]) == {"attentions": 1, "folded": 1}
    ref = f(*ref_args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for i in (8, 9):  # the caches: the poisoned position written, the rest as it was
        assert not args[i].isnan().any()
        torch.testing.assert_close(args[i], ref_args[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("f,why", [(_layer(_interleaved), "q: the probe matches 0"),
                                   (_layer(_half, read_early=True), "is used between")])
def test_pass_leaves_other_forms(f, why):
    """GPT-J's interleaved rotary (the probe finds none of the kernel's forms) and a read of v's cache between the
    two writes (the op would write it earlier) stay as they are, each with its reason, counted."""
    moecomp.counters.clear()
    args = _inputs()
    ref = f(*[a.clone() for a in args])
    gm, rec, out = _compile(f, args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)  # the early read sees the poison
    assert rec["attentions"] == 1 and rec["folded"] == [] and len(rec["left"]) == 1 and why in rec["left"][0], rec
    assert torch.ops.moecomp.qk_norm_rope_cache.default not in _targets(gm)
    assert sum(moecomp.counters["fuse_qkrope_left"].values()) == 1


def _decode(family, on: str, monkeypatch, kernel=False, skinny=True, **kw):
    """(tokens, lm_head outputs of every step, the decode compile's QkRopePass or None), with the linear and norm
    passes on, the q / k rope pass on ("1") or off; ``kernel``: the op runs its Triton kernel (interpreter);
    ``skinny``: the projections are skinny ops (as on the GPU at <= 4 rows), else ``F.linear`` (more rows)."""
    from moecomp.ops import linear16, qk_rope

    torch._dynamo.reset()  # no automatic-dynamic sizes / floats (another model's eps) carried over from other tests
    if skinny:
        monkeypatch.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)
    if kernel:
        monkeypatch.setattr(qk_rope, "use_kernel", lambda device: True)
    for name, v in (("MOECOMP_FUSE_LINEARS", "1"), ("MOECOMP_FUSE_NORM", "1"), ("MOECOMP_FUSE_QKROPE", on)):
        monkeypatch.setenv(name, v)
    out, seen, eng = greedy_cpu_engine(build(family, **kw))
    after = eng._compiled[1]["decode"][0].run.fusing.after
    return out, seen, next((p for p in after if isinstance(p, fq.QkRopePass)), None)


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("family,kernel,folds,skinny", [("qwen3_moe", True, 1, True), ("qwen2_moe", False, 1, True),
                                                        ("qwen3_moe", False, 1, False), ("olmoe", True, 0, True)])
def test_engine_decode_qkrope_on_equals_off(family, kernel, folds, skinny, monkeypatch):
    """Tiny Qwen3-MoE (q / k norms; the op's Triton kernel, under the interpreter) and Qwen2-MoE (no q / k norms,
    q / k / v biases; the op's torch path), 2 layers in one compiled layer graph: one fold in it, the op runs once
    a layer a decode step; the same with the projections as ``F.linear`` calls (the step at more rows). OLMoE normalizes q and k over all heads at once (a [Hq*D] weight, before the head
    view): not the op's per-head norm, left with its reason. Tokens equal to the pass off, logits within 1e-5."""
    from moecomp.ops import triton_qk_rope
    from moecomp.testing import count_calls

    moecomp.counters.clear()
    calls = count_calls(monkeypatch, triton_qk_rope, ["qk_norm_rope_cache_triton"])
    out_on, logits_on, p = _decode(family, "1", monkeypatch, kernel=kernel, skinny=skinny)
    assert [(r["attentions"], len(r["folded"])) for r in p.found] == [(1, folds)]
    assert dict(moecomp.counters["fuse_qkrope"]) == {"attentions": 1, "folded": folds}
    if folds:
        assert p.found[0]["left"] == []
    else:
        assert len(p.found[0]["left"]) == 1 and "has no role" in p.found[0]["left"][0], p.found
        assert sum(moecomp.counters["fuse_qkrope_left"].values()) == 1
    assert len(calls) == (2 * 3 if kernel and folds else 0)  # 2 layers, 3 decode steps
    out_off, logits_off, off = _decode(family, "0", monkeypatch, skinny=skinny)
    assert off is None
    assert torch.equal(out_on, out_off)
    logits_close(logits_on, logits_off)


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_qkrope_dynamic_batch(monkeypatch):
    """A second batch bucket (3 rows -> 4 after 2) recompiles the layer graph with symbolic sizes (torch's automatic
    dynamic shapes): the views read them as graph inputs, the probe runs at their hints; both graphs fold, the
    tokens of both calls equal the pass off."""
    from moecomp.ops import linear16

    monkeypatch.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)
    outs = {}
    for on in ("1", "0"):
        torch._dynamo.reset()  # each engine starts static (the first bucket), as in a fresh process
        for name, v in (("MOECOMP_FUSE_LINEARS", "1"), ("MOECOMP_FUSE_NORM", "1"), ("MOECOMP_FUSE_QKROPE", on)):
            monkeypatch.setenv(name, v)
        ref = build("qwen3_moe")
        opt = moecomp.optimize(copy.deepcopy(ref))
        opt.generate.cpu = True
        eng = opt.generate._engine()
        eng.cpu_compile, eng.compile_backend = True, "eager"
        outs[on] = []
        for b in (2, 3):
            ids, mask = prompts(ref.config.vocab_size, b, 7, seed=9, left_pad=(0, 2))
            outs[on].append(opt.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
            assert opt.generate.last["layers"] == "compiled" and eng.compile_error is None, eng.compile_traceback
        if on == "1":
            p = next(p for p in eng._compiled[1]["decode"][0].run.fusing.after if isinstance(p, fq.QkRopePass))
            assert [(r["attentions"], len(r["folded"]), r["left"]) for r in p.found] == [(1, 1, [])] * 2, p.found
    for a, b in zip(outs["1"], outs["0"]):
        assert torch.equal(a, b)
