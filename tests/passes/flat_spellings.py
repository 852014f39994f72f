"""MoE blocks whose experts are stored in layouts other than transformers' ``gate_up_proj`` / ``down_proj`` 3-D
tensors or a ModuleList of ``w1/w2/w3`` MLPs (issue 38): one 2-D matrix holding every expert's rows (or columns),
split in the forward by a view / reshape / unflatten, by row or column ranges, by ``chunk`` / ``split``; stacked 3-D
tensors under other names, on the block itself (also a block with no child module at all), one of them stored
[in, out] and the other [out, in]; per-expert modules in a custom container, per-expert Parameters in
``ParameterList``s. Attribute names are deliberately none of those ``recognise/structure.py`` knows.

Sizes: H = 16, I = 6, E = 4, top-2 (no two of H, I, 2I, E alike, so no layout is read by luck). ``SPELLINGS`` maps a
name to the block class, ``FLAT`` names the (parameter path, op argument) of each block's weights the op must read
in place (a view of the same storage); ``build(name)`` gives a block with seeded random weights, in eval mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

H, I, E, K = 16, 6, 4, 2


def _param(*shape):
    return nn.Parameter(torch.empty(*shape))


def _softmax_topk(logits, k=K, renorm=True):
    w, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if renorm else w), ids


def _sigmoid_topk(logits, k=K):
    w, ids = torch.topk(torch.sigmoid(logits), k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


class RowsViewGather(nn.Module):
    """Gated; ``w_in [E * 2I, H]`` viewed [E, 2I, H] and ``w_out [E * H, I]`` viewed [E, H, I] (out_in), gathered by
    the ids (``w[ids]``, einsum); router a Linear named ``scorer``; weights on the block itself."""

    def __init__(self):
        super().__init__()
        self.scorer = nn.Linear(H, E, bias=False)
        self.w_in = _param(E * 2 * I, H)
        self.w_out = _param(E * H, I)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.scorer(t))
        a = torch.einsum("th,tkoh->tko", t, self.w_in.view(E, 2 * I, H)[ids])
        g, u = a.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(g) * u, self.w_out.view(E, H, I)[ids])
        return (y * w[..., None]).sum(1).reshape(x.shape)


class ColumnsInOutLoop(nn.Module):
    """Gated, in_out: ``wi [H, E * 2I]`` viewed [H, E, 2I] and indexed ``[:, e]``, ``wo [E * I, H]`` unflattened
    [E, I, H]; a loop over the experts (``where(ids == e)``, ``index_add_``); sigmoid router, a bare Parameter."""

    def __init__(self):
        super().__init__()
        self.route = _param(E, H)
        self.wi = _param(H, E * 2 * I)
        self.wo = _param(E * I, H)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _sigmoid_topk(t @ self.route.t())
        wi, wo = self.wi.view(H, E, 2 * I), self.wo.unflatten(0, (E, I))
        out = torch.zeros_like(t)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            g, u = (t[tok] @ wi[:, e]).chunk(2, dim=-1)
            out.index_add_(0, tok, (F.silu(g) * u) @ wo[e] * w[tok, slot, None])
        return out.reshape(x.shape)


class RowRangesInterleaved(nn.Module):
    """Gated with gate / up interleaved (``h[..., ::2]`` / ``h[..., 1::2]``): row ranges ``w13[e * 2I:(e + 1) * 2I]``
    and ``w2[e * H:(e + 1) * H]`` of flat matrices in a child ``bank``; a shared expert (Linear MLP named
    ``common``)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.bank = nn.Module()
        self.bank.w13 = _param(E * 2 * I, H)
        self.bank.w2 = _param(E * H, I)
        self.common = nn.Sequential(nn.Linear(H, 2 * I, bias=False), nn.GELU(), nn.Linear(2 * I, H, bias=False))

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.gate(t))
        out = torch.zeros_like(t)
        n = 2 * I
        for e in range(E):
            tok, slot = torch.where(ids == e)
            h = F.linear(t[tok], self.bank.w13[e * n:(e + 1) * n])
            y = F.linear(F.silu(h[..., ::2]) * h[..., 1::2], self.bank.w2[e * H:(e + 1) * H])
            out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
        return (out + self.common(t)).reshape(x.shape)


