"""The FX pass on blocks that apply the routing weight to the expert *input* (``MoESpec.weight_on_input``; Llama 4,
whose HF form is in tests/hf/test_llama4.py), written here in plain PyTorch in another spelling: top-2 softmax,
renormalised, a sparse dispatch (``repeat_interleave``, gathered expert matrices, ``bmm``, ``index_add_``). The pass
reads it from what the graph computes (the weights are an ancestor of the first expert GEMM) and the numeric check
proves it, for stacked expert weights and for per-expert modules; a block that weights both the input and the output
is refused, and a scale of the routed output is not folded into the routing (it stays as a tail)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiny_models as tm
from moecomp.recognise.capture import DetectError, detect_block
from moecomp.ops.moe_op import MOE_ARGS
from moecomp.recognise.fx import detect_moe as dm
from moecomp.testing import rewrite_block_graph

H, I, E, K = 32, 24, 6, 2


class OnInputMoE(nn.Module):
    """expert_e(w * x) summed over the top-k, unweighted."""

    def __init__(self, seed=0):
        super().__init__()
        tm._router_and_experts(self, H, I, E, seed)

    def experts(self, xs, flat):
        h = torch.bmm(xs.unsqueeze(1), self.w13[flat].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm((F.silu(gate) * up).unsqueeze(1), self.w2[flat].transpose(1, 2)).squeeze(1)

    def routing(self, x):
        w, idx = torch.topk(torch.softmax(self.gate(x), dim=-1), K, dim=-1)
        return w / w.sum(-1, keepdim=True), idx

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, idx = self.routing(x)
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(K, dim=0) * w.reshape(-1, 1)  # the weight on the expert's input
        out = torch.zeros_like(x)
        out.index_add_(0, torch.arange(x.shape[0]).repeat_interleave(K), self.experts(xs, flat))
        return out.view(shape)


class BothSidesMoE(OnInputMoE):
    """w * expert(w * x): no spec computes it."""

    def forward(self, x):
        x = x.reshape(-1, H)
        w, idx = self.routing(x)
        flat = idx.reshape(-1)
        ys = self.experts(x.repeat_interleave(K, dim=0) * w.reshape(-1, 1), flat) * w.reshape(-1, 1)
        return ys.view(-1, K, H).sum(1)


class ScaledOutMoE(OnInputMoE):
    """2 * sum_k expert(w * x): routed scaling would scale the input, not the output (the experts are not linear)."""

    def forward(self, x):
        return super().forward(x) * 2.0


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PerExpertOnInputMoE(nn.Module):
    """Experts as a ModuleList, a loop that skips experts without tokens, each expert on x[tok] * weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([_Expert() for _ in range(E)])
        with torch.no_grad():
            self.gate.weight.mul_(5)

    def forward(self, x):
        x = x.reshape(-1, H)
        w, idx = torch.topk(torch.softmax(self.gate(x), -1), K)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, self.experts[e](x[tok] * w[tok, slot, None]))
        return out


def _get(block, path):
    return block.get_parameter(path)


def test_weight_on_input_is_read_and_proven(poison):
    block = OnInputMoE().eval()
    x = torch.randn(2, 5, H)
    m = detect_block(block, x)
    s = m.spec
    assert (s.weight_on_input, s.scoring, s.renormalize, s.top_k) == (True, "softmax", True, K), s.describe()
    assert m.verified.startswith("numeric"), m.verified
    x = torch.randn(3, 7, H)
    args = [None if m.bindings[k] is None else _get(block, m.bindings[k]) for k in MOE_ARGS]
    with torch.no_grad():
        got, want = torch.ops.moecomp.moe_forward(x, *args, s.key), block(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    # the rewritten graph computes the same
    gm, before, after = rewrite_block_graph(block, torch.randn(2, 5, H))
    assert [dm.op_name(n) for n in gm.graph.nodes].count("moe_forward") == 1
    assert ((after - before).abs().max() / before.abs().max()).item() <= 1e-5


def test_both_sides_is_refused():
    with pytest.raises(DetectError) as e:
        detect_block(BothSidesMoE().eval(), torch.randn(2, 5, H))
    assert "numeric check failed" in e.value.reason, e.value.reason


def test_scaled_output_stays_a_tail():
    """The scale is not folded into routed_scaling_factor (which would scale the input): the MoE ends before it and
    the multiply is a tail the rewrite leaves in place (detect_block refuses a tail unless allowed)."""
    m = detect_block(ScaledOutMoE().eval(), torch.randn(2, 5, H), allow_tail=True)
    assert m.spec.weight_on_input and m.spec.routed_scaling_factor == 1.0
    assert not m.output_is_graph_output and m.tail_ops == ("mul",)


def test_per_expert_modules():
    """The same reading for experts kept as per-expert modules (the loop traced with real values)."""
    m = detect_block(PerExpertOnInputMoE().eval(), torch.randn(64, H), real_values=True)
    assert m.spec.weight_on_input and m.spec.top_k == K, m.spec.describe()
    assert m.verified.startswith("numeric") and {d.name for d in m.derived} == {"_moecomp_w13", "_moecomp_w2"}
