"""The oracle's expert activations (split from reference.py, which passed 600 lines; ``moecomp.oracle.reference`` re-exports
them): what an expert computes between its first GEMM(s) and its down GEMM, as ``moecomp.core.spec``'s docstring says.
Plain PyTorch, in the dtype of the inputs (the reference calls them on fp32 / fp64 values).

    gated:                   act(g) * u
    activation_clamp:        act(min(g, L)) * clamp(u, -L, L)          (the gate clamped before the activation)
    activation_clamp_after:  min(act(g), L) * clamp(u, -L, L)          (the activation's output clamped: Step-3.7)
    swiglu_oai:              (clamp(u, -L, L) + 1) * g * sigmoid(alpha * g),  g = min(g, L)     (gpt-oss)
    softcaps:                cap(g, cg) * sigmoid(g) * cap(u, cu),  cap(v, c) = c * tanh(v / c)  (gated silu only)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(h: torch.Tensor, spec_activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    if spec_activation == "silu":
        return F.silu(h)
    if spec_activation == "gelu":
        return F.gelu(h)
    if spec_activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if spec_activation == "relu":
        return F.relu(h)
    if spec_activation == "relu2":
        return torch.square(F.relu(h))
    raise ValueError(f"not an elementwise activation: {spec_activation}")


def softcap(v: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(v / cap); v itself for cap 0 (no cap)."""
    return v if not cap else torch.tanh(v / cap) * cap


def gated_activation(gate, up, activation_name: str, alpha: float, limit: float, clamp: bool,
                     gate_softcap: float = 0.0, up_softcap: float = 0.0, clamp_after: bool = False) -> torch.Tensor:
    """act(gate) * up, with the clamps of clamped SwiGLU (``clamp``: the gate before its activation; ``clamp_after``:
    the activation's output, ``min(act(gate), limit)``; up to [-limit, limit] either way) or gpt-oss's
    ``swiglu_oai``; with softcaps (gated silu): softcap(gate, gate_softcap) * sigmoid(gate) * softcap(up, up_softcap),
    the sigmoid on the raw gate."""
    if clamp and clamp_after:
        raise ValueError("clamp (before the activation) and clamp_after (after it) exclude each other")
    if gate_softcap or up_softcap:
        if activation_name != "silu" or clamp or clamp_after:
            raise ValueError(f"softcaps apply to an unclamped gated silu, not {activation_name!r} (clamp={clamp}, "
                             f"clamp_after={clamp_after})")
        return softcap(gate, gate_softcap) * torch.sigmoid(gate) * softcap(up, up_softcap)
    if activation_name == "swiglu_oai":
        if clamp_after:
            raise ValueError("swiglu_oai clamps its gate before the activation: no clamp_after")
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if clamp:
        gate = gate.clamp(max=limit)
    if clamp or clamp_after:
        up = up.clamp(min=-limit, max=limit)
    h = activation(gate, activation_name)
    return (h.clamp(max=limit) if clamp_after else h) * up


def spec_gated(gate: torch.Tensor, up: torch.Tensor, s) -> torch.Tensor:
    """``gated_activation`` as ``s`` (a MoESpec or a SharedExpertSpec) says."""
    return gated_activation(gate, up, s.activation, s.activation_alpha, s.activation_limit, s.activation_clamp,
                            s.gate_softcap, s.up_softcap, s.activation_clamp_after)
