"""The decode path of 4-bit experts on dot-free GEMV kernels (``kernels/quant4_gemv.py``): what ``triton_moe.routed``
runs instead of the DIRECT gemm1 + down-combine when the decode config says ``mode: "gemv"``.

    x [T, H] --moe_gemv1_kernel--> h [P, I] (pair order, x's dtype) --moe_gemv_down_kernel--> out [T, H]
             one program per (pair, BLOCK_N columns)               one program per (token, BLOCK_N columns), the k
                                                                  slots summed inside (+ gated shared, zero experts)

    wanted(spec, dec, x, args)  -> whether this call takes it: the config's decode entry says mode "gemv" (or
                                   MOECOMP_W4_DECODE=gemv|dot, which wins), and ``layout_ok`` holds; weights held
                                   packed or in the mma layout (``QuantSpec.layout``)
    w4_mma(spec)                -> the kernels' W4_MMA: 1 for mxfp4 held in the mma layout (its word decode)
    layout_ok(x, w13, w2)       -> H and I multiples of 8, packed rows of unit stride, 4-byte aligned (int32 words)
    tiles(which, rows_per_col, blocks_per_col, N, K, device) -> BLOCK_N, BLOCK_K, REDUCE_END, PREFETCH, num_warps,
                                   num_stages of one launch
    routed(...)                 -> gemm1 then decode_down: out [T, H]
    gemm1(...), decode_down(...) -> the two launches

Tiles: BLOCK_N narrow enough for at least ``MIN_PROGRAMS_PER_SM`` programs per SM (at T = 1 and k = 4 on gpt-oss
sizes: gemm1 360 programs of 32 columns = 64 weight rows, the down-combine 360 programs of 8 columns), BLOCK_K so
that a step is about 32 bytes of weights per thread (``STEP_BYTES`` per program), halved while the last step's
masked tail (decoded, not loaded) is over 1 / ``MAX_TAIL`` of K. The down-combine walks its token's k slots in one
program (no [P, H] buffer or second launch; a split over the slots would need either); narrow columns with long K
steps give it the programs instead. PREFETCH (on for CUDA): each step loads the next step's
words before decoding its own, twice the bytes in flight at the 2-3 programs per SM of T = 1 (sm90 offline: 95
registers against 79 for gemm1's mxfp4 tile). A decode config's ``gemv1`` / ``gemv2`` dicts (``TILE_KEYS``), then
MOECOMP_W4_GEMV='{"gemv1": {...}, "gemv2": {...}}' (benchmark sweeps), override the heuristic; ``w4_asm`` 1 (or
MOECOMP_W4_ASM=1) takes the inline-PTX conversions (CUDA only). No host syncs, static grids: capturable.
"""

from __future__ import annotations

import json
import os

import torch
import triton

from ..kernels import quant4_gemv as gemv_k
from ..core.spec import MoESpec
from . import weight_on_input as woi
from . import zero_experts as zx
from .act_args import act_args
from .common import interpret as _interpret, sm_count as _sm_count

MODES = ("gemv", "dot")
MIN_PROGRAMS_PER_SM = 2
STEP_BYTES = 4096  # packed weight bytes a program loads per K step (128 threads x 32 bytes)
MAX_BLOCK_K = 1024
MAX_TAIL = 8  # BLOCK_K halved while the masked tail of the last step is over 1 / MAX_TAIL of K (decoded for nothing)
TILE_KEYS = ("BLOCK_N", "BLOCK_K", "REDUCE_END", "PREFETCH", "num_warps", "num_stages")


def mode(dec: dict | None) -> str:
    """"gemv" or "dot" for a decode call: MOECOMP_W4_DECODE when set, else the decode entry's "mode", else "dot"."""
    forced = os.environ.get("MOECOMP_W4_DECODE") or None
    if forced is not None and forced not in MODES:
        raise ValueError(f"MOECOMP_W4_DECODE={forced!r}: expected one of {MODES}")
    return forced or (dec or {}).get("mode") or "dot"


