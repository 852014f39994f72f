"""The shared (always-on) experts on the Triton path, without their gate (the combine applies it, and the op runs
them on a side stream beside the routed experts: ``ops/triton_moe.py``).

    gu = x @ [w1; w3].T  (torch's GEMM, or ``fp8_linear`` for FP8 weights)  ->  h = act(g) * u  (act_mul_kernel)
    ->  h @ w2.T  [-> RMS norm (SharedExpertSpec.norm; in torch, a [T, H] row norm)]  (* SharedExpertSpec.scale)
"""

from __future__ import annotations

import torch
import triton

from .. import reference
from .act_args import act_args
from ..kernels import combine as combine_k
from ..spec import MoESpec
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
        return _scaled(_norm(lin(reference.activation(up, sh.activation), "shared_w2"), args, sh), sh.scale)
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
    return _scaled(_norm(lin(hs, "shared_w2"), args, sh), sh.scale)


def _norm(y: torch.Tensor, args: dict, sh) -> torch.Tensor:
    """The shared expert's output y [T, H] (x's dtype) normalised as ``sh.norm`` says (the reference's formula)."""
    if sh.norm == "none":
        return y
    return reference.rms_norm(y, args["shared_norm_w"], sh.norm, sh.norm_eps, y.dtype)


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
