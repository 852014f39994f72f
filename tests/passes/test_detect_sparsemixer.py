"""Sparsemixer routing (``score_order == "sparsemixer"``) recognised by what the graph computes: PhiMoE's tiny model
(transformers) rewritten whole by both recognisers (FX pass and attribute reader), and the same routing written here
in another spelling (``torch.argmax``, ``torch.where``, the threshold as ``gap > 2 eps * max(|s|, m)``, three
rounds, experts gathered per pair and ``bmm``). Refused, with UNSUPPORTED_ROUTING: a look-alike whose threshold is
on the absolute gap (the probe rows tell it apart), and PhiMoE traced in training mode (Gumbel sampling).

Tolerances: whole-model logits (fp32) within 1e-4 of eager relative to their largest value
(``moecomp.coverage.families.TOL``); the plain block's output within 1e-5 of its own forward (fp32 op on the CPU path).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moecomp
from moecomp.recognise.capture import DetectError, detect_block
from moecomp.api.optimize import rewritten_blocks
from moecomp.core.reject import RejectCode

H, I, E, K = 32, 16, 6, 3


def rel_err(a, ref) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


class OwnMixer(nn.Module):
    """K sparsemixer rounds in another spelling than transformers' (``absolute``: the threshold on the gap itself,
    not relative to max(|s|, m): a look-alike that is not sparsemixer)."""

    def __init__(self, eps: float = 0.05, absolute: bool = False, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.eps, self.absolute = eps, absolute
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, H, I, generator=g) / math.sqrt(I))
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H) * 0.3)  # logits close together

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        s = self.gate(x)  # [T, E]
        cur, picks, ws = s, [], []
        for _ in range(K):
            i = torch.argmax(cur, dim=-1, keepdim=True)  # [T, 1]
            m = cur.gather(1, i)
            bound = 2 * self.eps if self.absolute else 2 * self.eps * torch.maximum(s.abs(), m)
            g = torch.where((m - s) > bound, float("-inf"), cur)
            ws.append(torch.softmax(g, dim=-1).gather(1, i))
            picks.append(i)
            cur = cur.scatter(1, i, float("-inf"))
        ids, w = torch.cat(picks, dim=-1).reshape(-1), torch.cat(ws, dim=-1)  # [T * K], [T, K]
        xs = x.repeat_interleave(K, dim=0)  # [T * K, H]
        h = torch.bmm(xs.unsqueeze(1), self.w13[ids].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.w2[ids].transpose(1, 2)).squeeze(1)
        return (y.view(-1, K, H) * w.unsqueeze(-1)).sum(1).view(shape)


def test_own_spelling_is_recognised():
    block = OwnMixer().eval()
    m = detect_block(block, torch.randn(2, 20, H))
    s = m.spec
    assert (s.score_order, s.top_k, s.jitter_eps, s.renormalize, s.num_experts) == ("sparsemixer", K, 0.05, False, E)
    assert m.verified.startswith("numeric"), m.verified
    x = torch.randn(3, 9, H)
    args = [None if p is None else block.get_parameter(p) for p in m.bindings.values()]
    with torch.no_grad():
        assert rel_err(torch.ops.moecomp.moe_forward(x, *args, s.key), block(x)) <= 1e-5


def test_absolute_threshold_is_refused():
    with pytest.raises(DetectError) as e:
        detect_block(OwnMixer(absolute=True).eval(), torch.randn(2, 5, H))
    codes = [r.code for _, r in e.value.rejected]
    assert codes == [RejectCode.UNSUPPORTED_ROUTING], e.value.reason
    assert "do not compute sparsemixer routing on probe logits" in e.value.reason


# ------------------------------------------------------------------------------------------------- PhiMoE
def _phimoe():
    pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    from moecomp.coverage import families as fam

    return fam, fam.build_tiny("phimoe", seed=0)[0]


def _logits(model, seed: int):
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("use_capture", [True, False], ids=["fx", "attributes"])
def test_phimoe_rewritten_whole(use_capture):
    """Both blocks rewritten, one moe_forward call each, the threshold read from router.router_jitter_noise; logits
    within 1e-4. A changed threshold is noticed (original forward, re-bound by optimize); training-mode calls run
    the original forward (its routing samples)."""
    fam, model = _phimoe()
    ref = copy.deepcopy(model)
    _, rep = moecomp.optimize(model, report=True, use_capture=use_capture)
    assert [b.status for b in rep.blocks] == ["rewritten"] * 2, str(rep)
    assert all(b.method == ("fx" if use_capture else "fallback") for b in rep.blocks), str(rep)
    specs = [blk._moecomp.spec for blk in rewritten_blocks(model).values()]
    assert [(s.score_order, s.jitter_eps, s.top_k, s.renormalize) for s in specs] == [("sparsemixer", 0.01, 2,
                                                                                     False)] * 2
    out, per, total = fam.count_calls_per_block(model, lambda: _logits(model, 1))
    assert total == 2 and sorted(per.values()) == [1, 1]
    assert rel_err(out, _logits(ref, 1)) <= fam.TOL
    for mm in (model, ref):
        for layer in mm.model.layers:
            layer.mlp.router.router_jitter_noise = 0.2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _, total = fam.count_calls_per_block(model, lambda: _logits(model, 2))
    assert total == 0 and any("router_jitter_noise" in str(w.message) for w in caught)
    assert rel_err(out, _logits(ref, 2)) <= fam.TOL
    _, rep = moecomp.optimize(model, report=True, use_capture=use_capture)
    assert [blk._moecomp.spec.jitter_eps for blk in rewritten_blocks(model).values()] == [0.2, 0.2], str(rep)
    out, _, total = fam.count_calls_per_block(model, lambda: _logits(model, 3))
    assert total == 2 and rel_err(out, _logits(ref, 3)) <= fam.TOL
    model.train()
    _, _, total = fam.count_calls_per_block(model, lambda: _logits(model, 4))
    assert total == 0


def test_phimoe_training_trace_is_refused():
    """PhiMoE traced in training mode draws its experts by Gumbel sampling (``exponential_``): UNSUPPORTED_ROUTING,
    saying why."""
    _, model = _phimoe()
    block = model.model.layers[0].mlp.train()
    with torch.no_grad(), pytest.raises(DetectError) as e:
        detect_block(block, torch.randn(1, 3, block.hidden_dim))
    assert [r.code for _, r in e.value.rejected] == [RejectCode.UNSUPPORTED_ROUTING], e.value.reason
    assert "sampled" in e.value.reason and "exponential_" in e.value.reason
