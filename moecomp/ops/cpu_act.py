"""The experts' activations on the op's torch code (the torch path's routed and shared experts, and the Triton path's
torch-level shared-expert steps): ``spec.activation`` elementwise, or gated, ``act(gate) * up`` with clamped SwiGLU
(the gate clamped before the activation, or its output after it: ``activation_clamp_after``), gpt-oss's
``swiglu_oai`` and the softcapped silu (``moecomp.core.spec`` has the formulas; the kernels' epilogue is
``kernels/activations.py``). One table from name to function, written for the op, apart from the oracle.

    split(h, ...)    h [n, 2I] after the first GEMM -> (gate, up) [n, I] each ("concat": halves, "interleaved": even /
                     odd columns)
    act_of(h, s)     the input of the second GEMM [n, I]: gated or not, as ``s`` (MoESpec / SharedExpertSpec) says
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _relu2(h: torch.Tensor) -> torch.Tensor:
    r = torch.relu(h)
    return r * r


ELEMENTWISE = {
    "silu": lambda h: h * torch.sigmoid(h),
    "gelu": lambda h: F.gelu(h),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": torch.relu,
    "relu2": _relu2,
}


def elementwise(h: torch.Tensor, name: str) -> torch.Tensor:
    """``name`` applied to each element of h (an ungated expert, or the gate of a gated one)."""
    fn = ELEMENTWISE.get(name)
    if fn is None:
        raise ValueError(f"activation={name!r} is not elementwise; expected one of {sorted(ELEMENTWISE)}")
    return fn(h)


def _capped(v: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(v / cap), or v for cap 0."""
    return cap * torch.tanh(v / cap) if cap else v


def gated(gate: torch.Tensor, up: torch.Tensor, s) -> torch.Tensor:
    """act(gate) * up as ``s`` says: softcapped silu, swiglu_oai ((up + 1) * gate * sigmoid(alpha * gate), both
    clamped by the limit), or ``s.activation`` with a limit L: ``activation_clamp`` act(min(gate, L)),
    ``activation_clamp_after`` min(act(gate), L) (Step-3.7), up within [-L, L] with either."""
    before, after = s.activation_clamp, s.activation_clamp_after
    if s.gate_softcap or s.up_softcap:  # the sigmoid reads the raw gate, the linear factor the capped one
        if s.activation != "silu" or before or after:
            raise ValueError(f"softcaps apply to an unclamped gated silu, not {s.activation!r} "
                             f"(activation_clamp={before}, activation_clamp_after={after})")
        return _capped(gate, s.gate_softcap) * torch.sigmoid(gate) * _capped(up, s.up_softcap)
    if before and after or s.activation == "swiglu_oai" and after:
        raise ValueError(f"activation_clamp_after excludes activation_clamp and swiglu_oai ({s.activation!r}, "
                         f"activation_clamp={before})")
    lim = s.activation_limit
    if s.activation == "swiglu_oai" or before:
        gate = torch.clamp(gate, max=lim)
    if s.activation == "swiglu_oai" or before or after:
        up = torch.clamp(up, -lim, lim)
    if s.activation == "swiglu_oai":
        return (up + 1) * (gate * torch.sigmoid(s.activation_alpha * gate))
    a = elementwise(gate, s.activation)
    return (torch.clamp(a, max=lim) if after else a) * up


def split(h: torch.Tensor, interleaved: bool, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [..., 2 * width] -> (gate, up) [..., width]: halves (``gate_up`` "concat", a shared expert's "concat"
    layout) or even / odd columns (``gate_up`` "interleaved")."""
    if interleaved:
        pairs = h.unflatten(-1, (width, 2))
        return pairs[..., 0], pairs[..., 1]
    return h[..., :width], h[..., width:]


def act_of(h: torch.Tensor, s, width: int) -> torch.Tensor:
    """The second GEMM's input from the first's output h [..., 2 * width] (gated) or [..., width]; gate and up split
    as ``s.gate_up`` says (a SharedExpertSpec has none: its concatenated halves)."""
    if not s.gated:
        return elementwise(h, s.activation)
    return gated(*split(h, getattr(s, "gate_up", "concat") == "interleaved", width), s)
