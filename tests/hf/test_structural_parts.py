"""Blocks found by their shapes (``hf/structure.structural_parts``, ``hf/discover.block_router``): a router [E, H]
(a child's weight, or the block's own Parameter) next to experts for it, under names the block finder does not
know. Their parts name only the router and the experts child (``kind="structural"``); the FX pass reads such a
block, and without it the dispatch reader (the attribute reader has no part names to read); models without a router
give no candidate.

Equivalence of the rewritten blocks (ModuleDict / Sequential experts, a bare router Parameter) is in
``tests/passes/test_per_expert_spellings.py``; here: the parts, the reading without the FX pass, the rewrite of a
block whose every name is unusual (fresh [2, 5, H] inputs, NaN-poisoned outputs, fp32 max |diff| / max |block|
<= 1e-5), and no candidates in dense models.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import moecomp
from moecomp.recognise.structure import iter_blocks, structural_parts

H, I, E, K = 24, 12, 6, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(H, I, bias=False)
        self.b = nn.Linear(H, I, bias=False)
        self.c = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.c(F.silu(self.a(x)) * self.b(x))


class OddNames(nn.Module):
    """Router ``chooser`` (a Linear), experts a ModuleDict ``pool`` with string keys, a bare scale Parameter."""

    def __init__(self):
        super().__init__()
        self.chooser = nn.Linear(H, E, bias=False)
        self.pool = nn.ModuleDict({f"e{i}": Expert() for i in range(E)})

    def forward(self, x):
        flat = x.reshape(-1, H)
        w, ids = torch.topk(self.chooser(flat).softmax(-1), K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for i, (name, ex) in enumerate(self.pool.items()):
            tok, slot = torch.where(ids == i)
            out.index_add_(0, tok, ex(flat[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class Layer(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.ffn = block

    def forward(self, x):
        return x + self.ffn(self.norm(x))


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(Layer(OddNames()), Layer(OddNames()))
    for p in m.parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.2)
    return m.eval()


def test_parts_name_router_and_experts():
    m = _model()
    found = [(n, p) for n, _, p, _ in iter_blocks(m)]
    assert [n for n, _ in found] == ["0.ffn", "1.ffn"]
    p = found[0][1]
    assert (p.kind, p.experts, p.router_module, p.router_weight, p.num_experts, p.hidden_size) == (
        "structural", "pool", "chooser", "chooser.weight", E, H)
    assert p.extra_modules == []


def test_bare_router_parameter():
    class Bare(OddNames):
        def __init__(self):
            super().__init__()
            del self.chooser
            self.route_w = nn.Parameter(torch.randn(E, H))

    p = structural_parts(Bare())
    assert (p.router_module, p.router_weight, p.experts) == ("", "route_w", "pool")


def test_rewritten_whole_and_equal(poison):
    m = _model(1)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(x)
    _, rep = moecomp.optimize(m, report=True)
    assert [b.name for b in rep.rewritten] == ["0.ffn", "1.ffn"], str(rep)
    assert all(b.method == "fx" for b in rep.rewritten)
    x2 = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = m(x2)
    moecomp.unoptimize(m)
    with torch.no_grad():
        ref = m(x2)
        assert torch.equal(m(x), want)  # unoptimize restores the original forwards
    assert torch.isfinite(got).all()
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_without_the_fx_pass_the_dispatch_reader_reads_it():
    """Without the FX pass (``use_capture=False``) the attribute reader has no part names to read; the dispatch
    reader (the block run with its experts observed) reads it, to the FX pass's spec. Seeing no capacity drop on its
    probes, it bounds the calls the op serves (``max_tokens``)."""
    m = _model()
    fx = moecomp.scan(m)
    rep = moecomp.scan(m, use_capture=False)
    assert [b.status for b in rep.blocks] == ["supported"] * 2 and all(b.method == "dispatch" for b in rep.blocks)
    assert [b.spec for b in rep.blocks] == [b.spec for b in fx.blocks] and fx.blocks[0].method == "fx"
    assert all(any("bound for calls of at most" in n for n in b.notes) for b in rep.blocks)


def test_dense_models_have_no_candidate():
    dense = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    two_mlps = nn.ModuleDict({"proj": nn.Linear(H, 4, bias=False),
                              "mlps": nn.ModuleList([nn.Sequential(nn.Linear(H, H), nn.Linear(H, H))] * 1)})
    for m in (dense, Layer(nn.Sequential(nn.Linear(H, H), nn.ReLU())), two_mlps):
        assert iter_blocks(m) == [], iter_blocks(m)


class SplitHalves(OddNames):
    """A module with a router and experts whose own forward is abstract: its parent calls ``first`` and ``second``
    around other work (as JetMoE's mixture of attention heads calls ``map`` / ``reduce`` around attention)."""

    def forward(self, x):
        raise NotImplementedError("call first / second")

    def first(self, x):
        return OddNames.forward(self, x)


class HalvesLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = SplitHalves()

    def forward(self, x):
        return x + self.heads.first(x)


def test_abstract_forward_is_left_alone_with_the_reason():
    """Found by its shapes, but its forward raises NotImplementedError: no call of it can be replaced, so the block
    is skipped with NOT_A_BLOCK and a reason saying so, and the model still runs as before (bitwise)."""
    from moecomp.core.reject import RejectCode

    m = nn.Sequential(HalvesLayer()).eval()
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = m(x)
    _, rep = moecomp.optimize(m, report=True)
    assert len(rep.blocks) == 1 and not rep.rewritten, str(rep)
    b = rep.blocks[0]
    assert RejectCode.NOT_A_BLOCK in b.codes and "forward is not callable" in b.reason, (b.codes, b.reason)
    with torch.no_grad():
        assert torch.equal(m(x), want)


def test_source_bound_takes_every_router_spelling(tmp_path):
    """The coverage tool's source bound (``discover.source_candidates``) keeps a modeling file whose router is a
    top-k, an argmax or a max over a dim (Switch Transformers' top-1 in transformers 5.17 is
    ``torch.max(probs, dim=-1)``), and drops one with none of them."""
    from moecomp.recognise.discover import source_candidates

    bodies = {"a": "w, i = torch.topk(p, 2, dim=-1)", "b": "i = p.argmax(-1)", "c": "v, i = torch.max(p, dim=-1)",
              "d": "v, i = p.max(-1)", "e": "m = torch.maximum(a, b)\ny = x.max()", "f": "z = torch.max(x)"}
    for fam, body in bodies.items():
        (tmp_path / fam).mkdir()
        (tmp_path / fam / f"modeling_{fam}.py").write_text(f"def route(p, x, a, b):\n    {body}\n")
    assert source_candidates(str(tmp_path)) == ["a", "b", "c", "d"]
