"""The shared (always-on) experts on the torch path (``ops/torch_moe.py``, and the parallel path on that backend),
written for the op apart from the oracle: all S stacked shared experts (``SharedExpertSpec.stacked``; a 2-D expert
is a stack of one) in one batched GEMM chain, their outputs weighed by the router's gammas (``shared_gamma``) in one
contraction, fp32 throughout (x's dtype only where the model rounds: before a norm, and FP8 GEMM inputs).

    ys  = act(x @ w1[s].T, x @ w3[s].T) @ w2[s].T           [S, T, H] ("concat": gate and up halves of one w1)
    y   = sum_s gammas[:, s] * ys[s]      (no gammas: the plain sum)
    y   = norm(round(y)) * sigmoid(x @ gate_w.T) * scale    (each where the spec has it)

FP8 shared experts (``shared.quant``): each GEMM on the dequantized weight with its input quantized as the spec says
(``moecomp.core.quant``), the activation rounded to x's dtype before the down GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import quant as q8
from ..core.spec import MoESpec
from . import cpu_act, norms

_W = ("shared_w1", "shared_w3", "shared_w2")


def _stacked(args: dict, sh) -> dict:
    """The three weights as fp32 stacks [S, out, in] (a 2-D expert: a stack of one); absent ones None."""
    out = {}
    for n in _W:
        t = args.get(n)
        out[n] = None if t is None else (t if sh.stacked else t[None]).float()
    return out


def _each(x: torch.Tensor, args: dict, sh) -> torch.Tensor:
    """Every shared expert's output, unweighted: x [T, H] fp32 -> [S, T, H] fp32."""
    w = _stacked(args, sh)

    def lin(a, name):
        return torch.matmul(a, w[name].transpose(-2, -1))  # [T, in] or [S, T, in] -> [S, T, out]

    if not sh.gated:
        h = cpu_act.elementwise(lin(x, "shared_w3"), sh.activation)
    elif sh.layout == "concat":
        h = cpu_act.act_of(lin(x, "shared_w1"), sh, sh.intermediate_size)
    else:
        h = cpu_act.gated(lin(x, "shared_w1"), lin(x, "shared_w3"), sh)
    return lin(h, "shared_w2")


def _quantized(x2: torch.Tensor, args: dict, sh) -> torch.Tensor:
    """FP8 shared expert (one, 2-D): x [T, H] -> fp32 [T, H]."""
    qs = sh.quant

    def lin(a, name):
        return q8.fake_quant_act(a, qs).float() @ q8.dequantize(args[name], args[f"{name}_scale"], qs).float().T

    if sh.gated:
        h = cpu_act.gated(lin(x2, "shared_w1"), lin(x2, "shared_w3"), sh)
    else:
        h = cpu_act.elementwise(lin(x2, "shared_w3"), sh.activation)
    return lin(h.to(x2.dtype), "shared_w2")


def shared_part(x2: torch.Tensor, args: dict, spec: MoESpec, gammas: torch.Tensor | None = None) -> torch.Tensor:
    """The shared experts' sum on x2 [T, H] -> fp32 [T, H]: times ``gammas`` [T, S] where given, normalised, gated
    and scaled as ``spec.shared`` says (``args`` with a fused gate split off)."""
    sh = spec.shared
    x = x2.float()
    if sh.quant is not None:
        y = _quantized(x2, args, sh)
    else:
        ys = _each(x, args, sh)  # [S, T, H]
        y = ys.sum(0) if gammas is None else torch.einsum("sth,ts->th", ys, gammas.float())
    if sh.norm != "none":  # the model's output rounded to x's dtype, then normalised
        y = norms.shared_norm(y.to(x2.dtype), args, sh).float()
    if sh.gate == "sigmoid":
        y = y * torch.sigmoid(F.linear(x, args["shared_gate_w"].float()))
    return y * sh.scale if sh.scale != 1.0 else y
