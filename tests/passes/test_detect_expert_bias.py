"""A bias on one of the two expert GEMMs only (``MoESpec.expert_bias`` "gemm1": b13 alone, "gemm2": b2 alone)
recognised by the FX pass and by the attribute reader, on blocks of stacked 3-D experts (``w[ids]`` einsum) and of
per-expert ``nn.Linear`` modules (a loop over the experts), then bound by ``optimize``.

Equivalence: the optimized block (one ``moe_forward``) against the block's own forward on fresh inputs, outputs
NaN-poisoned (``poison``), fp32, within 1e-5 relative to the output's max; ``scan`` counts the blocks rewritten.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moecomp
from moecomp.api.optimize import rewritten_blocks
from moecomp.recognise.recognise import match_block

H, E, I, K = 32, 6, 16, 2
TOL = 1e-5
SIDES = {"gemm1": (True, False), "gemm2": (False, True), "both": (True, True)}


def _rnd(g, *shape, scale=1.0):
    return nn.Parameter(torch.randn(*shape, generator=g) * scale)


class StackedExperts(nn.Module):
    """gate_up_proj [E, 2I, H] / down_proj [E, H, I], gathered per pair (``w[ids]``); either bias or both."""

    def __init__(self, b13: bool, b2: bool, g):
        super().__init__()
        self.gate_up_proj = _rnd(g, E, 2 * I, H, scale=1 / math.sqrt(H))
        self.down_proj = _rnd(g, E, H, I, scale=1 / math.sqrt(I))
        self.gate_up_proj_bias = _rnd(g, E, 2 * I, scale=0.5) if b13 else None
        self.down_proj_bias = _rnd(g, E, H, scale=0.5) if b2 else None

    def forward(self, x, idx, w):
        h = torch.einsum("th,tkoh->tko", x, self.gate_up_proj[idx])
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[idx]
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, self.down_proj[idx])
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[idx]
        return torch.einsum("tkh,tk->th", y, w)


class ExpertMLP(nn.Module):
    def __init__(self, b13: bool, b2: bool):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=b13)
        self.up_proj = nn.Linear(H, I, bias=b13)
        self.down_proj = nn.Linear(I, H, bias=b2)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertList(nn.ModuleList):
    """Per-expert modules, run in a loop over the experts hit."""

    def __init__(self, b13: bool, b2: bool, g):
        super().__init__(ExpertMLP(b13, b2) for _ in range(E))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 1 / math.sqrt(p.shape[1])))

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, self[e](x[tok]) * w[tok, slot, None])
        return out


class Block(nn.Module):
    """Softmax top-k routing, renormalised, over ``experts``."""

    def __init__(self, experts_cls, side: str, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate = nn.Linear(H, E, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H) * 2)
        self.experts = experts_cls(*SIDES[side], g)
        self.top_k = K

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, idx = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return self.experts(x, idx, w).reshape(shape)


class Model(nn.Module):
    def __init__(self, experts_cls, side: str):
        super().__init__()
        self.layers = nn.ModuleList(Block(experts_cls, side, seed=i) for i in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


CASES = [(cls, side) for cls in (StackedExperts, ExpertList) for side in ("gemm1", "gemm2")]


@pytest.mark.parametrize("use_fx", [True, False], ids=["fx", "fallback"])
@pytest.mark.parametrize("cls,side", CASES, ids=[f"{c.__name__}-{s}" for c, s in CASES])
def test_one_sided_bias_recognised(cls, side, use_fx):
    block = Block(cls, side).eval()
    v = match_block(block, use_fx=use_fx)
    spec = v.match.spec
    assert (spec.has_expert_bias, spec.expert_bias, spec.has_b13, spec.has_b2) == (True, side, *SIDES[side])
    assert (v.match.bindings["b13"] is not None, v.match.bindings["b2"] is not None) == SIDES[side]
    assert v.match.evidence.method.startswith("fx" if use_fx else "fallback"), v.match.evidence.method


@pytest.mark.parametrize("cls,side", CASES, ids=[f"{c.__name__}-{s}" for c, s in CASES])
def test_one_sided_bias_optimized_equal(cls, side, poison):
    model = Model(cls, side).eval()
    x = torch.randn(3, 5, H)
    with torch.no_grad():
        want = model(x)
        moecomp.optimize(model)
        assert len(rewritten_blocks(model)) == 2
        got = model(x)
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
