"""The decode step's norm pass (``generate/fuse_norm.py``): which RMSNorms it finds (by their nodes, checked on
probes: never by names), which it folds into ``moecomp::norm_group`` (every user a skinny linear of the group form),
the residual add folded with them, the counts; and the engine's decode with the pass on against off on tiny fp32
models (tokens equal, every step's logits within 1e-5 of the largest: the fused kernel's fp32 order against the
unfused norm's and linear's).

As in ``test_fuse_linears``, the engine tests patch ``linear16.takes`` so that the decode step's linears are the
skinny ops the GPU's step holds, run under the Triton interpreter."""

from __future__ import annotations

import math
import os

import pytest
import torch

import moecomp
from moecomp.generate import fuse_linears as fl
from moecomp.generate import fuse_norm as fn

from .models import build, greedy_cpu_engine, logits_close

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6


def _llama(h, g):
    hs = h.to(torch.float32)
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)
    return g * hs.to(h.dtype)


def _gemma(h, g):
    hs = h.float()
    out = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + g.float())).type_as(h)


def _square(h, g):
    return h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + EPS) * g


def _mean0(h, g):  # the nodes of an RMSNorm, but the mean runs over the rows: the probe rejects it
    hs = h.float()
    return g * (hs * torch.rsqrt(hs.pow(2).mean(0, keepdim=True) + EPS)).to(h.dtype)


class _Layer(torch.nn.Module):
    """A norm of (a + b) or of a, read by two linears (and by a sum with ``leak``); h is used after them."""

    def __init__(self, norm, residual: bool, leak: bool = False):
        super().__init__()
        self.norm, self.residual, self.leak = norm, residual, leak
        self.g = torch.nn.Parameter(torch.randn(32))
        self.q, self.k = torch.nn.Linear(32, 16), torch.nn.Linear(32, 8, bias=False)

    def forward(self, a, b):
        sl = torch.ops.moecomp.skinny_linear
        h = a + b if self.residual else a
        n = self.norm(h, self.g)
        out = [sl(n, self.q.weight, self.q.bias), sl(n, self.k.weight, None), h * 2]
        return out + ([n.sum()] if self.leak else [])


def _compile(mod, args, linears=True):
    be = fl.FusingBackend("eager", linears=linears, then=fn.NormPass())
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return be(gm, ex)

    torch._dynamo.reset()
    out = torch.compile(mod, backend=capture, fullgraph=True)(*args)
    return graphs[0], be, out


@pytest.mark.parametrize("norm,residual,linears,folded", [
    (_llama, True, True, [(2, True)]), (_gemma, False, True, [(2, False)]), (_square, True, False, [(2, True)]),
    (_mean0, True, True, None)])
def test_pass_folds_norms_found_by_meaning(norm, residual, linears, folded):
    """Three spellings of an RMSNorm (transformers' Llama form, Gemma's 1 + w, x * x without casts) fold into one
    norm_group with their residual add, after the sibling-linear pass (a skinny_group user) or alone (two
    skinny_linear users); a mean over the rows instead of the features matches the nodes but not the probe and
    stays. Outputs as the module's own (the op's CPU path: 1e-5)."""
    import moecomp.ops  # noqa: F401

    torch.manual_seed(3)
    mod = _Layer(norm, residual).eval()
    args = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    moecomp.counters.clear()
    gm, be, out = _compile(mod, args, linears)
    rec = be.then.found[0]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    ng = torch.ops.moecomp.norm_group.default
    if folded is None:
        assert rec["norms"] == 0 and rec["folded"] == [] and len(rec["skipped"]) == 1
        assert "does not compute an RMSNorm" in rec["skipped"][0] and ng not in targets
    else:
        assert rec["norms"] == 1 and rec["folded"] == folded and rec["skipped"] == []
        assert targets.count(ng) == 1 and torch.rsqrt not in targets
        assert not any(t in (torch.ops.moecomp.skinny_linear, torch.ops.moecomp.skinny_group.default)
                       for t in targets)
        c = moecomp.counters["fuse_norm"]
        assert (c["norms"], c["folded"], c["residuals"], c["linears"]) == (1, 1, int(residual), 2)
    with torch.no_grad():
        ref = mod(*args)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pass_leaves_norms_with_other_users():
    """A norm whose output also feeds a sum is checked (one norm) but stays, with its reason."""
    import moecomp.ops  # noqa: F401

    torch.manual_seed(4)
    mod = _Layer(_llama, True, leak=True).eval()
    gm, be, _ = _compile(mod, (torch.randn(1, 1, 32), torch.randn(1, 1, 32)))
    rec = be.then.found[0]
    assert rec["norms"] == 1 and rec["folded"] == [] and "is not a skinny linear" in rec["skipped"][0]
    assert torch.ops.moecomp.norm_group.default not in [n.target for n in gm.graph.nodes]


