"""Launchers of the Gluon FP8 GEMMs (``kernels/gluon_fp8.py``: gemm2; ``kernels/gluon_fp8_gemm1.py``: gemm1). Asked for
by a config's ``"gluon": 1`` (per GEMM: what ``tune --fp8`` writes where its "gluon" candidate measured fastest) or by
``MOECOMP_FP8_GLUON=1`` (every call), the FP8 TMA GEMMs (``triton_fp8_tma.gemm1`` / ``gemm2``) run them where
``unsupported1`` / ``unsupported`` find nothing against it; otherwise the TMA kernel runs and the reason is counted in
``FALLBACKS`` (``fallbacks()``: "gemm1: why" / "gemm2: why"). Not asked for (the default), nothing here runs.

Supported: w8a8 on prequantized h (the TMA gemm2's contract: A_QUANT 3, e4m3 codes + per-row 128-column scales),
block weight scales [E, H/128, I/128] (fp32 or ue8m0) with Q_BLOCK_N a multiple of BLOCK_N and Q_BLOCK_K = 128,
I a multiple of 128, CUDA compute capability 9.x (wgmma), and a Gluon with the names the kernel uses
(``gluon_api``). Tile: BLOCK_M = the alignment's (64 or 128; 4 warps per 64 rows), BLOCK_N 128 (three fp32
64-register tiles live a thread: the accumulator and two step products), BLOCK_K 128, 4 stages.
No PDL (a plain launch waits for gemm1; the next kernel's grid-dependency wait sees this grid complete).

gemm1 (``gemm1``): gated (gate / up concatenated), w8a8 prequant with x gathered into sorted order and quantized
(the TMA gemm1's ``tma_a`` form, whatever the config asks), block weight scales 128 x 128 (fp32 or ue8m0), H a
multiple of 128, activations silu / gelu / gelu_tanh / relu / relu2 without clamp or softcap, bias, weight on input.
Tile by BLOCK_M (``tile1``): 64 -> BLOCK_N 128 on 8 warps (gate and up halves on their own warp group), and h
quantized in the epilogue (Q_OUT) when gemm2 reads it so; 128 -> BLOCK_N 64 on 8 warps, h in x's dtype (gemm2 then
quantizes it: the same codes, one more pass). Either way one wgmma of N 128 a warp group and K step.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os

import torch
import triton

FALLBACKS: collections.Counter = collections.Counter()
STAGES = 4
GEMM1_NAMES = ("BlockedLayout", "SwizzledSharedLayout", "exp", "erf", "div_rn", "max", "abs", "full", "maximum",
               "minimum")
GEMM1_ACTS = (0, 1, 2, 3, 5)  # kernels/activations' silu, gelu, gelu_tanh, relu, relu2 (gluon_fp8_gemm1.gated_act)


def enabled() -> bool:
    """MOECOMP_FP8_GLUON=1 asks for the Gluon gemm2."""
    return os.environ.get("MOECOMP_FP8_GLUON", "0") == "1"


GL_NAMES = ("NVMMADistributedLayout", "NVMMASharedLayout", "SliceLayout", "allocate_shared_memory", "arange",
            "static_range", "zeros", "load", "store", "where", "cdiv", "program_id", "float8e4nv")
HOPPER_NAMES = ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma")
TMA_LOADS = ("async_load", "async_copy_global_to_shared")  # 3.9's name, 3.6's (kernels/gluon_fp8.tma_load picks)
KEYWORDS = (("warpgroup_mma", ("use_acc", "is_async")), ("warpgroup_mma_wait", ("num_outstanding", "deps")),
            ("mbarrier.expect", ("pred",)))


def missing_keywords(hopper) -> list[str]:
    """The keywords the kernels pass that this Gluon's functions do not take ("fn(kw=)"), where the function
    exists (a missing function is reported by name)."""
    out = []
    for path, kws in KEYWORDS:
        fn = hopper
        for part in path.split("."):
            fn = getattr(fn, part, None)
        if fn is None:
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature: nothing to check
            continue
        out += [f"{path}({k}=)" for k in kws if k not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())]
    return out


@functools.lru_cache(maxsize=None)
def gluon_api(gemm1: bool = False) -> str | None:
    """None where this Triton's Gluon has every name and keyword the kernel (``gemm1``: the gemm1 kernel) uses, else
    what is missing (checked by feature; Triton 3.6 and 3.9 both pass, with their own TMA load names)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError as e:
        return f"no Gluon ({e})"
    need = {gl: GL_NAMES + (GEMM1_NAMES if gemm1 else ()), hopper: HOPPER_NAMES}
    missing = [n for mod, names in need.items() for n in names if not hasattr(mod, n)]
    if gemm1 and not hasattr(getattr(gl, "shared_memory_descriptor", None), "slice"):
        missing.append("shared_memory_descriptor.slice")
    if hasattr(hopper, "tma") and not any(hasattr(hopper.tma, n) for n in TMA_LOADS):
        missing.append("tma." + " / ".join(TMA_LOADS))
    if hasattr(hopper, "mbarrier"):
        missing += [f"mbarrier.{n}" for n in ("init", "expect", "wait", "invalidate", "MBarrierLayout")
                    if not hasattr(hopper.mbarrier, n)]
    missing += missing_keywords(hopper)
    if "layout" not in inspect.signature(TensorDescriptor).parameters:
        missing.append("TensorDescriptor(layout=)")
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