class UngatedMixedLayout(nn.Module):
    """Not gated (gelu); ``fc_in [E * I, H]`` read [E, I, H] (out_in) but ``fc_out [E * I, H]`` read [E, I, H] as
    [in, out] (``h @ fc_out[e]``): w2 is a transposed view for the op; gathered with bmm; top-2 softmax, not
    renormalised."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, E, bias=False)
        self.fc_in = _param(E * I, H)
        self.fc_out = _param(E * I, H)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.lin(t), renorm=False)
        a = self.fc_in.reshape(E, I, H)[ids.reshape(-1)]  # [T * k, I, H]
        h = F.gelu(torch.bmm(a, t.repeat_interleave(K, 0)[:, :, None])[..., 0])  # [T * k, I]
        y = torch.bmm(h[:, None, :], self.fc_out.reshape(E, I, H)[ids.reshape(-1)])[:, 0]  # [T * k, H]
        return (y.view(-1, K, H) * w[..., None]).sum(1).reshape(x.shape)


class StackedOnBlock(nn.Module):
    """Stacked 3-D tensors ``wi [E, H, 2I]`` / ``wo [E, I, H]`` (in_out) directly on the block, named neither
    gate_up_proj nor w13; router ``selector``; gathered with ``torch.bmm``; sigmoid scores, renormalised."""

    def __init__(self):
        super().__init__()
        self.selector = nn.Linear(H, E, bias=False)
        self.wi = _param(E, H, 2 * I)
        self.wo = _param(E, I, H)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _sigmoid_topk(self.selector(t))
        f = ids.reshape(-1)
        g, u = torch.bmm(t.repeat_interleave(K, 0)[:, None], self.wi[f])[:, 0].chunk(2, -1)
        y = torch.bmm((F.silu(g) * u)[:, None], self.wo[f])[:, 0]
        return (y.view(-1, K, H) * w[..., None]).sum(1).reshape(x.shape)


class ExpertsInOutNames(nn.Module):
    """Stacked ``experts_in [E, 2I, H]`` ([out, in]) and ``experts_out [E, I, H]`` ([in, out]) in a child module
    named ``ffn``; a shared expert with a sigmoid gate (``shared_gate``: no name the finder knows either)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.ffn = nn.Module()
        self.ffn.experts_in = _param(E, 2 * I, H)
        self.ffn.experts_out = _param(E, I, H)
        self.always = nn.ModuleDict({"up": nn.Linear(H, 2 * I, bias=False), "down": nn.Linear(2 * I, H, bias=False)})
        self.always_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.router(t))
        a = torch.einsum("th,tkoh->tko", t, self.ffn.experts_in[ids])
        g, u = a.chunk(2, -1)
        y = torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.ffn.experts_out[ids])
        routed = (y * w[..., None]).sum(1)
        s = self.always["down"](F.relu(self.always["up"](t)))
        return (routed + torch.sigmoid(self.always_gate(t)) * s).reshape(x.shape)


