"""The oracle's steps around the routed experts and their routing (split from reference.py, which passed 600
lines; ``moecomp.oracle.reference`` re-exports them): the router's own input and its GEMM, per-expert weight multipliers,
the latent projections and the norms (``moecomp.core.spec``'s docstring has the formulas). Plain PyTorch, nothing fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.spec import MoESpec


def router_logits(x: torch.Tensor, router_w, router_b, spec: MoESpec) -> torch.Tensor:
    """x @ router_w.T (+ router_b) in x's dtype (fp32 with ``router_fp32``), times ``router_scale`` in that dtype."""
    if spec.router_fp32:
        x, router_w = x.float(), router_w.float()
        router_b = None if router_b is None else router_b.float()
    logits = F.linear(x, router_w.to(x.dtype), None if router_b is None else router_b.to(x.dtype))
    return logits * spec.router_scale if spec.router_scale != 1.0 else logits


def rms_norm(v: torch.Tensor, w: torch.Tensor, form: str, eps: float, dtype: torch.dtype,
             acc=torch.float32) -> torch.Tensor:
    """The norms of ``moecomp.core.spec`` on rows v [n, d] (any dtype), weight w [d] (or one row per v row, [n, d]) ->
    [n, d] in ``dtype``: "rms_1p" round(rms(v) * (1 + w)), "rms" round(rms(v) * w), "scaled_rms_1p"
    round(rms(round(v * (1 + w)))), "rms_per_expert" as "rms" (w: the expert's row); rms and the products in
    ``acc``, 1 + w formed in w's dtype, round = a cast to ``dtype``."""
    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    form = "rms" if form == "rms_per_expert" else form
    scale = w.to(acc) if form == "rms" else (1 + w).to(acc)
    if form == "scaled_rms_1p":
        return rms((v.to(acc) * scale).to(dtype).to(acc)).to(dtype)
    if form not in ("rms", "rms_1p"):
        raise ValueError(f"unknown norm form {form!r}")
    return (rms(v.to(acc)) * scale).to(dtype)


def router_input(x2: torch.Tensor, router_x, router_in_scale, spec: MoESpec) -> torch.Tensor:
    """What the router's GEMM reads, [T, H] in x's dtype (``moecomp.core.spec``: the router's own input): ``router_x``
    (``spec.router_input``; any [..., H] with T rows) or x, RMS-normalised without weight (``router_norm``: in fp32,
    rounded back), times ``router_in_scale`` [H] and ``router_in_const``. x itself when the spec has no prefix."""
    if not spec.router_prefix:
        return x2
    r = router_x.reshape(-1, router_x.shape[-1]).to(x2.dtype) if spec.router_input else x2
    if spec.router_norm:
        rf = r.float()
        r = (rf * torch.pow(rf.pow(2).mean(-1, keepdim=True) + spec.router_norm_eps, -0.5)).to(x2.dtype)
    if spec.router_in_scale:
        r = r * router_in_scale.to(r.dtype)
    if spec.router_in_const != 1.0:
        r = r * spec.router_in_const
    return r


def expert_scaled(weights: torch.Tensor, ids: torch.Tensor, expert_scale, spec: MoESpec) -> torch.Tensor:
    """``spec.expert_scale``: weights [T, k] times ``expert_scale`` [E (+ Z)] at their ids (pairs an expert capacity
    dropped, id -1, keep weight 0), in the weights' dtype; the weights themselves otherwise."""
    if not spec.expert_scale:
        return weights
    s = expert_scale.to(weights.dtype)[ids.clamp(min=0).long()]
    return weights * s


def latent_in(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc=torch.float32) -> torch.Tensor:
    """The experts' input of a latent block: x [T, H] @ w.T (+ b), w [L, H] -> [T, L] in ``acc``."""
    y = x.to(acc) @ w.to(acc).T
    return y if b is None else y + b.to(acc)


def latent_out(routed: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc=torch.float32) -> torch.Tensor:
    """The combined routed output of a latent block back to H: routed [T, L] @ w.T (+ b), w [H, L] -> [T, H]."""
    y = routed.to(acc) @ w.to(acc).T
    return y if b is None else y + b.to(acc)
