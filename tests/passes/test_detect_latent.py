"""The FX pass on blocks whose routed experts run between latent projections (``MoESpec.latent_size``; NemotronH's
``moe_latent_size``, whose HF form is tests/hf/test_nemotron_latent.py), written here in plain PyTorch in another
spelling and with other part names: a softmax top-2 router on x, the experts on ``to_small(x)`` (gathered expert
matrices, ``bmm``, a weighted ``view(T, k, L).sum(1)``), ``to_big`` after the combine, a sigmoid-gated shared expert
on x. The pass reads the projections from what the graph computes and the numeric check proves them; the attribute
reader finds them by their shapes ([L, H] and [H, L] linear children) and agrees. A routed scale after an unbiased
output projection, or before a biased one, is routed scaling; after a biased one the spec cannot express it and the
block is refused.

Tolerances: fp32, max abs error / max |block output| <= 1e-5 (the op's GEMMs are the block's in another order)."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.core.args import OP_ARGS
from moecomp.recognise.fx import detect_moe as dm
from moecomp.recognise.recognise import match_block
from moecomp.testing import rewrite_block_graph

H, L, I, E, K, IS = 32, 24, 16, 6, 2, 12
TOL = 1e-5


class Experts(nn.Module):
    """Stacked gated experts of width L: (x [T, L], ids [T, k], weights [T, k]) -> [T, L]."""

    def __init__(self, g):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, L, generator=g) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, L, I, generator=g) * 0.2)
        self.act_fn = nn.SiLU()

    def forward(self, x, ids, weights):
        flat = ids.reshape(-1)
        h = torch.bmm(x.repeat_interleave(K, 0).unsqueeze(1), self.gate_up_proj[flat].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((self.act_fn(gate) * up).unsqueeze(1), self.down_proj[flat].transpose(1, 2)).squeeze(1)
        return (y.view(-1, K, L) * weights.unsqueeze(-1)).sum(1)


class SharedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, IS, bias=False), nn.Linear(H, IS, bias=False)
        self.down_proj = nn.Linear(IS, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LatentMoE(nn.Module):
    def __init__(self, bias: bool = True, shared: bool = True, scale_after: float | None = None,
                 scale_inside: float | None = None, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.top_k = K
        self.router = nn.Linear(H, E, bias=False)
        self.to_small, self.to_big = nn.Linear(H, L, bias=bias), nn.Linear(L, H, bias=bias)
        self.experts = Experts(g)
        self.shared_expert = None
        if shared:
            self.shared_expert = SharedMLP()
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.scale_after, self.scale_inside = scale_after, scale_inside
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.startswith("experts"):
                    p.copy_(torch.randn(p.shape, generator=g) * (0.6 if name.startswith("router") else 0.2))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, idx = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        routed = self.experts(self.to_small(x), idx, w)  # [T, L]
        out = self.to_big(routed if self.scale_inside is None else routed * self.scale_inside)
        if self.scale_after is not None:
            out = out * self.scale_after
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _op(block, m, x):
    args = [None if m.bindings.get(k) is None else block.get_parameter(m.bindings[k]) for k in OP_ARGS]
    return torch.ops.moecomp.moe_forward(x, *args[:11], m.spec.key, *args[11:])


def test_latent_block_is_read_and_proven(poison):
    block = LatentMoE().eval()
    m = detect_block(block, torch.randn(2, 5, H))
    s = m.spec
    assert (s.hidden_size, s.latent_size, s.latent_bias, s.top_k, s.gated) == (H, L, True, K, True), s.describe()
    assert s.shared is not None and s.shared.gate == "sigmoid" and s.shared.intermediate_size == IS
    assert {k: m.bindings[k] for k in ("latent_in_w", "latent_in_b", "latent_out_w", "latent_out_b")} == dict(
        latent_in_w="to_small.weight", latent_in_b="to_small.bias", latent_out_w="to_big.weight",
        latent_out_b="to_big.bias")
    assert m.verified.startswith("numeric"), m.verified
    x = torch.randn(3, 7, H)
    with torch.no_grad():
        assert _rel(_op(block, m, x), block(x)) <= TOL
    # the compile backend's rewrite of the captured graph: one moe_forward, the same result
    gm, before, after = rewrite_block_graph(block, torch.randn(2, 5, H))
    assert [dm.op_name(n) for n in gm.graph.nodes].count("moe_forward") == 1
    assert _rel(after, before) <= TOL
    # the attribute reader (projections found by shape) and the verify stage give the same spec
    v = match_block(block, use_fx=False)
    assert v.match.spec == s and v.match.method == "fallback", (v.match.spec.describe(), s.describe())


def test_scale_after_an_unbiased_projection_is_routed_scaling():
    block = LatentMoE(bias=False, scale_after=2.0).eval()
    m = detect_block(block, torch.randn(2, 5, H))
    assert (m.spec.latent_size, m.spec.latent_bias, m.spec.routed_scaling_factor) == (L, False, 2.0)
    x = torch.randn(9, H)
    with torch.no_grad():
        assert _rel(_op(block, m, x), block(x)) <= TOL


def test_scale_before_a_biased_projection_is_routed_scaling():
    """Wo (2 r) + bo: routed scaling. The FX pass folds the multiply; the attribute reader sees unscaled routing
    weights and the verify stage fits the 2 on the routed part without the output bias (which it does not scale)."""
    block = LatentMoE(bias=True, scale_inside=2.0).eval()
    m = detect_block(block, torch.randn(2, 5, H))
    assert (m.spec.latent_bias, m.spec.routed_scaling_factor) == (True, 2.0), m.spec.describe()
    assert match_block(block, use_fx=False).match.spec == m.spec


def test_scale_after_a_biased_projection_is_refused():
    """2 * (Wo r + bo): the spec's routed scaling scales r only (the model's order); the bias scaled too is not a form
    the spec has, so no rewrite."""
    with pytest.raises(DetectError) as e:
        detect_block(LatentMoE(bias=True, scale_after=2.0).eval(), torch.randn(2, 5, H))
    assert "not a form MoESpec expresses" in e.value.reason, e.value.reason
