"""A MoE block's forward with given expert ids, in plain differentiable torch, on the block's own tensors.

Routing replay on transformers' path (:mod:`moecomp.api.routing`): while a replay is active, each recognised block
runs :func:`replay_block` instead of its own forward. What it computes is what the block's verified
:class:`moecomp.core.spec.MoESpec` says, with the selection replaced by the given ids (``moecomp.core.spec``'s
docstring; this is moecomp's own code, independent of the oracle and of the ops):

    logits   = (x @ router_w.T (+ router_b)) * router_scale      (fp32 with router_fp32)
    scores   = score_fn(logits)                                  softmax over E | sigmoid | sqrtsoftplus | none
    weights  = scores[ids] (/ max(sum + renorm_eps, renorm_min)) * routed_scaling
               (topk_then_score: softmax over logits[ids] | sigmoid of each)
    out      = sum_k weights * expert_ids(x) (+ shared(x) * sigmoid(x @ shared_gate_w.T) * shared.scale)

The correction bias and the expert groups only steer the selection: with given ids they change nothing; they are
used where a token's ids are the block's own (a row of -1, and recording: :func:`select`).

Every tensor is the block's own Parameter or buffer, read at each call (derived tensors, e.g. a ModuleList of
expert MLPs stacked, are rebuilt from the sources at each call, with autograd): gradients reach the model's
parameters. Spec features this forward does not compute are refused (:func:`refusals`), never ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.derived import Derived, get_path
from ..core.match import arg_name
from ..core.spec import MoESpec

# (feature present?, why it cannot be replayed): every spec field this forward does not compute
_REFUSED = (
    (lambda s: s.hash_routing, "hash routing (the ids come from a table of token ids, not from a selection)"),
    (lambda s: s.score_order == "sparsemixer", "sparsemixer routing (its weights are not the scores at the ids)"),
    (lambda s: s.has_capacity, "expert capacity (pairs past an expert's capacity are dropped)"),
    (lambda s: s.zero_experts > 0, "zero experts (router outputs past the experts)"),
    (lambda s: s.latent_size > 0, "latent experts (projections around the experts)"),
    (lambda s: s.quant is not None, "quantized routed experts"),
    (lambda s: s.fused_shared_gate, "a fused shared-expert gate row"),
    (lambda s: s.router_prefix, "a router that reads its own input / a normalised or scaled input"),
    (lambda s: s.expert_scale, "per-expert weight multipliers (expert_scale)"),
    (lambda s: s.shared_gamma != "none", "shared-expert gammas from the router"),
    (lambda s: s.has_weight_scale, "a learned routing-weight scale"),
    (lambda s: s.latent_norm != "none" or s.expert_norm != "none", "norms around the experts"),
    (lambda s: s.parallel is not None, "sharded experts (expert / tensor parallelism)"),
    (lambda s: s.shared is not None and (s.shared.quant is not None or s.shared.stacked or s.shared.norm != "none"),
     "quantized, stacked or normalised shared experts"),
)


def refusals(spec: MoESpec) -> list[str]:
    """Why :func:`replay_block` cannot compute this spec (empty: it can)."""
    return [why for present, why in _REFUSED if present(spec)]


# ------------------------------------------------------------------------------------------------- the tensors
def _build(block, d: Derived) -> torch.Tensor:
    """A derived tensor rebuilt from its sources with autograd (``Derived.build`` detaches: no gradient)."""
    srcs = [[get_path(block, p) for p in group] for group in d.sources]
    if d.kind == "rows":
        out = srcs[0][0][: d.rows]
    elif d.kind == "view":
        out = srcs[0][0].view(d.shape).permute(d.perm)
    elif d.kind == "cat":
        out = torch.cat([t.to(srcs[0][0].dtype) for t in srcs[0]], d.dim)
    else:
        out = torch.stack([torch.cat(g, 0) for g in srcs], 0)
    return out.float() if d.fp32 else out


def block_tensors(block, bindings: dict, derived: list) -> dict:
    """{op argument: the block's tensor} for the bound arguments (derived ones built with autograd)."""
    by_name = {d.name: d for d in derived}
    out = {}
    for a, p in bindings.items():
        if p is None or arg_name(p) is not None:
            continue
        out[a] = _build(block, by_name[p]) if p in by_name else get_path(block, p)
    return out


# ---------------------------------------------------------------------------------------------------- routing
def _score(spec: MoESpec, logits: torch.Tensor) -> torch.Tensor:
    if spec.scoring == "softmax":
        return logits.softmax(-1)
    if spec.scoring == "sigmoid":
        return logits.sigmoid()
    if spec.scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits


def router_logits(spec: MoESpec, t: dict, x2: torch.Tensor) -> torch.Tensor:
    """[T, E] logits in fp32 (the GEMM in x's dtype, or fp32 with ``router_fp32``)."""
    w, b = t["router_w"], t.get("router_b")
    xr = x2.float() if spec.router_fp32 else x2
    logits = F.linear(xr, w.to(xr.dtype), None if b is None else b.to(xr.dtype))
    if spec.router_scale != 1.0:
        logits = logits * spec.router_scale
    return logits.float()


def select(spec: MoESpec, logits: torch.Tensor, correction_bias: torch.Tensor | None) -> torch.Tensor:
    """The block's own choice, [T, k] int64: correction bias and expert groups as the spec says (no gradient)."""
    with torch.no_grad():
        logits = logits.detach()
        if spec.score_order == "topk_then_score":
            return logits.topk(spec.top_k, -1).indices
        cb = None if correction_bias is None else correction_bias.detach().reshape(-1).float()
        choice = logits if spec.bias_on_logits else _score(spec, logits)
        if spec.has_correction_bias and cb is not None:
            choice = choice + cb
        if spec.n_group > 1:
            T, E = choice.shape
            g = choice.view(T, spec.n_group, E // spec.n_group)
            gs = g.topk(2, -1).values.sum(-1) if spec.group_score == "top2_sum" else g.amax(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(spec.topk_group, -1).indices, True)
            fill = 0.0 if spec.group_mask_zero else float("-inf")
            choice = g.masked_fill(~keep.unsqueeze(-1), fill).view(T, E)
        return choice.topk(spec.top_k, -1).indices


def route_weights(spec: MoESpec, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, k] fp32 weights at ``ids``: the scores there, renormalised and scaled as the spec says (with autograd)."""
    picked = logits.gather(1, ids)
    if spec.score_order == "topk_then_score":
        w = picked.softmax(-1) if spec.scoring == "softmax" else _score(spec, picked)
    else:
        w = _score(spec, logits).gather(1, ids)
    if spec.renormalize:
        w = w / (w.sum(-1, keepdim=True) + spec.renorm_eps).clamp(min=spec.renorm_min)
    return w * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w


# ---------------------------------------------------------------------------------------------------- experts
def _act(s, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """act(gate) * up as the spec (MoESpec or SharedExpertSpec) says; ``up`` None: not gated, act(gate)."""
    name = s.activation
    if up is None:
        return _plain_act(name, gate)
    if s.gate_softcap or s.up_softcap:
        cg, cu = s.gate_softcap, s.up_softcap
        capped_g = cg * torch.tanh(gate / cg) if cg else gate
        capped_u = cu * torch.tanh(up / cu) if cu else up
        return capped_g * torch.sigmoid(gate) * capped_u
    lim = s.activation_limit
    if name == "swiglu_oai":
        gate, up = gate.clamp(max=lim), up.clamp(min=-lim, max=lim)
        return (up + 1) * gate * torch.sigmoid(gate * s.activation_alpha)
    if s.activation_clamp:
        gate = gate.clamp(max=lim)
    if s.activation_clamp or s.activation_clamp_after:
        up = up.clamp(min=-lim, max=lim)
    h = _plain_act(name, gate)
    return (h.clamp(max=lim) if s.activation_clamp_after else h) * up


def _plain_act(name: str, v: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(v)
    if name == "gelu":
        return F.gelu(v)
    if name == "gelu_tanh":
        return F.gelu(v, approximate="tanh")
    if name == "relu":
        return F.relu(v)
    if name == "relu2":
        return F.relu(v).square()
    raise ValueError(f"activation {name!r}: expected one of silu, gelu, gelu_tanh, relu, relu2 (swiglu_oai gated)")


def _expert(spec: MoESpec, t: dict, e: int, xs: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` on rows ``xs`` [n, H] -> [n, H]."""
    w13, w2 = t["w13"][e], t["w2"][e]
    h = xs @ w13.T if spec.w_layout == "out_in" else xs @ w13
    bias_1 = spec.has_expert_bias and spec.expert_bias in ("both", "gemm1") and t.get("b13") is not None
    bias_2 = spec.has_expert_bias and spec.expert_bias in ("both", "gemm2") and t.get("b2") is not None
    if bias_1:
        h = h + t["b13"][e]
    if spec.gated:
        I = h.shape[-1] // 2
        gate, up = (h[:, :I], h[:, I:]) if spec.gate_up == "concat" else (h[:, 0::2], h[:, 1::2])
        h = _act(spec, gate, up)
    else:
        h = _act(spec, h, None)
    y = h @ w2.T if spec.w_layout == "out_in" else h @ w2
    return y + t["b2"][e] if bias_2 else y


def _shared(spec: MoESpec, t: dict, x2: torch.Tensor) -> torch.Tensor:
    s = spec.shared
    if not s.gated:
        h = _act(s, x2 @ t["shared_w3"].T, None)
    elif s.layout == "concat":
        g = x2 @ t["shared_w1"].T
        h = _act(s, g[:, : s.intermediate_size], g[:, s.intermediate_size:])
    else:
        h = _act(s, x2 @ t["shared_w1"].T, x2 @ t["shared_w3"].T)
    y = h @ t["shared_w2"].T
    if s.gate == "sigmoid":
        y = y * torch.sigmoid(x2 @ t["shared_gate_w"].T)
    return y * s.scale if s.scale != 1.0 else y


def replay_block(spec: MoESpec, t: dict, x2: torch.Tensor,
                 ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block's output [T, H] in x's dtype, the ids used [T, k] int64) for x2 [T, H] and ``ids`` [T, k] (a row
    of -1: the block's own choice for that token; None: the block's own choice everywhere)."""
    logits = router_logits(spec, t, x2)
    own = select(spec, logits, t.get("correction_bias"))
    ids = own if ids is None else torch.where(ids < 0, own, ids.to(own.device).long())
    w = route_weights(spec, logits, ids)
    if spec.round_weights:
        w = w.to(x2.dtype)
    out = torch.zeros(x2.shape, dtype=torch.float32, device=x2.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        we = w[tok, slot].unsqueeze(-1)
        xs = x2[tok]
        if spec.weight_on_input:
            y = _expert(spec, t, e, (we * xs).to(x2.dtype)).float()
        else:
            y = _expert(spec, t, e, xs).float() * we.float()
        out = out.index_add(0, tok, y)
    out = out.to(x2.dtype)
    if spec.shared is not None:
        out = out + _shared(spec, t, x2).to(x2.dtype)
    return out, ids
