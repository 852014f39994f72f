"""A block that adds its own [H] tensor to the MoE result (JetMoE's ``return layer_output + self.bias``): found by
running it (``epilogue.find_output_bias``: raising the tensor by d raises the output by d), zeroed while the MoE part
is recognised (the FX pass sees an add of zeros, an identity), bound as ``moe_forward(x) + bias`` and checked whole.

Equivalence: fresh [2, 5, H] inputs, NaN-poisoned outputs, fp32, max |diff| / max |block| <= 1e-5; the bias is
read live (a changed bias changes the bound block's output the same way) and its values are untouched by
``optimize``. A [H] tensor that scales the output instead is not a bias: the block is refused with its reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moecomp
from moecomp.core.reject import RejectCode

H, I, E, K = 24, 12, 6, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BiasedMoE(nn.Module):
    def __init__(self, scale_instead: bool = False):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.bias = nn.Parameter(torch.randn(H) * 0.5)
        self.scale_instead = scale_instead

    def moe(self, x):
        flat = x.reshape(-1, H)
        w, ids = torch.topk(self.gate(flat).softmax(-1), K, dim=-1)
        out = torch.zeros_like(flat)
        for i, ex in enumerate(self.experts):
            tok, slot = torch.where(ids == i)
            out.index_add_(0, tok, ex(flat[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)

    def forward(self, x):
        out = self.moe(x)
        return out * self.bias if self.scale_instead else out + self.bias


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = nn.Sequential(BiasedMoE(**kw), nn.LayerNorm(H), BiasedMoE(**kw))
    for p in m.parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.2)
    return m.eval()


def _x(seed):
    return torch.randn(2, 5, H, generator=torch.Generator().manual_seed(seed))


def test_output_bias_rewritten_whole_and_equal(poison):
    m = _model(1)
    biases = [m[0].bias.detach().clone(), m[2].bias.detach().clone()]
    _, rep = moecomp.optimize(m, report=True)
    assert [b.name for b in rep.rewritten] == ["0", "2"], str(rep)
    assert all(b.epilogue == ["bias"] for b in rep.rewritten)
    assert torch.equal(m[0].bias, biases[0]) and torch.equal(m[2].bias, biases[1])  # restored after the peel
    x = _x(2)
    with torch.no_grad():
        got = m(x)
        m[2].bias.add_(1.0)  # the bound block reads the live tensor
        got_moved = m(x)
    moecomp.unoptimize(m)
    with torch.no_grad():
        ref_moved = m(x)
        m[2].bias.sub_(1.0)
        ref = m(x)
    assert torch.isfinite(got).all()
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    assert ((got_moved - ref_moved).abs().max() / ref_moved.abs().max()).item() <= 1e-5
    assert not torch.allclose(got_moved, got)


def test_a_scale_is_not_a_bias():
    m = _model(3, scale_instead=True)
    x = _x(4)
    with torch.no_grad():
        want = m(x)
    _, rep = moecomp.optimize(m, report=True)
    assert rep.rewritten == [] and len(rep.blocks) == 2
    assert all("post-processes the MoE result" in b.reason for b in rep.blocks), [b.reason for b in rep.blocks]
    with torch.no_grad():
        assert torch.equal(m(x), want)  # left untouched


def test_a_bias_that_is_zero_now_is_still_bound(poison):
    """A zero bias (a model not loaded yet) adds nothing on the probes, but it is found by what a change of it does:
    bound as an output bias, so values loaded later reach the output."""
    m = _model(5)
    with torch.no_grad():
        for b in (m[0], m[2]):
            b.bias.zero_()
    _, rep = moecomp.optimize(m, report=True)
    assert [b.epilogue for b in rep.rewritten] == [["bias"], ["bias"]], str(rep)
    x = _x(6)
    with torch.no_grad():
        m[0].bias.normal_()
        m[2].bias.normal_()
        got = m(x)
        moecomp.unoptimize(m)
        ref = m(x)
    assert torch.isfinite(got).all() and ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


class ZeroTensorMoE(BiasedMoE):
    """The MoE result with a zero block tensor of ``shape`` (a buffer) added (``use="add"``) or applied as a gain
    ``out * (1 + t)`` (``use="gain"``): zero at optimize time, it changes nothing on any probe."""

    def __init__(self, shape, use: str):
        super().__init__()
        del self.bias
        self.register_buffer("extra", torch.zeros(*shape))
        self.use = use

    def forward(self, x):
        out = self.moe(x)
        return out + self.extra if self.use == "add" else out * (1 + self.extra)


@pytest.mark.parametrize("shape", [(1, 1, H), (1, H)])
def test_a_zero_broadcast_tensor_added_is_bound_as_a_bias(poison, shape):
    """A zero [1, 1, H] / [1, H] buffer added to the MoE result: the FX pass's numeric check once folded the add of
    zeros into the MoE and bound the block without it (wrong as soon as the buffer is not zero). It is an output bias
    (one value per feature): bound as ``moe_forward(x) + extra`` and read live."""
    torch.manual_seed(7)
    m = nn.Sequential(ZeroTensorMoE(shape, "add")).eval()
    _, rep = moecomp.optimize(m, report=True)
    assert [b.epilogue for b in rep.rewritten] == [["extra"]], str(rep)
    x = _x(8)
    with torch.no_grad():
        m[0].extra.normal_()
        got = m(x)
        moecomp.unoptimize(m)
        ref = m(x)
    assert torch.isfinite(got).all() and ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_a_zero_tensor_used_otherwise_is_refused():
    """A zero [1, 1, H] buffer used as a gain ``out * (1 + t)``: no bias, and the numeric check gives it random
    values (the op would never read it), so the multiply is a tail the block applies: refused with the reason."""
    torch.manual_seed(7)
    m = nn.Sequential(ZeroTensorMoE((1, 1, H), "gain")).eval()
    _, rep = moecomp.optimize(m, report=True)
    assert rep.rewritten == [] and "post-processes the MoE result" in rep.blocks[0].reason, str(rep)
    assert RejectCode.NOT_RECOGNISED in rep.blocks[0].codes
