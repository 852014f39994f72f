"""The routing weights' last steps on the op's torch-level code (the torch path's routing, ``ops/cpu_route.py``, and
the Triton path's capacity drop, ``ops/capacity.py``): the renormalisation's denominator, the routed scaling, the
routing contract's finite weights and the rounding through the model dtype (``moecomp.core.spec`` has the rules; the
routing kernel does the same in its epilogue). Written for the op, apart from the oracle.
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec

FLT_MAX = float(torch.finfo(torch.float32).max)


def denominator(total: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """The renormalisation's denominator from the sum of the weights it spreads over: ``max(total + renorm_eps,
    renorm_min)`` (a renorm_min of 0 leaves it as it is)."""
    d = total + spec.renorm_eps
    return torch.maximum(d, d.new_tensor(spec.renorm_min)) if spec.renorm_min > 0 else d


def normalised(w: torch.Tensor, spec: MoESpec, total: torch.Tensor | None = None) -> torch.Tensor:
    """w [T, n] divided by the denominator of ``total`` [T, 1] (default: w's row sums) where ``spec.renormalize``,
    then times ``routed_scaling_factor``."""
    if spec.renormalize:
        w = w / denominator(w.sum(-1, keepdim=True) if total is None else total, spec)
    return w * spec.routed_scaling_factor


def finite(w: torch.Tensor, limit: float = FLT_MAX) -> torch.Tensor:
    """The routing contract's finite weights: NaN -> 0, anything past +-limit (infinities included) -> +-limit."""
    return torch.where(torch.isnan(w), torch.zeros_like(w), w).clamp(-limit, limit)


def rounded(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w through ``dtype`` and back (``spec.round_weights``), held within dtype's finite range first: a finite weight
    stays finite."""
    top = min(torch.finfo(dtype).max, torch.finfo(w.dtype).max)
    return w.clamp(-top, top).to(dtype).to(w.dtype)
