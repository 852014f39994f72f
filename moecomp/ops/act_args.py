"""The activation epilogue's launch arguments (``kernels/activations.py``'s ACT code and its constants), read from a
MoESpec or SharedExpertSpec once per launch."""

from __future__ import annotations

from typing import NamedTuple

from ..kernels.activations import CODES, SILU_SOFTCAP


class ActArgs(NamedTuple):
    ACT: int
    alpha: float
    limit: float
    CLAMP: bool


def act_args(s) -> ActArgs:
    """(ACT, alpha, limit, CLAMP) for ``gated`` / ``act`` from a MoESpec or SharedExpertSpec: a softcapped silu
    (gate_softcap / up_softcap) is ACT 6 with alpha = the gate's cap and limit = up's (0: uncapped)."""
    if s.gated and (s.gate_softcap or s.up_softcap):
        return ActArgs(SILU_SOFTCAP, float(s.gate_softcap), float(s.up_softcap), False)
    return ActArgs(CODES[s.activation], float(s.activation_alpha), float(s.activation_limit),
                   bool(s.activation_clamp))
