"""Tensor parallelism: every rank holds every expert's intermediate columns s = [r * I / W, (r + 1) * I / W):

    w13[e] rows  gate[s] and up[s]  (column-parallel: gate and up sliced alike; interleaved: rows 2s, 2s + 1)
    w2[e]  cols  s                  (row-parallel: the same columns)
    h_s = act(x @ gate[s].T) * (x @ up[s].T)      the activation is elementwise, so each rank has its columns' h
    y_s = h_s @ w2[:, s].T                         and sum_r y_r = h @ w2.T: the partial outputs add up to y

    partial [T, width] = moe_experts(xe, ids, weights) on the slices; b2 (whole, [E, H]) and the zero experts'
    weight * x are added by rank 0 only; an expert capacity's dropped pairs get an id past the experts (skipped).
    The caller sums the partials over the ranks (one all-reduce).

Mode "replicated" (every rank holds every expert whole) runs the same call on the whole I, each rank as rank 0: its
output is the complete routed part, the same on every rank, and nothing is reduced.
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec
from . import local
from ..ops.backend import Routed


def routed(xe: torch.Tensor, r: Routed, args: dict, spec: MoESpec) -> torch.Tensor:
    """This rank's partial routed output, fp32 [T, width] (mode "replicated": the complete one)."""
    p, E = spec.parallel, spec.num_experts
    lead = p.rank == 0 or p.mode == "replicated"  # (adds b2 and the zero experts' terms)
    ids, w = r.ids.long(), r.weights
    if spec.has_capacity:  # dropped pairs (-1 on the torch path, E on the Triton path): an id past the experts
        real = (ids >= 0) & (ids < E)
        ids, w = torch.where(real, ids, E), torch.where(real, w, 0.0)
    if spec.zero_experts and not lead:
        w = torch.where(ids >= E, 0.0, w)
    if spec.has_b2 and not lead:
        args = {**args, "b2": torch.zeros_like(args["b2"])}
    ks = local.kernel_spec(spec, ids.shape[1], spec.has_capacity)
    return local.run(xe, ids, w, args, ks).float()
