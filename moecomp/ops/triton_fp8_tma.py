"""Launchers of the FP8 TMA GEMMs (``kernels/grouped_gemm_tma_fp8.py``): w8a8 on activations quantized once
("prequant", A_QUANT 3), e4m3 weights in the [E, out, in] layout read by TMA, for the many-token buckets where the
16-bit path runs its TMA kernels too. A config asks for them as it does for the 16-bit ones (``"tma": 1`` in ``g1`` /
``g2``; ``"tma_a": 1`` gathers and quantizes x's rows into sorted order so gemm1 reads A by TMA as well); the
launchers run only where ``gemm1_ok`` / ``gemm2_ok`` hold, and ``triton_moe`` runs the pointer kernels otherwise (same
results up to accumulation order).

    gemm1:  x [T, H] --quantize_act (GATHER: sorted rows)--> x_q, s_x --TMA gemm1--> h (x's dtype, or e4m3 + group
            scales: Q_OUT, a QAct, when gemm2 reads h quantized and BLOCK_N covers whole 128-column groups)
    gemm2:  h (QAct, or quantized here with its padding rows skipped) --TMA gemm2--> y [P, H]

No host syncs; scratch is torch.empty; the grid is one program per SM (capturable).
"""

from __future__ import annotations

import torch
import triton

from .act_args import act_args
from ..kernels import fp8 as fp8_k
from ..kernels import grouped_gemm_tma_fp8 as k8
from ..core.spec import MoESpec
from .common import interpret as _interpret
from .tma import (tma_desc as _desc, persistent_programs as _programs, tensor_descriptor_class as _TensorDescriptor,
                  tma_rows as _tma_rows, w13_desc as _w13_desc, tma_device)
from . import triton_fp8
from . import triton_fp8_gluon as fp8_gluon
from .triton_fp8 import ACT_GROUP, H_DTYPE, QAct, fp8_a, quantize_act



def _ok(spec: MoESpec, w: torch.Tensor, q: dict | None, c: dict) -> bool:
    """What both FP8 TMA GEMMs need: descriptors in this Triton, dynamic w8a8 on prequantized activations, e4m3
    weights in the [E, out, in] layout, contiguous, with 16-byte rows, and a BLOCK_K that divides the activation
    group (and the weight blocks, for block scales)."""
    if q is None or q.get("A_QUANT") != 3 or _TensorDescriptor() is None or not tma_device(w):
        return False
    bk = c["BLOCK_K"]
    return (w.dtype == torch.float8_e4m3fn and spec.w_layout == "out_in" and w.is_contiguous() and _tma_rows(w)
            and bk >= 32 and ACT_GROUP % bk == 0 and (q["W_SCALE"] != 1 or q["Q_BLOCK_K"] % bk == 0))


def gemm1_ok(spec: MoESpec, x: torch.Tensor, w13: torch.Tensor, q: dict | None, c1: dict) -> bool:
    """gemm1 can run on the FP8 TMA kernel: ``_ok``, gate / up concatenated (not interleaved), x with unit-stride
    rows."""
    return _ok(spec, w13, q, c1) and (not spec.gated or spec.gate_up == "concat") and x.stride(-1) == 1


def gemm2_ok(spec: MoESpec, h, w2: torch.Tensor, q: dict | None, c2: dict) -> bool:
    """gemm2 can run on the FP8 TMA kernel: ``_ok``, and h [S, I] (a QAct or a tensor to quantize) with 16-byte rows
    of e4m3 codes."""
    return _ok(spec, w2, q, c2) and (h.q.shape[-1] if isinstance(h, QAct) else h.shape[-1]) % 16 == 0


def _scale_args(q: dict, bn: int) -> dict:
    """The weight-scale arguments the FP8 TMA kernels take from a ``quant_kwargs`` dict; WS_SCALAR where a tile of
    ``bn`` columns reads one row of block scales (Q_BLOCK_N a multiple of bn: tiles start at multiples of bn)."""
    return dict(ws_ptr=q["ws_ptr"], stride_se=q["stride_se"], stride_sn=q["stride_sn"], stride_sk=q["stride_sk"],
                W_SCALE=q["W_SCALE"], Q_BLOCK_N=q["Q_BLOCK_N"], Q_BLOCK_K=q["Q_BLOCK_K"], UE8M0=q["UE8M0"],
                WS_SCALAR=q["W_SCALE"] == 1 and q["Q_BLOCK_N"] % bn == 0)


