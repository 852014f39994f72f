"""The attribute reader's router logit scale (``MoESpec.router_scale``; MuseSpark's ``output_multiplier``), measured:
the logits the router module returned on the probe run against x @ W.T (+ b) in fp32: one constant c with
logits ~= c * (x @ W.T (+ b)) is the scale (snapped to the block's numeric attributes, as the routed scaling is).
1.0 when the router returns no logits of the experts' width, or when they are the plain GEMM's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import policy


def router_logits_out(rout, T: int, E: int) -> torch.Tensor | None:
    """The [T, E] floating tensor among what the router module returned, or None."""
    if isinstance(rout, torch.Tensor):
        rout = (rout,)
    if not isinstance(rout, (tuple, list)):
        return None
    return next((o.reshape(T, E) for o in rout if isinstance(o, torch.Tensor) and o.is_floating_point()
                 and o.shape[-1] == E and o.numel() == T * E), None)


def measure_scale(rout, x2: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, consts: list) -> float:
    """c (> 0) with router logits ~= c * (x2 @ W.T (+ b)); 1.0 when there are no logits to read or no one c fits."""
    E = W.shape[0]
    lg = router_logits_out(rout, x2.shape[0], E)
    if lg is None:
        return 1.0
    lg = lg.float()
    raw = F.linear(x2.float(), W.float(), None if b is None else b.float())
    denom = float((raw * raw).sum())
    if denom == 0:
        return 1.0
    c = float((lg * raw).sum()) / denom
    tol = policy.routing_match_tolerance(x2.dtype)
    if not (c > 0 and torch.allclose(lg, c * raw, rtol=tol, atol=tol * float(lg.abs().max()))):
        return 1.0
    c = policy.snap_constant(c, consts)
    return 1.0 if abs(c - 1.0) < 1e-6 else c
