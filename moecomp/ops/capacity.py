"""``MoESpec.capacity`` / ``capacity_factor`` on the Triton path (Switch Transformers, NLLB-MoE): pairs past an
expert's capacity are dropped (the rule in ``moecomp.core.spec``), with torch ops around the routing kernel:

    route_topk_kernel        ids [T, k], weights (raw scores when the renormalisation follows the drop:
                             ``kernel_spec``)
    kept()                   each pair's rank in its expert and group, slot-major: one stable sort of the keys
                             (group, expert), a scatter-add of the counts, their exclusive cumsum
    apply()                  a dropped pair's id becomes E and its weight 0 (renormalise / scale / round the kept
                             ones here when ``renorm_after_drop``); the zero-expert flags (``ops/zero_experts.py``)
                             then keep ids outside [0, E) out of the alignment, the DIRECT GEMMs and the combine's
                             reads: no expert runs for a dropped pair, and it adds 0 * x

Sizes depend on the shapes only (the capacity of a group of n tokens is a Python int), nothing is read on the host:
capturable in a CUDA graph. The torch path (``ops/cpu_route.py``) drops pairs with the same ``kept``; the oracle
ranks them its own way (a cumulative sum over their one-hot, ``moecomp.oracle.reference``).
"""

from __future__ import annotations

import math

import torch

from ..core.spec import MoESpec
from . import route_weights as rw


def kernel_spec(spec: MoESpec) -> MoESpec:
    """The spec the routing kernel runs for a capacity spec: as it is, or, when the renormalisation follows the drop
    (``renorm_after_drop``), without renormalisation, scaling and rounding (raw scores: ``apply`` does them)."""
    if not spec.renorm_after_drop:
        return spec
    return spec.replace(renormalize=False, renorm_eps=0.0, renorm_min=0.0, routed_scaling_factor=1.0,
                        round_weights=False, capacity=0, capacity_factor=0.0, capacity_per="call",
                        renorm_after_drop=False)


def group_tokens(shape, spec: MoESpec) -> int:
    """The tokens of one capacity group of an input x of ``shape`` [..., H]: each sequence (x's second-to-last dim;
    ``capacity_per`` "sequence" on an x of 3 or more dims), else every token of the call."""
    if spec.capacity_per == "sequence" and len(shape) > 2:
        return int(shape[-2])
    return math.prod(shape[:-1])


def kept(ids: torch.Tensor, spec: MoESpec, group: int) -> torch.Tensor:
    """[T, k] bool: the pairs the capacity keeps, groups of ``group`` consecutive tokens (ids in [0, E))."""
    T, k = ids.shape
    if T == 0:
        return torch.ones_like(ids, dtype=torch.bool)
    G, E, dev = T // group, spec.num_experts, ids.device
    key = ids.long() + (torch.arange(T, device=dev) // group * E)[:, None]  # [T, k]: (group, expert)
    key = key.reshape(G, group, k).transpose(1, 2).reshape(-1)  # [P], slot-major in each group
    order = torch.sort(key, stable=True).indices  # each key's pairs together, in slot-major order
    counts = torch.zeros(G * E, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    start = counts.cumsum(0) - counts  # [G * E]: where each key's pairs begin in ``order``
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(key.numel(), device=dev))
    keep = (pos - start[key]) < spec.capacity_for(group)
    return keep.reshape(G, k, group).transpose(1, 2).reshape(T, k)


def apply(ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec, group: int, out_dtype: torch.dtype):
    """(ids [T, k] int32, weights [T, k] fp32) from the routing kernel (run with ``kernel_spec``) -> the same with
    the dropped pairs' ids E and weights 0; with ``renorm_after_drop`` the kept weights renormalised (denominator
    ``max(sum + renorm_eps, renorm_min)``), scaled and rounded as the routing kernel would have."""
    keep = kept(ids, spec, group)
    w = weights.masked_fill(~keep, 0.0)
    if spec.renorm_after_drop:
        w = rw.finite(rw.normalised(w, spec))
        if spec.round_weights and out_dtype in (torch.bfloat16, torch.float16):
            w = rw.rounded(w, out_dtype)
    return ids.masked_fill(~keep, spec.num_experts), w
