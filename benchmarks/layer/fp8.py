"""``--dtype fp8``: every family's block with FP8 block-quantized experts, its references, checks, floor and the fp8
matmul ceiling.

The block is built and initialised in bf16 as in the other modes (the HF block stays the bf16 reference, and
moecomp's bf16 path runs on it), then its routed experts (w13 [E, 2I, H], gate and up blocked apart; w2 [E, H, I])
and its shared experts (gate_proj, up_proj, down_proj: 2-D, dense) are quantized with ``moecomp.core.quant.quantize``:
e4m3 weights, one fp32 scale per 128x128 block, the spec's activations "dynamic" (per token, groups of 128). The
router, the shared-expert gate and the correction bias stay as they are; activations are bf16 in and out.

References, per cell, from ``moecomp.oracle.reference.moe_forward`` with the quantized spec and the scales (weights
dequantized exactly, fp32 math): "w8a8" quantizes each GEMM's input as the spec says (activation quantization
counted), "w8a16" is the same spec weight-only (``moecomp.core.quant.weight_only``), which the op's kernel table may pick
for a dynamic spec (docs/FP8.md). The quantization error of the format itself is the w8a8 reference against the bf16
HF block.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

import report_fp8  # benchmarks/report_fp8.py (the targets; stdlib only)

from . import common
from .checks import check_output, rel_err

MODE_ENV = "MOECOMP_FP8_MODE"  # read by moecomp.ops.tuning.fp8_forced at call time: "w8a8" | "w8a16"
# The check of an FP8 path against the dequantized reference it computes: both quantize the same bf16 values the
# same way, so they differ by bf16 roundings (of h, of the output) and the rare e4m3 rounding such a bf16 ulp flips:
# the bf16 rule (policy.BENCH_TOLERANCE) applies. The quantization error itself (w8a8 reference vs the bf16 block)
# is several times larger (~3-5% on these random weights) and is reported, not judged.
FP8_TOLERANCE = common.policy.BENCH_TOLERANCE
# vLLM's kernels under the CPU Triton interpreter: its fp32 -> e4m3 cast does not round to nearest even (it halves
# 1-2% of the activation codes, ../shared/peers/vllm_fused_moe/README.md). Measured on the tiny fp8 Mixtral block
# (T=4): 0.10 against the reference with torch's cast, 1.8e-3 against the same reference with the interpreter's
# cast (check_peer.py's emulation), so the wiring is right and the gap is the cast. A CPU smoke run judges the vLLM
# fp8 path with this bound; on the GPU the hardware cast runs and FP8_TOLERANCE applies.
FP8_INTERPRET_TOLERANCE = 0.25
HF_NA = ("n/a in fp8: transformers' FP8 forward (FP8Experts / FP8Linear, quantization_config fp8) calls kernels "
         "fetched from the hub at run time (the `kernels` package, online); nothing of it runs offline")
QUANT_METHOD = ("e4m3 weights, one fp32 scale per 128x128 block (moecomp.core.quant.quantize of the block's own random "
                "bf16 weights; w13's gate and up rows blocked apart), routed and shared experts; activations "
                "quantized per token in groups of 128 (dynamic) where a kernel runs w8a8; router, shared-expert "
                "gate and correction bias unquantized; bf16 in and out")
REFERENCE_METHOD = ("moecomp.oracle.reference.moe_forward with the quantized spec and the scales (weights dequantized, "
                    "fp32 math): w8a8 = activations quantized as the spec says (activation quantization counted), "
                    "w8a16 = the same spec weight-only; the op may run either (its kernel table picks per T), so a "
                    "moecomp fp8 path passes when it is within the tolerance of one of them (ran = the closer one)")
MODES = {"moecomp_fp8": None, "moecomp_fp8_w8a8": "w8a8", "moecomp_fp8_w8a16": "w8a16"}
TARGETS = report_fp8.TARGETS  # issue 19's: >= 1.7x bf16 at T <= 128, >= 1.4x at T = 8192, <= vLLM fp8 everywhere
_QUANT_CHUNK_ELEMS = 1 << 28  # quantize at most this many weight elements at a time (fp32 temporaries ~1 GiB each)


def quant_spec():
    from moecomp.core.spec import QuantSpec

    return QuantSpec()  # e4m3, "block" 128 x 128, fp32 scales, "dynamic" activations in groups of 128


@dataclasses.dataclass
class Fp8Block:
    spec: object  # the recognised spec with quant (and shared.quant) set
    tensors: dict  # MOE_ARGS name -> tensor: fp8 experts (and shared experts), the rest the block's own
    scales: dict  # QUANT_ARGS name -> fp32 scale tensor (the ones this spec has)
    seconds: float = 0.0

    def op_args(self) -> tuple:
        from moecomp.core.args import MOE_ARGS

        return tuple(self.tensors[n] for n in MOE_ARGS)

    def scale_args(self) -> tuple:
        """The op's arguments after ``spec``, in QUANT_ARGS order (None where this spec has none)."""
        from moecomp.core.args import QUANT_ARGS

        return tuple(self.scales.get(n) for n in QUANT_ARGS)

    def weight_only_spec(self):
        """The spec weight-only (activation "none"), as ``moecomp.core.quant.weight_only`` means it (built with
        ``dataclasses.replace``: ``weight_only`` copies ``__dict__``, which holds the cached ``key`` once read)."""
        sh = self.spec.shared

        def wo(q):
            return None if q is None else dataclasses.replace(q, activation="none")

        return self.spec.replace(quant=wo(self.spec.quant),
                                 shared=None if sh is None else dataclasses.replace(sh, quant=wo(sh.quant)))

    def dequantized_shared(self, dtype: torch.dtype) -> dict:
        """The tensors with the shared experts' weights dequantized to ``dtype`` (for peers that run the shared
        expert in plain torch); the routed experts stay fp8."""
        from moecomp.core import quant as q8

        out = dict(self.tensors)
        sh = self.spec.shared
        if sh is not None and sh.quant is not None:
            for n in ("shared_w1", "shared_w3", "shared_w2"):
                if out.get(n) is not None:
                    out[n] = q8.dequantize(out[n], self.scales[f"{n}_scale"], sh.quant).to(dtype)
        return out

    def describe(self) -> dict:
        from moecomp.core.spec import FP8_MAX

        return dict(spec=self.spec.key, quant=self.spec.quant.key, fp8_max=FP8_MAX, seconds=round(self.seconds, 2),
                    scales={n: list(t.shape) for n, t in self.scales.items()},
                    weight_bytes={n: t.numel() * t.element_size() for n, t in self.tensors.items()
                                  if t is not None and t.dtype == torch.float8_e4m3fn})


