"""FP8 launch helpers of the Triton path (docs/FP8.md): the quantized GEMMs' extra kernel arguments, their tile
rules, and the dense ``fp8_linear`` (``torch.ops.moecomp.fp8_linear``'s CUDA path, through ``triton_moe.fp8_linear``).

    quant_kwargs(quant, scale, act_scale, mode)   -> the trailing arguments of moe_gemm1/2_kernel and
                                                     fp8_linear_kernel: scale pointer and strides, W_SCALE,
                                                     A_QUANT, block sizes, UE8M0, EXACT_CAST (the interpreter)
    expert_kwargs(quant, args, mode, cand)         -> (gemm1's, gemm2's) quant_kwargs of the routed experts
    fp8_tile(c, kw)                                -> c with a BLOCK_K the quantization allows
    fp8_a(a, kw) / gemm1_io(x, S, I, kw, c1)      -> a GEMM's A operand and launch arguments (prequant: A quantized
                                                     once, ``quantize_act``; gemm1 may write h quantized, a QAct)
    fp8_linear(x, weight, weight_scale, bias, act_scale, q)   y = x_q @ (q_w * s_w).T (+ bias), x's dtype

The mode ("w8a8" | "w8a16") of a call: ``tuning.fp8_mode``; the speed candidates ("prequant", "fold"; off unless a
config key or MOECOMP_FP8_PREQUANT / MOECOMP_FP8_FOLD turn them on, docs/FP8.md): ``tuning.fp8_candidates``. ue8m0
scales reach the kernels as their bytes (``.view(torch.uint8)``); the kernels decode them. Keys of a kwargs dict
that start with "_" are the launchers' (``fp8_a`` / ``gemm1_io`` drop them), never the kernels'.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton

from ..kernels import fp8 as fp8_k
from ..kernels import fp8_linear as fp8_linear_k
from ..core.spec import MoESpec
from . import fp8_blas, skinny, triton_quant4, tuning
from .common import interpret as _interpret, dot_precision as _precision, sm_count as _sm_count, upcast_bf16 as _upcast

W_SCALE = {"block": 1, "channel": 2, "tensor": 3}
ACT_GROUP = 128
H_DTYPE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # gemm1's Q_OUT: the dtype h is rounded to


def quant_kwargs(quant, scale: torch.Tensor, act_scale: torch.Tensor | None, mode: str, experts: bool = True,
                 cand: dict | None = None) -> dict:
    """Kernel arguments of one quantized GEMM. ``scale``: the weight scales (per expert [E, ...] when ``experts``,
    else a 2-D weight's); ``act_scale``: static activation scales ([E], or one value), used in "w8a8" mode of a
    "static" spec; ``mode``: ``tuning.fp8_mode``'s answer; ``cand``: ``tuning.fp8_candidates``'s (None: both off):
    "prequant" makes a dynamic w8a8 GEMM A_QUANT 3 (``fp8_a`` then quantizes A and adds its scales), "fold" (1, 2)
    adds FOLD to a w8a16 GEMM over block scales. Off, the arguments are exactly those of before the candidates."""
    if quant.scale_dtype == "ue8m0":
        scale = scale.view(torch.uint8)
    strides = list(scale.stride()) if experts else [0, *scale.stride()]
    strides += [0] * (3 - len(strides))
    a_quant = 0
    if mode == "w8a8":
        a_quant = 2 if quant.activation == "static" else 1
    if a_quant == 2:
        act_scale = act_scale.reshape(-1)
        if act_scale.numel() > 1 and act_scale.stride(0) != 1:
            act_scale = act_scale.contiguous()
    cand = cand or {}
    if a_quant == 1 and cand.get("prequant"):
        a_quant = 3
    kw = dict(ws_ptr=scale, as_ptr=act_scale if a_quant == 2 else None, stride_se=strides[0],
              stride_sn=strides[1], stride_sk=strides[2], W_SCALE=W_SCALE[quant.scale], A_QUANT=a_quant,
              Q_BLOCK_N=quant.block_n, Q_BLOCK_K=quant.block_k, UE8M0=quant.scale_dtype == "ue8m0",
              EXACT_CAST=_interpret())
    if a_quant == 0 and quant.scale == "block" and cand.get("fold"):
        kw["FOLD"] = int(cand["fold"])
    return kw


def expert_kwargs(quant, args: dict, mode: str, cand: dict) -> tuple[dict, dict]:
    """(gemm1's, gemm2's) ``quant_kwargs`` of the routed experts. Prequant: gemm1's carry "_h_quant" (gemm2 reads h
    quantized: ``gemm1_io`` may have gemm1 write it so)."""
    q1 = quant_kwargs(quant, args["w13_scale"], args.get("a13_scale"), mode, cand=cand)
    q2 = quant_kwargs(quant, args["w2_scale"], args.get("a2_scale"), mode, cand=cand)
    if q2["A_QUANT"] == 3:
        q1["_h_quant"] = True
    return q1, q2


class QAct(NamedTuple):
    """An activation quantized once per (row, 128-column group) ("prequant"): e4m3 codes [M, K], fp32 scales
    [M, cdiv(K, 128)], and the dtype of the tensor it stands for (a GEMM reading it still outputs that dtype)."""

    q: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self) -> torch.Tensor:
        """codes * their group's scale, fp32 [M, K] (for checks: the tuner compares candidates on it)."""
        K = self.q.shape[1]
        return self.q.float() * self.s.repeat_interleave(ACT_GROUP, dim=1)[:, :K]


