"""Elementwise activations shared by the kernels.

Codes: 0 silu, 1 gelu, 2 gelu_tanh, 3 relu, 4 swiglu_oai (gated only, see ``gated``), 5 relu2 (relu(x)**2).
"""

import triton
import triton.language as tl

SILU, GELU, GELU_TANH, RELU, SWIGLU_OAI, RELU2 = 0, 1, 2, 3, 4, 5
CODES = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH, "relu": RELU, "swiglu_oai": SWIGLU_OAI, "relu2": RELU2}


@triton.jit
def act(g, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g)
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z)
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    elif ACT == 5:
        r = tl.maximum(g, 0.0)
        return r * r
    else:
        return tl.maximum(g, 0.0)


@triton.jit
def gated(g, u, alpha, limit, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """act(g) * u in fp32. CLAMP (clamped SwiGLU): g <= limit and |u| <= limit first.
    ACT 4 (gpt-oss): (clamp(u) + 1) * g * sigmoid(alpha * g) with g <= limit."""
    if ACT == 4 or CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if ACT == 4:
        return (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        return act(g, ACT) * u