def unquantizable(spec) -> str | None:
    """Why moecomp's quantized spec cannot describe this block (docs/FP8.md), or None."""
    why = []
    if spec.w_layout != "out_in" or spec.gate_up != "concat":
        why.append(f"experts {spec.w_layout} / {spec.gate_up} (quantized experts need out_in / concat)")
    if spec.has_expert_bias:
        why.append("expert biases")
    sh = spec.shared
    if sh is not None and sh.gated and sh.layout != "separate":
        why.append(f"shared expert layout {sh.layout} (quantized shared experts need 'separate')")
    if spec.fused_shared_gate:
        why.append("a fused shared-expert gate")
    return "; ".join(why) or None


def _quantize_chunked(w: torch.Tensor, quant, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moecomp.core.quant.quantize`` of [E, rows, cols] a few experts at a time (its fp32 temporaries of a whole
    DeepSeek-V3 w13 would be ~30 GiB each)."""
    from moecomp.core import quant as q8

    E, rows, cols = w.shape
    step = max(1, _QUANT_CHUNK_ELEMS // (rows * cols))
    qs, ss = [], []
    for e0 in range(0, E, step):
        q, s = q8.quantize(w[e0:e0 + step], quant, halves)
        qs.append(q)
        ss.append(s)
    return torch.cat(qs), torch.cat(ss)


def quantize_block(spec, tensors: dict) -> Fp8Block:
    """The block's tensors with FP8 experts (routed and shared) and the quantized spec (``spec.replace(quant=...)``,
    ``shared.quant`` likewise); raises ValueError when the spec cannot be quantized (``unquantizable``)."""
    why = unquantizable(spec)
    if why:
        raise ValueError(f"cannot quantize this block: {why}")
    from moecomp.core import quant as q8
    from moecomp.ops.moe_op import check_args

    t0 = time.perf_counter()
    q = quant_spec()
    sh = spec.shared
    qspec = spec.replace(quant=q, shared=None if sh is None else dataclasses.replace(sh, quant=q))
    out, scales = dict(tensors), {}
    with torch.no_grad():
        out["w13"], scales["w13_scale"] = _quantize_chunked(tensors["w13"], q, 2 if spec.gated else 1)
        out["w2"], scales["w2_scale"] = _quantize_chunked(tensors["w2"], q, 1)
        if sh is not None:
            for n in ("shared_w1", "shared_w3", "shared_w2"):
                if tensors.get(n) is not None:
                    out[n], scales[f"{n}_scale"] = q8.quantize(tensors[n], q)
    x = torch.empty(1, spec.hidden_size, device=tensors["w13"].device, dtype=common.DTYPE)
    check_args(x, {**out, **scales}, qspec)  # the op's own argument checks (shapes, dtypes, scales)
    return Fp8Block(qspec, out, scales, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------- references, checks
def references(x2: torch.Tensor, fb: Fp8Block) -> dict:
    """{"w8a8": ..., "w8a16": ...}: the dequantized references of x2 [T, H] (moecomp.oracle.reference.moe_forward on the
    quantized spec and scales, fp32 math, output in x's dtype)."""
    from moecomp.oracle import reference

    with torch.no_grad():
        return {"w8a8": reference.moe_forward(x2, *fb.op_args(), fb.spec, **fb.scales),
                "w8a16": reference.moe_forward(x2, *fb.op_args(), fb.weight_only_spec(), **fb.scales)}


def quant_error(refs: dict, ref_hf: torch.Tensor, amb) -> dict:
    """The format's own error: the dequantized references against the bf16 HF block (all tokens, and the tokens
    whose routing is unambiguous, where a tie flip cannot count)."""
    c = check_output(refs["w8a8"], ref_hf.reshape(refs["w8a8"].shape), amb, math.inf, key="rel_err")
    c.pop("check_ok", None)
    c.pop("bad_token_frac_unambiguous", None)
    c["rel_err_w8a16"] = rel_err(refs["w8a16"], ref_hf.reshape(refs["w8a16"].shape))
    c["between_w8a8_and_w8a16"] = rel_err(refs["w8a16"], refs["w8a8"])  # activation quantization's own share
    return c


def _judged(c: dict, key: str) -> float:
    u = c.get("rel_err_unambiguous")
    return u if u is not None else c[key]


def fp8_check(out: torch.Tensor, refs: dict, amb, tol: float, want: str | None, either: bool = True) -> dict:
    """A fp8 path's verdict against the dequantized references. ``want``: the mode it should run ("w8a8", "w8a16",
    None = the kernel table's choice); ``either``: it passes within ``tol`` of either reference (moecomp: both are
    valid computations of a dynamic spec), else only of ``want``'s (vLLM: w8a8). ``ran``: the closer reference
    (``"unclear"`` when neither is clearly closer); ``mode_honoured``: ran == want (forced modes)."""
    out = out.reshape(refs["w8a8"].shape)
    c8 = check_output(out, refs["w8a8"], amb, tol, key="rel_err_vs_ref")
    c16 = check_output(out, refs["w8a16"], amb, tol, key="rel_err_vs_ref_w8a16")
    e8, e16 = _judged(c8, "rel_err_vs_ref"), _judged(c16, "rel_err_vs_ref_w8a16")
    rec = dict(c8, rel_err_vs_ref_w8a16=c16["rel_err_vs_ref_w8a16"], against="dequantized reference (w8a8)",
               tolerance=tol)
    if "rel_err_unambiguous" in c16:
        rec["rel_err_unambiguous_w8a16"] = c16["rel_err_unambiguous"]
    lo, hi = min(e8, e16), max(e8, e16)
    rec["ran"] = ("w8a8" if e8 < e16 else "w8a16") if math.isfinite(hi) and lo < 0.5 * hi else "unclear"
    if want is not None:
        rec["mode_honoured"] = rec["ran"] == want
    judged = lo if either else (e8 if want in (None, "w8a8") else e16)
    rec["check_ok"] = bool(math.isfinite(c8["rel_err_vs_ref"]) and judged <= tol)
    return rec


def check_of(rec: dict, tol: float) -> dict:
    """A path's fp8 verdict for the cell (``cell.check_fp8[path]``), from its timing record."""
    if rec.get("rel_err_vs_ref") is None:
        return dict(rel_err=None, ok=False, tolerance=tol, error=rec.get("error", "no output"))
    chk = dict(rel_err=rec["rel_err_vs_ref"], ok=bool(rec.get("check_ok")), tolerance=rec.get("tolerance", tol),
               against=rec.get("against"))
    for k in ("rel_err_vs_ref_w8a16", "rel_err_unambiguous", "ambiguous_tokens", "ran", "mode_honoured"):
        if k in rec:
            chk[k] = rec[k]
    return chk


# ---------------------------------------------------------------------------------------------- ceiling, floor
def measure_fp8_ceiling(device: torch.device, timer) -> dict:
    """The fp8 matmul rate: ``torch._scaled_mm`` (e4m3 x e4m3, tensor-wise fp32 scales, bf16 out) on an 8192^3
    product (256^3 on the CPU); without it (or where it fails) the bf16 rate stands in, and the record says so."""
    m = 8192 if device.type == "cuda" else 256
    rec = dict(fp8_matmul_size=m)
    if not hasattr(torch, "_scaled_mm"):
        return dict(rec, fp8_matmul_flops_per_s=None, fp8_matmul_note="torch._scaled_mm absent: bf16 rate used")
    try:
        a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)

        def mm():
            return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        mm()
        t = timer.bench(mm, 1.0)
        del a, b
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return dict(rec, fp8_matmul_flops_per_s=2 * m**3 / (t * 1e-3), fp8_matmul_ms=t,
                    fp8_matmul_note="torch._scaled_mm, e4m3 x e4m3, tensor-wise scales, bf16 out")
    except Exception as e:
        return dict(rec, fp8_matmul_flops_per_s=None,
                    fp8_matmul_note=f"torch._scaled_mm failed ({common.root_msg(e, 120)}): bf16 rate used")


def rate_key(ceilings: dict) -> str:
    """The ceilings' key of the rate the fp8 floor's FLOPs are counted at."""
    return "fp8_matmul_flops_per_s" if ceilings.get("fp8_matmul_flops_per_s") else "matmul_flops_per_s"


FLOOR_METHOD = ("fp8 floor = max(bytes / copy rate, FLOPs / fp8 matmul rate): bytes = distinct experts touched x "
                "(1 byte per weight element + fp32 block scales) + shared experts likewise + router (bf16) + "
                "correction bias + bf16 activations in and out; FLOPs as in bf16, at the fp8 rate")
