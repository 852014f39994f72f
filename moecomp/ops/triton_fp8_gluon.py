"""Launcher of the Gluon FP8 gemm2 (``kernels/gluon_fp8.py``), opt-in: ``MOECOMP_FP8_GLUON=1`` makes the FP8 TMA
gemm2 (``triton_fp8_tma.gemm2``) run it where ``unsupported`` finds nothing against it; otherwise the TMA kernel
runs and the reason is counted in ``FALLBACKS`` (``fallbacks()``). Off (the default), nothing here runs.

Supported: w8a8 on prequantized h (the TMA gemm2's contract: A_QUANT 3, e4m3 codes + per-row 128-column scales),
block weight scales [E, H/128, I/128] (fp32 or ue8m0) with Q_BLOCK_N a multiple of BLOCK_N and Q_BLOCK_K = 128,
I a multiple of 128, CUDA compute capability 9.x (wgmma), and a Gluon with the names the kernel uses
(``gluon_api``). Tile: BLOCK_M = the alignment's (64 or 128; 4 warps per 64 rows), BLOCK_N 128 (three fp32
64-register tiles live a thread: the accumulator and two step products), BLOCK_K 128, 4 stages.
No PDL (a plain launch waits for gemm1; the next kernel's grid-dependency wait sees this grid complete).
"""

from __future__ import annotations

import collections
import functools
import os

import torch
import triton

FALLBACKS: collections.Counter = collections.Counter()
STAGES = 4


def enabled() -> bool:
    """MOECOMP_FP8_GLUON=1 asks for the Gluon gemm2."""
    return os.environ.get("MOECOMP_FP8_GLUON", "0") == "1"


@functools.lru_cache(maxsize=None)
def gluon_api() -> str | None:
    """None where this Triton's Gluon has every name the kernel uses, else what is missing (checked by feature)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as e:
        return f"no Gluon ({e})"
    need = {gl: ("NVMMADistributedLayout", "NVMMASharedLayout", "SliceLayout", "allocate_shared_memory", "arange",
                 "static_range", "zeros", "load", "store", "where"),
            hopper: ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma")}
    missing = [n for mod, names in need.items() for n in names if not hasattr(mod, n)]
    if not (hasattr(hopper.tma, "async_load") or hasattr(hopper.tma, "async_copy_global_to_shared")):
        missing.append("tma.async_load / async_copy_global_to_shared")
    missing += [f"mbarrier.{n}" for n in ("init", "expect", "wait", "invalidate", "MBarrierLayout")
                if not hasattr(hopper.mbarrier, n)]
    return f"Gluon lacks {', '.join(missing)}" if missing else None


def tile(bm: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) at BLOCK_M ``bm`` (64 or 128): 128 columns, one warp group per 64 rows."""
    return 128, 4 * (bm // 64)


def chunk(nk: int) -> tuple[int, int]:
    """(CHUNK, TAIL): K steps a loop iteration and the steps after the loop. Three at most, and a tail of one at
    most: ptxas sinks the promotions of an unrolled chunk behind its MMAs, so more step products live at once and
    spill (sm_90, BLOCK_N 128: chunk 8 serializes every wgmma; chunk 3 + a tail of 2 spills 176 bytes)."""
    c = 3 if nk % 3 == 0 else 2
    return c, nk % c


def unsupported(h_q: torch.Tensor, w2: torch.Tensor, q: dict, bm: int) -> str | None:
    """Why the Gluon gemm2 cannot take this call (None: it can)."""
    api = gluon_api()
    if api is not None:
        return api
    if w2.device.type != "cuda" or torch.cuda.get_device_capability(w2.device)[0] != 9:
        return "not a CUDA compute capability 9.x device (wgmma)"
    if q.get("A_QUANT") != 3 or q.get("W_SCALE") != 1:
        return "not w8a8 prequant with block weight scales"
    bn = tile(bm)[0] if bm in (64, 128) else 0
    if not bn:
        return f"BLOCK_M {bm} (64 or 128)"
    if q["Q_BLOCK_K"] != 128 or q["Q_BLOCK_N"] % bn:
        return f"block scales {q['Q_BLOCK_N']}x{q['Q_BLOCK_K']} (Q_BLOCK_K 128, Q_BLOCK_N a multiple of {bn})"
    if w2.shape[-1] % 128 or h_q.shape[-1] != w2.shape[-1] or not h_q.is_contiguous():
        return "I not a multiple of 128, or h not contiguous [S, I]"
    return None


def _desc(t: torch.Tensor, rows: int, block: list):
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    return TensorDescriptor(t, [rows, t.shape[-1]], [t.shape[-1], 1], block, layout)


def gemm2(hq: torch.Tensor, hk: dict, w2, b2, weights, aligned, P: int, bm: int, q: dict, y: torch.Tensor,
          wk: dict) -> torch.Tensor:
    """h_q [S, I] e4m3 (sorted order; scales ``hk``: as_ptr, stride_am) x w2 [E, H, I] e4m3 -> y [P, H] in pair
    order, times the routing weights unless ``wk`` turns them off (WEIGHTED False)."""
    from ..kernels import gluon_fp8 as gk

    sorted_ids, block_expert, num_padded, max_blocks = aligned
    E, H, I = w2.shape
    bn, nw = tile(bm)
    nk = I // 128
    ch, tail = chunk(nk)
    grid = (max_blocks * triton.cdiv(H, bn),)
    gk.moe_gemm2_gluon_fp8_kernel[grid](
        _desc(hq, sorted_ids.numel(), [bm, 128]), hk["as_ptr"], _desc(w2.view(E * H, I), E * H, [bn, 128]),
        q["ws_ptr"], b2, weights, y, sorted_ids, block_expert, num_padded, P, H, I,
        hk["stride_am"], q["stride_se"], q["stride_sn"], q["stride_sk"], 0 if b2 is None else b2.stride(0),
        y.stride(0), Q_BLOCK_N=q["Q_BLOCK_N"], UE8M0=bool(q["UE8M0"]), HAS_BIAS=b2 is not None,
        WEIGHTED=bool(wk.get("WEIGHTED", True)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, STAGES=STAGES, CHUNK=ch,
        TAIL=tail, num_warps=nw,
    )
    return y


def fallbacks() -> dict:
    """Counted reasons the Gluon gemm2 was asked for and did not run."""
    return dict(FALLBACKS)
