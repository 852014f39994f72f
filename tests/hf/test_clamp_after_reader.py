"""The activation clamped after it (``activation_clamp_after``: min(act(g), L) * clamp(u, -L, L), Step-3.7-Flash's
``limit_after_act``) measured, not read, by the attribute reader's probes (``probe/activations.py``): the experts'
``_apply_gate`` (``probe_gate``) and a dense MLP called whole (``probe_mlp``), on synthetic modules; the near
variants the spec lacks named (``describe_unknown_gate``); verify's activation check refusing a spec that drops the
clamp or takes it for the other one; and transformers' own Step-3.7 (the ``step3p7:limits`` variant: routed and
shared experts clamped at 0.5) read whole by the attribute reader and by the experts interface. Probe inputs
(pre-activations over about +-20 / +-25) and tolerances: ``moecomp.core.policy``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecomp.probe import activations as A
from moecomp.coverage import families as Fam
from moecomp.recognise.structure import iter_blocks, mlp_parts


class GateExperts(nn.Module):
    """An experts module as transformers writes them: ``_apply_gate`` over gate / up concatenated or interleaved,
    its clamp limit an attribute."""

    def __init__(self, fn, limit, interleaved=False):
        super().__init__()
        self.fn, self.limit, self.interleaved = fn, limit, interleaved

    def _apply_gate(self, gate_up):
        g, u = (gate_up[..., 0::2], gate_up[..., 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)
        return self.fn(g, u, self.limit)


class ClampMLP(nn.Module):
    """Step-3.7's dense / shared MLP: gate_proj, up_proj, down_proj; ``fn`` between them with ``limit``."""

    def __init__(self, fn, limit, H=32, I=24):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.fn, self.limit = fn, limit

    def forward(self, x):
        return self.down_proj(self.fn(self.gate_proj(x), self.up_proj(x), self.limit))


def after(act):
    return lambda g, u, L: act(g).clamp(max=L) * u.clamp(-L, L)


def before(act):
    return lambda g, u, L: act(g.clamp(max=L)) * u.clamp(-L, L)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_probe_gate_tells_the_two_clamps_apart(act, interleaved):
    fn = {"silu": F.silu, "gelu": F.gelu}[act]
    lay = "interleaved" if interleaved else "concat"
    # (L = 2: silu(2) = 1.76, gelu(2) = 1.95; at L = 7 gelu(7) = 7 in fp32 and the two forms are one function)
    r = A.probe_gate(GateExperts(after(fn), 2.0, interleaved), None)
    assert r == A.GateReading(act, lay, 1.702, 2.0, False, clamp_after=True)
    r = A.probe_gate(GateExperts(before(fn), 2.0, interleaved), None)
    assert r == A.GateReading(act, lay, 1.702, 2.0, True)
    # without a limit attribute nothing clamped is tried: no reading
    unnamed = GateExperts(after(fn), 2.0, interleaved)
    unnamed.fn = lambda g, u, L, _f=unnamed.fn: _f(g, u, 2.0)
    unnamed.limit = None
    assert A.probe_gate(unnamed, None) is None


def test_probe_mlp_reads_the_clamp_after():
    block = nn.Module()
    block.shared = ClampMLP(after(F.silu), 4.0)
    mp = mlp_parts(block.shared, "shared", 32)
    assert A.probe_mlp(block, mp) == A.MlpReading("silu", False, 1.702, 4.0, clamp_after=True)
    block.shared = ClampMLP(before(F.silu), 4.0)
    assert A.probe_mlp(block, mp) == A.MlpReading("silu", True, 1.702, 4.0)
    block.shared = ClampMLP(lambda g, u, L: F.silu(g) * u, 4.0)  # a limit attribute, no clamp
    assert A.probe_mlp(block, mp) == A.MlpReading("silu", False, 1.702, 7.0)


@pytest.mark.parametrize("fn, words", [
    (lambda g, u, L: F.silu(g).clamp(max=L) * u, "the activation's output clamped, min(silu(gate), 5)"),
    (lambda g, u, L: F.silu(g.clamp(max=L)) * u, "the gate clamped before its activation, silu(min(gate, 5))"),
    (lambda g, u, L: F.gelu(g) * u.clamp(-L, L), "only up clamped, gelu(gate)"),
])
def test_near_variants_are_named_not_read(fn, words):
    experts = GateExperts(fn, 5.0)
    assert A.probe_gate(experts, None) is None
    what = A.describe_unknown_gate(experts)
    assert words in what and "no MoESpec field" in what, what
    assert A.describe_unknown_gate(GateExperts(after(F.silu), 5.0)) == ""  # (known: read, not described)


needs_step3p7 = pytest.mark.skipif(not (Fam.transformers_dir() and os.path.isdir(
    os.path.join(Fam.transformers_dir(), "models", "step3p7"))), reason="this transformers has no step3p7")


def _step3p7_block():
    model, _ = Fam.build_tiny("step3p7:limits")
    name, block, parts, reason = iter_blocks(model)[0]
    assert parts is not None, reason
    return block.eval(), parts


@needs_step3p7
def test_step3p7_read_by_the_attribute_reader():
    from moecomp.recognise import fallback as fb

    block, parts = _step3p7_block()
    s = fb.static_extract(block, parts).spec
    assert (s.activation, s.activation_clamp_after, s.activation_clamp, s.activation_limit) == ("silu", True, False,
                                                                                                0.5)
    assert (s.shared.activation_clamp_after, s.shared.activation_clamp, s.shared.activation_limit) == (True, False,
                                                                                                       0.5)
    assert A.activation_mismatch(block, parts, s) is None
    # dropped, or taken for the clamp before the activation: refused, for the routed and for the shared experts
    sh = s.shared
    for routed, shared in ((dict(activation_clamp_after=False), {}),
                           (dict(activation_clamp_after=False, activation_clamp=True), {}),
                           ({}, dict(activation_clamp_after=False)),
                           ({}, dict(activation_clamp_after=False, activation_clamp=True))):
        wrong = s.replace(**routed, shared=sh.__class__(**{**sh.__dict__, **shared}))
        assert "differs" in A.activation_mismatch(block, parts, wrong), (routed, shared)


@pytest.mark.skipif("step3p7" not in Fam.experts_families(), reason="step3p7's experts are decorated from 5.25")
def test_step3p7_experts_interface():
    """``experts_implementation="moecomp"``'s reader on Step-3.7's experts module: the clamp read from
    ``_apply_gate``, the module's own forward matching ``moe_experts`` on a probe."""
    from moecomp.hf import experts_interface as ei

    block, parts = _step3p7_block()
    m = next(m for m in block.modules() if Fam.is_experts_class(type(m)))
    spec = ei.experts_spec(m, top_k=2)
    assert (spec.activation_clamp_after, spec.activation_limit) == (True, 0.5)
    err, tol = ei.verify_experts(m, spec)
    assert err <= tol
    err, tol = ei.verify_experts(m, spec.replace(activation_clamp_after=False))
    assert err > tol