def layout_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The GEMV kernels read packed rows as int32 words: H = x's width and I = 2 * w2's bytes a row multiples of 8,
    the bytes of unit stride along K, expert and row strides and the bases multiples of 4 bytes; x of unit stride."""
    H, I = x.shape[1], 2 * w2.shape[-1]
    if H % 8 or I % 8 or x.stride(1) != 1:
        return False
    return all(w.dtype == torch.uint8 and w.stride(2) == 1 and w.stride(0) % 4 == 0 and w.stride(1) % 4 == 0
               and w.data_ptr() % 4 == 0 for w in (w13, w2))


def wanted(spec: MoESpec, dec: dict | None, x: torch.Tensor, args: dict) -> bool:
    """This decode call runs on the GEMV kernels: 4-bit experts (held packed or in the mma layout,
    ``QuantSpec.layout``: the kernels read both, ``w4_mma``), mode "gemv" (``mode``) and ``layout_ok``."""
    q = spec.quant
    return (q is not None and q.packed and dec is not None and mode(dec) == "gemv"
            and layout_ok(x, args["w13"], args["w2"]))


def w4_mma(spec: MoESpec) -> int:
    """The kernels' W4_MMA: 1 for mxfp4 weights held in the mma layout (``QuantSpec.layout`` "mma": their words
    re-encoded, ``ops/w4_layout.py``), else 0 (packed weights, and int4 ones in either layout: the same bytes)."""
    q = spec.quant
    if q.layout not in ("packed", "mma"):
        raise ValueError(f"spec.quant.layout={q.layout!r}: the GEMV decode kernels read 'packed' or 'mma'")
    return int(q.layout == "mma" and q.weight == "mxfp4")


def tiles(which: str, rows_per_col: int, blocks_per_col: int, N: int, K: int, device: torch.device,
          over: dict | None = None) -> dict:
    """Tiles of one launch. ``which``: "gemv1" / "gemv2"; ``rows_per_col``: weight rows per output column (2 for a
    gated gemm1); ``blocks_per_col``: programs per BLOCK_N-column block (P for gemm1, T for the down-combine); N
    output columns, K the reduction length; ``over``: a config's dict (wins). BLOCK_K is rounded to the group by the
    launchers (``_block_k``)."""
    env = os.environ.get("MOECOMP_W4_GEMV")
    over = {**(over or {}), **(json.loads(env).get(which, {}) if env else {})}
    unknown = sorted(set(over) - set(TILE_KEYS))
    if unknown:
        raise ValueError(f"{which} tiles (config / MOECOMP_W4_GEMV): unknown key(s) {unknown}; expected {TILE_KEYS}")
    if device.type != "cuda":  # the interpreter: small tiles, a few K steps on the tests' shapes
        return {**dict(BLOCK_N=16, BLOCK_K=64, REDUCE_END=1, PREFETCH=0, num_warps=4, num_stages=1), **over}
    want = MIN_PROGRAMS_PER_SM * _sm_count(device)
    bn = 32 if which == "gemv1" else 64
    while bn > 4 and blocks_per_col * triton.cdiv(N, bn) < want:
        bn //= 2
    bk = max(32, min(MAX_BLOCK_K, 2 * STEP_BYTES // (bn * rows_per_col), triton.next_power_of_2(K)))
    while bk > 32 and (triton.cdiv(K, bk) * bk - K) * MAX_TAIL > K:  # K = 768: 256, not 1024 (a third masked)
        bk //= 2
    return {**dict(BLOCK_N=bn, BLOCK_K=bk, REDUCE_END=1, PREFETCH=1, num_warps=4, num_stages=3), **over}


def _block_k(bk: int, group: int) -> int:
    """A BLOCK_K the K loop takes: a power of two >= 32 that divides the group or is a multiple of it (groups are
    multiples of 32, so halving reaches 32, which divides them)."""
    bk = max(32, triton.next_power_of_2(bk))
    while group % bk and bk % group:
        bk //= 2
    return bk


def _asm(dec: dict | None) -> int:
    v = os.environ.get("MOECOMP_W4_ASM") or (dec or {}).get("w4_asm") or 0
    return 0 if _interpret() else int(v)


def _quant(q: dict) -> tuple:
    """(scales, zero points (the scales where there are none), their expert / row / group strides, W4, the group)
    from ``triton_quant4.quant4_kwargs``'s arguments."""
    ws = q["ws_ptr"]
    return ws, q.get("zp_ptr", ws), q["stride_se"], q["stride_sn"], q["stride_sk"], q["W4"], q["Q_BLOCK_K"]


def routed(x, ids_flat, weights, args: dict, spec: MoESpec, out, shared, gate, dec: dict | None, q1: dict,
           q2: dict, join=None, launch: dict | None = None) -> torch.Tensor:
    """x [T, H] -> out [T, H] = sum_k weight * expert(x) (+ gated shared): ``gemm1`` then ``decode_down``.
    ``ids_flat`` [P] int32, ``weights`` [T, k] fp32; ``q1`` / ``q2``: ``triton_quant4.quant4_kwargs`` of w13 / w2.
    ``args``' weights as held: packed or in the mma layout (``spec.quant.layout``, ``w4_mma``)."""
    b13, b2 = _unit_stride(args["b13"]), _unit_stride(args["b2"])
    h = gemm1(x, args["w13"], b13, spec, ids_flat, weights.shape[1], q1, weights, dec, launch)
    return decode_down(h, args["w2"], b2, ids_flat, weights.reshape(-1), spec, out, shared, gate, q2, dec, join, x,
                       launch)


