"""The one interface of the op's implementations: the vectorised torch path (``ops/torch_moe.py``) and the Triton
path (``ops/triton_moe.py``) are both modules that satisfy :class:`Backend`, and every caller of either (``moe_op``,
the parallel path ``parallel/route.py``) goes through these names and this one result type.

    route_all(x2, args, spec, shape) -> Routed(ids, weights, gammas, gate)
        the routing preamble on x2 [T, H] (``shape``: x's shape, for an expert capacity's groups): the router's own
        input, its GEMM, the selection, the weights as the spec says (renormalised, scaled, rounded, capacity drops)
    shared_part(x2, args, spec, routed) -> fp32 [T, H]
        the shared experts' sum on x2, gated, scaled and times the routing's gammas
    moe_forward(x, args, spec) -> [..., H]      the whole block
    moe_experts(x, ids, weights, args, spec)    the routed experts alone, routing given

Where the two differ, by design, is said here once: the torch path's ids are int64 and an expert capacity's dropped
pairs there are -1 (what the oracle says, ``moecomp.oracle.reference``), the Triton path's ids int32 and dropped pairs E (the
kernels skip any id outside [0, E) and read no weight for it); both give a dropped pair weight 0. ``gate`` is the
sigmoid gate's logit where the Triton router GEMM computes it fused with the router (the torch path's shared experts
compute their gate themselves: None there).

Nothing here imports either implementation (they import this module); ``moe_op.implementation(device)`` picks one.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..core.spec import MoESpec


class Routed(NamedTuple):
    """What the routing preamble hands the experts: one field order on every path."""

    ids: torch.Tensor  # [T, k] expert ids over the E (+ zero) experts; dropped pairs -1 (torch) or E (Triton)
    weights: torch.Tensor  # [T, k] fp32 routing weights (0 for a dropped pair)
    gammas: torch.Tensor | None  # [T, G] fp32 shared-expert scales (spec.shared_gamma), else None
    gate: torch.Tensor | None  # [T] the shared-expert gate's logit (Triton router GEMM), else None


@runtime_checkable
class Backend(Protocol):
    """An implementation of the op (a module: ``torch_moe`` or ``triton_moe``)."""

    def route_all(self, x2: torch.Tensor, args: dict, spec: MoESpec, shape) -> Routed: ...

    def shared_part(self, x2: torch.Tensor, args: dict, spec: MoESpec, routed: Routed) -> torch.Tensor: ...

    def moe_forward(self, x: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor: ...

    def moe_experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, args: dict,
                    spec: MoESpec) -> torch.Tensor: ...
