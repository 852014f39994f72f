"""What the FX pass refuses, and says why, where the block computes more than any spec does (issue 21: Inkling2's
softcapped SwiGLU, MuseSpark's scaled router logits).

A softcap ``tanh(x / c) * c`` between the expert GEMMs beside a sigmoid once passed for silu * up: the numeric check
alone stood in the way, and with a cap far beyond the check's values (here 1000: the check's error would be ~1e-7)
the block was bound, wrong wherever activations reach the cap. Ops that belong to no activation the spec knows
refuse the block, whatever the check says; softcaps are now a spec feature (``MoESpec.gate_softcap`` /
``up_softcap``, tests/passes/test_detect_softcap.py): the cap of 1000 is read as such and the bound op equals the
block where the activations reach it. Router logits scaled before the scoring are refused with that reason.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.core.reject import RejectCode

H, I, E, K = 16, 8, 4, 2


class Block(nn.Module):
    def __init__(self, cap: float | None = None, logit_scale: float | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(E, H, generator=g) * 0.5)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.3)
        self.down = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.3)
        self.cap, self.logit_scale = cap, logit_scale

    def forward(self, x):
        flat = x.reshape(-1, H)
        logits = flat @ self.router.T
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        w, ids = torch.topk(logits.sigmoid(), K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        h = torch.einsum("th,tknh->tkn", flat, self.gate_up[ids])
        g, u = h.chunk(2, dim=-1)
        if self.cap is not None:  # tanh softcaps on the gate's linear factor and on up (Inkling2's SwiGLU)
            act = torch.tanh(g / self.cap) * self.cap * torch.sigmoid(g) * (torch.tanh(u / self.cap) * self.cap)
        else:
            act = F.silu(g) * u
        y = torch.einsum("tki,tkhi->tkh", act, self.down[ids])
        return (y * w[..., None]).sum(1).reshape(x.shape)


def _x():
    return torch.randn(1, 3, H, generator=torch.Generator().manual_seed(1))


def test_plain_block_is_read():
    assert detect_block(Block(), _x()).spec.activation == "silu"


def test_a_softcap_beyond_the_check_is_read_as_one():
    """Cap 1000: invisible on the check's values, read from the graph, and right where the activations reach it
    (expert input weights scaled so that gate / up pass 1000; op against block, max |diff| / max |ref| <= 1e-5,
    fp32)."""
    b = Block(cap=1000.0)
    x = _x()
    with torch.no_grad():  # the premise: on ordinary values the cap changes nothing the check could see
        assert (b(x) - Block()(x)).abs().max() / Block()(x).abs().max() < 1e-5
    m = detect_block(b, x)
    assert (m.spec.activation, m.spec.gate_softcap, m.spec.up_softcap) == ("silu", 1000.0, 1000.0), m.spec.describe()
    with torch.no_grad():
        b.gate_up.mul_(3000.0)
        h = torch.einsum("th,enh->ten", x.reshape(-1, H), b.gate_up)
        args = [None if p is None else b.get_parameter(p) for p in m.bindings.values()]
        got, want = torch.ops.moecomp.moe_forward(x, *args, m.spec.key), b(x)
    assert h.abs().max() > 2000, "the activations must reach past the cap"
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_an_unexplained_op_is_refused_whatever_the_numeric_check_says():
    """An ``exp`` factor beside silu * up (a term no spec activation has, ~1 on the check's values) refuses the block
    with the op named."""
    class Odd(Block):
        def forward(self, x):
            flat = x.reshape(-1, H)
            w, ids = torch.topk((flat @ self.router.T).sigmoid(), K, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            g, u = torch.einsum("th,tknh->tkn", flat, self.gate_up[ids]).chunk(2, dim=-1)
            act = F.silu(g) * u * torch.exp(g * 1e-9)  # ~1 on the check's values
            y = torch.einsum("tki,tkhi->tkh", act, self.down[ids])
            return (y * w[..., None]).sum(1).reshape(x.shape)

    try:
        detect_block(Odd(), _x())
    except DetectError as e:
        assert e.code is RejectCode.NOT_RECOGNISED and "['exp'] between the GEMMs" in e.reason, e.reason
    else:
        raise AssertionError("an exp between the GEMMs was read as a spec activation")


def test_scaled_router_logits_are_read_as_router_scale():
    """Logits times a constant before the scoring (MuseSpark's output_multiplier) are MoESpec.router_scale now; the
    numeric check proves it (a scale of 1 would pick other experts on the probes)."""
    m = detect_block(Block(logit_scale=2.0), _x())
    assert m.spec.router_scale == 2.0, m.spec.describe()
