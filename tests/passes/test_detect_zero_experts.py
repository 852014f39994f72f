"""The FX pass on blocks with zero-computation experts (``MoESpec.zero_experts``; LongCat-Flash, whose HF form is in
tests/hf/test_longcat.py), written here in plain PyTorch in other spellings: sigmoid scores with a correction bias
over E + Z router outputs, top-k, stacked expert weights gathered per pair (``w[ids]``, ``bmm``) and
``torch.where(ids < E, expert(x), x)`` for the identity, or a loop over constant ids. The pass reads E from the
stacked weights (the smaller row count; the router's extra outputs are the zero experts), binds a weight of E + Z
rows as a view of its first E (``Derived`` "rows", a ``narrow`` in a rewritten graph), and the numeric check proves
what the zero experts compute: a block that drops their pairs instead is refused. The block-level spelling (the
block adds the identity term and hands the experts dummy ids of weight 0) is in test_detect_zero_remap.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.recognise.fx import detect_moe as dm
from moecomp.testing import rewrite_block_graph

H, I, E, Z, K = 32, 24, 6, 3, 2


class ZeroMoE(nn.Module):
    """out = sum_k w * (expert_e(x) if e < E else x); w13 holds ``w13_rows`` experts (E, or E + Z unused ones)."""

    def __init__(self, w13_rows: int = E + Z, seed: int = 0, drop: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.drop = drop
        self.gate = nn.Linear(H, E + Z, bias=False)
        self.bias = nn.Parameter(torch.randn(E + Z, generator=g) * 0.1)
        self.w13 = nn.Parameter(torch.randn(w13_rows, 2 * I, H, generator=g) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, H, I, generator=g) / math.sqrt(I))
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E + Z, H, generator=g) / math.sqrt(H) * 2)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        scores = torch.sigmoid(self.gate(x))  # [T, E + Z]
        idx = torch.topk(scores + self.bias, K, dim=-1).indices  # [T, K]
        w = scores.gather(1, idx)
        real = idx < E
        safe = torch.where(real, idx, 0).reshape(-1)  # [T * K]: zero experts' pairs computed on expert 0, unused
        xs = x.repeat_interleave(K, dim=0)  # [T * K, H]
        h = torch.bmm(xs.unsqueeze(1), self.w13[safe].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.w2[safe].transpose(1, 2)).squeeze(1)
        keep = xs * 0 if self.drop else xs  # the identity (or, drop=True, nothing)
        y = torch.where(real.reshape(-1, 1), y, keep).view(-1, K, H)
        return (y * w.unsqueeze(-1)).sum(1).view(shape)


class LoopZeroMoE(ZeroMoE):
    """A loop over the E + Z router outputs (constants), both stacked weights of E experts: ids >= E add x * w."""

    def __init__(self):
        super().__init__(w13_rows=E)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        scores = torch.sigmoid(self.gate(x))
        idx = torch.topk(scores + self.bias, K, dim=-1).indices
        w = scores.gather(1, idx)
        out = torch.zeros_like(x)
        for e in range(E + Z):
            tok, slot = torch.where(idx == e)
            if e >= E:  # a zero expert
                out.index_add_(0, tok, x[tok] * w[tok, slot, None])
                continue
            gate, up = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(gate) * up, self.w2[e]) * w[tok, slot, None])
        return out.view(shape)


def _get(block, path):
    return block.get_parameter(path)


@pytest.mark.parametrize("form", ["gathered", "loop"])
def test_zero_experts_are_read_and_proven(poison, form):
    """gathered: w13 of E + Z experts (bound as a view of its first E); loop: the ids compared with constants, both
    weights of E experts (bound as they are), the loop traced with real values."""
    block = (ZeroMoE() if form == "gathered" else LoopZeroMoE()).eval()
    w13_rows = block.w13.shape[0]
    m = detect_block(block, torch.randn(2, 40, H), real_values=form == "loop")
    s = m.spec
    assert (s.num_experts, s.zero_experts, s.top_k, s.scoring, s.has_correction_bias, s.renormalize) == (
        E, Z, K, "sigmoid", True, False), s.describe()
    assert m.verified.startswith("numeric"), m.verified
    views = [d for d in m.derived if d.kind == "rows"]
    if w13_rows == E:
        assert m.bindings["w13"] == "w13" and not views
    else:
        assert [(d.name, d.source_paths(), d.rows) for d in views] == [("_moecomp_w13", ["w13"], E)]
        assert m.bindings["w13"] == "_moecomp_w13"
    w13 = views[0].build(block) if views else block.w13
    assert w13.shape[0] == E and w13.data_ptr() == block.w13.data_ptr()  # a view: nothing copied
    x = torch.randn(3, 7, H)
    args = {k: (w13 if k == "w13" else None if p is None else _get(block, p)) for k, p in m.bindings.items()}
    with torch.no_grad():
        got, want = torch.ops.moecomp.moe_forward(x, *args.values(), s.key), block(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_rewritten_graph_reads_the_first_rows():
    """The rewrite passes w13 through a ``narrow`` to E rows and computes what the block computed."""
    block = ZeroMoE().eval()
    gm, before, after = rewrite_block_graph(block, torch.randn(2, 5, H))
    names = [dm.op_name(n) for n in gm.graph.nodes]
    assert names.count("moe_forward") == 1 and "narrow" in names
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-5


def test_dropped_zero_pairs_are_refused():
    """Router outputs past the experts whose pairs add nothing: not zero experts, and no spec says so."""
    with pytest.raises(DetectError) as e:
        detect_block(ZeroMoE(drop=True).eval(), torch.randn(2, 5, H))
    assert "numeric check failed" in e.value.reason, e.value.reason