def gemm1(x, w13, b13, spec: MoESpec, aligned, k: int, bm: int, c1: dict, q: dict, wk: dict, pdl: dict):
    """x [T, H] x fp8 w13 -> h [S, I] in sorted order (activation fused), or its QAct (Q_OUT). ``q``: gemm1's
    ``quant_kwargs`` (A_QUANT 3; "_h_quant": gemm2 reads h quantized); ``wk``: weight-on-input arguments; ``pdl``:
    the launch options of a GEMM."""
    sorted_ids, block_expert, num_padded, max_blocks = aligned
    T, H = x.shape
    if fp8_gluon.enabled() or c1.get("gluon"):  # the table's "gluon" key or MOECOMP_FP8_GLUON=1: else counted
        why = fp8_gluon.unsupported1(spec, x, w13, q, bm)
        if why is None:
            xa = _quantize_gathered(x, sorted_ids, num_padded, T * k, k)
            return fp8_gluon.gemm1(xa, w13, b13, spec, aligned, T * k, bm, q, wk, x.dtype)
        fp8_gluon.FALLBACKS["gemm1: " + why] += 1
    I = spec.intermediate_size
    S = sorted_ids.numel()
    bn, bk = c1["BLOCK_N"], c1["BLOCK_K"]
    a_tma = bool(c1.get("tma_a", False))
    if a_tma:  # x's rows in sorted order, quantized in the same pass (padding rows left unwritten: never stored)
        xa = _quantize_gathered(x, sorted_ids, num_padded, T * k, k)
    else:
        xa = quantize_act(x)
    h_quant = bool(q.get("_h_quant")) and bn % ACT_GROUP == 0
    if h_quant:
        h = torch.empty(S, I, dtype=torch.float8_e4m3fn, device=x.device)
        hs = torch.empty(S, triton.cdiv(I, ACT_GROUP), dtype=torch.float32, device=x.device)
    else:
        h, hs = torch.empty(S, I, dtype=x.dtype, device=x.device), None
    n_prog = _programs(x.device, max_blocks * triton.cdiv(I, bn), c1.get("per_sm", 1))
    act = act_args(spec)
    k8.moe_gemm1_tma_fp8_kernel[(n_prog,)](
        xa.q, _desc(xa.q, S, [bm, bk]) if a_tma else None, xa.s, _w13_desc(w13, spec.gated, bn, bk), b_ptr=b13, h_ptr=h,
        hs_ptr=hs, sorted_ptr=sorted_ids, block_expert_ptr=block_expert, num_padded_ptr=num_padded, P=T * k, TOP_K=k,
        N_OUT=I, K=H, stride_xm=xa.q.stride(0), stride_am=xa.s.stride(0), stride_be=0 if b13 is None else b13.stride(0),
        stride_hm=h.stride(0), stride_hsm=0 if hs is None else hs.stride(0), alpha=act.alpha,
        limit=act.limit, GATED=spec.gated, ACT=act.ACT, CLAMP=act.CLAMP, HAS_BIAS=b13 is not None,
        A_TMA=a_tma, Q_OUT=H_DTYPE[x.dtype] if h_quant else 0, EXACT_CAST=_interpret(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c1["GROUP_M"], TILE_N=bn * (2 if spec.gated else 1),
        NUM_PROGRAMS=n_prog, WARP_SPECIALIZE=bool(c1.get("ws", a_tma)), num_warps=c1["num_warps"],
        num_stages=c1["num_stages"], **_scale_args(q, bn), **pdl, **wk,
    )
    return QAct(h, hs, x.dtype) if h_quant else h


def gemm2(h, w2, b2, weights, aligned, P: int, bm: int, c2: dict, q: dict, y: torch.Tensor, wk: dict, pdl: dict):
    """h [S, I] (sorted order; a QAct from gemm1's Q_OUT, or quantized here) x fp8 w2 -> y [P, H] in pair order, times
    the routing weights (unless ``wk`` turns them off)."""
    sorted_ids, block_expert, num_padded, max_blocks = aligned
    E, H, I = w2.shape
    S = sorted_ids.numel()
    hq, hk = fp8_a(h, q, aligned, P)  # h's codes (gemm1's QAct, or quantized here, padding rows skipped), its scales
    if fp8_gluon.enabled() or c2.get("gluon"):  # the table's "gluon" key or MOECOMP_FP8_GLUON=1: else counted
        why = fp8_gluon.unsupported(hq, w2, q, bm)
        if why is None:
            return fp8_gluon.gemm2(hq, hk, w2, b2, weights, aligned, P, bm, q, y, wk)
        fp8_gluon.FALLBACKS["gemm2: " + why] += 1
    bn, bk = c2["BLOCK_N"], c2["BLOCK_K"]
    n_prog = _programs(y.device, max_blocks * triton.cdiv(H, bn), c2.get("per_sm", 1))
    k8.moe_gemm2_tma_fp8_kernel[(n_prog,)](
        _desc(hq, S, [bm, bk]), hk["as_ptr"], _desc(w2, E * H, [bn, bk]), b_ptr=b2, topk_w_ptr=weights, y_ptr=y,
        sorted_ptr=sorted_ids, block_expert_ptr=block_expert, num_padded_ptr=num_padded, P=P, N=H, K=I,
        stride_hsm=hk["stride_am"], stride_be=0 if b2 is None else b2.stride(0), stride_ym=y.stride(0),
        **_scale_args(q, bn), HAS_BIAS=b2 is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c2["GROUP_M"],
        NUM_PROGRAMS=n_prog,
        WARP_SPECIALIZE=bool(c2.get("ws", True)), num_warps=c2["num_warps"], num_stages=c2["num_stages"],
        **pdl, **wk,
    )
    return y


def _quantize_gathered(x: torch.Tensor, sorted_ids, num_padded, P: int, k: int) -> QAct:
    """x [T, H] -> QAct [S, H]: row s is x's row of sorted row s's token, quantized per 128-column group (the
    prequant formula); padding rows unwritten."""
    S, H = sorted_ids.numel(), x.shape[1]
    G = triton.cdiv(H, ACT_GROUP)
    qx = torch.empty(S, H, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(S, G, dtype=torch.float32, device=x.device)
    bm = 16 if S <= 1024 else 32
    fp8_k.quant_act_kernel[(triton.cdiv(S, bm), G)](
        x, qx, s, sorted_ids, num_padded, S, H, P, x.stride(0), qx.stride(0), s.stride(0),
        ROWS_SORTED=True, GATHER=k, EXACT_CAST=_interpret(), BLOCK_M=bm, num_warps=4,
        **triton_fp8.launch_options(x.device),
    )
    return QAct(qx, s, x.dtype)
