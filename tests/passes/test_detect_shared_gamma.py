"""The FX pass on a hand-written block with router-given shared-expert gammas (``MoESpec.shared_gamma``
"joint_renorm", ``SharedExpertSpec.stacked``, ``has_weight_scale``; Inkling's HF form is tests/hf/test_inkling.py),
spelled differently from Inkling and with other part names: the router a plain ``nn.Linear`` [E + S, H] named
``scorer`` in the model dtype; sigmoid scores sliced ``[:, :E]`` (not ``[..., :-S]``); the chosen *scores* gathered and
concatenated with the shared *scores* (or each part scored on its own slice of the logits, ``narrow``), renormalised by ``w / w.sum(-1, keepdim=True)`` (not logsumexp), times a
constant and a learned [1] Parameter; the experts in a per-expert gathered ``bmm``; the shared experts stacked in
``ParameterDict`` children of unknown names, their gammas applied after the down bmm (or before it, as Inkling). The pass reads every field from
the graph, the numeric check proves it; the op equals the block. A router whose extra rows are not renormalised
with the chosen ones is refused.

Tolerances: fp32, max abs error / max |block output| <= 1e-5 (the op's GEMMs are the block's in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moecomp.recognise.capture import DetectError, detect_block
from moecomp.core.args import OP_ARGS
from moecomp.recognise.fx import detect_moe as dm
from moecomp.testing import rewrite_block_graph

H, I, E, K, S, IS = 32, 16, 6, 2, 3, 12
TOL = 1e-5


class GammaMoE(nn.Module):
    def __init__(self, joint: bool = True, seed: int = 0, sliced: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.joint, self.sliced = joint, sliced
        self.scorer = nn.Linear(H, E + S, bias=False)
        with torch.no_grad():
            self.scorer.weight.copy_(torch.randn(E + S, H, generator=g) * 0.3)
        self.steer = nn.Parameter(torch.randn(E, generator=g) * 0.05)
        self.gscale = nn.Parameter(torch.tensor([1.3]))
        self.bank = nn.ParameterDict(dict(w_in=nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.2),
                                          w_out=nn.Parameter(torch.randn(E, H, I, generator=g) * 0.2)))
        self.always = nn.ParameterDict(dict(g=nn.Parameter(torch.randn(S, IS, H, generator=g) * 0.2),
                                            u=nn.Parameter(torch.randn(S, IS, H, generator=g) * 0.2),
                                            d=nn.Parameter(torch.randn(S, H, IS, generator=g) * 0.2)))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        if self.sliced:  # each part scored on its own slice of the logits
            logits = self.scorer(x)
            routed_scores, shared_scores = torch.sigmoid(logits[:, :E]), torch.sigmoid(logits.narrow(-1, E, S))
        else:
            scores = torch.sigmoid(self.scorer(x))
            routed_scores, shared_scores = scores[:, :E], scores[:, E:]
        ids = torch.topk(routed_scores + self.steer, K, dim=-1).indices
        chosen = routed_scores.gather(1, ids)
        if self.joint:
            w = torch.cat([chosen, shared_scores], dim=1)
            w = w / w.sum(-1, keepdim=True) * 2.0 * self.gscale
            routed_w, gam = w[:, :K], w[:, K:]
        else:  # the extra rows scored apart: not the joint renormalisation
            routed_w = chosen / chosen.sum(-1, keepdim=True)
            gam = shared_scores
        flat = ids.reshape(-1)
        h = torch.bmm(x.repeat_interleave(K, 0).unsqueeze(1), self.bank.w_in[flat].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.bank.w_out[flat].transpose(1, 2)).squeeze(1)
        routed = (y.view(-1, K, H) * routed_w.unsqueeze(-1)).sum(1)
        xs = x.unsqueeze(0).expand(S, -1, -1)
        a = F.silu(torch.bmm(xs, self.always.g.transpose(1, 2))) * torch.bmm(xs, self.always.u.transpose(1, 2))
        if self.sliced:  # the gammas before the down bmm (as Inkling)
            shared = torch.bmm(a * gam.t().unsqueeze(-1), self.always.d.transpose(1, 2)).sum(0)
        else:  # after it
            shared = (torch.bmm(a, self.always.d.transpose(1, 2)) * gam.t().unsqueeze(-1)).sum(0)
        return (routed + shared).reshape(shape)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _op(block, m, x):
    args = [None if m.bindings.get(k) is None else block.get_parameter(m.bindings[k]) for k in OP_ARGS]
    return torch.ops.moecomp.moe_forward(x, *args[:11], m.spec.key, *args[11:])


@pytest.mark.parametrize("sliced", [False, True])
def test_gamma_block_is_read_and_proven(poison, sliced):
    block = GammaMoE(sliced=sliced).eval()
    m = detect_block(block, torch.randn(2, 5, H))
    s = m.spec
    assert (s.num_experts, s.top_k, s.scoring, s.shared_gamma, s.has_weight_scale, s.routed_scaling_factor) == (
        E, K, "sigmoid", "joint_renorm", True, 2.0), s.describe()
    assert s.shared is not None and (s.shared.stacked, s.shared.intermediate_size, s.shared.gate) == (S, IS, "none")
    assert {k: m.bindings[k] for k in ("router_w", "weight_scale", "shared_w1", "shared_w3", "shared_w2")} == dict(
        router_w="scorer.weight", weight_scale="gscale", shared_w1="always.g", shared_w3="always.u", shared_w2="always.d")
    assert m.verified.startswith("numeric"), m.verified
    x = torch.randn(3, 7, H)
    with torch.no_grad():
        assert _rel(_op(block, m, x), block(x)) <= TOL
    gm, before, after = rewrite_block_graph(block, torch.randn(2, 5, H))
    assert [dm.op_name(n) for n in gm.graph.nodes].count("moe_forward") == 1
    assert _rel(after, before) <= TOL


def test_extra_router_rows_scored_apart_are_refused():
    with pytest.raises(DetectError, match="renormalised together"):
        detect_block(GammaMoE(joint=False).eval(), torch.randn(2, 5, H))


def test_optimize_finds_and_binds_it(poison):
    """The whole pipeline: the block finder takes it by its shapes (no part names it knows), the FX pass reads it,
    verify proves it, the binder binds it (one moe_forward per call)."""
    import moecomp
    from moecomp.coverage.families import count_calls_per_block

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.moe = nn.Linear(H, H), GammaMoE(sliced=True)

        def forward(self, x):
            return self.moe(self.inp(x))

    model = Model().eval()
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        want = model(x)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["moe"], str(rep)
    assert rep.rewritten[0].spec.shared_gamma == "joint_renorm"
    with torch.no_grad():
        out, per, total = count_calls_per_block(model, lambda: model(x))
    assert per == {"moe": 1} and total == 1 and _rel(out, want) <= TOL
