"""Tiny random-weight models for the pass / backend tests: HF families built from config (no downloads) and
plain-PyTorch MoEs written without transformers.

HF sizes: hidden 64, 4 heads, 2 KV heads, 8 experts, top-2, 2 layers (FACTS.md gotchas applied). Every floating
parameter and buffer is redrawn N(0, 0.1) (router weights N(0, 0.3), correction biases N(0, 0.1)) so that nothing
is zero and routing is not degenerate.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

H = 64
E = 8
K = 2
LAYERS = 2

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")
IMPLS = ("grouped_mm", "batched_mm", "eager")


def hf_config(family: str, impl: str = "grouped_mm"):
    import transformers

    kw = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=LAYERS,
              vocab_size=128, max_position_embeddings=128, intermediate_size=96)
    if family == "mixtral":
        kw.update(num_local_experts=E, num_experts_per_tok=K, sliding_window=64)
    elif family == "qwen2_moe":
        kw.update(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  sliding_window=64, norm_topk_prob=False)
    elif family == "qwen3_moe":
        kw.update(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32, sliding_window=64,
                  norm_topk_prob=True, head_dim=16)
    elif family == "olmoe":
        kw.update(num_experts=E, num_experts_per_tok=K, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    elif family == "deepseek_v3":
        kw.update(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                  topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4)
    elif family == "glm4_moe":
        kw.update(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=32, n_shared_experts=1, n_group=2,
                  topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.5, head_dim=16)
    elif family == "gpt_oss":
        kw.update(num_local_experts=E, num_experts_per_tok=K, sliding_window=64, head_dim=16,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "llama":
        pass
    else:
        raise ValueError(family)
    cfg = transformers.CONFIG_MAPPING[family](**kw)
    if family != "llama":
        cfg._experts_implementation = impl
    return cfg


def hf_model(family: str, impl: str = "grouped_mm", seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family, impl)
    if family == "llama":
        model = AutoModelForCausalLM.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=impl)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.3 if name.endswith(("gate.weight", "router.weight")) else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()


def moe_blocks(model) -> list[nn.Module]:
    """The decoder layers' MoE blocks (``layers.i.mlp``) of a tiny HF model."""
    return [layer.mlp for layer in model.model.layers]


# ------------------------------------------------------------------------------------------ plain-PyTorch MoEs
def _router_and_experts(m: nn.Module, dim: int, inter: int, experts: int, seed: int) -> None:
    """m.gate [E, dim] and stacked m.w13 [E, 2*inter, dim], m.w2 [E, dim, inter], seeded random."""
    g = torch.Generator().manual_seed(seed)
    m.gate = nn.Linear(dim, experts, bias=False)
    m.w13 = nn.Parameter(torch.randn(experts, 2 * inter, dim, generator=g) / math.sqrt(dim))
    m.w2 = nn.Parameter(torch.randn(experts, dim, inter, generator=g) / math.sqrt(inter))
    with torch.no_grad():
        m.gate.weight.copy_(torch.randn(experts, dim, generator=g) / math.sqrt(dim) * 2)


class EinsumMoE(nn.Module):
    """gpt-fast style: expert weights gathered per token (``w13[expert_indices]``) and applied with einsum."""

    def __init__(self, dim=H, inter=40, experts=E, k=K, seed=0):
        super().__init__()
        self.k, self.dim = k, dim
        _router_and_experts(self, dim, inter, experts, seed)

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.dim)
        scores = F.softmax(self.gate(x), dim=-1)
        weights, idx = torch.topk(scores, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        h = torch.einsum("ti,taoi->tao", x, self.w13[idx])
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tao,taio->tai", F.silu(gate) * up, self.w2[idx])
        return torch.einsum("tai,ta->ti", y, weights).view(shape)


class BmmMoE(nn.Module):
    """Sigmoid routing, top-k, no renormalisation, weights stored [E, in, out], gelu (tanh) gate, bmm on
    gathered weights, combine by index_add_."""

    def __init__(self, dim=H, inter=24, experts=E, k=K, seed=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.k, self.dim, self.experts = k, dim, experts
        self.router = nn.Parameter(torch.randn(experts, dim, generator=g) / math.sqrt(dim) * 2)
        self.w_in = nn.Parameter(torch.randn(experts, dim, 2 * inter, generator=g) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(experts, inter, dim, generator=g) / math.sqrt(inter))

    def forward(self, x):
        T = x.shape[0]
        probs = torch.sigmoid(x @ self.router.t())
        w, idx = probs.topk(self.k, dim=-1)
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(self.k, dim=0)
        h = torch.bmm(xs.unsqueeze(1), self.w_in[flat]).squeeze(1)
        g, u = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2:]
        h = F.gelu(g, approximate="tanh") * u
        y = torch.bmm(h.unsqueeze(1), self.w_out[flat]).squeeze(1) * w.reshape(-1, 1)
        out = torch.zeros_like(x)
        out.index_add_(0, torch.arange(T, device=x.device).repeat_interleave(self.k), y)
        return out


class SeparateW1W3MoE(EinsumMoE):
    """Like EinsumMoE but with separate stacked gate / up weights (gpt-fast's w1 / w3): not supported by the op."""

    def __init__(self, dim=H, inter=40, experts=E, k=K, seed=2):
        super().__init__(dim, inter, experts, k, seed)
        w13 = self.w13.detach()
        del self.w13
        self.w1 = nn.Parameter(w13[:, :inter].clone())
        self.w3 = nn.Parameter(w13[:, inter:].clone())

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.dim)
        weights, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        g = torch.einsum("ti,taoi->tao", x, self.w1[idx])
        u = torch.einsum("ti,taoi->tao", x, self.w3[idx])
        y = torch.einsum("tao,taio->tai", F.silu(g) * u, self.w2[idx])
        return torch.einsum("tai,ta->ti", y, weights).view(shape)