def launch_options(device: torch.device) -> dict:
    """The launch options of the op's kernels on ``device`` (programmatic dependent launch): ``triton_moe`` sets
    this to its ``_pdl`` when it imports this module (it imports this module, so this one cannot import it)."""
    return {}


def quantize_act(a: torch.Tensor, aligned=None, P: int = 0, col_major: bool = False) -> QAct:
    """a [M, K] (unit column stride) -> QAct, ``quant.quantize_act``'s formula (dynamic, groups of 128) in one
    launch (``kernels/fp8.quant_act_kernel``). ``aligned``: a is h [S, I] in the sorted order of this ``align``
    tuple (sentinel P): padding rows are skipped. ``col_major``: the scales [M, G] with strides (1, M) (torch's
    block-scaled GEMM takes them so). Scratch is torch.empty; no host sync (CUDA-graph capturable)."""
    M, K = a.shape
    G = triton.cdiv(K, ACT_GROUP)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty(G, M, dtype=torch.float32, device=a.device).t() if col_major else \
        torch.empty(M, G, dtype=torch.float32, device=a.device)
    if M:
        sorted_ids, num_padded = (None, None) if aligned is None or aligned[1] is None else aligned[0:3:2]
        bm = 16 if M <= 1024 else 32
        fp8_k.quant_act_kernel[(triton.cdiv(M, bm), G)](
            a, q, s, sorted_ids, num_padded, M, K, P, a.stride(0), q.stride(0), s.stride(0),
            ROWS_SORTED=sorted_ids is not None, EXACT_CAST=_interpret(), BLOCK_M=bm, num_warps=4,
            **({"stride_sg": s.stride(1)} if col_major else {}), **launch_options(a.device),
        )
    return QAct(q, s, a.dtype)


def fp8_a(a, kw: dict | None, aligned=None, P: int = 0):
    """(A operand, launch kwargs) of a quantized GEMM (``kw``: ``quant_kwargs``, maybe with "_" keys, dropped here):
    as given, or for A_QUANT 3 the e4m3 codes of a (quantized here, unless ``a`` is a QAct already) with as_ptr /
    stride_am its scales. ``aligned`` / ``P``: as in ``quantize_act``."""
    if kw is None:
        return a, None
    kw = {n: v for n, v in kw.items() if not n.startswith("_")}
    if kw["A_QUANT"] != 3:
        assert not isinstance(a, QAct), "a quantized activation for a GEMM that quantizes its own"
        return a, kw
    if not isinstance(a, QAct):
        if a.stride(-1) != 1:
            a = a.contiguous()
        a = quantize_act(a, aligned, P)
    return a.q, dict(kw, as_ptr=a.s, stride_am=a.s.stride(0))


