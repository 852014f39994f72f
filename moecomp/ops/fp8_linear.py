"""``torch.ops.moecomp.fp8_linear``: a dense linear over quantized weights (transformers' ``FP8Linear``: attention
projections, dense MLPs, shared experts outside a block's op), opaque to Dynamo / Inductor.

    y = quantize_act(x) @ dequantize(weight, weight_scale).T (+ bias)      x [..., in], weight [out, in] e4m3

``quant`` is a ``QuantSpec`` key (``moecomp.core.spec.QuantSpec.key``): scale layout "block" ``[ceil(out / block_n),
ceil(in / block_k)]``, "channel" ``[out]``, "tensor" ``[]``; activations "dynamic" (per token and 128 columns),
"static" (``act_scale``, one value) or "none" (weight-only). CUDA runs the Triton kernel
(``ops/triton_moe.fp8_linear``); CPU dequantizes for the call (nothing kept) and quantizes x as the kernel does
(``moecomp.core.quant``).
"""

from __future__ import annotations

import torch

from ..core import quant as q8
from ..core.spec import QuantSpec, SpecError
from .common import backend_name as _backend

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_fp8_linear(x, weight, weight_scale, bias, act_scale, q: QuantSpec) -> None:
    """SpecError (a ValueError) naming the argument and what was expected."""
    if x.dtype not in _X_DTYPES:
        raise SpecError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if weight.dim() != 2 or weight.dtype != q8.FP8:
        raise SpecError(f"weight has shape {tuple(weight.shape)} and dtype {weight.dtype}; expected 2-D [out, in] "
                        f"{q8.FP8}")
    N, K = weight.shape
    if x.dim() == 0 or x.shape[-1] != K:
        raise SpecError(f"x has shape {tuple(x.shape)}; its last dim must be the weight's in_features {K}")
    want = q.scale_shape(N, K)
    if tuple(weight_scale.shape) != want:
        raise SpecError(f"weight_scale has shape {tuple(weight_scale.shape)}; {q.scale} scales for weight "
                        f"{tuple(weight.shape)} need {want}")
    if weight_scale.dtype != q8.scale_dtype(q):
        raise SpecError(f"weight_scale has dtype {weight_scale.dtype}; expected {q8.scale_dtype(q)} "
                        f"(scale_dtype {q.scale_dtype!r})")
    if bias is not None and (tuple(bias.shape) != (N,) or not bias.is_floating_point()):
        raise SpecError(f"bias has shape {tuple(bias.shape)} and dtype {bias.dtype}; expected a float [{N}]")
    if (act_scale is not None) != (q.activation == "static"):
        raise SpecError(f"act_scale is {'given' if act_scale is not None else 'None'}; the quant spec's activation "
                        f"is {q.activation!r} (a static scale exactly when 'static')")
    if act_scale is not None and (act_scale.numel() != 1 or act_scale.dtype != torch.float32):
        raise SpecError(f"act_scale has shape {tuple(act_scale.shape)} and dtype {act_scale.dtype}; expected one "
                        f"float32 value")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias), ("act_scale", act_scale)):
        if t is not None and t.device != x.device:
            raise SpecError(f"{name} is on {t.device}; expected {x.device}, the device of x")


def torch_fp8_linear(x, weight, weight_scale, bias, act_scale, q: QuantSpec) -> torch.Tensor:
    """The CPU path (and the oracle): fp32 math on the dequantized weight."""
    x2 = x.reshape(-1, x.shape[-1])
    y = q8.fake_quant_act(x2, q, act_scale) @ q8.dequantize(weight, weight_scale, q).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("moecomp::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               act_scale: torch.Tensor | None, quant: str) -> torch.Tensor:
    q = QuantSpec.from_key(quant)
    check_fp8_linear(x, weight, weight_scale, bias, act_scale, q)
    return _run(x, weight, weight_scale, bias, act_scale, q)


def _run(x, weight, weight_scale, bias, act_scale, q: QuantSpec) -> torch.Tensor:
    if _backend(x.device) == "triton":  # CUDA, or the interpreter under MOECOMP_CPU_BACKEND=triton
        from . import triton_moe  # lazy: Triton

        run = getattr(triton_moe, "fp8_linear", None)
        if run is not None:
            return run(x, weight, weight_scale, bias, act_scale, q)
    return torch_fp8_linear(x, weight, weight_scale, bias, act_scale, q)


@fp8_linear.register_fake
def _(x, weight, weight_scale, bias, act_scale, quant):
    q = QuantSpec.from_key(quant)
    check_fp8_linear(x, weight, weight_scale, bias, act_scale, q)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def call_fp8_linear(x, weight, weight_scale, bias, act_scale, q: QuantSpec) -> torch.Tensor:
    """For eager callers: the op's computation without the dispatcher's host cost where it would change nothing."""
    from .moe_op import plain_eager

    if plain_eager((x, weight, weight_scale, bias, act_scale)):
        check_fp8_linear(x, weight, weight_scale, bias, act_scale, q)
        return _run(x, weight, weight_scale, bias, act_scale, q)
    return torch.ops.moecomp.fp8_linear(x, weight, weight_scale, bias, act_scale, q.key)
