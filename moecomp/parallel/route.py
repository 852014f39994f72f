"""What every rank computes whole, as the op computes it on one GPU: the routing over the E global experts and the
shared experts. The same implementation the op picks for x's device (``moe_op.implementation``: the vectorised torch
path ``ops/torch_moe.py`` or the Triton kernels ``ops/triton_moe.py``), through their one interface
(``ops/backend.Backend``).

    route(x2, args, spec, shape) -> Routed(ids [T, k], weights [T, k] fp32, gammas [T, G] fp32 | None, gate [T] | None)
        ids: global expert ids; an expert capacity's dropped pairs are -1 (torch) or E (Triton), weight 0; zero
        experts' pairs (spec.zero_experts) are >= E. gate: the sigmoid gate's logit where the Triton router GEMM
        gave it (the torch path's shared experts compute their gate themselves).
    shared_part(x2, args, spec, routed) -> fp32 [T, H]: sum of the shared experts, gated / scaled / times gammas
    shared_slice(args, spec) -> (args, spec) of this rank's intermediate slice of the shared experts, or None
        (the shared experts' partial sums add up to the whole: x @ w1[s].T ... @ w2[:, s].T is linear in the slices)
"""

from __future__ import annotations

import dataclasses

import torch

from ..ops.backend import Routed
from ..ops.moe_op import implementation
from ..core.spec import MoESpec


def route(x2: torch.Tensor, args: dict, spec: MoESpec, shape) -> Routed:
    """The routing of the op on x2 [T, H] (``shape``: x's shape, for the capacity's groups)."""
    return implementation(x2.device).route_all(x2, args, spec, shape)


def shared_part(x2: torch.Tensor, args: dict, spec: MoESpec, routed: Routed) -> torch.Tensor:
    """The shared experts' sum on x2 [T, H] -> fp32 [T, H] (gate, scale and gammas applied)."""
    return implementation(x2.device).shared_part(x2, args, spec, routed)


def shared_slice(args: dict, spec: MoESpec, rank: int, world_size: int):
    """(args, spec) of rank's slice of the shared experts' intermediate dim (views of the whole weights, no copy), or
    None where it does not split: quantized shared experts (their scales' blocks), gate and up concatenated in one
    weight, Is not divisible by the world size, or a norm of the output (it reads the whole sum)."""
    sh = spec.shared
    Is = sh.intermediate_size
    if sh.quant is not None or (sh.gated and sh.layout == "concat") or Is % world_size or sh.norm != "none":
        return None
    n = Is // world_size
    s = slice(rank * n, (rank + 1) * n)
    out = dict(args)
    for name in ("shared_w1", "shared_w3"):  # [(S,) Is, H]: rows
        if args.get(name) is not None:
            out[name] = args[name][..., s, :]
    out["shared_w2"] = args["shared_w2"][..., s]  # [(S,) H, Is]: columns
    return out, spec.replace(shared=dataclasses.replace(sh, intermediate_size=n))