class CapacityMoE(EinsumMoE):
    """Drops a token's expert slot when more than ``capacity`` tokens chose that expert before it (Switch-style):
    on uncrowded inputs it equals a plain MoE, on crowded ones it does not. Must not be matched."""

    capacity = 4

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.dim)
        weights, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        onehot = F.one_hot(idx, self.w13.shape[0]).reshape(-1, self.w13.shape[0])  # [T*k, E]
        pos = (torch.cumsum(onehot, 0) * onehot).sum(-1).reshape(idx.shape)  # 1-based slot in the expert
        weights = weights * (pos <= self.capacity).to(weights.dtype)
        h = torch.einsum("ti,taoi->tao", x, self.w13[idx])
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tao,taio->tai", F.silu(gate) * up, self.w2[idx])
        return torch.einsum("tai,ta->ti", y, weights).view(shape)


class ScaledOutMoE(EinsumMoE):
    """Multiplies the MoE result by 0.5 inside the block (Beam's ``* routed_scaling_factor`` after the combine):
    the same as scaling the routing weights, matched with ``routed_scaling_factor=0.5``."""

    def forward(self, x):
        return super().forward(x) * 0.5


class TanhOutMoE(EinsumMoE):
    """tanh of the MoE result inside the block: no spec computes it. The MoE before it is matched, the tanh is a
    tail the rewrite leaves in place (``detect_block`` refuses: the block post-processes the result)."""

    def forward(self, x):
        return torch.tanh(super().forward(x) * 3.0)


class ClampedSwiGLUMoE(EinsumMoE):
    """DeepSeek-V4 style clamped SwiGLU: silu(gate.clamp(max=L)) * up.clamp(-L, L), L small enough to bind."""

    limit = 0.5

    def act(self, h):
        g, u = h.chunk(2, dim=-1)
        return F.silu(g.clamp(max=self.limit)) * u.clamp(min=-self.limit, max=self.limit)

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.dim)
        weights, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        h = torch.einsum("ti,taoi->tao", x, self.w13[idx])
        y = torch.einsum("tao,taio->tai", self.act(h), self.w2[idx])
        return torch.einsum("tai,ta->ti", y, weights).view(shape)


class TwoSidedGateClampMoE(ClampedSwiGLUMoE):
    """The gate clamped on both sides: not the clamped SwiGLU the spec knows; must not be matched."""

    def act(self, h):
        g, u = h.chunk(2, dim=-1)
        return F.silu(g.clamp(-self.limit, self.limit)) * u.clamp(min=-self.limit, max=self.limit)


class Relu2MoE(nn.Module):
    """Ungated relu(x)**2 experts (Nemotron-H), sigmoid routing with a correction bias on the logits (Kolibri-1),
    renormalised by clamp(sum, min) (ERNIE-4.5), output scaled by a constant after the combine (Beam)."""

    def __init__(self, dim=H, inter=24, experts=E, k=K, seed=4):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.k = k
        self.router = nn.Parameter(torch.randn(experts, dim, generator=g) / math.sqrt(dim) * 2)
        self.bias = nn.Parameter(torch.randn(1, experts, generator=g) * 0.3)
        self.w_up = nn.Parameter(torch.randn(experts, inter, dim, generator=g) / math.sqrt(dim))
        self.w_down = nn.Parameter(torch.randn(experts, dim, inter, generator=g) / math.sqrt(inter))

    def forward(self, x):
        logits = F.linear(x, self.router)
        idx = torch.topk(logits + self.bias.squeeze(), self.k, dim=-1).indices
        w = torch.sigmoid(logits.gather(1, idx))
        w = w / torch.clamp(w.sum(-1, keepdim=True), min=0.05)
        h = torch.square(F.relu(torch.einsum("ti,taoi->tao", x, self.w_up[idx])))
        y = torch.einsum("tao,taio->tai", h, self.w_down[idx])
        return torch.einsum("tai,ta->ti", y, w) * 1.25


class JitterMoE(EinsumMoE):
    """Random noise on the router logits (training-style jitter): nondeterministic, must not be matched."""

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.dim)
        logits = self.gate(x)
        logits = logits * torch.empty_like(logits).uniform_(0.99, 1.01)
        weights, idx = torch.topk(F.softmax(logits, dim=-1), self.k, dim=-1)
        h = torch.einsum("ti,taoi->tao", x, self.w13[idx])
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tao,taio->tai", F.silu(gate) * up, self.w2[idx])
        return torch.einsum("tai,ta->ti", y, weights).view(shape)


class LoopMoE(nn.Module):
    """A loop over all experts with ``torch.where`` and ``index_add_`` (small reference implementations); traces
    into one graph with ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``."""

    def __init__(self, dim=H, inter=32, experts=E, k=K, seed=3):
        super().__init__()
        self.k, self.experts = k, experts
        _router_and_experts(self, dim, inter, experts, seed)

    def forward(self, x):
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.experts):
            tok, slot = torch.where(idx == e)
            h = F.linear(x[tok], self.w13[e])
            g, u = h.chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.w2[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y)
        return out


class DenseMLP(nn.Module):
    def __init__(self, dim=H, inter=96):
        super().__init__()
        self.up = nn.Linear(dim, inter)
        self.down = nn.Linear(inter, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class DataDependentBlock(EinsumMoE):
    """Python control flow on a tensor value: Dynamo cannot capture it with fullgraph=True."""

    def forward(self, x):
        if x.sum() > 0:
            return super().forward(x)
        return x