def tma_desc(t: torch.Tensor, rows: int, block: list):
    """Gluon's TMA descriptor of ``t`` read as [rows, t.shape[-1]] (contiguous rows), box ``block``, the kernels'
    128-byte-swizzled e4m3 shared layout (the same constructor on Triton 3.6 and 3.9)."""
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
        tma_desc(hq, sorted_ids.numel(), [bm, 128]), hk["as_ptr"], tma_desc(w2.view(E * H, I), E * H, [bn, 128]),
        q["ws_ptr"], b2, weights, y, sorted_ids, block_expert, num_padded, P, H, I,
        hk["stride_am"], q["stride_se"], q["stride_sn"], q["stride_sk"], 0 if b2 is None else b2.stride(0),
        y.stride(0), Q_BLOCK_N=q["Q_BLOCK_N"], UE8M0=bool(q["UE8M0"]), HAS_BIAS=b2 is not None,
        WEIGHTED=bool(wk.get("WEIGHTED", True)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, STAGES=STAGES, CHUNK=ch,
        TAIL=tail, num_warps=nw,
    )
    return y


def tile1(bm: int) -> tuple[int, int, int]:
    """gemm1's (BLOCK_N, WARPS_N, STAGES) at BLOCK_M ``bm`` (64 or 128), 8 warps either way. Shared memory: STAGES
    slots of A [bm, 128] + B [2 * BLOCK_N, 128] e4m3 (160 / 128 KiB); the epilogue's fp32 accumulator
    [bm, 2 * BLOCK_N] (64 KiB) reuses the ring (sm_90 compile: 160 / 128 KiB in all)."""
    return (128, 2, STAGES) if bm == 64 else (64, 1, STAGES)


def chunk1(nk: int, bm: int) -> tuple[int, int]:
    """gemm1's (CHUNK, TAIL): ``chunk`` at BLOCK_M 128 (chunks of 3 fit: 254 registers, no spill); 2 at BLOCK_M 64,
    where chunks of 3 spill (244 bytes: the warps 4 x 2 layout costs ~20 registers more)."""
    return chunk(nk) if bm == 128 else (2, nk % 2)


