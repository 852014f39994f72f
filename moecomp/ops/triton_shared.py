"""The shared (always-on) experts on the Triton path, without their gate (the combine applies it, and the op runs
them on a side stream beside the routed experts: ``ops/triton_moe.py``).

    gu = x @ [w1; w3].T  (torch's GEMM, or ``fp8_linear`` for FP8 weights)  ->  h = act(g) * u  (act_mul_kernel)
    ->  h @ w2.T  [-> RMS norm (SharedExpertSpec.norm; in torch, a [T, H] row norm)]  (* SharedExpertSpec.scale)

``shared_part`` (the Triton path's ``Backend.shared_part``, ``ops/backend.py``): the same in fp32 with the gate applied,
for the parallel path, which adds the shared experts outside the combine.
"""

from __future__ import annotations

import torch
import triton

from ..kernels import combine as combine_k
from ..core.spec import MoESpec
from . import cpu_act, norms
from . import shared_gamma as sg
from .act_args import act_args
from .backend import Routed
from .triton_fp8 import block_cfg as _block_cfg
from .triton_fp8 import fp8_linear


def shared_mlp(x: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    """Shared experts without their gate (the combine applies it): x [T, H] -> [T, H]. Quantized
    (``spec.shared.quant``): each of the three GEMMs is the dense fp8 linear (``fp8_linear``)."""
    sh = spec.shared
    Is = sh.intermediate_size
    T = x.shape[0]
    lin = _shared_linear(args, sh.quant, _block_cfg(x, spec))
    if not sh.gated:
        up = lin(x, "shared_w3")
        h = cpu_act.elementwise(up.float(), sh.activation).to(up.dtype)
        return _scaled(norms.shared_norm(lin(h, "shared_w2"), args, sh), sh.scale)
    if sh.layout == "concat":
        gu = lin(x, "shared_w1")  # [T, 2 Is]
    else:
        gu = torch.empty(T, 2 * Is, dtype=x.dtype, device=x.device)
        lin(x, "shared_w1", gu[:, :Is])
        lin(x, "shared_w3", gu[:, Is:])
    hs = torch.empty(T, Is, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(Is))
    act = act_args(sh)
    combine_k.act_mul_kernel[(T, triton.cdiv(Is, block))](
        gu, hs, Is, gu.stride(0), hs.stride(0), act.alpha, act.limit, ACT=act.ACT, CLAMP=act.CLAMP, BLOCK=block,
    )
    return _scaled(norms.shared_norm(lin(hs, "shared_w2"), args, sh), sh.scale)


def shared_part(x2: torch.Tensor, args: dict, spec: MoESpec, routed: Routed) -> torch.Tensor:
    """The shared experts' sum on x2 [T, H] -> fp32 [T, H] (gate, scale and gammas applied): what the op's combine
    adds, computed apart (the parallel path adds it outside the routed experts' combine). The gate: the sigmoid of
    ``routed.gate``, the logit the router GEMM gave (in fp32, as the combine kernel does)."""
    if sg.stacked(spec):
        s = sg.weighted_sum(sg.shared_outputs(x2, args, spec), routed.gammas, spec, torch.empty_like(x2))
    else:
        s = shared_mlp(x2, args, spec)
    s = s.float()
    if routed.gate is not None:
        s = s * torch.sigmoid(routed.gate.float())[:, None]
    return s


def _shared_linear(args: dict, quant, cfg: dict | None = None):
    """lin(a, name, out=None) = a @ args[name].T: torch's GEMM, or the fp8 linear with the weight's scales (in the
    mode of ``cfg``, the block's, if given)."""
    def lin(a, name, out=None):
        if quant is not None:
            return fp8_linear(a, args[name], args[f"{name}_scale"], None, None, quant, out, cfg)
        if out is None:
            return torch.nn.functional.linear(a, args[name])
        return torch.mm(a, args[name].t(), out=out)

    return lin


def _scaled(y: torch.Tensor, scale: float) -> torch.Tensor:
    """The shared experts' output times ``SharedExpertSpec.scale`` (in place; nothing to do at 1)."""
    return y.mul_(scale) if scale != 1.0 else y
