"""A dense linear stored 4-bit (int4 GPTQ / AWQ, mxfp4), as a module of moecomp's own: ``Packed4Linear``.

The int4 loader (``api/load_gptq.py``) puts one where a checkpoint holds an int4 linear outside the routed experts
(attention projections, shared experts, dense MLPs, a quantized ``lm_head``). It holds the tensors as stored (moecomp's
layout, ``moecomp.core.quant``; nothing dequantized is kept) and its forward is one ``torch.ops.moecomp.linear_4bit`` call
(``ops/linear4.py``: plain PyTorch on CPU, Triton on CUDA)::

    x [..., in] ──[x[..., perm]: act-order checkpoints only]──► linear_4bit(x, qweight, scales, zeros, bias, quant)
                                                                    ──► y [..., out] in x's dtype

    qweight [out, in / 2] uint8   code of input 2j in the low nibble of byte j (not GPTQ's int32 [in / 8, out])
    scales  [out, ceil(in / g)]   fp16 / bf16 / fp32 (int4), float8_e8m0fnu (mxfp4, g = 32)
    zeros   [out, ceil(in / g)]   uint8, int4 with zero points (else None: zero 8)
    bias    [out] or None
    perm    [in] int64 or None    act-order (GPTQ ``desc_act``): the stored columns are the inputs in the order
                                  ``perm`` (groups of g consecutive stored columns), so x is gathered the same way

All are frozen (``requires_grad=False``); gradients flow to x through the op (the dequantized weight). It is not an
``nn.Linear`` subclass on purpose: code that reads ``.weight`` as a float matrix (or the generate engine's 16-bit
skinny swap of plain ``nn.Linear`` modules) must not take it for one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import quant as q8
from ..ops.linear4 import call_linear_4bit, check_linear_4bit
from ..core.spec import QuantSpec, SpecError


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class Packed4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W stored 4-bit (module docstring). ``quant``: ``QuantSpec.int4(group, zero_point,
    scale_dtype)`` or ``QuantSpec.mxfp4()``. Shapes and dtypes are checked here (a ValueError naming the tensor)."""

    def __init__(self, quant: QuantSpec, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(quant, QuantSpec) or not quant.packed:
            raise SpecError(f"quant must be a 4-bit QuantSpec (QuantSpec.int4(...) or QuantSpec.mxfp4()), got "
                            f"{quant!r}")
        self.quant = quant
        self._quant_key = quant.key  # (read outside any trace: Dynamo cannot trace a cached property's first read)
        if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
            raise SpecError(f"qweight must be a 2-D [out, in / 2] uint8 tensor, got "
                            f"{getattr(qweight, 'shape', type(qweight).__name__)}")
        self.out_features, self.in_features = int(qweight.shape[0]), 2 * int(qweight.shape[1])
        if perm is not None and (perm.dim() != 1 or perm.shape[0] != self.in_features or perm.is_floating_point()
                                 or perm.device != qweight.device):
            raise SpecError(f"perm has shape {tuple(perm.shape)} and dtype {perm.dtype}; expected an integer "
                            f"[{self.in_features}] permutation of the inputs on {qweight.device}")
        x = torch.empty(0, self.in_features, dtype=torch.bfloat16, device=qweight.device)
        check_linear_4bit(x, qweight, scales, zeros, bias, quant)  # a SpecError naming the tensor
        self.qweight, self.scales, self.zeros, self.bias = (_frozen(t) for t in (qweight, scales, zeros, bias))
        self.register_buffer("perm", None if perm is None else perm.long())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if torch.compiler.is_compiling():
            return torch.ops.moecomp.linear_4bit(x, self.qweight, self.scales, self.zeros, self.bias, self._quant_key)
        return call_linear_4bit(x, self.qweight, self.scales, self.zeros, self.bias, self.quant)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] in the inputs' order (tests, references; nothing kept)."""
        w = q8.dequantize(self.qweight, self.scales, self.quant, zero=self.zeros)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def extra_repr(self) -> str:
        q = self.quant
        fmt = "mxfp4" if q.weight == "mxfp4" else f"int4 g{q.block_k}" + (" +zero" if q.zero_point else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{fmt}" + (", act-order" if self.perm is not None else ""))
