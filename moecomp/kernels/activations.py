"""Elementwise activations shared by the kernels (codes: 0 silu, 1 gelu, 2 gelu_tanh, 3 relu)."""

import triton
import triton.language as tl

SILU, GELU, GELU_TANH, RELU, SWIGLU_OAI = 0, 1, 2, 3, 4


@triton.jit
def act(g, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g)
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z)
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        return tl.maximum(g, 0.0)