def gemm1_io(x: torch.Tensor, S: int, I: int, kw: dict | None, c1: dict):
    """gemm1's (A operand, h buffer, what gemm1 returns, launch kwargs). Plain: (x, h, h, kw) with h [S, I] in x's
    dtype. Prequant: x quantized (``fp8_a``); when gemm2 reads h quantized ("_h_quant") and BLOCK_N covers whole
    128-column groups, the epilogue writes h as e4m3 + group scales (Q_OUT, h rounded to x's dtype first: the codes
    gemm2's A loads would make) and gemm1 returns a QAct; otherwise gemm2 quantizes h (``quantize_act``)."""
    h_quant = kw is not None and kw.get("_h_quant") and c1["BLOCK_N"] % ACT_GROUP == 0
    dtype = x.dtype
    x, kw = fp8_a(x, kw)
    if not h_quant:
        h = torch.empty(S, I, dtype=dtype, device=x.device)
        return x, h, h, kw
    h = torch.empty(S, I, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(S, triton.cdiv(I, ACT_GROUP), dtype=torch.float32, device=x.device)
    return x, h, QAct(h, hs, dtype), dict(kw, hs_ptr=hs, stride_hsm=hs.stride(0), Q_OUT=H_DTYPE[dtype])


def fp8_tile(c: dict, kw: dict | None) -> dict:
    """``c`` with its BLOCK_K halved until it divides the weight blocks' block_k (block scales) and the 128-column
    activation group (dynamic activations); a tuned or heuristic FP8 tile has 128 already."""
    if kw is None:
        return c
    if kw.get("W4"):  # 4-bit weights: their own rule
        return triton_quant4.tile(c, kw)
    bk = c["BLOCK_K"]
    while bk > 16 and ((kw["W_SCALE"] == 1 and kw["Q_BLOCK_K"] % bk) or (kw["A_QUANT"] in (1, 3) and ACT_GROUP % bk)):
        bk //= 2
    return c if bk == c["BLOCK_K"] else dict(c, BLOCK_K=bk)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, act_scale, q,
               out: torch.Tensor | None = None, cfg: dict | None = None) -> torch.Tensor:
    """x [..., K] x weight [N, K] e4m3 -> [..., N] in x's dtype (``kernels/fp8_linear.py``). ``out``: a [M, N] view
    with unit column stride to write into (the shared experts' gate / up halves), returned as is. ``cfg``: a config
    whose mode and candidates the call takes (a block's shared experts run in its routed experts' mode, so that the
    block has one mode, as its reference does); None: ``tuning.fp8_mode``'s rule by M."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return out if out is not None else x.new_empty(*x.shape[:-1], N)
    kw = quant_kwargs(q, weight_scale, act_scale, tuning.fp8_mode(q, M, cfg), experts=False,
                      cand=tuning.fp8_candidates(_linear_cfg(cfg, M)))
    y = None
    if _skinny_ok(kw, M, N, K):
        y = skinny.skinny_linear(x2, weight, bias, weight_scale, q, out=out)
    elif out is None and kw["A_QUANT"] in (1, 3) and fp8_blas.takes(x2, weight, weight_scale, q):
        qa = quantize_act(x2, col_major=True)
        y = fp8_blas.linear(qa.q, qa.s, weight, weight_scale, bias, x.dtype)  # None: refused (remembered)
    if y is None:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
        c = fp8_tile(tuning.fp8_linear_config(M, N, K, x.device, _sm_count(x.device)), kw)
        upcast, precision = _upcast(x2), _precision(x2)
        x2, kw = fp8_a(x2, kw)  # prequant: x2 is then e4m3 (kw: its scales)
        del kw["stride_se"]
        if bias is not None and bias.stride(-1) != 1:
            bias = bias.contiguous()
        grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)
        fp8_linear_k.fp8_linear_kernel[grid](
            x2, weight, kw.pop("ws_ptr"), kw.pop("as_ptr"), bias, y, M, N, K, x2.stride(0), weight.stride(0),
            weight.stride(1), kw.pop("stride_sn"), kw.pop("stride_sk"), y.stride(0),
            HAS_BIAS=bias is not None, UPCAST=upcast, DOT_PRECISION=precision, BLOCK_M=c["BLOCK_M"],
            BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"], num_warps=c["num_warps"],
            num_stages=c["num_stages"], **kw,
        )
    return y if out is not None else y.reshape(*x.shape[:-1], N)


def _linear_cfg(cfg: dict | None, M: int) -> dict | None:
    """The config whose speed candidates a call takes: the block's, else above 64 rows the standalone linear's
    measured defaults (``tuning.FP8_LINEAR_DEFAULTS``; decode sizes were not measured with them)."""
    return cfg if cfg is not None or M <= 64 else tuning.FP8_LINEAR_DEFAULTS


def _skinny_ok(kw: dict, M: int, N: int, K: int) -> bool:
    """A weight-only call of a few rows takes the skinny kernel (``kernels/skinny.py``) where it was measured faster
    (``skinny.use_skinny``), unless MOECOMP_SKINNY=0."""
    return (kw["A_QUANT"] == 0 and skinny.use_skinny(M, N, K, True) and os.environ.get("MOECOMP_SKINNY", "1") != "0")


def expert_quant(args: dict, spec: MoESpec, cfg: dict, T: int) -> tuple[dict | None, dict | None]:
    """(gemm1's, gemm2's) fp8 kernel arguments (``quant_kwargs``) for a quantized spec, in the call's mode
    (``tuning.fp8_mode``: MOECOMP_FP8_MODE, the config's "fp8" key, or the heuristic) and with the speed candidates
    asked for (``tuning.fp8_candidates``; docs/FP8.md); 4-bit specs: ``triton_quant4.expert_kwargs`` (w4a16);
    (None, None) otherwise."""
    qs = spec.quant
    if qs is None:
        return None, None
    if qs.packed:
        return triton_quant4.expert_kwargs(qs, args, cfg)
    return expert_kwargs(qs, args, tuning.fp8_mode(qs, T, cfg), tuning.fp8_candidates(cfg))


def block_cfg(x, spec: MoESpec) -> dict | None:
    """The routed experts' config when they are quantized (its FP8 mode is the block's: the shared experts take it)."""
    if spec.quant is None or spec.shared.quant is None:
        return None
    T, H = x.shape
    return tuning.get_config(spec.num_experts, spec.intermediate_size, H, T, spec.top_k, x.dtype, x.device, spec.quant)
