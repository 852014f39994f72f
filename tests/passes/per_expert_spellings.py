"""More ways an author writes the same top-k softmax per-expert-loop MoE (issue 21, part 3): each block below is a
plausible spelling of ``per_expert_blocks``' loop (sizes H = 16, I = 8, E = 4, top-2; weights from
``per_expert_blocks._redraw``). ``SPELLINGS`` maps a name to the block class; ``test_per_expert_spellings`` states
what each must give.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from per_expert_blocks import E, H, I, K, BiasedExpert, GatedExpert, _sequential


class FusedExpert(nn.Module):
    """down(silu(g) * u) with g, u = gate_up(x).chunk(2, -1): one fused first linear."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(H, 2 * I, bias=False)
        self.down = nn.Linear(I, H, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class _Base(nn.Module):
    def __init__(self, expert=GatedExpert):
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([expert() for _ in range(E)])

    def route(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    def forward(self, hidden):
        """[..., H] in: the loop (``mix``) runs on the flattened [T, H] tokens."""
        return self.mix(hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape)


class Nonzero(_Base):
    """``(ids == e).nonzero()`` columns for token / slot, ``range(self.num_experts)``."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            nz = (ids == e).nonzero()
            tok, slot = nz[:, 0], nz[:, 1]
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1))
        return out


class MaskAny(_Base):
    """A boolean token mask ``(ids == e).any(-1)``, ``x[mask]``, ``out[mask] += ...``; the token's weight for e as
    ``(w * (ids == e)).sum(-1)``."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = ids == e
            mask = hit.any(dim=-1)
            we = (w * hit).sum(-1)
            out[mask] += expert(x[mask]) * we[mask, None]
        return out


class IndexAddOutOfPlace(_Base):
    """``out = out.index_add(0, tok, ...)`` (not in place), experts as ``Sequential(Linear, GELU, Linear)``."""

    def __init__(self):
        super().__init__(expert=_sequential)

    def mix(self, x):
        w, ids = self.route(x)
        out = x.new_zeros(x.shape)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            out = out.index_add(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class ScatterAdd(_Base):
    """``out.scatter_add_(0, tok[:, None].expand(-1, H), ...)``."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            y = expert(x[tok]) * w[tok, slot][:, None]
            out.scatter_add_(0, tok[:, None].expand(-1, x.shape[-1]), y)
        return out


class IndexPutAdd(_Base):
    """``out[tok] += ...`` (an expert appears at most once in a token's top-k, so rows do not repeat)."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out[tok] += expert(x[tok]) * w[tok, slot, None]
        return out


class WeightOnHidden(_Base):
    """The routing weight scales h before the down projection (equal to scaling the output: no down bias)."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            xs = x[tok]
            h = F.silu(ex.w1(xs)) * ex.w3(xs) * w[tok, slot, None]
            out.index_add_(0, tok, ex.w2(h))
        return out


class WeightOnInput(_Base):
    """The routing weight scales the expert's input (Llama 4's apply-weight-on-input), top-1 sigmoid-free softmax."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok] * w[tok, slot, None]))
        return out


class OneHotTokenMajor(_Base):
    """``one_hot(ids, E).permute(2, 0, 1)[e]`` ([T, k] per expert), experts in a ModuleDict with non-numeric keys
    iterated by ``.values()``."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleDict({f"expert_{e}": GatedExpert() for e in range(E)})

    def mix(self, x):
        w, ids = self.route(x)
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 0, 1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts.values()):
            tok, slot = torch.where(mask[e])
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class OneHotSummed(_Base):
    """A [T, E] token-expert mask ``one_hot(ids, E).sum(1)``, its column e's nonzero rows, the weight as a dense
    [T, E] matrix ``zeros.scatter(1, ids, w)``."""

    def mix(self, x):
        w, ids = self.route(x)
        mask = F.one_hot(ids, self.num_experts).sum(dim=1)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=w.dtype).scatter(1, ids, w)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok = torch.nonzero(mask[:, e]).squeeze(-1)
            out.index_add_(0, tok, self.experts[e](x[tok]) * dense[tok, e, None])
        return out


class FusedGateUp(_Base):
    """Experts with one fused ``gate_up`` linear, ``chunk``ed; router a bare Parameter ``x @ W.T``; top-k of the
    logits, then softmax."""

    def __init__(self):
        super().__init__(expert=FusedExpert)
        del self.gate
        self.router_w = nn.Parameter(torch.empty(E, H))

    def mix(self, x):
        vals, ids = torch.topk(x @ self.router_w.T, self.top_k, dim=-1)
        w = vals.softmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class DenseScattered(_Base):
    """Every expert on every token, weighted by column e of a dense [T, E] weight ``zeros.scatter(1, ids, w)``;
    router ``F.linear`` of a bare Parameter, not renormalised."""

    def __init__(self):
        super().__init__()
        del self.gate
        self.router_w = nn.Parameter(torch.empty(E, H))

    def mix(self, x):
        w, ids = F.softmax(F.linear(x, self.router_w), dim=-1).topk(self.top_k, dim=-1)
        dense = torch.zeros_like(x[:, :self.num_experts]).scatter(1, ids, w)
        out = 0
        for e, expert in enumerate(self.experts):
            out = out + dense[:, e:e + 1] * expert(x)
        return out


class DenseStacked(_Base):
    """``torch.stack([expert(x) for expert in experts], 1)`` weighted by the dense [T, E] weight, summed."""

    def mix(self, x):
        w, ids = self.route(x)
        dense = torch.zeros(x.shape[0], self.num_experts).scatter(1, ids, w)
        ys = torch.stack([expert(x) for expert in self.experts], dim=1)
        return (ys * dense[..., None]).sum(dim=1)


class SlotLoop(_Base):
    """A loop over the k slots, then the experts: ``mask = ids[:, j] == e``, ``out[mask] += w[mask, j] * ...``."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for j in range(self.top_k):
            for e in range(self.num_experts):
                mask = ids[:, j] == e
                out[mask] += w[mask, j, None] * self.experts[e](x[mask])
        return out


class RepeatInterleave(_Base):
    """Tokens repeated k times, ``y[flat == e] = expert(xr[flat == e])``, then ``(y.view(T, k, H) * w).sum(1)``;
    biased experts (fc1 / fc2)."""

    def __init__(self):
        super().__init__(expert=BiasedExpert)

    def mix(self, x):
        w, ids = self.route(x)
        flat = ids.view(-1)
        xr = x.repeat_interleave(self.top_k, dim=0)
        y = torch.empty_like(xr)
        for e in range(self.num_experts):
            y[flat == e] = self.experts[e](xr[flat == e])
        return (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1)


class UniqueIds(_Base):
    """Only the experts some token picked: ``for e in ids.unique().tolist()`` (data-dependent loop)."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class ThreeDInput(_Base):
    """[B, S, H] in, flattened and restored; gating by ``torch.where(..., w, 0)`` as a dense [T, k] weight."""

    def forward(self, hidden):
        b, s, h = hidden.shape
        x = hidden.reshape(b * s, h)
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = ids == e
            we = torch.where(hit, w, torch.zeros_like(w)).sum(-1, keepdim=True)
            tok = hit.any(-1).nonzero(as_tuple=True)[0]
            out.index_add_(0, tok, expert(x[tok]) * we[tok])
        return out.reshape(b, s, h)


class SigmoidFloatMask(_Base):
    """Sigmoid scores, top-k, renormalised; every expert on every token, weighted by
    ``(w * ids.eq(e).float()).sum(-1, keepdim=True)``; ``out = out + ...``."""

    def mix(self, x):
        w, ids = torch.sigmoid(self.gate(x)).topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            out = out + self.experts[e](x) * (w * ids.eq(e).float()).sum(-1, keepdim=True)
        return out


class SkipEmpty(_Base):
    """``counts = bincount(ids)``, ``if counts[e] == 0: continue`` (a data-dependent branch: Dynamo cannot capture)."""

    def mix(self, x):
        w, ids = self.route(x)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class GatherWeight(_Base):
    """Weights ``scores.gather(1, ids)``, not renormalised; flat (token, slot) pairs: ``sel = ids.reshape(-1) == e``,
    the token of each pair from ``arange(T).repeat_interleave(k)``."""

    def mix(self, x):
        scores = self.gate(x).softmax(-1)
        ids = scores.topk(self.top_k, dim=-1).indices
        flat_ids, flat_w = ids.reshape(-1), scores.gather(1, ids).reshape(-1)
        tok_of = torch.arange(x.shape[0]).repeat_interleave(self.top_k)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            sel = flat_ids == e
            t = tok_of[sel]
            out.index_add_(0, t, self.experts[e](x[t]) * flat_w[sel, None])
        return out


SPELLINGS = {
    "nonzero": Nonzero,
    "mask_any": MaskAny,
    "index_add_out_of_place": IndexAddOutOfPlace,
    "scatter_add": ScatterAdd,
    "index_put_add": IndexPutAdd,
    "weight_on_hidden": WeightOnHidden,
    "weight_on_input": WeightOnInput,
    "one_hot_token_major": OneHotTokenMajor,
    "one_hot_summed": OneHotSummed,
    "fused_gate_up": FusedGateUp,
    "dense_scattered": DenseScattered,
    "dense_stacked": DenseStacked,
    "slot_loop": SlotLoop,
    "repeat_interleave": RepeatInterleave,
    "unique_ids": UniqueIds,
    "three_d_input": ThreeDInput,
    "sigmoid_float_mask": SigmoidFloatMask,
    "skip_empty": SkipEmpty,
    "gather_weight": GatherWeight,
}
