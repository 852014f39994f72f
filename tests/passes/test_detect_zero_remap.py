"""Zero experts handled by the block, not by its experts (LongCat-Flash's spelling from transformers 5.25), in modules
of our own: the router scores E + Z outputs, the stacked expert weights hold E experts, and the block

    identity = x * (weights at the slots whose id >= E, summed)
    ids      = where(id >= E, a dummy id in [0, E), id)        weights = 0 at those slots
    out      = experts(x, ids, weights) + identity

so the experts compute every slot and the dummy slots add nothing. The block finder takes the router of E + Z rows
next to experts of E (``BlockParts.extra_rows``), the attribute reader refuses it (what the extra outputs compute is
in the forward), the FX pass reads ``zero_experts = Z`` from the router's width against the weights' and its numeric
check proves it on tokens some of which take zero experts; how the dummy ids are spelled (spread over the experts as
transformers does, or clamped to the last) and how their weight is zeroed (``masked_fill``, a multiply by the mask)
leave the spec unchanged. A block whose dummy slots keep their weight computes something else and is refused.
The E + Z-row weight spelling (5.24) is in test_detect_zero_experts.py; the HF model in tests/hf/test_longcat.py.

Tolerances: fp32, max |op - block| / max |block| <= 1e-5 (the numeric check's own bound is 1e-4)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moecomp
from moecomp.recognise.capture import DetectError, detect_block
from moecomp.core.derived import get_path
from moecomp.coverage import families as fam
from moecomp.recognise.fallback import FallbackError, static_extract
from moecomp.recognise.structure import NotABlock, find_parts, iter_blocks

H, I, E, Z, K = 32, 24, 6, 3, 2
SCALE = 2.0
TOL = 1e-5


class Router(nn.Module):
    """softmax over E + Z logits, top-k of scores + a correction bias, weights = scores at the ids * SCALE."""

    def __init__(self, g: torch.Generator, outputs: int = E + Z):
        super().__init__()
        self.classifier = nn.Linear(H, outputs, bias=False)
        self.e_score_correction_bias = nn.Buffer(torch.randn(outputs, generator=g) * 0.05)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.randn(outputs, H, generator=g) / math.sqrt(H) * 2)

    def forward(self, x):
        scores = self.classifier(x).softmax(-1)
        ids = torch.topk(scores + self.e_score_correction_bias, K, dim=-1).indices
        return scores.gather(1, ids) * SCALE, ids


class Experts(nn.Module):
    """E experts stacked (gate_up [E, 2I, H], down [E, H, I]): sum_k w * expert_id(x), gathered per pair (bmm) or a
    loop over the experts (constant ids, ``index_add_``)."""

    def __init__(self, g: torch.Generator, loop: bool):
        super().__init__()
        self.loop = loop
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g) / math.sqrt(I))

    def forward(self, x, ids, w):
        if self.loop:
            out = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.where(ids == e)
                gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
                out.index_add_(0, tok, F.linear(F.silu(gate) * up, self.down_proj[e]) * w[tok, slot, None])
            return out
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(K, dim=0)
        h = torch.bmm(xs.unsqueeze(1), self.gate_up_proj[flat].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.down_proj[flat].transpose(1, 2)).squeeze(1)
        return (y.view(-1, K, H) * w.unsqueeze(-1)).sum(1)


class RemapZeroMoE(nn.Module):
    """The block-level spelling (module docstring). ``dummy``: "spread" ((id - E) * E // Z, transformers') or
    "clamp" (E - 1); ``zeroing``: "masked_fill" or "mul" (weights * ~mask); ``keep_weight``: the dummy slots keep
    their weights (a different computation)."""

    def __init__(self, *, loop: bool = False, dummy: str = "spread", zeroing: str = "masked_fill",
                 keep_weight: bool = False, seed: int = 0, router_outputs: int = E + Z):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.router = Router(g, router_outputs)
        self.experts = Experts(g, loop)
        self.dummy, self.zeroing, self.keep_weight = dummy, zeroing, keep_weight

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, ids = self.router(x)
        mask = ids >= E
        identity = x * w.masked_fill(~mask, 0.0).sum(-1, keepdim=True)
        dummy = (ids - E) * E // Z if self.dummy == "spread" else torch.full_like(ids, E - 1)
        ids = torch.where(mask, dummy, ids)
        if not self.keep_weight:
            w = w.masked_fill(mask, 0.0) if self.zeroing == "masked_fill" else w * (~mask).to(w.dtype)
        return (self.experts(x, ids, w) + identity).view(shape)


def _op_vs_block(block, m, x):
    args = [None if p is None else get_path(block, p) for p in m.bindings.values()]
    with torch.no_grad():
        got, want = torch.ops.moecomp.moe_forward(x, *args, m.spec.key), block(x)
    assert torch.isfinite(got).all()
    return ((got - want).abs().max() / want.abs().max()).item()


def _reaches_both(router, x) -> bool:
    """Does ``x`` route some pairs to zero experts and some to real ones?"""
    with torch.no_grad():
        ids = router(x.reshape(-1, H))[1]
    return bool((ids >= E).any() and (ids < E).any())


@pytest.mark.parametrize("loop,dummy,zeroing", [(False, "spread", "masked_fill"), (False, "clamp", "mul"),
                                                (True, "clamp", "masked_fill")])
def test_block_level_zero_experts_are_read_and_proven(poison, loop, dummy, zeroing):
    """zero_experts = Z whatever the dummy ids and the zeroing; both weights bound as they are (no view). (The loop
    is traced with real values, where torch 2.13 cannot trace an integer ``//``: its fake ``prims.signbit`` is not
    bool. So the loop takes the clamped dummy ids; transformers' loop-free grouped_mm path takes the ``//``.)"""
    block = RemapZeroMoE(loop=loop, dummy=dummy, zeroing=zeroing).eval()
    m = detect_block(block, torch.randn(2, 40, H), real_values=loop)
    s = m.spec
    assert (s.num_experts, s.zero_experts, s.top_k, s.scoring, s.has_correction_bias, s.renormalize) == (
        E, Z, K, "softmax", True, False), s.describe()
    assert s.routed_scaling_factor == pytest.approx(SCALE) and s.shared is None, s.describe()
    assert m.verified.startswith("numeric"), m.verified
    assert (m.bindings["w13"], m.bindings["w2"], m.bindings["router_w"], m.bindings["correction_bias"]) == (
        "experts.gate_up_proj", "experts.down_proj", "router.classifier.weight", "router.e_score_correction_bias")
    assert not m.derived, m.derived
    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(5))
    assert _reaches_both(block.router, x), "the input must reach zero experts and real ones"
    assert _op_vs_block(block, m, x) <= TOL


def test_dummy_slots_that_keep_their_weight_are_refused():
    """The dummy ids' slots weighted as before: each such slot adds x * w and a real expert's output; no spec says
    that, and the numeric check refuses the block."""
    with pytest.raises(DetectError) as e:
        detect_block(RemapZeroMoE(keep_weight=True).eval(), torch.randn(2, 40, H))
    assert "numeric check failed" in e.value.reason, e.value.reason


def test_the_block_finder_takes_a_router_wider_than_the_experts():
    """Router [E + Z, H] next to experts of E: a candidate whose parts say so (the correction bias found at the
    router's width); the attribute reader refuses it with why. A router of 2E rows or more is not taken for one."""
    p = find_parts(RemapZeroMoE())
    assert (p.kind, p.num_experts, p.extra_rows, p.router_weight, p.correction_bias, p.w13, p.w2) == (
        "fused", E, Z, "router.classifier.weight", "router.e_score_correction_bias", "experts.gate_up_proj",
        "experts.down_proj"), p
    with pytest.raises(FallbackError) as e:
        static_extract(RemapZeroMoE())
    assert f"has {E + Z} outputs but the experts hold {E}" in str(e.value) and "only the FX pass" in str(e.value)
    with pytest.raises(NotABlock):
        find_parts(RemapZeroMoE(router_outputs=2 * E))
    assert find_parts(RemapZeroMoE(router_outputs=E)).extra_rows == 0


class Layer(nn.Module):
    def __init__(self, seed: int, loop: bool):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.mlp = RemapZeroMoE(seed=seed, loop=loop, dummy="clamp" if loop else "spread")

    def forward(self, x):
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize("loop", [False, True])
def test_optimize_rewrites_them_whole(poison, loop):
    """Two layers of the block-level spelling: optimize rewrites both by the FX pass (the loop traced with real
    values over enough tokens for the router's E + Z outputs), one moe_forward each, and the model's output is the
    original's on fresh inputs that reach zero experts; unoptimize gives the forwards back."""
    model = nn.Sequential(Layer(1, loop), Layer(2, loop)).eval()
    assert [n for n, _, p, _ in iter_blocks(model) if p is not None] == ["0.mlp", "1.mlp"]
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(6))
    assert all(_reaches_both(layer.mlp.router, layer.norm(x)) for layer in model)
    with torch.no_grad():
        want = model(x)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["0.mlp", "1.mlp"] and len(rep.blocks) == 2, str(rep)
    assert all(b.method == "fx" and b.spec.zero_experts == Z and b.spec.num_experts == E for b in rep.rewritten)
    with torch.no_grad():  # (with grad the bound forward runs the original: the op has no backward)
        got, per, total = fam.count_calls_per_block(model, lambda: model(x))
    assert per == {"0.mlp": 1, "1.mlp": 1} and total == 2
    assert torch.isfinite(got).all() and ((got - want).abs().max() / want.abs().max()).item() <= TOL
    moecomp.unoptimize(model)
    with torch.no_grad():
        assert torch.equal(model(x), want)
