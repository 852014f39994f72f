"""The FX pass on blocks whose experts compute a softcapped SwiGLU (``MoESpec.gate_softcap`` / ``up_softcap``;
Inkling2, whose HF form is pinned in tests/hf/test_families.py), written here in plain PyTorch in several spellings:
``tanh(v / c) * c`` or ``c * tanh(v * (1 / c))``, in fp32 or not, on the gate's linear factor and / or up, in the
routed experts and in a shared expert. The pass reads the caps from the graph; the numeric check (with the
pre-activations driven past the caps) proves them. A sigmoid of the capped gate, or a tanh that is no softcap, is
refused. Tolerance: the op against the block, max |diff| / max |ref| <= 1e-5 (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.recognise.fx import detect_moe as dm
from moecomp.testing import rewrite_block_graph

H, I, E, K, IS = 32, 24, 6, 2, 16


def cap_div(v, c):
    return torch.tanh(v / c) * c


def cap_mul(v, c):
    return c * torch.tanh(v * (1.0 / c))


ACTS = {  # name: (h(gate, up), gate cap, up cap)
    "both_fp32": (lambda g, u: (cap_div(g.float(), 4.0) * torch.sigmoid(g.float()) * cap_div(u.float(), 2.5)
                                ).to(g.dtype), 4.0, 2.5),
    "both_mul_spelling": (lambda g, u: cap_mul(u, 1.5) * (torch.sigmoid(g) * cap_mul(g, 0.75)), 0.75, 1.5),
    "up_only_silu": (lambda g, u: F.silu(g) * cap_div(u, 2.0), 0.0, 2.0),
    "large_caps": (lambda g, u: cap_div(g, 40.0) * torch.sigmoid(g) * cap_div(u, 300.0), 40.0, 300.0),
}
BAD = {  # name: (h(gate, up), the reason's words)
    "sigmoid_of_capped_gate": (lambda g, u: F.silu(cap_div(g, 2.0)) * cap_div(u, 2.0), "sigmoid of a softcapped"),
    "not_a_softcap": (lambda g, u: torch.tanh(g / 2.0) * 3.0 * torch.sigmoid(g) * u, "is not a softcap"),
    "gelu_capped": (lambda g, u: F.gelu(g) * cap_div(u, 2.0), "only a gated silu"),
    "two_up_caps": (lambda g, u: F.silu(g) * cap_div(u, 2.0) * cap_div(u, 3.0), "softcaps 2 and 3"),
}


class SoftcapMoE(nn.Module):
    """Inkling2-style routing: sigmoid scores + correction bias, top-k, renorm (eps 1e-20), scaling 2.5; stacked
    experts gathered per pair (Inkling2's own loop over experts: tests/hf); ``act`` between the GEMMs; optionally a
    gated shared expert with the same activation."""

    def __init__(self, act, shared: bool = False, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.act = act
        self.gate = nn.Linear(H, E, bias=False)
        self.bias = nn.Parameter(torch.randn(E, generator=g) * 0.1)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H) * 2)
        self.w2 = nn.Parameter(torch.randn(E, H, I, generator=g) / math.sqrt(I))
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H) * 2)
        self.shared = None
        if shared:
            self.shared = nn.ModuleDict(dict(gate_proj=nn.Linear(H, IS, bias=False),
                                             up_proj=nn.Linear(H, IS, bias=False),
                                             down_proj=nn.Linear(IS, H, bias=False)))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        scores = torch.sigmoid(self.gate(x))
        idx = torch.topk(scores + self.bias, K, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
        ids = idx.reshape(-1)
        xs = x.repeat_interleave(K, dim=0)  # [T * K, H]: each pair's expert gathered (w13[ids], bmm)
        gate, up = torch.bmm(xs.unsqueeze(1), self.w13[ids].transpose(1, 2)).squeeze(1).chunk(2, dim=-1)
        y = torch.bmm(self.act(gate, up).unsqueeze(1), self.w2[ids].transpose(1, 2)).squeeze(1).view(-1, K, H)
        out = (y * w.unsqueeze(-1)).sum(1)
        if self.shared is not None:
            s = self.shared
            out = out + s.down_proj(self.act(s.gate_proj(x), s.up_proj(x)))
        return out.view(shape)


def _run_op(block, m, x):
    args = [None if p is None else block.get_parameter(p) for p in m.bindings.values()]
    with torch.no_grad():
        return torch.ops.moecomp.moe_forward(x, *args, m.spec.key), block(x)


@pytest.mark.parametrize("name", sorted(ACTS))
def test_softcaps_are_read_and_proven(poison, name):
    act, cg, cu = ACTS[name]
    block = SoftcapMoE(act, shared=name == "both_fp32").eval()
    m = detect_block(block, torch.randn(2, 40, H))
    s = m.spec
    assert (s.activation, s.gated, s.gate_softcap, s.up_softcap) == ("silu", True, cg, cu), s.describe()
    assert (s.scoring, s.has_correction_bias, s.renorm_eps, s.routed_scaling_factor) == ("sigmoid", True, 1e-20, 2.5)
    if block.shared is not None:
        assert (s.shared.gate_softcap, s.shared.up_softcap, s.shared.activation) == (cg, cu, "silu")
    assert m.verified.startswith("numeric"), m.verified
    got, want = _run_op(block, m, torch.randn(3, 7, H) * 3)  # wide inputs: the caps bend
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("name", sorted(BAD))
def test_other_tanh_uses_are_refused(name):
    act, words = BAD[name]
    with pytest.raises(DetectError) as e:
        detect_block(SoftcapMoE(act).eval(), torch.randn(2, 40, H))
    assert words in e.value.reason, e.value.reason


def test_rewritten_graph_matches():
    block = SoftcapMoE(ACTS["both_fp32"][0], shared=True).eval()
    gm, before, after = rewrite_block_graph(block, torch.randn(2, 5, H) * 3)
    assert [dm.op_name(n) for n in gm.graph.nodes].count("moe_forward") == 1
    assert "tanh" not in [dm.op_name(n) for n in gm.graph.nodes]
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-5
