"""Launch wrappers: the op's CUDA path on our Triton kernels (and, under TRITON_INTERPRET=1, its CPU test path); one of
the two implementations of ``ops/backend.Backend``.

moe_forward, main stream                                   side stream (shared experts)
    logits = x @ [router_w; shared_gate_w].T   (FSE)       g, u = x @ w1.T, x @ w3.T
    route_topk_kernel      -> ids [T, k], w [T, k]          h = act(g) * u        (act_mul_kernel)
    align kernels          -> sorted_ids, block_expert      s = h @ w2.T
    moe_gemm1_kernel       -> h [S, I]   (act fused)
    moe_gemm2_kernel       -> y [P, H]   (routing weight fused; moe_gemm2_tma_kernel where the config says "tma")
                                         (spec.weight_on_input: fused into gemm1 instead, ``ops/weight_on_input.py``)
    combine_kernel         -> out [T, H] = sum_k y (+ sigmoid(gate) * s)   <- waits for the side stream
    (spec.zero_experts: routing over E + Z, ids >= E skip the GEMMs and the combine adds w * x, ``ops/zero_experts.py``)
    (spec.hash_routing: route_topk_kernel reads the ids from hash_table[token_ids] instead of a top-k,
     ``ops/hash_routing.py``; routes_in: from the caller's ids, routes_out / route_weights_out: written by it too,
     ``ops/routes.py``)
    (spec capacity: pairs past an expert's capacity get id E and weight 0 after the routing kernel and are left out
     as zero experts' pairs are, ``ops/capacity.py``)
    (spec.latent_size: the experts' kernels run on latent_in(x) [T, L], their combine into [T, L], then latent_out
     and a one-slot combine that adds the gated shared expert, ``ops/latent.py``; spec.latent_norm: in torch)
    (spec.expert_norm: gemm2 unweighted, then norm + weight + combine per token, ``ops/triton_norm.py``;
     spec.router_scale: the logits scaled in torch after the router GEMM)

Decode (T <= the config's ``decode.max_t``): no alignment; moe_gemm1_kernel(DIRECT) -> h [P, I] in pair order, then
moe_down_combine_kernel -> out [T, H] (down projection, routing weights, top-k sum and shared expert in one kernel),
or moe_gemm2_kernel(DIRECT) + combine_kernel (the config's ``mode``). On Hopper every kernel here is launched with
programmatic dependent launch (``_pdl``): the next launch overlaps the previous kernel's tail.

Every size the kernels see on the device is static for a given T (worst-case block counts), nothing reads device
memory on the host, so the whole op can be captured in a CUDA graph.

FP8 experts (``spec.quant``; docs/FP8.md): the same launches with the scales (``expert_quant`` -> ``quant_kwargs``)
and FP8 tiles (``tuning.get_config(..., quant)``, BLOCK_K 128), in the call's mode (``tuning.fp8_mode``: w8a8, fp8 x
fp8 dots on activations quantized in the GEMMs' A loads, or w8a16, weight-only); both decode modes ("fused", "pairs")
take fp8 w2; a config's "tma" runs the FP8 TMA GEMMs (``triton_fp8_tma``) on w8a8 prequant calls. FP8 shared
experts (``spec.shared.quant``): ``fp8_linear`` for gate, up and down. 4-bit experts (mxfp4 / int4): the same
launches again, ``expert_quant`` -> ``triton_quant4.expert_kwargs`` (w4a16, ``kernels/quant4.py``; never TMA);
their decode path runs on dot-free GEMV kernels instead where the decode config says mode "gemv" (on CUDA up to
``tuning.QUANT4_GEMV_MAX_T`` tokens; ``triton_quant4_gemv``, ``kernels/quant4_gemv.py``). The opt-in "mma" form
(MOECOMP_W4_FORM=mma) runs the aligned GEMMs and the DIRECT / down-combine launches on the re-laid weights
(``triton_quant4.gemm_weights``); the GEMV kernels read the weights as held (packed, or the mma layout when
``QuantSpec.layout`` says so; never a re-laid copy: ``triton_quant4.direct_kwargs``).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton

from ..kernels import activations as act_k
from .act_args import act_args
from ..kernels import align as align_k
from ..kernels import combine as combine_k
from ..kernels import decode as decode_k
from ..kernels import grouped_gemm as gemm_k
from ..kernels import grouped_gemm_tma as tma_k
from ..kernels import routing as routing_k
from ..core.spec import MoESpec
from . import capacity as cap
from . import skinny, triton_fp8, triton_quant4, triton_quant4_gemv, triton_router, tuning
from . import triton_fp8_tma as fp8_tma
from . import hash_routing as hr
from . import routes
from . import shared_gamma as sg
from . import latent, triton_norm
from . import weight_on_input as woi
from . import zero_experts as zx
from .backend import Routed
from .tuning import ROUTE_ELEMS, ROUTE_ONE_TOKEN_T, route_tiles  # noqa: F401  (tests and benchmarks read them here)
from .router_input import router_in
from .triton_router import ROUTER_GEMV_MAX_T, router_gemv, router_logits  # noqa: F401  (tests read them here)
from .triton_shared import shared_mlp, shared_part  # noqa: F401  (shared_part: this path's Backend.shared_part)
from .tma import (  # noqa: F401  (tests read them here)
    tma_desc as _desc, persistent_programs as _programs, tensor_descriptor_class as _TensorDescriptor,
    tma1_ok as _tma1_ok, tma_ok as _tma_ok, tma_rows as _tma_rows, w13_desc as _w13_desc, tma_device)
from .common import (  # noqa: F401  (used here and by tests / benchmarks)
    flat_ids as _flat_ids, interpret as _interpret, dot_precision as _precision, sm_count as _sm_count,
    upcast_bf16 as _upcast, w_strides as _w_strides)
from .triton_fp8 import (  # noqa: F401  (expert_quant: also the tuner's and tests')
    block_cfg as _block_cfg, expert_kwargs, expert_quant, fp8_a, fp8_linear, fp8_tile, gemm1_io, quant_kwargs)

_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2, "none": 3}
_ACT = act_k.CODES  # activation name -> the kernels' ACT code
SMALL_P = 256  # single-program alignment up to this many (token, expert) pairs (MOECOMP_ALIGN_SMALL_P overrides)


def _pdl(device: torch.device, gemm: bool = False) -> dict:
    """Launch options for programmatic dependent launch: on for CUDA devices of compute capability 9+ (Hopper) when
    this Triton has grid dependency control, unless MOECOMP_PDL=0; {} (plain launches) otherwise. A GEMM lets the
    next kernel launch after its main loop (USE_PDL 2, ``kernels/pdl.py``), or at its start under MOECOMP_PDL=early
    (1, as every other kernel does). Signalling late was as fast or faster at T = 1, 2, 16 on all five presets
    (H200; Mixtral T=1 191 us against 206 us; ``benchmarks/diag_kernels.py --parts pdl``, same JSON)."""
    mode = os.environ.get("MOECOMP_PDL")
    if device.type != "cuda" or _interpret() or mode == "0" or (_pdl_held and mode != "side"):
        return {}
    on = _pdl_devices.get(device.index)
    if on is None:
        on = _pdl_devices[device.index] = _pdl_supported() and torch.cuda.get_device_capability(device)[0] >= 9
    return dict(USE_PDL=1 if mode == "early" or not gemm else 2, launch_pdl=True) if on else {}


_pdl_devices: dict = {}
triton_fp8.launch_options = lambda device: _pdl(device)  # its launches take the same options (it cannot import us)
triton_router.launch_options = triton_fp8.launch_options
# the skinny linears: wait, release after K (opt-in until measured on a GPU: MOECOMP_SKINNY_PDL=1)
skinny.launch_options = lambda device: _pdl(device, gemm=True) if os.environ.get("MOECOMP_SKINNY_PDL") == "1" else {}
_pdl_held = False  # set by ``_hold_pdl`` while the aligned path runs beside the shared experts' side stream


@contextlib.contextmanager
def _hold_pdl(on: bool):
    """Launch without PDL inside (when ``on``): the aligned path's kernels while the shared experts run on the side
    stream. Launched early, their programs wait on the SMs the side stream's GEMMs want: DeepSeek-V3 at T=1 took
    262 us with PDL against 225 us without (H200, ``diag_kernels.py --parts pdl``, e2dab59); at T=16 the two were
    equal. The decode path keeps PDL (Qwen1.5-MoE T=1: 60.8 us with, 67.8 without). MOECOMP_PDL=side keeps PDL here
    too."""
    global _pdl_held
    before, _pdl_held = _pdl_held, on or _pdl_held
    try:
        yield
    finally:
        _pdl_held = before


def _pdl_supported() -> bool:
    """This Triton has grid dependency control (``kernels/pdl.py`` uses it) and the ``launch_pdl`` launch option."""
    from triton.language.extra import cuda as tlcuda

    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(tlcuda, "gdc_wait") and hasattr(tlcuda, "gdc_launch_dependents") and "launch_pdl" in fields


def _unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels index vectors and the last dim of bias rows as contiguous (offset = index): a view with another
    last-dim stride (a slice with a step, a transposed bias) is copied first."""
    return t if t is None or t.stride(-1) == 1 or t.numel() <= 1 else t.contiguous()


