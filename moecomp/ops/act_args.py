"""The activation epilogue's launch arguments (``kernels/activations.py``'s ACT code and its constants), read from a
MoESpec or SharedExpertSpec once per launch."""

from __future__ import annotations

from typing import NamedTuple

from ..kernels.activations import CLAMP_ACT, CLAMP_GATE, CLAMP_NONE, CODES, SILU_SOFTCAP


class ActArgs(NamedTuple):
    ACT: int
    alpha: float
    limit: float
    CLAMP: int  # kernels/activations' clamp code: CLAMP_NONE, CLAMP_GATE (activation_clamp), CLAMP_ACT (..._after)


def act_args(s) -> ActArgs:
    """(ACT, alpha, limit, CLAMP) for ``gated`` / ``act`` from a MoESpec or SharedExpertSpec: a softcapped silu
    (gate_softcap / up_softcap) is ACT 6 with alpha = the gate's cap and limit = up's (0: uncapped); CLAMP is
    CLAMP_GATE with ``activation_clamp``, CLAMP_ACT with ``activation_clamp_after`` (gated only), else CLAMP_NONE."""
    if s.gated and (s.gate_softcap or s.up_softcap):
        return ActArgs(SILU_SOFTCAP, float(s.gate_softcap), float(s.up_softcap), CLAMP_NONE)
    clamp = CLAMP_NONE
    if s.gated and s.activation_clamp:
        clamp = CLAMP_GATE
    elif s.gated and s.activation_clamp_after:
        clamp = CLAMP_ACT
    return ActArgs(CODES[s.activation], float(s.activation_alpha), float(s.activation_limit), clamp)
