"""The FX pass (and the attribute reader) on blocks with a router logit scale and norms around the experts
(``MoESpec.router_scale`` / ``latent_norm`` / ``expert_norm``; MuseSpark's form is tests/hf/test_muse_spark.py),
written here in plain PyTorch in another spelling and with other names: the logits divided by a constant before the
sigmoid, a correction bias, the experts on ``squeeze(x)`` normalised by an inline RMS norm (``x / sqrt(mean + eps)``
times a raw parameter, or (1 + w) by a child module), gathered expert matrices with ``einsum``, each pair's output
scaled by (1 + g) first and normalised after (the input-scaled form), a weighted ``view(T, k, L).sum(1)``,
``unsqueeze`` back to H. The pass reads the scale, the norms' weights and eps from what the graph computes, the
numeric check picks the forms (the norm weights drawn at random there: zero weights would hide them); a norm in a
form the spec does not have (normalise first, then scale) is refused, not rewritten wrong.

Tolerances: fp32, max abs error / max |block output| <= 1e-5."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.core.args import OP_ARGS
from moecomp.recognise.fx import detect_moe as dm
from moecomp.recognise.recognise import match_block
from moecomp.testing import rewrite_block_graph

H, L, I, E, K = 32, 24, 16, 8, 2
TOL = 1e-5


class OneMinusScaleNorm(nn.Module):
    """rms(v) * (1 + w), written as a module (the attribute reader names it by its one [L] vector)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.zeros(n)), eps

    def forward(self, v):
        return v / torch.sqrt(v.square().mean(dim=-1, keepdim=True) + self.eps) * (1 + self.w)


class Block(nn.Module):
    def __init__(self, out_norm: str = "scaled", seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.route = nn.Linear(H, E, bias=False)
        self.steer = nn.Parameter(torch.randn(E, generator=g) * 0.1)
        self.squeeze, self.unsqueeze = nn.Linear(H, L, bias=False), nn.Linear(L, H, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, 2 * I, L, generator=g) * 0.2)
        self.w_out = nn.Parameter(torch.randn(E, L, I, generator=g) * 0.2)
        self.out_norm = out_norm
        self.g_in = nn.Parameter(torch.randn(L, generator=g) * 0.3 + 1)  # plain weight: rms(v) * g
        self.g_out = nn.Parameter(torch.zeros(L))  # zeros, as MuseSpark's start
        with torch.no_grad():
            for p in (self.route.weight, self.squeeze.weight, self.unsqueeze.weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        s = torch.sigmoid(self.route(x) / 4.0)
        idx = torch.topk(s + self.steer, K, dim=-1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-12) * 1.5
        z = self.squeeze(x)
        z = z / torch.sqrt(z.square().mean(dim=-1, keepdim=True) + 1e-5) * self.g_in
        flat = idx.reshape(-1)
        zz = z.repeat_interleave(K, 0)
        h = torch.einsum("tl,tnl->tn", zz, self.w_in[flat])
        a, b = h.chunk(2, dim=-1)
        y = torch.einsum("ti,tli->tl", torch.nn.functional.silu(a) * b, self.w_out[flat])
        if self.out_norm == "scaled":  # (1 + g) first, then the normalisation
            t = y * (1 + self.g_out)
            y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
        else:  # normalise first, then (1 + g): no expert_norm form the spec has
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.g_out)
        routed = (y.view(-1, K, L) * w.unsqueeze(-1)).sum(1)
        return self.unsqueeze(routed).view(shape)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _op(block, m, x):
    args = [None if m.bindings.get(k) is None else block.get_parameter(m.bindings[k]) for k in OP_ARGS]
    return torch.ops.moecomp.moe_forward(x, *args[:11], m.spec.key, *args[11:])


def _randomise_out_norm(block):
    with torch.no_grad():
        block.g_out.copy_(torch.randn(L, generator=torch.Generator().manual_seed(7)) * 0.3)


