"""``torch.ops.moecomp.skinny_linear``: ``F.linear`` for a few rows against 16-bit weights, through the skinny kernel
(``ops/skinny.py``) on CUDA where it was measured faster than cuBLAS (``skinny.use_skinny``: one row always, two
rows up to 32M weight elements), ``F.linear`` everywhere else (CPU, more rows, ``MOECOMP_SKINNY=0``).

The generate engine's compiled decode steps call it for the decoder layers' plain ``nn.Linear`` modules
(``generate/shared_layers.method_forwards``): at batch 1 every attention projection is a latency-bound launch, which
cuBLAS runs at 1.0-2.2 TB/s on Qwen3-30B-A3B's shapes and this kernel at 1.0-4.2 (``diag_skinny.py``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_DTYPES = (torch.float16, torch.bfloat16)


def check_linear(x, weight, bias) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"skinny_linear: weight dtype {weight.dtype} must equal x's {x.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],)):
        raise ValueError(f"skinny_linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def enabled() -> bool:
    """MOECOMP_SKINNY=0 turns the skinny kernel off (read outside traced code)."""
    return os.environ.get("MOECOMP_SKINNY", "1") != "0"


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call goes to the skinny kernel, decided from shapes, dtypes and the device (trace-time constants
    at a static batch; a guard at a dynamic one)."""
    if not (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype and weight.stride(-1) == 1):
        return False
    from . import skinny

    N, K = weight.shape
    return skinny.use_skinny(x.numel() // max(K, 1), N, K, False)


@torch.library.custom_op("moecomp::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    check_linear(x, weight, bias)
    return run(x, weight, bias)


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op's computation on checked arguments (also each member of ``moecomp::skinny_group`` it does not launch
    as one)."""
    if not (enabled() and takes(x, weight)):
        return F.linear(x, weight, bias)
    from . import skinny

    K = x.shape[-1]
    y = skinny.skinny_linear(x.reshape(-1, K), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@skinny_linear.register_fake
def _(x, weight, bias):
    check_linear(x, weight, bias)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """The linear's gradients (the op is a linear; the kernel only changes how the forward is summed)."""
    x, weight = ctx.saved_tensors
    N, K = weight.shape
    g2 = grad.reshape(-1, N)  # [M, N]
    gx = (g2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    gw = g2.T @ x.reshape(-1, K) if ctx.needs_input_grad[1] else None
    gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb


skinny_linear.register_autograd(_backward, setup_context=_setup)


def linear_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A plain ``nn.Linear``'s forward through the op where the kernel takes the call, ``F.linear`` otherwise (the
    choice is made on shapes, so a compiled step holds one or the other)."""
    if takes(x, self.weight):
        return torch.ops.moecomp.skinny_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)