# --------------------------------------------------------------------------------------------- routing
def route(logits: torch.Tensor, correction_bias, spec: MoESpec, out_dtype: torch.dtype, tiles: dict | None = None,
          hashed: dict | None = None, expert_scale: torch.Tensor | None = None, gammas: torch.Tensor | None = None,
          weight_scale: torch.Tensor | None = None, rt: dict | None = None):
    """logits [T, E (+ Z) (+ G)] (any row stride) -> ids [T, k] int32, weights [T, k] fp32. ``tiles``
    (``route_tiles``'s keys) overrides the launch shape (the routing sweep in benchmarks/ uses it). ``hashed``: the
    op's arguments holding ``hash_table`` / ``token_ids``, needed (and only read) with ``spec.hash_routing``.
    ``expert_scale`` [E (+ Z)] (``spec.expert_scale``): each weight times it at its id, in the kernel after the
    scaling. ``gammas`` [T, G] fp32 (written; ``spec.shared_gamma``) and ``weight_scale`` [1]
    (``spec.has_weight_scale``): ``ops/shared_gamma.py``. ``rt``: ``routes.kernel_kwargs`` (record / replay)."""
    ids, weights, block_t, args, kw = route_args(logits, correction_bias, spec, out_dtype, tiles, hashed, expert_scale,
                                                 gammas, weight_scale, rt)
    if logits.shape[0]:
        routing_k.route_topk_kernel[(triton.cdiv(logits.shape[0], block_t),)](*args, **kw)
    return ids, weights


