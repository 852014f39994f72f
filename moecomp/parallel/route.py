"""What every rank computes whole, as the op computes it on one GPU: the routing over the E global experts and the
shared experts. The same implementation the op picks for x's device (``ops/common._backend``): the vectorised torch
path (``ops/torch_moe.py``) or the Triton kernels (``ops/triton_moe.py``).

    route(x2, args, spec, shape) -> Routing(ids [T, k], weights [T, k] fp32, gammas [T, G] fp32 | None, gate [T] | None)
        ids: global expert ids; an expert capacity's dropped pairs are -1 (torch) or E (Triton), weight 0; zero
        experts' pairs (spec.zero_experts) are >= E. gate: the sigmoid gate's logit where the Triton router GEMM
        gave it (the torch path's shared experts compute their gate themselves).
    shared_part(x2, args, spec, routing) -> fp32 [T, H]: sum of the shared experts, gated / scaled / times gammas
    shared_slice(args, spec) -> (args, spec) of this rank's intermediate slice of the shared experts, or None
        (the shared experts' partial sums add up to the whole: x @ w1[s].T ... @ w2[:, s].T is linear in the slices)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .. import reference
from ..ops.common import _backend, split_fused_gate
from ..spec import MoESpec

_SHARED_QUANT = ("shared_w1_scale", "shared_w3_scale", "shared_w2_scale")


class Routing(NamedTuple):
    ids: torch.Tensor  # [T, k] global expert ids
    weights: torch.Tensor  # [T, k] fp32
    gammas: torch.Tensor | None  # [T, G] fp32 (spec.shared_gamma)
    gate: torch.Tensor | None  # [T] the shared-expert gate's logit (Triton path), else None


def route(x2: torch.Tensor, args: dict, spec: MoESpec, shape) -> Routing:
    """The routing of the op on x2 [T, H] (``shape``: x's shape, for the capacity's groups)."""
    if _backend(x2.device) == "torch":
        return _route_torch(x2, args, spec, shape)
    return _route_triton(x2, args, spec, shape)


def _route_torch(x2, args, spec: MoESpec, shape) -> Routing:
    from ..ops.torch_moe import route_all

    weights, ids, gammas = route_all(x2, split_fused_gate(args, spec), spec, shape)
    return Routing(ids, weights.float(), gammas, None)


def _route_triton(x2, args, spec: MoESpec, shape) -> Routing:
    from ..ops.triton_moe import route_all

    return Routing(*route_all(x2, args, spec, shape))


def shared_part(x2: torch.Tensor, args: dict, spec: MoESpec, routing: Routing) -> torch.Tensor:
    """The shared experts' sum on x2 [T, H] -> fp32 [T, H] (gate, scale and gammas applied)."""
    if _backend(x2.device) == "torch":  # as ops/torch_moe.moe_forward
        a = split_fused_gate(args, spec)
        return reference.shared_experts(x2, a["shared_w1"], a["shared_w3"], a["shared_w2"], a["shared_gate_w"], spec,
                                        gammas=routing.gammas, shared_norm_w=a.get("shared_norm_w"),
                                        **{n: a.get(n) for n in _SHARED_QUANT})
    from ..ops import shared_gamma as sg
    from ..ops.triton_shared import shared_mlp

    if sg.stacked(spec):
        s = sg.weighted_sum(sg.shared_outputs(x2, args, spec), routing.gammas, spec, torch.empty_like(x2))
    else:
        s = shared_mlp(x2, args, spec)
    s = s.float()
    if routing.gate is not None:  # what the combine kernel does: sigmoid of the gate's logit, in fp32
        s = s * torch.sigmoid(routing.gate.float())[:, None]
    return s


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
