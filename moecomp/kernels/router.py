r"""Router GEMV at a few tokens: logits = x . W^T (+ b), one program per (token, BLOCK_R router rows).

    x [T, H] --.--> logits [T, R]          R = E router rows (+ 1: the shared-expert gate row, HAS_GATE)
    W [E, H] -/                            row E (HAS_GATE) is read from g [H], not from W

Every operand is rounded to the logits' dtype first (the gate row to W's dtype before that), then multiplied in
fp32 and summed in fp32, and the result is rounded once to the logits' dtype: what ``torch.nn.functional.linear``
computes on the converted operands (``moecomp.ops.triton_moe.router_logits``), without converting W on every call.
At one token cuBLAS runs this [1, H] x [H, E] product on a few SMs; a program per router row reads W on all of them.
"""

import triton
import triton.language as tl

from . import pdl


@triton.jit
def router_gemv_kernel(
    x_ptr,  # [T, H], row stride stride_xt
    w_ptr,  # [E, H], row stride stride_w
    g_ptr,  # [H] shared-expert gate row (HAS_GATE) or None
    b_ptr,  # [E] router bias (HAS_BIAS) or None
    out_ptr,  # [T, R] logits, row stride stride_o
    E,
    R,  # E, or E + 1 with the gate row
    H,
    stride_xt,
    stride_w,
    stride_o,
    HAS_GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    num_r = tl.cdiv(R, BLOCK_R)
    t = (tl.program_id(0) // num_r).to(tl.int64)
    rows = (tl.program_id(0) % num_r) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    in_w = rows < E
    out_t = out_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)  # [BH]
        h_ok = offs_h < H
        xv = tl.load(x_ptr + t * stride_xt + offs_h, mask=h_ok, other=0.0).to(out_t).to(tl.float32)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_h[None, :]
        w = tl.load(w_ptrs, mask=in_w[:, None] & h_ok[None, :], other=0.0).to(out_t).to(tl.float32)  # [BR, BH]
        if HAS_GATE:
            g = tl.load(g_ptr + offs_h, mask=h_ok, other=0.0).to(w_ptr.dtype.element_ty).to(out_t).to(tl.float32)
            w = tl.where((rows == E)[:, None], g[None, :], w)
        acc += w * xv[None, :]
    logit = tl.sum(acc, axis=1)  # [BR]
    if HAS_BIAS:
        logit += tl.load(b_ptr + rows, mask=in_w, other=0.0).to(out_t).to(tl.float32)
    tl.store(out_ptr + t * stride_o + rows, logit.to(out_t), mask=rows < R)
