"""What the router's GEMM reads on every path of the op (``MoESpec.router_input`` / ``router_norm`` /
``router_in_scale`` / ``router_in_const``; Gemma-4): a torch prefix over [T, H] before the router GEMM (a row norm
that does not pay to fuse into it), run by the torch path (``ops/cpu_route.py``) and the Triton path
(``triton_moe.route_all``) alike.

    r = router_x (op argument, any [..., H] of T rows) or x            in x's dtype
    r = r / sqrt(mean(r^2) + router_norm_eps)                          (router_norm: fp32, rounded back to x's dtype)
    r = r * router_in_scale [H]                                        (router_in_scale: in x's dtype)
    r = r * router_in_const                                            (a constant != 1)
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec


def router_in(x2: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    """The router's input [T, H] in x2's dtype; x2 itself (the same tensor) when the spec has no prefix."""
    if not spec.router_prefix:
        return x2
    src = args["router_x"] if spec.router_input else x2
    r = src.reshape(x2.shape[0], src.shape[-1]).to(x2.dtype)
    if spec.router_norm:
        f = r.float()
        r = (f * torch.rsqrt(f.square().mean(dim=-1, keepdim=True) + spec.router_norm_eps)).to(x2.dtype)
    if spec.router_in_scale:
        r = r * args["router_in_scale"].to(x2.dtype)
    if spec.router_in_const != 1.0:
        r = r * spec.router_in_const
    return r