def route_args(logits: torch.Tensor, correction_bias, spec: MoESpec, out_dtype: torch.dtype, tiles=None, hashed=None,
               expert_scale=None, gammas=None, weight_scale=None, rt=None):
    """``route``'s outputs (ids, weights) and its launch: (ids, weights, BLOCK_T, positional arguments, keyword
    arguments of ``route_topk_kernel``)."""
    T, E, k = logits.shape[0], spec.router_width, spec.top_k
    ids = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    # "topk_then_score" is top-k of the raw logits, then the score of the chosen (moecomp.oracle.reference): no
    # correction bias and no group-limited selection take part, whatever else the spec says (the kernel would apply
    # both).
    plain_topk = spec.score_order == "topk_then_score"
    rt = rt or {}
    select = not (plain_topk or rt.get("GIVEN"))  # replayed ids: no selection (bias and groups unused) either
    n_group = spec.n_group if select else 1
    tiles = {**route_tiles(max(T, 1), E, n_group), **(tiles or {})}
    block_e = triton.next_power_of_2(E)
    group_3d = bool(tiles["group_3d"]) and n_group > 1 and E == block_e and E % n_group == 0
    round_to = 0
    if spec.round_weights:
        round_to = {torch.bfloat16: 1, torch.float16: 2}.get(out_dtype, 0)
    args = (logits, _unit_stride(correction_bias), ids, weights, T, E, logits.stride(0),
            float(spec.routed_scaling_factor), float(spec.renorm_eps), float(spec.renorm_min))
    kw = dict(
        TOP_K=k, K_PAD=triton.next_power_of_2(k), BLOCK_T=tiles["block_t"], BLOCK_E=block_e,
        SCORING=_SCORING[spec.scoring], TOPK_THEN_SCORE=plain_topk,
        RENORM=spec.renormalize, HAS_BIAS=spec.has_correction_bias and select,
        BIAS_ON_LOGITS=spec.bias_on_logits, MASK_ZERO=spec.group_mask_zero and select,
        N_GROUP=n_group, G_PAD=triton.next_power_of_2(n_group), TOPK_GROUP=spec.topk_group if select else 1,
        GROUP_BY_MAX=spec.group_score == "max", GROUP_3D=group_3d, GROUP_SIZE=E // n_group if group_3d else 1,
        ROUND_TO=round_to, num_warps=tiles["num_warps"], **_pdl(logits.device),
        SPARSEMIXER=spec.score_order == "sparsemixer", sm_thr=2 * float(spec.jitter_eps),
        **hr.route_kwargs(spec, hashed or {}), **sg.route_kwargs(spec, gammas, _unit_stride(weight_scale)),
        **({} if expert_scale is None else dict(escale_ptr=_unit_stride(expert_scale), HAS_ESCALE=True)), **rt,
    )
    return ids, weights, tiles["block_t"], args, kw


