"""``torch.ops.moecomp.linear_4bit``: a dense linear over 4-bit weights (the int4 linears of GPTQ / AWQ checkpoints
outside the routed experts: attention projections, shared experts, dense MLPs; mxfp4 too), opaque to Dynamo /
Inductor. ``formats/packed_linear.Packed4Linear``'s forward is this op.

    y = x @ dequantize(q, scale, quant, zero=zero).T (+ bias)        x [..., K] -> y [..., N] in x's dtype

    q      [N, K / 2] uint8     code of input 2j in the low nibble of byte j (``moecomp.core.quant``, the oracle)
    scale  [N, ceil(K / g)]     int4: fp16 / bf16 / fp32 (the spec's scale_dtype); mxfp4: float8_e8m0fnu, g = 32
    zero   [N, ceil(K / g)]     uint8, int4 with ``quant.zero_point`` only (else None: zero 8)
    bias   [N] float or None
    quant  a ``QuantSpec.key`` of a 4-bit spec (``QuantSpec.int4(g, zero_point, scale_dtype)`` / ``mxfp4()``)

CPU (and the oracle, ``torch_linear_4bit``): the weight dequantized for the call (fp32, nothing kept), an fp32
matmul, the bias added in fp32, one rounding to x's dtype. CUDA (or the interpreter under MOECOMP_CPU_BACKEND=triton):
``ops/triton_linear4.py`` (the skinny 4-bit kernel at up to 4 rows, the MMA kernel on ``quant4.dot_loop4`` above).
Gradients: x's (and bias's) through the dequantized weight; the 4-bit tensors get none (frozen).
"""

from __future__ import annotations

import torch

from ..core import quant as q8
from ..core.spec import QuantSpec, SpecError
from .common import backend_name as _backend

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _quant(quant) -> QuantSpec:
    q = QuantSpec.from_key(quant)
    if not q.packed:
        raise SpecError(f"quant is a {q.weight!r} spec; linear_4bit takes a 4-bit one (QuantSpec.int4(...) or "
                        f"QuantSpec.mxfp4())")
    return q  # (validated by from_key)


def check_linear_4bit(x, q, scale, zero, bias, quant: QuantSpec) -> None:
    """SpecError (a ValueError) naming the argument and what was expected."""
    if x.dtype not in _X_DTYPES:
        raise SpecError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise SpecError(f"q has shape {tuple(q.shape)} and dtype {q.dtype}; expected 2-D [out, in / 2] torch.uint8 "
                        f"(two 4-bit codes a byte)")
    N, K = q.shape[0], 2 * q.shape[1]
    if x.dim() == 0 or x.shape[-1] != K:
        raise SpecError(f"x has shape {tuple(x.shape)}; its last dim must be the weight's in_features {K} (twice "
                        f"q's {q.shape[1]} bytes a row)")
    want = quant.scale_shape(N, K)
    sdt = q8.scale_dtype(quant)
    if tuple(scale.shape) != want or scale.dtype != sdt:
        raise SpecError(f"scale has shape {tuple(scale.shape)} and dtype {scale.dtype}; expected {list(want)} "
                        f"{sdt} (one scale per row and group of {quant.block_k} inputs, scale_dtype "
                        f"{quant.scale_dtype!r})")
    if quant.zero_point:
        if zero is None or tuple(zero.shape) != want or zero.dtype != torch.uint8:
            got = "None" if zero is None else f"shape {tuple(zero.shape)} and dtype {zero.dtype}"
            raise SpecError(f"zero is {got}; quant.zero_point needs {list(want)} torch.uint8 (the scales' shape)")
    elif zero is not None:
        raise SpecError(f"zero is given ({tuple(zero.shape)}) but the quant spec has no zero_point (int4 without "
                        f"zero points uses 8; mxfp4 has none): expected None")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype not in _X_DTYPES):
        raise SpecError(f"bias has shape {tuple(bias.shape)} and dtype {bias.dtype}; expected a float [{N}]")
    for name, t in (("q", q), ("scale", scale), ("zero", zero), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise SpecError(f"{name} is on {t.device}; expected {x.device}, the device of x")


def torch_linear_4bit(x, q, scale, zero, bias, quant: QuantSpec) -> torch.Tensor:
    """The CPU path and the oracle: fp32 math on the weight dequantized for the call."""
    x2 = x.reshape(-1, x.shape[-1])
    y = x2.float() @ q8.dequantize(q, scale, quant, zero=zero).T  # [M, N] fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def _run(x, q, scale, zero, bias, quant: QuantSpec) -> torch.Tensor:
    if _backend(x.device) == "triton":  # CUDA, or the interpreter under MOECOMP_CPU_BACKEND=triton
        from . import triton_linear4  # lazy: Triton

        return triton_linear4.linear_4bit(x, q, scale, zero, bias, quant)
    return torch_linear_4bit(x, q, scale, zero, bias, quant)


@torch.library.custom_op("moecomp::linear_4bit", mutates_args=())
def linear_4bit(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                bias: torch.Tensor | None, quant: str) -> torch.Tensor:
    qs = _quant(quant)
    check_linear_4bit(x, q, scale, zero, bias, qs)
    return _run(x, q, scale, zero, bias, qs)


@linear_4bit.register_fake
def _(x, q, scale, zero, bias, quant):
    check_linear_4bit(x, q, scale, zero, bias, _quant(quant))
    return x.new_empty(*x.shape[:-1], q.shape[0])


def _setup(ctx, inputs, output):
    x, q, scale, zero, bias, quant = inputs
    ctx.save_for_backward(q, scale, zero)
    ctx.quant, ctx.bias_dtype = quant, None if bias is None else bias.dtype


def _backward(ctx, grad):
    """dy/dx through the dequantized weight (x's dtype); the bias's gradient its sum; the 4-bit tensors none."""
    q, scale, zero = ctx.saved_tensors
    gx = gb = None
    if ctx.needs_input_grad[0]:
        w = q8.dequantize(q, scale, _quant(ctx.quant), zero=zero)  # [N, K] fp32
        gx = (grad.float() @ w).to(grad.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        gb = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
    return gx, None, None, None, gb, None


linear_4bit.register_autograd(_backward, setup_context=_setup)


def call_linear_4bit(x, q, scale, zero, bias, quant: QuantSpec) -> torch.Tensor:
    """For eager callers: the op's computation without the dispatcher's host cost where it would change nothing
    (through the op when tracing, under a dispatch mode, or with gradients to record)."""
    from .moe_op import plain_eager

    if plain_eager((x, q, scale, zero, bias)):
        check_linear_4bit(x, q, scale, zero, bias, quant)
        return _run(x, q, scale, zero, bias, quant)
    return torch.ops.moecomp.linear_4bit(x, q, scale, zero, bias, quant.key)
