"""The one-launch decode path of the routed experts (``kernels/decode_fused.py``; issue 20's "monolithic" path).

    routed(x [T, H], ids, weights) at T <= DECODE_FUSED_MAX_T, with MOECOMP_DECODE_FUSED=1:
        ws = zeros(T * H + T) (one memset: the fp32 accumulator and the per-token counters)
        moe_decode_fused_kernel[(T * k * cdiv(I, BLOCK_I),)]  -> out [T, H] (+ gated shared experts)

Off by default: it is not measured on a GPU yet (``benchmarks/run_gpu.sh decodefused`` times it against the
two-kernel decode path). ``unsupported(spec)`` says when the two-kernel path must run instead.
"""

from __future__ import annotations

import os

import torch
import triton

from ..kernels import activations as act_k
from ..kernels import decode_fused as fused_k
from ..spec import MoESpec
from .common import _flat_ids, _sm_count, _w_strides

DECODE_FUSED_MAX_T = 4


def enabled(T: int) -> bool:
    """MOECOMP_DECODE_FUSED=1 and T within DECODE_FUSED_MAX_T (read at every call, like the FP8 candidates)."""
    return os.environ.get("MOECOMP_DECODE_FUSED", "0") == "1" and 0 < T <= DECODE_FUSED_MAX_T


def unsupported(spec: MoESpec, x: torch.Tensor, args: dict) -> str | None:
    """Why the one-launch path cannot run this call (None: it can)."""
    if spec.quant is not None:
        return "quantized experts"
    if spec.weight_on_input:
        return "weight_on_input"
    if getattr(spec, "zero_experts", 0):
        return "zero experts"
    if args["w13"].dtype != x.dtype or args["w2"].dtype != x.dtype:
        return "expert weights in another dtype than x"
    return None


def block_i(T: int, k: int, I: int, sms: int) -> int:
    """The widest power of two in [16, 64] that still gives at least two programs per SM (else 16)."""
    bi = 64
    while bi > 16 and T * k * triton.cdiv(I, bi) < 2 * sms:
        bi //= 2
    return bi


def routed(x, ids, weights, args: dict, spec: MoESpec, out, shared=None, gate=None, join=None) -> torch.Tensor:
    """out [T, H] = sum_k weight * expert(x) (+ sigmoid(gate) * shared): one memset and one launch. ``join()`` (the
    shared experts' side stream) runs before the launch when there is a shared expert."""
    T, H = x.shape
    k = ids.shape[1]
    I = spec.intermediate_size
    w13, w2, b13, b2 = args["w13"], args["w2"], args["b13"], args["b2"]
    ws = torch.zeros(T * H + T, dtype=torch.float32, device=x.device)
    acc, cnt = ws[: T * H].view(T, H), ws[T * H:].view(torch.int32)
    s13, s2 = _w_strides(w13, spec.w_layout), _w_strides(w2, spec.w_layout)
    bi = block_i(T, k, I, _sm_count(x.device)) if x.is_cuda else 16
    slices = triton.cdiv(I, bi)
    if join is not None:
        join()
    ids_flat, wts = _flat_ids(ids), _flat_ids(weights)
    fused_k.moe_decode_fused_kernel[(T * k * slices,)](
        x, w13, w2, b13, b2, ids_flat, wts, acc, cnt, shared, gate, out, H, I,
        x.stride(0), *s13, *s2, 0 if b13 is None else b13.stride(0), 0 if b2 is None else b2.stride(0),
        acc.stride(0), 0 if shared is None else shared.stride(0), 0 if gate is None else gate.stride(0),
        out.stride(0), float(spec.activation_alpha), float(spec.activation_limit),
        TOP_K=k, GATED=spec.gated, INTERLEAVED=spec.gated and spec.gate_up == "interleaved",
        HAS_B13=b13 is not None, HAS_B2=b2 is not None, HAS_SHARED=shared is not None, HAS_GATE=gate is not None,
        ACT=act_k.CODES[spec.activation], CLAMP=spec.activation_clamp, BLOCK_I=bi, BLOCK_H=128, SLICES=slices,
        num_warps=4,
    )
    return out
