"""Sorted dispatch (issue 21, part 3): the same top-k softmax MoE as ``per_expert_spellings`` (H = 16, I = 8, E = 4,
top-2, renormalised), written the way many real models dispatch: the (token, slot) pairs sorted by expert id, the
per-expert counts, one contiguous run of sorted rows per expert, the results put back in pair order, weighted and
summed over k. ``SPELLINGS`` maps a name to the block class; ``test_per_expert_spellings`` states what each gives.

Experts as per-expert modules (``GatedExpert``) or as stacked weights with no module per expert (``_Stacked``:
w13 [E, 2I, H] gate rows first, w2 [E, H, I]; or Aria's grouped-GEMM layout [E, H, 2I] / [E, I, H]).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from per_expert_blocks import E, H, I, K
from per_expert_spellings import _Base


def _pairs(ids: torch.Tensor):
    """(order, counts): the flat (token, slot) pairs sorted by expert (stable), and how many each expert has."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=E)


class SortedSplit(_Base):
    """``torch.split(x[order // k], counts.tolist())``, one chunk per expert module, ``cat``, then ``y[order] = ``."""

    def mix(self, x):
        w, ids = self.route(x)
        order, counts = _pairs(ids)
        chunks = torch.split(x[order // self.top_k], counts.tolist())
        ys = torch.cat([self.experts[e](c) for e, c in enumerate(chunks)])
        y = torch.empty_like(ys)
        y[order] = ys
        return (y.view(-1, self.top_k, x.shape[-1]) * w[..., None]).sum(1)


class SortedCumsumIndexCopy(_Base):
    """histc counts, ``cumsum`` offsets on the CPU, ``xs[start:end]`` per expert module, ``ys[start:end] = ...``,
    written back with ``index_copy_(0, order, ys)`` (Aria's dispatch on per-expert modules)."""

    def mix(self, x):
        w, ids = self.route(x)
        flat = ids.flatten()
        order = flat.argsort()
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        ends = counts.cpu().cumsum(0)
        xs = x.index_select(0, order // self.top_k)
        ys = torch.zeros_like(xs)
        for e in range(self.num_experts):
            start, end = (ends[e - 1] if e else 0), ends[e]
            ys[start:end] = self.experts[e](xs[start:end])
        y = torch.zeros_like(ys).index_copy_(0, order, ys)
        return (y.view(x.shape[0], self.top_k, -1) * w.unsqueeze(-1)).sum(dim=1)


class SortedInversePerm(_Base):
    """``sort`` of the flat ids, offsets from ``counts.tolist()`` in Python, the expert outputs ``cat``ed, then the
    inverse permutation ``ys[order.argsort()]``; weighted before the sum by ``einsum``."""

    def mix(self, x):
        w, ids = self.route(x)
        _, order = ids.view(-1).sort(stable=True)
        xs = x.repeat_interleave(self.top_k, dim=0)[order]
        start, outs = 0, []
        for e, n in enumerate(torch.bincount(ids.view(-1), minlength=self.num_experts).tolist()):
            outs.append(self.experts[e](xs[start:start + n]))
            start += n
        y = torch.cat(outs, 0)[order.argsort()]
        return torch.einsum("tkh,tk->th", y.view(x.shape[0], self.top_k, -1), w)


class SortedScatterReduce(_Base):
    """Pairs sorted, each sorted row's token and weight carried along, weighted per expert, summed into the tokens
    with ``scatter_reduce_(0, tok, ·, "sum")``; ``for e in range(len(self.experts))``."""

    def mix(self, x):
        w, ids = self.route(x)
        order, counts = _pairs(ids)
        tok = order // self.top_k
        ws = w.reshape(-1)[order]
        offs = [0] + torch.cumsum(counts, 0).tolist()
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            s, t = offs[e], offs[e + 1]
            y = self.experts[e](x[tok[s:t]]) * ws[s:t, None]
            out.scatter_reduce_(0, tok[s:t, None].expand(-1, x.shape[-1]), y, reduce="sum")
        return out


class SkipEmptyContinue(_Base):
    """``for e in range(len(self.experts))``, ``tok, slot = where(ids == e)``, ``if tok.numel() == 0: continue``
    (a data-dependent branch on the routing)."""

    def mix(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class _Weights(nn.Module):
    """Stacked expert weights with no forward of their own: w13 [E, 2I, H] (gate rows first), w2 [E, H, I]."""

    def __init__(self):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))


class _Stacked(nn.Module):
    """A router and stacked expert weights (``experts.w13`` / ``experts.w2``), no module per expert; the block's
    own code runs them."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = _Weights()
        self.w13, self.w2 = self.experts.w13, self.experts.w2

    route = _Base.route

    def forward(self, hidden):
        return self.mix(hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape)

    def ffn(self, xs, e):
        g, u = F.linear(xs, self.w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.w2[e])


class StackedSortedSlices(_Stacked):
    """Sorted pairs, ``counts.tolist()`` offsets, ``F.linear(xs[s:t], w13[e])`` per expert on the stacked weights,
    each run weighted and ``index_add_``ed into its tokens."""

    def mix(self, x):
        w, ids = self.route(x)
        order, counts = _pairs(ids)
        tok, ws = order // self.top_k, w.reshape(-1)[order]
        out = torch.zeros_like(x)
        s = 0
        for e, n in enumerate(counts.tolist()):
            out.index_add_(0, tok[s:s + n], self.ffn(x[tok[s:s + n]], e) * ws[s:s + n, None])
            s += n
        return out


class StackedUpFirst(StackedSortedSlices):
    """``StackedSortedSlices`` with the up rows first in w13 (``u, g = ...chunk(2)``): a gate / up order the spec has
    no value for (it knows gate rows first, or interleaved)."""

    def ffn(self, xs, e):
        u, g = F.linear(xs, self.w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.w2[e])


class StackedGatherEinsum(_Stacked):
    """No loop: every pair's expert weights gathered ``w13[ids]`` ([T, k, 2I, H]), ``einsum``, then the weighted
    sum over k."""

    def mix(self, x):
        w, ids = self.route(x)
        h = torch.einsum("th,tkoh->tko", x, self.w13[ids])
        g, u = h.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(g) * u, self.w2[ids])
        return (y * w[..., None]).sum(1)


class StackedGatherBmm(_Stacked):
    """Pairs flattened, ``bmm`` of the gathered ``w13[flat]`` [P, 2I, H] with the repeated tokens [P, H, 1]; the
    sum over k as ``index_add_`` of ``arange(T).repeat_interleave(k)``."""

    def mix(self, x):
        w, ids = self.route(x)
        flat = ids.reshape(-1)
        xr = x.repeat_interleave(self.top_k, dim=0)
        h = torch.bmm(self.w13[flat], xr.unsqueeze(-1)).squeeze(-1)
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(self.w2[flat], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1) * w.reshape(-1, 1)
        tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        return torch.zeros_like(x).index_add_(0, tok, y)


class GroupedGemmSorted(nn.Module):
    """Aria-like: two grouped-GEMM modules holding [E, H, 2I] / [E, I, H] (in_out) weights, each run by a loop over
    ``cumsum`` slices of the sorted rows (``out[start:end] = rows @ w[e]``), up before gate in the fused first
    weight, pairs put back by ``index_copy_`` and weighted."""

    class Gemm(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(E, n_in, n_out))

        def forward(self, rows, counts):
            ends = torch.cumsum(counts, 0)
            out = rows.new_zeros(rows.shape[0], self.weight.shape[-1])
            for e in range(self.weight.shape[0]):
                start = ends[e] - counts[e]
                out[start:ends[e]] = rows[start:ends[e]] @ self.weight[e]
            return out

    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.fc1, self.fc2 = self.Gemm(H, 2 * I), self.Gemm(I, H)

    route = _Base.route

    def forward(self, hidden):
        x = hidden.reshape(-1, hidden.shape[-1])
        w, ids = self.route(x)
        order, counts = _pairs(ids)
        g, u = self.fc1(x[order // self.top_k], counts).chunk(2, dim=-1)
        ys = self.fc2(F.silu(g) * u, counts)
        y = torch.zeros_like(ys).index_copy_(0, order, ys)
        return (y.view(-1, self.top_k, x.shape[-1]) * w[..., None]).sum(1).reshape(hidden.shape)


SPELLINGS = {
    "sorted_split": SortedSplit,
    "sorted_cumsum_index_copy": SortedCumsumIndexCopy,
    "sorted_inverse_perm": SortedInversePerm,
    "sorted_scatter_reduce": SortedScatterReduce,
    "skip_empty_continue": SkipEmptyContinue,
    "stacked_sorted_slices": StackedSortedSlices,
    "stacked_up_first": StackedUpFirst,
    "stacked_gather_einsum": StackedGatherEinsum,
    "stacked_gather_bmm": StackedGatherBmm,
    "grouped_gemm_sorted": GroupedGemmSorted,
}
