"""The routed experts as GEMVs at a few tokens (``kernels/skinny_moe.py``): gemm1 per (pair, columns of I), then
the down projection with the top-k sum and the shared expert fused, per (token, columns of H). Two launches, no
alignment, no tensor cores; weight-only for e4m3 experts (a "dynamic" FP8 spec runs w8a16 here, as the decode
path may; "static" specs never take it).

    applies(spec, args, x, T)   whether a call of T tokens takes this path: ``use_skinny_experts``' measured rule,
                                and a layout the kernels read (unit stride along K); MOECOMP_SKINNY_MOE=0 / 1 turns it
                                off / on for every call of up to MAX_T tokens the kernels can run (benchmarks,
                                tests)
    routed(...)                 out [T, H] = sum_k weight * expert(x) (+ gated shared), ``triton_moe.routed``'s
                                contract
"""

from __future__ import annotations

import os

import torch
import triton

from ..kernels import skinny_moe as k
from ..kernels.activations import CODES as ACT_CODES
from ..spec import MoESpec
from . import triton_fp8
from . import weight_on_input as woi
from . import zero_experts as zx
from .common import _flat_ids, _sm_count, _w_strides

ENV = "MOECOMP_SKINNY_MOE"
MAX_T = 8  # never above this many tokens (MOECOMP_SKINNY_MOE=1 included): pairs sharing an expert read it once each


def use_skinny_experts(spec: MoESpec, T: int) -> bool:
    """The measured rule (H200; see ``MAX_T``): not measured yet, so off unless MOECOMP_SKINNY_MOE=1."""
    return False


def applies(spec: MoESpec, args: dict, x: torch.Tensor, T: int) -> bool:
    env = os.environ.get(ENV)
    if env == "0" or not 1 <= T <= MAX_T or (env != "1" and not use_skinny_experts(spec, T)):
        return False
    if spec.quant is not None and spec.quant.activation == "static":
        return False
    if spec.w_layout != "out_in" or args["w13"].stride(2) != 1 or args["w2"].stride(2) != 1:
        return False
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def tiles(P: int, T: int, spec: MoESpec, itemsize: int, device: torch.device) -> tuple[dict, dict]:
    """(gemm1's, the down kernel's) tiles: narrow BLOCK_N until there are about two programs per SM, BLOCK_K a few
    KiB of weight per row and step. MOECOMP_SKINNY_MOE_TILES="bn1,bk1,red1,bn2,bk2,red2" overrides (the sweep)."""
    env = os.environ.get("MOECOMP_SKINNY_MOE_TILES")
    if env:
        v = [int(s) for s in env.split(",")]
        return (dict(BLOCK_N=v[0], BLOCK_K=v[1], REDUCE_END=v[2]), dict(BLOCK_N=v[3], BLOCK_K=v[4], REDUCE_END=v[5]))
    if device.type != "cuda":  # the interpreter: small tiles, a few K steps on the tests' shapes
        return dict(BLOCK_N=8, BLOCK_K=32, REDUCE_END=1), dict(BLOCK_N=8, BLOCK_K=32, REDUCE_END=0)
    sms = _sm_count(device)
    bk = 1024 if itemsize == 1 else 512
    bn1 = 16
    while bn1 > 4 and P * triton.cdiv(spec.intermediate_size, bn1) < 2 * sms:
        bn1 //= 2
    bn2 = 16
    while bn2 > 4 and T * triton.cdiv(spec.hidden_size, bn2) < 2 * sms:
        bn2 //= 2
    return dict(BLOCK_N=bn1, BLOCK_K=bk, REDUCE_END=1), dict(BLOCK_N=bn2, BLOCK_K=bk, REDUCE_END=1)


def _scale_kwargs(spec: MoESpec, scale) -> dict:
    """The kernels' scale arguments (``triton_fp8.quant_kwargs``' names, weight-only)."""
    if spec.quant is None:
        return dict(ws_ptr=None, stride_se=0, stride_sn=0, stride_sk=0, W_SCALE=0, Q_BLOCK_N=1, Q_BLOCK_K=1,
                    UE8M0=False)
    kw = triton_fp8.quant_kwargs(spec.quant, scale, None, "w8a16")
    return {n: kw[n] for n in ("ws_ptr", "stride_se", "stride_sn", "stride_sk", "W_SCALE", "Q_BLOCK_N", "Q_BLOCK_K",
                               "UE8M0")}