class ChunkedSplit(nn.Module):
    """Gated; ``w_a [E * 2I, H]`` taken apart by ``chunk(E)``, ``w_b [H, E * I]`` by ``split(I, dim=1)`` (each
    expert [H, I]: [out, in]); a loop over the experts with a boolean mask; softmax without renormalising."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, E, bias=False)
        self.w_a = _param(E * 2 * I, H)
        self.w_b = _param(H, E * I)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.proj(t), renorm=False)
        a, b = self.w_a.chunk(E, 0), self.w_b.split(I, dim=1)
        out = torch.zeros_like(t)
        for e in range(E):
            hit = ids == e
            mask = hit.any(-1)
            we = (w * hit).sum(-1)
            g, u = F.linear(t[mask], a[e]).chunk(2, -1)
            out[mask] += F.linear(F.silu(g) * u, b[e]) * we[mask, None]
        return out.reshape(x.shape)


class FlatBiased(nn.Module):
    """Not gated (relu), biased: ``up [E * I, H]`` / ``up_b [E * I]`` and ``dn [E * H, I]`` / ``dn_b [E * H]``, all
    flat, viewed [E, ...] and gathered by the ids; sigmoid router with a bias."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(H, E)
        self.up = _param(E * I, H)
        self.up_b = _param(E * I)
        self.dn = _param(E * H, I)
        self.dn_b = _param(E * H)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _sigmoid_topk(self.score(t))
        h = torch.einsum("th,tkih->tki", t, self.up.view(E, I, H)[ids]) + self.up_b.view(E, I)[ids]
        y = torch.einsum("tki,tkhi->tkh", F.relu(h), self.dn.view(E, H, I)[ids]) + self.dn_b.view(E, H)[ids]
        return (y * w[..., None]).sum(1).reshape(x.shape)


class GateUpApartView(nn.Module):
    """Gated; ``a [E * 2I, H]`` viewed [E, 2, I, H] (gate ``[:, :, 0]``, up ``[:, :, 1]`` of the gathered experts),
    ``b [E * H, I]`` viewed [E, H * I] then gathered and reshaped; flat weights in a child that also holds an
    activation module."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.Module()
        self.experts.act = nn.SiLU()
        self.experts.a = _param(E * 2 * I, H)
        self.experts.b = _param(E * H, I)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.gate(t))
        a = self.experts.a.view(E, 2, I, H)[ids]  # [T, k, 2, I, H]
        g = torch.einsum("th,tkih->tki", t, a[:, :, 0])
        u = torch.einsum("th,tkih->tki", t, a[:, :, 1])
        b = self.experts.b.view(E, -1)[ids].view(-1, K, H, I)
        y = torch.einsum("tki,tkhi->tkh", self.experts.act(g) * u, b)
        return (y * w[..., None]).sum(1).reshape(x.shape)


class InterleavedView(nn.Module):
    """Gated with gate / up interleaved in the storage: ``a [E * 2I, H]`` viewed [E, I, 2, H] (gate ``[..., 0, :]``,
    up ``[..., 1, :]``); ``b [E * I, H]`` read [E, I, H] ([in, out]); weights on the block."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.a = _param(E * 2 * I, H)
        self.b = _param(E * I, H)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.gate(t))
        a = self.a.view(E, I, 2, H)[ids]
        g = torch.einsum("th,tkih->tki", t, a[..., 0, :])
        u = torch.einsum("th,tkih->tki", t, a[..., 1, :])
        y = torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.b.view(E, I, H)[ids])
        return (y * w[..., None]).sum(1).reshape(x.shape)


class _Unit(nn.Module):
    """A per-expert MLP with names no list holds: ``inp`` (gate and up, [2I, H]) and ``outp``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(H, 2 * I, bias=False)
        self.outp = nn.Linear(I, H, bias=False)

    def forward(self, x):
        g, u = self.inp(x).chunk(2, -1)
        return self.outp(F.silu(g) * u)


class _Pool(nn.Module):
    """A custom container: experts as attributes ``unit0`` .. ``unit{E-1}``, fetched by ``pick(e)``."""

    def __init__(self):
        super().__init__()
        for e in range(E):
            setattr(self, f"unit{e}", _Unit())

    def pick(self, e):
        return getattr(self, f"unit{e}")


class CustomContainer(nn.Module):
    """Per-expert modules in a custom container (``_Pool``), a loop with ``nonzero``; softmax router ``assign``."""

    def __init__(self):
        super().__init__()
        self.assign = nn.Linear(H, E, bias=False)
        self.pool = _Pool()

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.assign(t))
        out = torch.zeros_like(t)
        for e in range(E):
            nz = (ids == e).nonzero()
            tok, slot = nz[:, 0], nz[:, 1]
            out.index_add_(0, tok, self.pool.pick(e)(t[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class ParameterLists(nn.Module):
    """One Parameter per expert and projection, in two ``nn.ParameterList``s (``up``: gate and up [2I, H], ``down``
    [H, I]); a loop over the experts; softmax router ``gate``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.up = nn.ParameterList([_param(2 * I, H) for _ in range(E)])
        self.down = nn.ParameterList([_param(H, I) for _ in range(E)])

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(self.gate(t))
        out = torch.zeros_like(t)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            g, u = F.linear(t[tok], self.up[e]).chunk(2, -1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, self.down[e]) * w[tok, slot, None])
        return out.reshape(x.shape)