# --------------------------------------------------------------------------------------------- alignment
def align(ids: torch.Tensor, E: int, block_m: int):
    """ids [T, k] -> (sorted_ids [S], block_expert [S / block_m], num_padded [1], max_blocks). No host sync. Pairs
    whose id is outside [0, E) (zero experts) are in no block."""
    flat = _flat_ids(ids)
    P = flat.numel()
    dev = ids.device
    max_blocks = triton.cdiv(P, block_m) + min(E, P)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(E)
    block_b = max(16, min(128, 8192 // e_pad))
    if P <= int(os.environ.get("MOECOMP_ALIGN_SMALL_P", SMALL_P)):
        align_k.align_small_kernel[(1,)](
            flat, sorted_ids, block_expert, num_padded, P, E, max_blocks,
            BLOCK_M=block_m, E_PAD=e_pad, P_PAD=max(16, triton.next_power_of_2(P)), BLOCK_B=block_b, **_pdl(dev),
        )
    else:
        counts = torch.zeros(E, dtype=torch.int32, device=dev)
        cursor = torch.empty(E, dtype=torch.int32, device=dev)
        block_p = max(16, min(1024, 32768 // e_pad))
        grid = (triton.cdiv(P, block_p),)
        align_k.count_kernel[grid](flat, counts, P, E, E_PAD=e_pad, BLOCK_P=block_p)
        align_k.offsets_kernel[(1,)](
            counts, sorted_ids, block_expert, num_padded, cursor, P, E, max_blocks,
            BLOCK_M=block_m, E_PAD=e_pad, BLOCK_B=block_b,
        )
        align_k.scatter_kernel[(triton.cdiv(P, 1024),)](flat, cursor, sorted_ids, P, E, BLOCK_P=1024)
    return sorted_ids, block_expert, num_padded, max_blocks


# --------------------------------------------------------------------------------------------- experts
def direct(ids: torch.Tensor):
    """ids [T, k] -> the ``aligned`` tuple of the DIRECT (unaligned, one pair per program) GEMMs: (flat ids [P],
    None, None, P). h is then [P, I] in pair order."""
    flat = _flat_ids(ids)
    return flat, None, None, flat.numel()


def gemm1(x, w13, b13, spec: MoESpec, aligned, k: int, bm: int, c1: dict, q: dict | None = None,
          weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] x w13 [E, 2I, H] over expert-sorted rows -> h [S, I] (activation fused); DIRECT (``direct``):
    h [P, I] in pair order. ``q``: fp8 w13 (``quant_kwargs``; the pointer kernel, BLOCK_K per ``fp8_tile``).
    ``weights`` (fp32 [T, k]): the routing weights, needed (and only read) with ``spec.weight_on_input``."""
    wk = woi.gemm1_kwargs(spec, weights)
    sorted_ids, block_expert, num_padded, max_blocks = aligned
    T, H = x.shape
    S, I = sorted_ids.numel(), spec.intermediate_size
    if q is None and c1.get("tma") and block_expert is not None and _tma1_ok(spec, x, w13):
        return _gemm1_tma(x, w13, b13, spec, aligned, k, bm, c1, torch.empty(S, I, dtype=x.dtype, device=x.device),
                          wk)
    c1 = fp8_tile(c1, q)
    if c1.get("tma") and block_expert is not None and fp8_tma.gemm1_ok(spec, x, w13, q, c1):
        return fp8_tma.gemm1(x, w13, b13, spec, aligned, k, bm, c1, q, wk, _pdl(x.device, gemm=True))
    x, h, out, q = gemm1_io(x, S, I, q, c1)  # (x, h, h, q) unless FP8 "prequant" (then out may be a QAct)
    se, sn, sk = _w_strides(w13, spec.w_layout)
    interleaved = spec.gated and spec.gate_up == "interleaved"
    grid = (max_blocks * triton.cdiv(I, c1["BLOCK_N"]),)  # DIRECT: max_blocks = P
    act = act_args(spec)
    gemm_k.moe_gemm1_kernel[grid](
        x, w13, b13, h, sorted_ids, block_expert, num_padded,
        T * k, k, I, H, max_blocks,
        x.stride(0), se, sn, sk, 0 if b13 is None else b13.stride(0), h.stride(0),
        1 if interleaved else I, act.alpha, act.limit,
        GATE_STRIDE=2 if interleaved else 1, GATED=spec.gated, ACT=act.ACT, CLAMP=act.CLAMP,
        HAS_BIAS=b13 is not None, UPCAST=_upcast(x), DOT_PRECISION=_precision(x),
        BLOCK_M=bm, BLOCK_N=c1["BLOCK_N"], BLOCK_K=c1["BLOCK_K"], GROUP_M=c1["GROUP_M"],
        TILE_N=c1["BLOCK_N"] * (2 if spec.gated else 1), DIRECT=block_expert is None,
        num_warps=c1["num_warps"], num_stages=c1["num_stages"], **_pdl(x.device, gemm=True), **(q or {}), **wk,
        **zx.gemm_kwargs(spec), **({"PAIR_LOAD": True} if _pair_load(spec, w13, q) else {}),
    )
    return out


def _pair_load(spec: MoESpec, w13: torch.Tensor, q) -> bool:
    """gemm1 loads gate and up tiles apart (``kloop.pair_loop``) when they are concatenated halves whose rows have
    unit stride (the in_out layout, [E, H, 2I]): one tile over both would gather across the halves."""
    return q is None and spec.gated and spec.gate_up == "concat" and _w_strides(w13, spec.w_layout)[1] == 1


def gemm2(h, w2, b2, weights, spec: MoESpec, aligned, P: int, bm: int, c2: dict, q: dict | None = None):
    """h [S, I] x w2 [E, H, I] -> y [P, H] in pair order, each row times its routing weight (DIRECT: h [P, I]).
    ``q``: fp8 w2, as in ``gemm1``."""
    sorted_ids, block_expert, num_padded, max_blocks = aligned
    H, I = spec.hidden_size, spec.intermediate_size
    y = torch.empty(P, H, dtype=h.dtype, device=h.device)
    if q is None and c2.get("tma") and block_expert is not None and _tma_ok(spec, h, w2):
        return _gemm2_tma(h, w2, b2, weights, aligned, P, bm, c2, y, woi.gemm2_kwargs(spec))
    c2 = fp8_tile(c2, q)
    if c2.get("tma") and block_expert is not None and fp8_tma.gemm2_ok(spec, h, w2, q, c2):
        return fp8_tma.gemm2(h, w2, b2, weights, aligned, P, bm, c2, q, y, woi.gemm2_kwargs(spec),
                             _pdl(h.device, gemm=True))
    h, q = fp8_a(h, q, aligned, P)  # prequant: h (or gemm1's QAct) as e4m3 codes + scales
    se, sn, sk = _w_strides(w2, spec.w_layout)
    grid = (max_blocks * triton.cdiv(H, c2["BLOCK_N"]),)
    gemm_k.moe_gemm2_kernel[grid](
        h, w2, b2, weights, y, sorted_ids, block_expert, num_padded,
        P, H, I, max_blocks,
        h.stride(0), se, sn, sk, 0 if b2 is None else b2.stride(0), y.stride(0),
        HAS_BIAS=b2 is not None, UPCAST=_upcast(h), DOT_PRECISION=_precision(h),
        BLOCK_M=bm, BLOCK_N=c2["BLOCK_N"], BLOCK_K=c2["BLOCK_K"], GROUP_M=c2["GROUP_M"], DIRECT=block_expert is None,
        num_warps=c2["num_warps"], num_stages=c2["num_stages"], **_pdl(h.device, gemm=True), **(q or {}),
        **woi.gemm2_kwargs(spec), **zx.gemm_kwargs(spec),
    )
    return y


# --------------------------------------------------------------------------------------------- TMA gemm2
def _gemm1_tma(x, w13, b13, spec: MoESpec, aligned, k: int, bm: int, c1: dict, h: torch.Tensor,
               wk: dict | None = None) -> torch.Tensor:
    """gemm1 on the TMA kernel. ``c1["tma_a"]``: x's rows gathered into sorted order first (xs [S, H]) and read by
    TMA too; else read by pointer loads. Warp specialisation (``c1["ws"]``) defaults to on with tma_a, off without."""
    sorted_ids, block_expert, num_padded, max_blocks = aligned
    T, H = x.shape
    I = spec.intermediate_size
    S = sorted_ids.numel()
    bn, bk = c1["BLOCK_N"], c1["BLOCK_K"]
    a_tma = bool(c1.get("tma_a", False))
    xs_desc = None
    if a_tma:
        xs = torch.empty(S, H, dtype=x.dtype, device=x.device)
        tma_k.gather_rows_kernel[(S // 16,)](  # S is a multiple of BLOCK_M >= 16
            x, sorted_ids, num_padded, xs, T * k, k, H, x.stride(0), xs.stride(0),
            BLOCK_R=16, BLOCK_K=min(512, triton.next_power_of_2(H)), num_warps=4, **_pdl(x.device),
        )
        xs_desc = _desc(xs, S, [bm, bk])
    w_desc = _w13_desc(w13, spec.gated, bn, bk)
    n_prog = _programs(x.device, max_blocks * triton.cdiv(I, bn))
    act = act_args(spec)
    tma_k.moe_gemm1_tma_kernel[(n_prog,)](
        x, xs_desc, w_desc, b13, h, sorted_ids, block_expert, num_padded,
        T * k, k, I, H, x.stride(0), 0 if b13 is None else b13.stride(0), h.stride(0),
        act.alpha, act.limit,
        GATED=spec.gated, ACT=act.ACT, CLAMP=act.CLAMP, HAS_BIAS=b13 is not None,
        A_TMA=a_tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c1["GROUP_M"],
        TILE_N=bn * (2 if spec.gated else 1), NUM_PROGRAMS=n_prog, WARP_SPECIALIZE=bool(c1.get("ws", a_tma)),
        num_warps=c1["num_warps"], num_stages=c1["num_stages"], **_pdl(x.device, gemm=True), **(wk or {}),
    )
    return h


def _gemm2_tma(h, w2, b2, weights, aligned, P: int, bm: int, c2: dict, y: torch.Tensor,
               wk: dict | None = None) -> torch.Tensor:
    """gemm2 on the TMA kernel: h [S, I] (sorted order) x w2 -> y [P, H] in pair order, times the routing weights."""
    sorted_ids, block_expert, num_padded, max_blocks = aligned
    E, H, I = w2.shape
    S = sorted_ids.numel()
    bn, bk = c2["BLOCK_N"], c2["BLOCK_K"]
    n_prog = _programs(h.device, max_blocks * triton.cdiv(H, bn))
    tma_k.moe_gemm2_tma_kernel[(n_prog,)](
        _desc(h, S, [bm, bk]), _desc(w2, E * H, [bn, bk]), b2, weights, y, sorted_ids, block_expert, num_padded,
        P, H, I, 0 if b2 is None else b2.stride(0), y.stride(0),
        HAS_BIAS=b2 is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c2["GROUP_M"], NUM_PROGRAMS=n_prog,
        WARP_SPECIALIZE=bool(c2.get("ws", True)), num_warps=c2["num_warps"], num_stages=c2["num_stages"],
        **_pdl(h.device, gemm=True), **(wk or {}),
    )
    return y


def decode_down(h, w2, b2, ids_flat, weights, spec: MoESpec, out, shared, gate, c2: dict, join=None,
                q: dict | None = None, x=None):
    """Decode: h [P, I] (pair order) x w2 -> out [T, H] = sum_k weight * (h . w2_e + b2) (+ gated shared).
    ``c2["mode"]``: "fused" (moe_down_combine_kernel, one launch) or "pairs" (gemm2 DIRECT -> y [P, H], then the
    combine); ``q``: fp8 w2 (``quant_kwargs``). ``join()`` runs before the first launch that reads ``shared``.
    ``x`` [T, H]: the routed input, needed (and only read) with ``spec.zero_experts``."""
    T, H = out.shape
    P = ids_flat.numel()
    if c2.get("mode", "fused") == "pairs":
        y = gemm2(h, w2, b2, weights, spec, (ids_flat, None, None, P), P, 16, c2, q)
        if join is not None:
            join()
        return combine(y, T, P // T, out, shared, gate, zx.combine_kwargs(spec, x, ids_flat, weights))
    if join is not None:
        join()
    c2 = fp8_tile(c2, q)
    h, q = fp8_a(h, q)
    se, sn, sk = _w_strides(w2, spec.w_layout)
    decode_k.moe_down_combine_kernel[(T * triton.cdiv(H, c2["BLOCK_N"]),)](
        h, w2, b2, ids_flat, weights, shared, gate, out, H, spec.intermediate_size,
        h.stride(0), se, sn, sk, 0 if b2 is None else b2.stride(0),
        0 if shared is None else shared.stride(0), 0 if gate is None else gate.stride(0), out.stride(0),
        TOP_K=P // T, HAS_BIAS=b2 is not None, HAS_SHARED=shared is not None,
        HAS_GATE=gate is not None, UPCAST=_upcast(h), DOT_PRECISION=_precision(h),
        BLOCK_M=16, BLOCK_N=c2["BLOCK_N"], BLOCK_K=c2["BLOCK_K"],
        num_warps=c2["num_warps"], num_stages=c2["num_stages"], **_pdl(h.device, gemm=True), **(q or {}),
        **woi.gemm2_kwargs(spec), **zx.down_kwargs(spec, x),
    )
    return out


def experts(x, ids, weights, args: dict, spec: MoESpec, cfg: dict | None = None) -> torch.Tensor:
    """Routed experts before the combine: x [T, H] -> y [T * k, H] (routing weights applied), x's dtype (rows of
    zero experts' pairs unwritten: the combine adds them)."""
    T, H = x.shape
    k = ids.shape[1]
    if cfg is None:
        cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, H, T, k, x.dtype, x.device, spec.quant)
    bm = cfg["BLOCK_M"]
    q1, q2 = expert_quant(args, spec, cfg, T)
    w13, w2 = triton_quant4.gemm_weights(spec.quant, args, q1, q2)  # 4-bit "mma" form: its layout (else args')
    aligned = align(ids, spec.num_experts, bm)
    h = gemm1(x, w13, _unit_stride(args["b13"]), spec, aligned, k, bm, cfg["g1"], q1, weights)
    return gemm2(h, w2, _unit_stride(args["b2"]), weights, spec, aligned, T * k, bm, cfg["g2"], q2)


def routed(x, ids, weights, args: dict, spec: MoESpec, out, shared=None, gate=None, cfg: dict | None = None,
           join=None):
    """The routed experts and the combine: x [T, H] -> out [T, H] = sum_k weight * expert(x) (+ gated shared).
    Up to the config's ``decode.max_t`` tokens: the DIRECT gemm1 and ``decode_down`` (no alignment; the fused
    down-combine or gemm2 DIRECT + combine), or for 4-bit experts whose decode entry says mode "gemv" the dot-free
    kernels (``triton_quant4_gemv``); above, align + gemm1 + gemm2 + combine. ``join()`` (the shared
    experts' side stream) runs just before the first kernel that reads ``shared``."""
    T, H = x.shape
    k = ids.shape[1]
    if cfg is None:
        cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, H, T, k, x.dtype, x.device, spec.quant)
    dec = tuning.decode_config(cfg, T, x.device)
    if spec.expert_norm != "none":  # unweighted pair rows, then norm + weight + combine (``ops/triton_norm.py``)
        with _hold_pdl(join is not None):
            y = experts(x, ids, weights, args, spec, cfg)
        if join is not None:
            join()
        return triton_norm.norm_combine(y, weights, args["expert_norm_w"], spec, T, k, out, shared, gate, ids)
    if dec is None:
        with _hold_pdl(join is not None):
            y = experts(x, ids, weights, args, spec, cfg)
        if join is not None:
            join()
        return combine(y, T, k, out, shared, gate, zx.combine_kwargs(spec, x, ids, weights))
    ids_direct = direct(ids)
    gemv = triton_quant4_gemv.wanted(spec, dec, x, args)  # 4-bit experts on the dot-free kernels (mode "gemv")
    q1, q2 = (triton_quant4.direct_kwargs(q, x.device, gemv) for q in expert_quant(args, spec, cfg, T))
    if gemv:
        return triton_quant4_gemv.routed(x, ids_direct[0], weights, args, spec, out, shared, gate, dec, q1, q2, join,
                                         _pdl(x.device, gemm=True))
    w13, w2 = triton_quant4.gemm_weights(spec.quant, args, q1, q2)  # 4-bit "mma" form: its layout (else args')
    h = gemm1(x, w13, _unit_stride(args["b13"]), spec, ids_direct, k, 16, dec["g1"], q1, weights)
    return decode_down(h, w2, _unit_stride(args["b2"]), ids_direct[0], weights.reshape(-1), spec, out, shared, gate,
                       dec["g2"], join, q2, x)


def combine(y: torch.Tensor, T: int, k: int, out: torch.Tensor, shared=None, gate=None,
            zero: dict | None = None) -> torch.Tensor:
    """out [T, H] = sum_k y (+ gated shared); ``zero``: ``zero_experts.combine_kwargs`` (their slots: w * x)."""
    H = out.shape[1]
    if T == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(H))
    combine_k.combine_kernel[(T, triton.cdiv(H, block_h))](
        y, shared, gate, out, H,
        y.stride(0), 0 if shared is None else shared.stride(0), 0 if gate is None else gate.stride(0), out.stride(0),
        TOP_K=k, K_PAD=triton.next_power_of_2(k), HAS_SHARED=shared is not None, HAS_GATE=gate is not None,
        BLOCK_H=block_h, num_warps=4, **_pdl(out.device), **(zero or {}),
    )
    return out


_side_streams: dict = {}


def _side_stream(device: torch.device):
    s = _side_streams.get(device.index)
    if s is None:
        s = _side_streams[device.index] = torch.cuda.Stream(device)
    return s


def route_all(x2: torch.Tensor, args: dict, spec: MoESpec, shape) -> Routed:
    """The op's routing of x2 [T, H] (``shape``: x's, for the capacity's groups) -> Routed(ids [T, k] int32, weights
    [T, k] fp32, gammas [T, G] | None, gate [T] | None: the shared-expert gate's logit from the router GEMM). The
    router's own input / prefix (spec.router_prefix) in torch (``ops/router_input.py``), then the router GEMM and the
    routing kernel; an expert capacity's dropped pairs: ids E, weights 0 (``ops/capacity.py``). ``moe_forward`` and
    the parallel path (``parallel/route.py``) route through this (``Backend.route_all``)."""
    r2 = router_in(x2, args, spec).contiguous()
    escale = args.get("expert_scale") if spec.expert_scale else None  # applied in the routing kernel
    gammas = sg.gamma_buffer(spec, x2.shape[0], x2.device)
    if spec.has_capacity:  # ids: the selection, before the drop
        kspec, kw = cap.kernel_spec(spec), dict(expert_scale=escale, rt=routes.kernel_kwargs(args, weights=False))
    else:
        kspec, kw = spec, dict(hashed=args, expert_scale=escale, gammas=gammas, weight_scale=args.get("weight_scale"),
                               rt=routes.kernel_kwargs(args))
    logits, gate = router_logits(r2, args, spec)  # [T, E (+ G)], [T] or None
    ids, weights = route(logits, args["correction_bias"], kspec, x2.dtype, **kw)
    if spec.has_capacity:
        ids, weights = cap.apply(ids, weights, spec, cap.group_tokens(shape, spec), x2.dtype)
        routes.record(args, None, weights)
    return Routed(ids, weights, gammas, gate)


# --------------------------------------------------------------------------------------------- entry points
def moe_forward(x: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()  # [T, H]
    T = x2.shape[0]
    out = torch.empty_like(x2)
    if T == 0:
        return out.reshape(shape)
    side_out, side = None, None
    many = sg.stacked(spec)  # stacked shared experts / router gammas: ys [S, T, H], summed before the combine
    shared_fn = sg.shared_outputs if many else shared_mlp
    overlap = spec.shared is not None and x2.is_cuda and os.environ.get("MOECOMP_NO_OVERLAP") != "1"
    if overlap:
        main = torch.cuda.current_stream(x2.device)
        side = _side_stream(x2.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            side_out = shared_fn(x2, args, spec)
    elif spec.shared is not None:
        side_out = shared_fn(x2, args, spec)

    def join():
        if overlap:
            main.wait_stream(side)
            side_out.record_stream(main)
            x2.record_stream(side)
        if many:  # after the routing (the gammas) and the side stream (ys)
            sg.weighted_sum(side_out, gammas, spec, shared)

    ids, weights, gammas, gate = route_all(x2, args, spec, shape)
    shared = torch.empty_like(x2) if many else side_out
    if not (overlap or many):
        join = None  # noqa: F811  (nothing to wait for)
    if spec.latent_size:
        return _latent_routed(x2, ids, weights, args, spec, out, shared, gate, join).reshape(shape)
    return routed(x2, ids, weights, args, spec, out, shared, gate, join=join).reshape(shape)


def _latent_routed(x2, ids, weights, args: dict, spec: MoESpec, out, shared, gate, join):
    """``spec.latent_size``: the routed experts of ``spec.experts_spec()`` on latent_in(x) [T, L] (every routed path
    as without projections, combined into [T, L]), then latent_out [T, H] and, with shared experts, a one-slot
    combine into ``out`` that adds them (gated) after the projection."""
    xl = latent.project_in(x2, args, spec)  # [T, L] (normalised: spec.latent_norm)
    rl = routed(xl, ids, weights, args, spec.experts_spec(), torch.empty_like(xl))  # [T, L]
    y = latent.project_out(rl, args)  # [T, H]
    if shared is None:
        return y
    if join is not None:
        join()
    return combine(y, x2.shape[0], 1, out, shared, gate)


def moe_experts(x, topk_ids, topk_weights, args: dict, spec: MoESpec) -> torch.Tensor:
    x2 = x.contiguous()
    T = x2.shape[0]
    out = torch.empty_like(x2)
    if T == 0:
        return out
    return routed(x2, topk_ids.to(torch.int32), topk_weights.float().contiguous(), args, spec, out)