def _unit(b: torch.Tensor | None) -> torch.Tensor | None:
    return b if b is None or b.stride(-1) == 1 else b.contiguous()


def _block_k(c: dict, kw: dict, K: int) -> int:
    """BLOCK_K capped at K's power of two, and dividing or a multiple of the scale blocks' block_k."""
    bk = min(c["BLOCK_K"], max(16, triton.next_power_of_2(K)))
    qbk = kw["Q_BLOCK_K"]
    if kw["W_SCALE"] == 1 and bk % qbk and qbk % bk:
        bk = min(bk, qbk & -qbk)
    return bk


def routed(x, ids, weights, args: dict, spec: MoESpec, out, shared=None, gate=None, join=None,
           launch: dict | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride) -> out [T, H]; ``join()`` runs before the down kernel (it reads ``shared``);
    ``launch``: launch options of both kernels (PDL)."""
    T, H = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    kk = ids.shape[1]
    ids_flat = _flat_ids(ids)
    P = ids_flat.numel()
    I = spec.intermediate_size
    launch = launch or {}
    w13, w2, b13, b2 = args["w13"], args["w2"], _unit(args["b13"]), _unit(args["b2"])
    c1, c2 = tiles(P, T, spec, w13.element_size(), x.device)
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    q1, q2 = _scale_kwargs(spec, args.get("w13_scale")), _scale_kwargs(spec, args.get("w2_scale"))
    se, sn, _ = _w_strides(w13, spec.w_layout)
    interleaved = spec.gated and spec.gate_up == "interleaved"
    flat_w = weights.reshape(-1)
    if flat_w.dtype != torch.float32 or (flat_w.numel() > 1 and flat_w.stride(0) != 1):
        flat_w = flat_w.float().contiguous()
    wk = woi.gemm1_kwargs(spec, flat_w)
    k.skinny_gemm1_kernel[(P * triton.cdiv(I, c1["BLOCK_N"]),)](
        x, w13, b13, h, ids_flat, q1.pop("ws_ptr"), I, H, x.stride(0), se, sn, 0 if b13 is None else b13.stride(0),
        h.stride(0), q1.pop("stride_se"), q1.pop("stride_sn"), q1.pop("stride_sk"), 1 if interleaved else I,
        float(spec.activation_alpha), float(spec.activation_limit),
        TOP_K=kk, GATE_STRIDE=2 if interleaved else 1, GATED=spec.gated, ACT=ACT_CODES[spec.activation],
        CLAMP=spec.activation_clamp, HAS_BIAS=b13 is not None, BLOCK_N=c1["BLOCK_N"], BLOCK_K=_block_k(c1, q1, H),
        REDUCE_END=c1["REDUCE_END"], num_warps=4, num_stages=3, **q1, **launch, **wk, **zx.gemm_kwargs(spec),
    )
    if join is not None:
        join()
    se2, sn2, _ = _w_strides(w2, spec.w_layout)
    k.skinny_down_kernel[(T * triton.cdiv(H, c2["BLOCK_N"]),)](
        h, w2, b2, ids_flat, flat_w, shared, gate, out, q2.pop("ws_ptr"), H, I, h.stride(0), se2, sn2,
        0 if b2 is None else b2.stride(0), q2.pop("stride_se"), q2.pop("stride_sn"), q2.pop("stride_sk"),
        0 if shared is None else shared.stride(0), 0 if gate is None else gate.stride(0), out.stride(0),
        TOP_K=kk, HAS_BIAS=b2 is not None, HAS_SHARED=shared is not None, HAS_GATE=gate is not None,
        BLOCK_N=c2["BLOCK_N"], BLOCK_K=_block_k(c2, q2, I), REDUCE_END=c2["REDUCE_END"], num_warps=4, num_stages=3,
        **q2, **launch, **woi.gemm2_kwargs(spec), **zx.down_kwargs(spec, x),
    )
    return out