def test_inline_norms_are_read_and_proven(poison):
    block = Block().eval()
    m = detect_block(block, torch.randn(2, 5, H))
    s = m.spec
    assert (s.router_scale, s.routed_scaling_factor, s.renorm_eps, s.latent_size) == (0.25, 1.5, 1e-12, L), \
        s.describe()
    assert (s.latent_norm, s.latent_norm_eps, s.expert_norm, s.expert_norm_eps) == ("rms", 1e-5, "scaled_rms_1p",
                                                                                   1e-6), s.describe()
    assert (m.bindings["latent_norm_w"], m.bindings["expert_norm_w"]) == ("g_in", "g_out")
    assert m.verified.startswith("numeric"), m.verified
    _randomise_out_norm(block)  # the op reads the weights; a zero g_out proves nothing about (1 + g)
    x = torch.randn(3, 7, H)
    with torch.no_grad():
        assert _rel(_op(block, m, x), block(x)) <= TOL
    gm, before, after = rewrite_block_graph(block, torch.randn(2, 5, H))
    assert [dm.op_name(n) for n in gm.graph.nodes].count("moe_forward") == 1
    assert _rel(after, before) <= TOL


class Router(nn.Module):
    """Returns (its scaled logits, weights, ids), as MuseSpark's router does: the attribute reader measures the scale
    from the logits it returns."""

    def __init__(self, g):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H, generator=g) * 0.3)
        # (the attribute reader finds a correction bias by name)
        self.e_score_correction_bias = nn.Parameter(torch.randn(E, generator=g) * 0.1)
        self.routed_scaling_factor = 1.5

    def forward(self, x):
        logits = (x @ self.weight.t()) * 0.25
        s = torch.sigmoid(logits)
        idx = torch.topk(s + self.e_score_correction_bias, K, dim=-1).indices
        w = s.gather(1, idx)
        return logits, w / (w.sum(dim=-1, keepdim=True) + 1e-12) * self.routed_scaling_factor, idx


class ScaledNorm(nn.Module):
    """rms(round(v * (1 + w))) (the input-scaled form), as a module."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(n)), eps

    def forward(self, v):
        t = (v.float() * (1.0 + self.weight).float()).to(v.dtype).float()
        return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps)).to(v.dtype)


class Experts(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, L, generator=g) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, L, I, generator=g) * 0.2)
        self.out_norm = ScaledNorm(L, 1e-6)
        self.act_fn = nn.SiLU()

    def forward(self, x, ids, weights):
        flat = ids.reshape(-1)
        h = torch.bmm(x.repeat_interleave(K, 0).unsqueeze(1), self.gate_up_proj[flat].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((self.act_fn(gate) * up).unsqueeze(1), self.down_proj[flat].transpose(1, 2)).squeeze(1)
        return (self.out_norm(y).view(-1, K, L) * weights.unsqueeze(-1)).sum(1)


class ModuleBlock(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.top_k = K
        self.router = Router(g)
        self.to_small, self.to_big = nn.Linear(H, L, bias=False), nn.Linear(L, H, bias=False)
        self.small_norm = OneMinusScaleNorm(L, 1e-5)
        self.experts = Experts(g)
        with torch.no_grad():
            for p in (self.to_small.weight, self.to_big.weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        _, w, idx = self.router(x)
        return self.to_big(self.experts(self.small_norm(self.to_small(x)), idx, w)).view(shape)


def test_module_norms_and_the_attribute_reader(poison):
    """The norms as child modules, the scale inside a router module: the pass reads them from the graph, the
    attribute reader names them by their one [L] vector and measures form, eps and scale, and both agree."""
    block = ModuleBlock().eval()
    m = detect_block(block, torch.randn(2, 5, H))
    s = m.spec
    assert (s.router_scale, s.latent_norm, s.latent_norm_eps, s.expert_norm, s.expert_norm_eps) == (
        0.25, "rms_1p", 1e-5, "scaled_rms_1p", 1e-6), s.describe()
    assert (m.bindings["latent_norm_w"], m.bindings["expert_norm_w"]) == ("small_norm.w", "experts.out_norm.weight")
    with torch.no_grad():
        block.small_norm.w.copy_(torch.randn(L, generator=torch.Generator().manual_seed(8)) * 0.3)
        block.experts.out_norm.weight.copy_(torch.randn(L, generator=torch.Generator().manual_seed(9)) * 0.3)
    x = torch.randn(4, H)
    with torch.no_grad():
        assert _rel(_op(block, m, x), block(x)) <= TOL
    v = match_block(block, use_fx=False)
    assert v.match.spec == s and v.match.method == "fallback", (v.match.spec.describe(), s.describe())


def test_norm_in_another_order_is_refused():
    """rms(y) * (1 + g) on each expert's output: not the spec's input-scaled form, and the numeric check (with g
    drawn at random) tells them apart: no rewrite."""
    with pytest.raises(DetectError) as e:
        detect_block(Block(out_norm="after").eval(), torch.randn(2, 5, H))
    assert "numeric check failed" in e.value.reason, e.value.reason
