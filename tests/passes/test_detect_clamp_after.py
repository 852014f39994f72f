"""The FX pass on blocks whose experts clamp the activation's output (``MoESpec.activation_clamp_after``,
Step-3.7-Flash's ``limit_after_act``; its HF form is pinned in tests/hf/test_families.py as ``step3p7:limits``):
min(act(g), L) * clamp(u, -L, L), written here in plain PyTorch in several spellings (``F.silu`` or
``g * sigmoid(g)``, gelu, ``clamp`` / ``clamp_max`` / ``torch.clamp``, in fp32 or not), in gathered experts (one
graph), in a loop over the experts (unrolled: one activation per expert), and in a shared expert with a limit of its
own. The pass reads the form and L from the graph; the numeric check proves it with the pre-activations driven past L
(a limit out of reach of the check's plain values is still proven: ``test_stress_proves_the_form``). Clamps that are
neither of the spec's clamped SwiGLUs are refused. Tolerance: the op against the block, max |diff| / max |ref| <= 1e-5
(fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.recognise.fx import detect_moe as dm
from moecomp.recognise.fx import moe_activation
from moecomp.testing import rewrite_block_graph

H, I, E, K, IS = 32, 24, 6, 2, 16


def after(act, L):
    return lambda g, u: act(g).clamp(max=L) * u.clamp(-L, L)


ACTS = {  # name: (h(gate, up), activation, L)
    "silu": (after(F.silu, 0.5), "silu", 0.5),
    "sigmoid_spelling_clamp_max": (lambda g, u: torch.clamp_max(g * torch.sigmoid(g), 0.7)
                                   * torch.clamp(u, min=-0.7, max=0.7), "silu", 0.7),
    "gelu": (after(F.gelu, 0.6), "gelu", 0.6),
    "fp32": (lambda g, u: (F.silu(g.float()).clamp(max=0.5) * u.float().clamp(-0.5, 0.5)).to(g.dtype), "silu", 0.5),
    "large_limit": (after(F.silu, 12.0), "silu", 12.0),  # out of the check's plain reach: the stress proves it
}
BAD = {  # name: (h(gate, up), the reason's words)
    "up_unclamped": (lambda g, u: F.silu(g).clamp(max=0.5) * u, "not one gate clamp(max=L) and one up clamp"),
    "two_limits": (lambda g, u: F.silu(g).clamp(max=0.5) * u.clamp(-0.6, 0.6), "not one gate clamp(max=L)"),
    "act_clamped_both_sides": (lambda g, u: F.silu(g).clamp(-0.5, 0.5) * u.clamp(-0.5, 0.5),
                               "not one gate clamp(max=L)"),
    "clamped_act_not_times_up": (lambda g, u: F.silu(g).clamp(max=0.5) + u.clamp(-0.5, 0.5) * g,
                                 "do not feed act(gate) * up"),
}


class ClampAfterMoE(nn.Module):
    """Step-3.7-style routing (sigmoid scores + correction bias, top-k, renormalised, scaled 1.5); stacked experts
    gathered per pair (``loop``: a loop over the experts instead); ``act`` between the GEMMs; optionally a gated
    shared expert with ``shared_act``."""

    def __init__(self, act, shared_act=None, loop: bool = False, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.act, self.shared_act, self.loop = act, shared_act, loop
        self.gate = nn.Linear(H, E, bias=False)
        self.bias = nn.Parameter(torch.randn(E, generator=g) * 0.1)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, H, I, generator=g) / math.sqrt(I))
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H) * 2)
        self.shared = None
        if shared_act is not None:
            self.shared = nn.ModuleDict(dict(gate_proj=nn.Linear(H, IS, bias=False),
                                             up_proj=nn.Linear(H, IS, bias=False),
                                             down_proj=nn.Linear(IS, H, bias=False)))

    def _experts(self, x, idx, w):
        if self.loop:
            out = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.where(idx == e)
                g, u = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
                out.index_add_(0, tok, F.linear(self.act(g, u), self.w2[e]) * w[tok, slot, None])
            return out
        ids = idx.reshape(-1)
        xs = x.repeat_interleave(K, dim=0)  # [T * K, H]: each pair's expert gathered (w13[ids], bmm)
        gate, up = torch.bmm(xs.unsqueeze(1), self.w13[ids].transpose(1, 2)).squeeze(1).chunk(2, dim=-1)
        y = torch.bmm(self.act(gate, up).unsqueeze(1), self.w2[ids].transpose(1, 2)).squeeze(1).view(-1, K, H)
        return (y * w.unsqueeze(-1)).sum(1)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        scores = torch.sigmoid(self.gate(x))
        idx = torch.topk(scores + self.bias, K, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * 1.5
        out = self._experts(x, idx, w)
        if self.shared is not None:
            s = self.shared
            out = out + s.down_proj(self.shared_act(s.gate_proj(x), s.up_proj(x)))
        return out.view(shape)


def _detect(block, x):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        return detect_block(block, x)


def _run_op(block, m, x):
    args = [None if p is None else block.get_parameter(p) for p in m.bindings.values()]
    with torch.no_grad():
        return torch.ops.moecomp.moe_forward(x, *args, m.spec.key), block(x)


@pytest.mark.parametrize("name", sorted(ACTS))
def test_clamp_after_is_read_and_proven(poison, name):
    act, activation, L = ACTS[name]
    block = ClampAfterMoE(act).eval()
    m = _detect(block, torch.randn(2, 40, H))
    s = m.spec
    assert (s.activation, s.gated, s.activation_clamp_after, s.activation_clamp, s.activation_limit) == (
        activation, True, True, False, L), s.describe()
    assert (s.scoring, s.has_correction_bias, s.routed_scaling_factor) == ("sigmoid", True, 1.5)
    assert m.verified.startswith("numeric") and "clamps binding" in m.verified, m.verified
    got, want = _run_op(block, m, torch.randn(3, 7, H) * 3 * max(1.0, L))  # wide inputs: the clamps bind
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_shared_expert_with_its_own_limit_and_expert_loop(poison):
    """Routed experts in a loop (one activation per expert) clamped at 0.5, the shared expert at 0.3."""
    block = ClampAfterMoE(after(F.silu, 0.5), after(F.silu, 0.3), loop=True).eval()
    m = _detect(block, torch.randn(2, 40, H))
    s = m.spec
    assert (s.activation_clamp_after, s.activation_limit) == (True, 0.5), s.describe()
    assert (s.shared.activation, s.shared.activation_clamp_after, s.shared.activation_clamp,
            s.shared.activation_limit) == ("silu", True, False, 0.3)
    got, want = _run_op(block, m, torch.randn(3, 7, H) * 3)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_shared_expert_alone_clamped_after():
    """Plain routed experts beside a shared expert clamped after its activation: only the shared spec has it."""
    block = ClampAfterMoE(lambda g, u: F.silu(g) * u, after(F.silu, 0.4)).eval()
    s = _detect(block, torch.randn(2, 40, H)).spec
    assert not s.activation_clamp_after and not s.activation_clamp
    assert (s.shared.activation_clamp_after, s.shared.activation_limit) == (True, 0.4)


def test_clamp_before_in_sigmoid_spelling_is_the_other_form():
    """The gate clamped before x * sigmoid(x) (DeepSeek-V4's form, silu spelled out) is ``activation_clamp``."""
    def before(g, u):
        m = g.clamp(max=0.5)
        return m * torch.sigmoid(m) * u.clamp(-0.5, 0.5)

    s = _detect(ClampAfterMoE(before).eval(), torch.randn(2, 40, H)).spec
    assert (s.activation, s.activation_clamp, s.activation_clamp_after, s.activation_limit) == ("silu", True, False,
                                                                                                0.5)


@pytest.mark.parametrize("name", sorted(BAD))
def test_other_clamps_are_refused(name):
    act, words = BAD[name]
    with pytest.raises(DetectError) as e:
        _detect(ClampAfterMoE(act).eval(), torch.randn(2, 40, H))
    assert words in e.value.reason, e.value.reason


def test_stress_proves_the_form(monkeypatch):
    """A clamp after the activation at L = 5 (about 5 standard deviations of the pre-activations: no plain check value
    reaches it) read as the other clamped SwiGLU (the gate clamped before the activation: the same function until g
    passes L, then silu(5) = 4.97 against 5) agrees with the block on the plain check values; only the stress round,
    with the pre-activations driven past L, refuses it. (Far larger limits make the two forms agree to within
    L * exp(-L) everywhere: there either reading computes the block.)"""
    monkeypatch.setattr(moe_activation, "_clamp_is_after", lambda *a: False)
    with pytest.raises(DetectError) as e:
        _detect(ClampAfterMoE(after(F.silu, 5.0)).eval(), torch.randn(2, 40, H))
    assert "not once the activation clamps bind" in e.value.reason, e.value.reason


def test_rewritten_graph_matches():
    block = ClampAfterMoE(ACTS["fp32"][0], after(F.silu, 0.3)).eval()
    gm, before, after_ = rewrite_block_graph(block, torch.randn(2, 5, H) * 3)
    ops = [dm.op_name(n) for n in gm.graph.nodes]
    assert ops.count("moe_forward") == 1 and not {"clamp", "clamp_max", "clamp_min"} & set(ops)
    assert ((after_ - before).abs().max() / before.abs().max()).item() <= 1e-5