def _skinny_on_cpu(monkeypatch):
    from moecomp.ops import linear16

    monkeypatch.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)


def _decode(family, norm: str, monkeypatch, **kw):
    """(tokens, lm_head outputs of every step, the decode compile's NormPass or None) with the pass on ("1") or
    off, the sibling-linear pass on."""
    monkeypatch.setenv("MOECOMP_FUSE_LINEARS", "1")
    monkeypatch.setenv("MOECOMP_FUSE_NORM", norm)
    out, seen, eng = greedy_cpu_engine(build(family, **kw))
    return out, seen, eng._compiled[1]["decode"][0].run.fusing.then


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_norm_pass_on_equals_off_qwen3(monkeypatch):
    """Tiny Qwen3-MoE (2 layers, one compiled layer graph): four RMSNorms checked (the pre-attention norm, q_norm,
    k_norm, the post-attention norm); only the pre-attention one folds (into the q / k / v group; its residual add
    is in the previous layer's graph): q_norm / k_norm feed views and rotary, the post-attention norm the MoE op.
    The fused kernel runs once a layer a decode step."""
    from moecomp.ops import skinny
    from moecomp.testing import count_calls

    _skinny_on_cpu(monkeypatch)
    moecomp.counters.clear()
    calls = count_calls(monkeypatch, skinny, ["skinny_norm_group"])
    out_on, logits_on, npass = _decode("qwen3_moe", "1", monkeypatch)
    assert [(r["norms"], r["folded"]) for r in npass.found] == [(4, [(3, False)])]
    assert moecomp.counters["fuse_norm"]["folded"] == 1
    assert len(calls) == 2 * 3  # 2 layers, 3 decode steps
    out_off, logits_off, off = _decode("qwen3_moe", "0", monkeypatch)
    assert off is None
    assert torch.equal(out_on, out_off)
    logits_close(logits_on, logits_off)


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_norm_pass_on_equals_off_deepseek(monkeypatch):
    """Tiny DeepSeek-V3 with its first layer dense: in both layer graphs the input norm (into q_a / kv_a) and
    q_a_layernorm (into q_b alone: a group of one) fold, kv_a_layernorm (a view reads it) stays; the dense layer's
    post-attention norm folds with its residual add into the MLP's gate / up, the MoE layer's feeds the MoE op."""
    _skinny_on_cpu(monkeypatch)
    out_on, logits_on, npass = _decode("deepseek_v3", "1", monkeypatch, first_k_dense_replace=1)
    got = sorted((r["norms"], sorted(r["folded"])) for r in npass.found)
    assert got == [(4, [(1, False), (2, False)]), (4, [(1, False), (2, False), (2, True)])], got
    out_off, logits_off, _ = _decode("deepseek_v3", "0", monkeypatch, first_k_dense_replace=1)
    assert torch.equal(out_on, out_off)
    logits_close(logits_on, logits_off)


class _Val:
    """What ``_outside_auto`` reads of a node's example value: shape, numel, device (a CUDA value without a GPU)."""

    def __init__(self, shape, device):
        self.shape, self.device = shape, torch.device(device)

    def numel(self):
        return math.prod(self.shape)


@pytest.mark.parametrize("shape,device,folds", [((1, 1, 64), "cuda", True), ((2, 1, 64), "cuda", True),
                                                ((4, 1, 64), "cuda", False), ((3, 64), "cuda", False),
                                                ((1, 1, 64), "cpu", False)])
def test_auto_mode_folds_cuda_graphs_of_at_most_two_rows(shape, device, folds, monkeypatch):
    """The default ("auto", MOECOMP_FUSE_NORM unset) folds where it measured faster: CUDA graphs of 1-2 rows; "1"
    folds every graph, "0" none."""
    monkeypatch.delenv("MOECOMP_FUSE_NORM", raising=False)
    assert fn.mode() == "auto" and fn.enabled() and fn.AUTO_ROWS == 2
    for v, m in (("1", "on"), ("0", "off"), ("x", "auto")):
        monkeypatch.setenv("MOECOMP_FUSE_NORM", v)
        assert fn.mode() == m and fn.enabled() == (m != "off")
    monkeypatch.setattr(fn, "example_value", lambda node: _Val(shape, device))
    why = fn.NormPass(auto=True)._outside_auto({"root": None})
    assert (why == "") == folds, why
    assert fn.NormPass(auto=False)._outside_auto({"root": None}) == ""
