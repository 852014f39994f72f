"""The decode step's o_proj pass (``generate/fuse_oproj.py``): which linear -> residual add -> RMSNorm chains it folds
into ``moecomp::linear_add_norm`` (found by nodes, the norm checked on ``fuse_norm``'s probes: never by names), which
it leaves and why, the counts; and the engine's decode with the pass on against off on a tiny fp32 Qwen3-MoE
(tokens equal, every step's logits within 1e-5 of the largest: the fused kernel's fp32 sum orders against the
unfused linear's and norm's), one fold a layer graph.

As in ``test_fuse_norm``, the skinny ops' ``linear16.takes`` is patched so that the decode step's linears are the
skinny ops the GPU's step holds, run under the Triton interpreter."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import moecomp
from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec
from moecomp.generate import fuse_linears as fl
from moecomp.generate import fuse_oproj as fo

from .models import build, greedy_cpu_engine
from .test_fuse_norm import _gemma, _llama, _mean0, _skinny_on_cpu, _square

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERP, reason="the kernels run under TRITON_INTERPRET=1 on CPU")


def _gptoss(h, g):  # gpt-oss's form: the weight multiplies in fp32, one rounding at the end
    hs = h.to(torch.float32)
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (g * hs).to(h.dtype)


class _Block(torch.nn.Module):
    """o_proj -> residual add -> norm -> a non-linear user of the norm; h is read again at the end (the next
    residual). ``fmt`` "fp8": o_proj is a weight-only e4m3 ``fp8_linear``; ``leak``: o_proj's output has a second
    user (no fold)."""

    def __init__(self, norm, swap=False, bias=True, fmt="16", leak=False):
        super().__init__()
        self.norm, self.swap, self.fmt, self.leak = norm, swap, fmt, leak
        self.o = torch.nn.Linear(48, 40, bias=bias)
        self.g = torch.nn.Parameter(torch.randn(40))
        if fmt == "fp8":
            q = QuantSpec(scale="block", activation="none", block_n=16, block_k=16)
            self.key = q.key
            w, s = q8.quantize(torch.randn(40, 48) * 0.1, q)
            self.register_buffer("wq", w)
            self.register_buffer("ws", s)

    def forward(self, o, r):
        if self.fmt == "fp8":
            a = torch.ops.moecomp.fp8_linear(o, self.wq, self.ws, self.o.bias, None, self.key)
        else:
            a = torch.ops.moecomp.skinny_linear(o, self.o.weight, self.o.bias)
        h = a + r if self.swap else r + a
        n = self.norm(h, self.g)
        y = torch.tanh(n) * n.sum(-1, keepdim=True)  # anything, not a linear
        return [h + y] + ([a * 2] if self.leak else [])


def _compile(mod, args):
    be = fl.FusingBackend("eager", linears=False, after=[fo.make_pass()])
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return be(gm, ex)

    torch._dynamo.reset()
    out = torch.compile(mod, backend=capture, fullgraph=True)(*args)
    return graphs[0], be.after[0], out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@needs_triton
@pytest.mark.parametrize("norm,swap,bias,fmt", [(_llama, False, True, "16"), (_gemma, True, False, "16"),
                                                (_square, False, True, "16"), (_llama, True, True, "fp8")])
def test_pass_folds_linear_add_norm(monkeypatch, norm, swap, bias, fmt):
    """Three spellings of the norm (Llama's casts, Gemma's 1 + w, x * x), either operand order of the add, with and
    without a bias, 16-bit and e4m3 weight-only o_proj: one fold, the linear, the add and the norm's rsqrt gone; the
    outputs as the eager module's (fp32: 1e-5, the kernel's sum orders), the fused kernel launched once."""
    import moecomp.ops  # noqa: F401
    from moecomp.testing import count_calls

    _skinny_on_cpu(monkeypatch)
    if fmt == "fp8":
        monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")  # the FP8 linear's triton path: weight-only skinny
    lan = sys.modules["moecomp.ops.linear_add_norm"]
    torch.manual_seed(5)
    mod = _Block(norm, swap, bias, fmt).eval()
    args = (torch.randn(1, 1, 48), torch.randn(1, 1, 40))
    moecomp.counters.clear()
    calls = count_calls(monkeypatch, lan, ["launch"])
    gm, opass, out = _compile(mod, args)
    assert opass.found == [dict(matched=1, folded=1, skipped=[])]
    t = _targets(gm)
    assert t.count(torch.ops.moecomp.linear_add_norm.default) == 1 and torch.rsqrt not in t
    assert not any(x in (torch.ops.moecomp.skinny_linear, torch.ops.moecomp.fp8_linear) for x in t)
    assert dict(moecomp.counters["fuse_oproj"]) == dict(matched=1, folded=1)
    assert calls == ["launch"] and moecomp.counters["linear_add_norm"]["fused"] == 1
    with torch.no_grad():
        ref = mod(*args)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("norm,offset,round_unit", [(_llama, False, True), (_gemma, True, False),
                                                    (_gptoss, False, False)])
def test_pass_reads_the_norms_rounding(monkeypatch, norm, offset, round_unit):
    """bf16: the op's ``offset`` from the probe and ``round_unit`` from the graph (Llama / Qwen cast h * rsqrt to
    bf16 before the weight multiply; Gemma and gpt-oss round once, at the end)."""
    import moecomp.ops  # noqa: F401

    _skinny_on_cpu(monkeypatch)
    torch.manual_seed(8)
    mod = _Block(norm).eval().to(torch.bfloat16)
    gm, opass, _ = _compile(mod, (torch.randn(1, 1, 48).bfloat16(), torch.randn(1, 1, 40).bfloat16()))
    assert opass.found == [dict(matched=1, folded=1, skipped=[])]
    (call,) = [n for n in gm.graph.nodes if n.target == torch.ops.moecomp.linear_add_norm.default]
    assert call.args[8:] == (offset, round_unit)


@pytest.mark.parametrize("case", ["mean0", "leak", "cpu", "rows"])
def test_pass_leaves_what_it_cannot_fold(monkeypatch, case):
    """A mean over the rows (the probe says no: skipped with the reason), o_proj's output read twice (no chain: not
    matched), the op's one launch refused at the graph's rows (on CPU without the skinny kernel; with
    MOECOMP_FUSE_OPROJ_ROWS=0): matched, skipped with the op's reason. Nothing folded, the graph runs as before."""
    import moecomp.ops  # noqa: F401

    if case != "cpu":
        _skinny_on_cpu(monkeypatch)
    if case == "rows":
        monkeypatch.setenv("MOECOMP_FUSE_OPROJ_ROWS", "0")
    torch.manual_seed(6)
    mod = _Block(_mean0 if case == "mean0" else _llama, leak=case == "leak").eval()
    args = (torch.randn(1, 1, 48), torch.randn(1, 1, 40))
    moecomp.counters.clear()
    gm, opass, out = _compile(mod, args)
    rec = opass.found[0]
    assert rec["folded"] == 0 and torch.ops.moecomp.linear_add_norm.default not in _targets(gm)
    want = {"mean0": (0, "does not compute an RMSNorm"), "leak": (0, None),
            "cpu": (1, "does not take the skinny kernel"), "rows": (1, "1 rows (one launch takes 1..0")}[case]
    assert rec["matched"] == want[0]
    if want[1] is None:
        assert rec["skipped"] == []
    else:
        assert len(rec["skipped"]) == 1 and want[1] in rec["skipped"][0], rec
    with torch.no_grad():
        ref = mod(*args)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _decode(oproj: str, monkeypatch, family="qwen3_moe", **kw):
    """(tokens, lm_head outputs of every step, the decode compile's OprojPass or None) with the pass on ("1") or
    off; the sibling-linear and norm passes on either way."""
    monkeypatch.setenv("MOECOMP_FUSE_LINEARS", "1")
    monkeypatch.setenv("MOECOMP_FUSE_NORM", "1")
    monkeypatch.setenv("MOECOMP_FUSE_OPROJ", oproj)
    out, seen, eng = greedy_cpu_engine(build(family, **kw))
    after = eng._compiled[1]["decode"][0].run.fusing.after
    return out, seen, (after[0] if after else None)


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_oproj_pass_on_equals_off_qwen3(monkeypatch):
    """Tiny Qwen3-MoE (2 layers, one compiled layer graph), after fuse_linears and fuse_norm: exactly one chain
    folds (o_proj -> + residual -> post-attention norm -> the MoE op); the fused kernel runs once a layer a decode
    step; greedy tokens equal the unfused engine's, logits within 1e-5 of the largest."""
    from moecomp.testing import count_calls

    _skinny_on_cpu(monkeypatch)
    lan = sys.modules["moecomp.ops.linear_add_norm"]
    moecomp.counters.clear()
    calls = count_calls(monkeypatch, lan, ["launch"])
    out_on, logits_on, opass = _decode("1", monkeypatch)
    assert opass.found == [dict(matched=1, folded=1, skipped=[])]
    assert dict(moecomp.counters["fuse_oproj"]) == dict(matched=1, folded=1)
    assert moecomp.counters["fuse_norm"]["folded"] == 1  # the pre-attention norm, as without this pass
    assert len(calls) == 2 * 3  # 2 layers, 3 decode steps
    out_off, logits_off, off = _decode("0", monkeypatch)
    assert off is None
    assert torch.equal(out_on, out_off)
    assert len(logits_on) == len(logits_off) == 4
    for a, b in zip(logits_on, logits_off):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_oproj_pass_after_fuse_norm_deepseek(monkeypatch):
    """Tiny DeepSeek-V3 with its first layer dense (two layer graphs): ``fuse_norm`` runs first and folds the dense
    layer's post-attention norm (with its residual add) into the MLP's gate / up, so this pass finds no chain there;
    in the MoE layer's graph it folds the one chain. Tokens equal the unfused engine's."""
    _skinny_on_cpu(monkeypatch)
    moecomp.counters.clear()
    out_on, logits_on, opass = _decode("1", monkeypatch, "deepseek_v3", first_k_dense_replace=1)
    got = sorted((r["matched"], r["folded"], len(r["skipped"])) for r in opass.found)
    assert got == [(0, 0, 0), (1, 1, 0)], opass.found
    out_off, logits_off, _ = _decode("0", monkeypatch, "deepseek_v3", first_k_dense_replace=1)
    assert torch.equal(out_on, out_off)
    for a, b in zip(logits_on, logits_off):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
