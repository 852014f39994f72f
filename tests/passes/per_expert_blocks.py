"""Tiny plain-PyTorch MoE blocks whose experts are per-expert modules (``nn.ModuleList`` / ``nn.ModuleDict`` /
``nn.Sequential`` of 2-D weights), one per loop spelling the FX pass reads (captured with ``real_values=True``).

Sizes: H = 16, I = 8, E = 4, top-2. Weights are redrawn from a seeded generator (router x 2 so that routing is not
degenerate); ``build(name)`` returns the block in eval mode, ``skewed()`` one whose router reaches experts 0 and 1
only.
"""

from __future__ import annotations

import math
import textwrap

import torch
import torch.nn as nn
import torch.nn.functional as F

H, I, E, K = 16, 8, 4, 2


# ------------------------------------------------------------------------------------------------------- experts
class GatedExpert(nn.Module):
    """w2(silu(w1 x) * w3 x) with nn.Linear (the transformers-4 Mixtral expert)."""

    def __init__(self, h=H, i=I):
        super().__init__()
        self.w1 = nn.Linear(h, i, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MatmulExpert(nn.Module):
    """The gated expert on bare Parameters: ``x @ w.T`` and ``torch.matmul(x, w.t())``, up before gate."""

    def __init__(self, h=H, i=I):
        super().__init__()
        self.up = nn.Parameter(torch.empty(i, h))
        self.gate = nn.Parameter(torch.empty(i, h))
        self.down = nn.Parameter(torch.empty(h, i))

    def forward(self, x):
        u = x @ self.up.T
        g = torch.matmul(x, self.gate.t())
        return F.linear(F.silu(g) * u, self.down)


class BiasedExpert(nn.Module):
    """fc2(gelu(fc1 x)): two biased nn.Linear, not gated (b13 / b2)."""

    def __init__(self, h=H, i=I):
        super().__init__()
        self.fc1 = nn.Linear(h, i)
        self.fc2 = nn.Linear(i, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _sequential(h=H, i=I):
    return nn.Sequential(nn.Linear(h, i, bias=False), nn.GELU(), nn.Linear(i, h, bias=False))


def _redraw(block: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            scale = 2.0 if name.startswith(("gate.", "router")) else 1.0
            fan = p.shape[-1] if p.dim() > 1 else H
            p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(fan))
    return block.eval()


# -------------------------------------------------------------------------------------------------------- blocks
class ClassicLoop(nn.Module):
    """(a) softmax, top-k, renormalised; ``torch.where(ids == e)``, ``if tok.numel()``, ``index_add_``; returns
    (out, router_logits) like transformers-4 Mixtral."""

    def __init__(self, expert=GatedExpert, e=E, k=K):
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(H, e, bias=False)
        self.experts = nn.ModuleList([expert() for _ in range(e)])

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])
        logits = self.gate(x)
        w = torch.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(w, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.view(shape), logits


class NoIfLoop(ClassicLoop):
    """(b) top-k of the logits, then softmax (topk_then_score); the loop without the ``if``; experts of
    ``x @ w.T`` / ``torch.matmul``."""

    def __init__(self):
        super().__init__(expert=MatmulExpert)

    def forward(self, x):
        vals, ids = torch.topk(self.gate(x), self.top_k)
        w = F.softmax(vals, dim=-1)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1))
        return out


class DenseLoop(ClassicLoop):
    """(c) every expert on every token, weighted by ``(w * (ids == e)).sum(-1, keepdim=True)``; softmax then top-k,
    not renormalised."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = torch.softmax(self.gate(x), dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += expert(x) * (w * (ids == e)).sum(-1, keepdim=True)
        return out.reshape(shape)


class DictExperts(nn.Module):
    """(d) experts in an ``nn.ModuleDict`` keyed "0".."E-1", dispatched through a one-hot mask
    (``one_hot(ids).permute(2, 1, 0)[e]``, transformers-4 Mixtral's spelling)."""

    def __init__(self):
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({str(e): GatedExpert() for e in range(E)})

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for key, expert in self.experts.items():
            slot, tok = torch.where(mask[int(key)])
            out.index_add_(0, tok, expert(x[None, tok].reshape(-1, H)) * w[tok, slot, None])
        return out


class SequentialExperts(ClassicLoop):
    """(d) ``nn.Sequential(Linear, GELU, Linear)`` experts: not gated."""

    def __init__(self):
        super().__init__(expert=_sequential)

    def forward(self, x):
        return super().forward(x)[0]


_EXEC_SOURCE = textwrap.dedent('''
    class ExecBlock(nn.Module):
        """(e) defined by exec: inspect.getsource fails on it; (f) its top-k count is ``num_selected``."""

        def __init__(self):
            super().__init__()
            self.num_selected = K
            self.router = nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([GatedExpert() for _ in range(E)])

        def forward(self, x):
            scores = self.router(x).softmax(-1)
            w, ids = scores.topk(self.num_selected)
            w = w / w.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e in range(len(self.experts)):
                tok, slot = torch.where(ids == e)
                if tok.numel() > 0:
                    out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
            return out
''')
_ns = dict(nn=nn, torch=torch, K=K, H=H, E=E, GatedExpert=GatedExpert)
exec(compile(_EXEC_SOURCE, "<per-expert block>", "exec"), _ns)
ExecBlock = _ns["ExecBlock"]


class BiasedLoop(ClassicLoop):
    """(g) two biased nn.Linear per expert, not gated (b13 = fc1.bias, b2 = fc2.bias)."""

    def __init__(self):
        super().__init__(expert=BiasedExpert)

    def forward(self, x):
        return super().forward(x)[0]


class SharedLoop(ClassicLoop):
    """The classic loop plus a sigmoid-gated shared expert (transformers-4 Qwen2-MoE)."""

    def __init__(self):
        super().__init__()
        self.shared_expert = GatedExpert(H, 12)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x):
        routed = super().forward(x)[0]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class SkewedLoop(ClassicLoop):
    """A router whose bias sends every token to experts 0 and 1 (see :func:`skewed`): an example input reaches
    only some experts."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=True)

    def forward(self, hidden_states):
        return super().forward(hidden_states)[0]


BLOCKS = {
    "classic": ClassicLoop,
    "no_if": NoIfLoop,
    "dense": DenseLoop,
    "module_dict": DictExperts,
    "sequential": SequentialExperts,
    "exec_num_selected": ExecBlock,
    "biased": BiasedLoop,
    "shared": SharedLoop,
}


def build(name: str, seed: int = 0) -> nn.Module:
    return _redraw(BLOCKS[name](), seed)


def skewed(seed: int = 0) -> nn.Module:
    block = _redraw(SkewedLoop(), seed)
    with torch.no_grad():
        block.gate.weight.mul_(0.01)
        block.gate.bias.copy_(torch.tensor([10.0, 10.0] + [-10.0] * (E - 2)))
    return block