def unsupported1(spec, x: torch.Tensor, w13: torch.Tensor, q: dict, bm: int) -> str | None:
    """Why the Gluon gemm1 cannot take this call (None: it can); the caller (``triton_fp8_tma.gemm1``) has checked
    ``gemm1_ok`` (e4m3 [E, out, in] weights, TMA rows, gate / up concatenated). The device is checked last (the
    other reasons show on CPU too)."""
    from .act_args import act_args

    api = gluon_api(gemm1=True)
    if api is not None:
        return api
    if q.get("A_QUANT") != 3 or q.get("W_SCALE") != 1:
        return "not w8a8 prequant with block weight scales"
    if not spec.gated:
        return "not gated"
    act = act_args(spec)
    if act.ACT not in GEMM1_ACTS or act.CLAMP:
        return f"activation code {act.ACT} / clamp {act.CLAMP} (silu, gelu, gelu_tanh, relu, relu2 unclamped)"
    if bm not in (64, 128):
        return f"BLOCK_M {bm} (64 or 128)"
    bn = tile1(bm)[0]
    if q["Q_BLOCK_K"] != 128 or q["Q_BLOCK_N"] % bn:
        return f"block scales {q['Q_BLOCK_N']}x{q['Q_BLOCK_K']} (Q_BLOCK_K 128, Q_BLOCK_N a multiple of {bn})"
    if x.shape[-1] % 128 or w13.shape[-1] != x.shape[-1]:
        return "H not a multiple of 128"
    if w13.device.type != "cuda" or torch.cuda.get_device_capability(w13.device)[0] != 9:
        return "not a CUDA compute capability 9.x device (wgmma)"
    return None


def gemm1(xa, w13, b13, spec, aligned, P: int, bm: int, q: dict, wk: dict, x_dtype: torch.dtype):
    """xa: x's rows gathered into sorted order and quantized (``triton_fp8_tma._quantize_gathered``: a QAct [S, H])
    x w13 [E, 2I, H] e4m3 -> h [S, I] in x's dtype, or its QAct (e4m3 + group scales) when gemm2 reads h quantized
    and the tile holds whole groups (BLOCK_M 64). ``wk``: weight-on-input arguments."""
    from ..kernels import gluon_fp8_gemm1 as gk1
    from .act_args import act_args
    from .triton_fp8 import ACT_GROUP, H_DTYPE, QAct

    sorted_ids, block_expert, num_padded, max_blocks = aligned
    E, two_i, H = w13.shape
    I, S = two_i // 2, sorted_ids.numel()
    bn, wn, stages = tile1(bm)
    h_quant = bool(q.get("_h_quant")) and bn % ACT_GROUP == 0
    dev = xa.q.device
    h = torch.empty(S, I, dtype=torch.float8_e4m3fn if h_quant else x_dtype, device=dev)
    hs = torch.empty(S, triton.cdiv(I, ACT_GROUP), dtype=torch.float32, device=dev) if h_quant else None
    ch, tail = chunk1(H // 128, bm)
    gk1.moe_gemm1_gluon_fp8_kernel[(max_blocks * triton.cdiv(I, bn),)](
        tma_desc(xa.q, S, [bm, 128]), xa.s, tma_desc(w13.view(E * two_i, H), E * two_i, [bn, 128]), q["ws_ptr"], b13, h,
        hs, wk.get("topk_w_ptr"), sorted_ids, block_expert, num_padded, P, I, H, xa.s.stride(0), q["stride_se"],
        q["stride_sn"], q["stride_sk"], 0 if b13 is None else b13.stride(0), h.stride(0),
        0 if hs is None else hs.stride(0), Q_BLOCK_N=q["Q_BLOCK_N"], UE8M0=bool(q["UE8M0"]),
        HAS_BIAS=b13 is not None, ACT=act_args(spec).ACT, Q_OUT=H_DTYPE[x_dtype] if h_quant else 0,
        W_ON_INPUT=bool(wk.get("W_ON_INPUT", False)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, WARPS_N=wn,
        STAGES=stages, CHUNK=ch, TAIL=tail, num_warps=8,
    )
    return QAct(h, hs, x_dtype) if h_quant else h


def fallbacks() -> dict:
    """Counted reasons a Gluon GEMM was asked for and did not run ("gemm1: ..." / "gemm2: ...")."""
    return dict(FALLBACKS)
