"""Elementwise activations shared by the kernels.

Codes: 0 silu, 1 gelu, 2 gelu_tanh, 3 relu, 4 swiglu_oai (gated only, see ``gated``), 5 relu2 (relu(x)**2),
6 softcapped silu (gated only: ``gated``'s alpha / limit carry the gate / up softcaps, see ``act_args``).
Clamp codes (``gated``'s CLAMP, gated only): 0 none, 1 the gate clamped before the activation (clamped SwiGLU), 2 the
activation's output clamped after it (Step-3.7's limit_after_act); up to [-limit, limit] with either.
"""


import triton
import triton.language as tl

SILU, GELU, GELU_TANH, RELU, SWIGLU_OAI, RELU2, SILU_SOFTCAP = 0, 1, 2, 3, 4, 5, 6
CLAMP_NONE, CLAMP_GATE, CLAMP_ACT = 0, 1, 2
CODES = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH, "relu": RELU, "swiglu_oai": SWIGLU_OAI, "relu2": RELU2}


@triton.jit
def tanh(x):
    """tanh in fp32 without cancellation near 0: odd Taylor terms for |x| < 1/16, else (1 - e) / (1 + e) with
    e = exp(-2|x|) (relative error about 1e-7 either way)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    t = tl.where(a < 0.0625, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def softcap(v, cap):
    """cap * tanh(v / cap); v where cap is 0 (no cap)."""
    c = tl.where(cap > 0, cap, 1.0)
    return tl.where(cap > 0, c * tanh(v / c), v)


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
    """act(g) * u in fp32. CLAMP 1 (clamped SwiGLU): g <= limit and |u| <= limit first; CLAMP 2 (clamped after the
    activation): min(act(g), limit) * u with |u| <= limit (a constexpr branch: nothing when 0).
    ACT 4 (gpt-oss): (clamp(u) + 1) * g * sigmoid(alpha * g) with g <= limit.
    ACT 6 (softcapped silu): softcap(g, alpha) * sigmoid(g) * softcap(u, limit), the sigmoid on the raw g."""
    if ACT == 6:
        return softcap(g, alpha) * tl.sigmoid(g) * softcap(u, limit)
    if ACT == 4 or CLAMP == 1:
        g = tl.minimum(g, limit)
    if ACT == 4 or CLAMP != 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if ACT == 4:
        return (u + 1.0) * (g * tl.sigmoid(g * alpha))
    elif CLAMP == 2:
        return tl.minimum(act(g, ACT), limit) * u
    else:
        return act(g, ACT) * u