def _unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """Biases are read as rows of unit stride (a view with another last-dim stride is copied first)."""
    return t if t is None or t.stride(-1) == 1 or t.numel() <= 1 else t.contiguous()


def gemm1(x, w13, b13, spec: MoESpec, ids_flat, k: int, q: dict, weights, dec: dict | None,
          launch: dict | None = None) -> torch.Tensor:
    """x [T, H] x w13 (4-bit, [E, rows, H / 2]) -> h [P, I] in pair order, the activation fused (as the DIRECT gemm1
    writes it). ``q``: ``triton_quant4.quant4_kwargs`` of w13; ``weights``: fp32 [T, k] (weight_on_input);
    ``launch``: PDL launch options."""
    T, H = x.shape
    P, I = ids_flat.numel(), spec.intermediate_size
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    ws, zp, se, sn, sk, w4, group = _quant(q)
    c = tiles("gemv1", 2 if spec.gated else 1, P, I, H, x.device, (dec or {}).get("gemv1"))
    interleaved = spec.gated and spec.gate_up == "interleaved"
    act = act_args(spec)
    gemv_k.moe_gemv1_kernel[(P * triton.cdiv(I, c["BLOCK_N"]),)](
        x, w13, b13, h, ids_flat, ws, zp, k, I, H, x.stride(0), w13.stride(0), w13.stride(1),
        0 if b13 is None else b13.stride(0), h.stride(0), se, sn, sk, 1 if interleaved else I, act.alpha, act.limit,
        GATE_STRIDE=2 if interleaved else 1, GATED=spec.gated, ACT=act.ACT, CLAMP=act.CLAMP, HAS_BIAS=b13 is not None,
        W4=w4, GROUP=group, BLOCK_N=c["BLOCK_N"], BLOCK_K=_block_k(c["BLOCK_K"], group), REDUCE_END=c["REDUCE_END"],
        K_ALIGNED=H % 32 == 0, ASM=_asm(dec), PREFETCH=c["PREFETCH"], num_warps=c["num_warps"],
        num_stages=c["num_stages"], W4_MMA=w4_mma(spec), **(launch or {}), **woi.gemm1_kwargs(spec, weights),
        **zx.gemm_kwargs(spec),
    )
    return h


def decode_down(h, w2, b2, ids_flat, weights, spec: MoESpec, out, shared, gate, q: dict, dec: dict | None,
                join=None, x=None, launch: dict | None = None):
    """h [P, I] x w2 (4-bit) -> out [T, H] = sum_k weight * (h . w2_e + b2) (+ gated shared; zero experts: weight
    * x). ``join()`` runs before the launch (it reads ``shared``)."""
    T, H = out.shape
    P, I = ids_flat.numel(), h.shape[1]
    ws, zp, se, sn, sk, w4, group = _quant(q)
    c = tiles("gemv2", 1, T, H, I, h.device, (dec or {}).get("gemv2"))
    if join is not None:
        join()
    gemv_k.moe_gemv_down_kernel[(T * triton.cdiv(H, c["BLOCK_N"]),)](
        h, w2, b2, ids_flat, weights, shared, gate, out, ws, zp, H, I, h.stride(0), w2.stride(0), w2.stride(1),
        0 if b2 is None else b2.stride(0), se, sn, sk, 0 if shared is None else shared.stride(0),
        0 if gate is None else gate.stride(0), out.stride(0),
        TOP_K=P // T, HAS_BIAS=b2 is not None, HAS_SHARED=shared is not None, HAS_GATE=gate is not None,
        W4=w4, GROUP=group, BLOCK_N=c["BLOCK_N"], BLOCK_K=_block_k(c["BLOCK_K"], group), REDUCE_END=c["REDUCE_END"],
        K_ALIGNED=I % 32 == 0, ASM=_asm(dec), PREFETCH=c["PREFETCH"], num_warps=c["num_warps"],
        num_stages=c["num_stages"], W4_MMA=w4_mma(spec), **(launch or {}), **woi.gemm2_kwargs(spec),
        **zx.down_kwargs(spec, x),
    )
    return out