class NoChildren(nn.Module):
    """Everything the block's own Parameters, no child module at all: router ``r [E, H]``, ``wi [E, 2I, H]``,
    ``wo [E, H, I]``; gathered by the ids."""

    def __init__(self):
        super().__init__()
        self.r = _param(E, H)
        self.wi = _param(E, 2 * I, H)
        self.wo = _param(E, H, I)

    def forward(self, x):
        t = x.reshape(-1, H)
        w, ids = _softmax_topk(t @ self.r.T)
        g, u = torch.einsum("th,tkoh->tko", t, self.wi[ids]).chunk(2, -1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(g) * u, self.wo[ids])
        return (y * w[..., None]).sum(1).reshape(x.shape)


SPELLINGS = {
    "rows_view_gather": RowsViewGather,
    "columns_in_out_loop": ColumnsInOutLoop,
    "row_ranges_interleaved": RowRangesInterleaved,
    "ungated_mixed_layout": UngatedMixedLayout,
    "stacked_on_block": StackedOnBlock,
    "experts_in_out_names": ExpertsInOutNames,
    "chunked_split": ChunkedSplit,
    "flat_biased": FlatBiased,
    "custom_container": CustomContainer,
    "gate_up_apart_view": GateUpApartView,
    "interleaved_view": InterleavedView,
    "parameter_lists": ParameterLists,
    "no_children": NoChildren,
}

# name -> {parameter path: op argument} the op reads in place (views of the same storage); per-expert Parameters are
# stacked once and re-pointed (they then view the op's tensor)
FLAT = {
    "rows_view_gather": {"w_in": "w13", "w_out": "w2"},
    "columns_in_out_loop": {"wi": "w13", "wo": "w2"},
    "row_ranges_interleaved": {"bank.w13": "w13", "bank.w2": "w2"},
    "ungated_mixed_layout": {"fc_in": "w13", "fc_out": "w2"},
    "stacked_on_block": {"wi": "w13", "wo": "w2"},
    "experts_in_out_names": {"ffn.experts_in": "w13", "ffn.experts_out": "w2"},
    "chunked_split": {"w_a": "w13", "w_b": "w2"},
    "flat_biased": {"up": "w13", "dn": "w2", "up_b": "b13", "dn_b": "b2"},
    "custom_container": {},
    "gate_up_apart_view": {"experts.a": "w13", "experts.b": "w2"},
    "interleaved_view": {"a": "w13", "b": "w2"},
    "parameter_lists": {"up.0": "w13", "down.3": "w2"},  # per-expert Parameters: re-pointed into the op's stack
    "no_children": {"wi": "w13", "wo": "w2"},
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The block ``name`` with seeded random weights (router x 2: routing not degenerate), eval mode."""
    block = SPELLINGS[name]()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in block.named_parameters():
            fan = H if p.dim() == 1 or p.shape[-1] == E * I else p.shape[-1]
            scale = 2.0 if p.shape == (E, H) else 1.0
            p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(fan))
    return block.eval()
