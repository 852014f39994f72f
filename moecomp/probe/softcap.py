"""Softcaps measured, not read: fit the caps of a softcapped gated silu (MoESpec ``gate_softcap`` / ``up_softcap``)
from what a block's own gate function computes.

The model h = cap(g, cg) * sigmoid(g) * cap(u, cu), cap(v, c) = c * tanh(v / c) (c = 0: v itself). With g = t large
(sigmoid(t) = 1 in fp32) the gate factor is a constant cap(t, cg), so two calls give both caps apart:

    y1 = fn(g = t, u = t)   = cap(t, cg) * cap(t, cu)
    y2 = fn(g = t, u = eps) = cap(t, cg) * eps               (cap(eps, c) = eps for any cap far above eps)
    cap(t, cu) = eps * y1 / y2,  cap(t, cg) = y2 / eps

and c -> c * tanh(t / c) rises from 0 to t, so each cap is the root of one monotone equation (bisection). A value
within a relative 1e-6 of t is no cap (0). The fitted caps are then checked on the wide gate probe as a whole
(``activations.probe_gate``): a function that is no softcapped silu fits caps that fail that check.
"""

from __future__ import annotations

import math

import torch

from ..core.reject import raise_if_oom

T_PROBE = 1000.0  # g and u of the fitting calls: caps up to about 10 * T_PROBE stay measurable in fp32
EPS_PROBE = 1e-3
NO_CAP_RTOL = 1e-6


def capped(t: float, c: float) -> float:
    return t if not c else c * math.tanh(t / c)


def solve_cap(value: float, t: float = T_PROBE) -> float | None:
    """The cap c with c * tanh(t / c) == value (0: no cap, value ~ t); None when no c fits (value <= 0 or > t)."""
    if not math.isfinite(value) or value <= 0 or value > t * (1 + NO_CAP_RTOL):
        return None
    if value >= t * (1 - NO_CAP_RTOL):
        return 0.0
    lo, hi = value, value  # c * tanh(t / c) <= c: the root is >= value; grow hi until it brackets
    while capped(t, hi) < value:
        hi *= 2.0
        if hi > 1e12:
            return None
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if capped(t, mid) < value:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    c = 0.5 * (lo + hi)
    nice = float(f"{c:.6g}")  # 4.0 rather than 3.9999998 where the measurement allows it
    return nice if math.isclose(capped(t, nice), value, rel_tol=1e-7) else c


def fit_softcaps(fn) -> tuple[float, float] | None:
    """(gate cap, up cap) of the gate function ``fn`` ([n, 2] gate / up -> [n, 1], one intermediate column, so
    the concat and interleaved splits coincide), or None when it cannot run or no caps fit. Both 0: no softcap."""
    h = torch.tensor([[T_PROBE, T_PROBE], [T_PROBE, EPS_PROBE]], dtype=torch.float64)
    try:
        with torch.no_grad():
            y = fn(h.float().clone())
    except Exception as e:  # noqa: BLE001  (a gate that cannot run on this probe: not one to fit)
        raise_if_oom(e)
        return None
    if not isinstance(y, torch.Tensor) or y.shape != (2, 1):
        return None
    y1, y2 = float(y[0, 0]), float(y[1, 0])
    cg = solve_cap(y2 / EPS_PROBE)
    cu = solve_cap(EPS_PROBE * y1 / y2) if y2 else None
    if cg is None or cu is None:
        return None
    return cg, cu
