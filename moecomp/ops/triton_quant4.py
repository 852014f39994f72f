"""4-bit routed experts on the Triton path (w4a16: ``kernels/quant4.py``): the GEMMs' extra kernel arguments and
their tile rule. Called through ``triton_fp8.expert_quant`` / ``fp8_tile``, so the launchers of ``triton_moe``
(gemm1, gemm2, the decode down-combine; aligned and DIRECT) take 4-bit weights the way they take FP8 ones.

    expert_kwargs(quant, args, cfg)   -> (gemm1's, gemm2's) kwargs: group scales (ue8m0 as their bytes), the int4
                                         zero points (w13_zero / w2_zero), W4 (1 mxfp4, 2 int4, 3 int4 with zeros),
                                         Q_BLOCK_K (the group), UE8M0, and the options asked for
    tile(c, kw)                       -> c with a BLOCK_K of at least 32 (two 16-column halves a step) that divides
                                         the int4 group when the scale is applied after the dot (the default)

Options (speed candidates; per call, as the FP8 ones): the config's keys ``"w4_fold": 1`` (int4: the scale folded
into the weight tile, one rounding of each scaled weight to x's dtype; off by default) and ``"w4_form"``:
"interleave" (the unpacked nibbles interleaved into one [BLOCK_K, N] tile, one dot a step), "split" (A's even / odd
columns times the low / high nibbles, two dots a step) or "dot_scaled" (mxfp4 with 16-bit x: ``tl.dot_scaled``; else
interleave); or MOECOMP_W4_FOLD=0|1 / MOECOMP_W4_FORM=interleave|split|dot_scaled, which win. mxfp4 always folds
(exact); "asm" (mxfp4 with 16-bit x on CUDA: ``kernels/quant4.py`` FORM 3, inline PTX decode; the
interpreter runs "split" instead); "mma" (opt-in: ``kernels/quant4_mma.py`` on ``ops/w4_layout.py``'s re-laid
weights, ``gemm_weights``; the aligned GEMMs and the decode path's DIRECT gemm1 / gemm2 and down-combine, while the
GEMV kernels read the weights as held: ``direct_kwargs``; also a BLOCK_N of at least 16: ``tile``); weights held in
the mma layout (``QuantSpec.layout`` "mma": re-laid once, in place, by ``optimize`` when MOECOMP_W4_FORM=mma) always
take the "mma" form on the dot paths, and the GEMV decode kernels read them too (their W4_MMA word decode).
Default (``DEFAULT_FORM``): "dot_scaled" on CUDA, measured on an H200 (2026-12-03, 41626bb,
``benchmarks/results/nvidia-h200-2026-12-03-41626bb-diag-quant4.json``, gpt-oss-120b layer): 0.60-0.68x the
interleave form's time at T = 1, 4, 16, 64 (87 against 128 us at T = 1), the split form 1.04-1.15x; int4 and fp32 x
take interleave. Under the interpreter (CPU tests): interleave.

The decode path's dot-free alternative (``ops/triton_quant4_gemv.py``, decode config mode "gemv") reads the same
kwargs (scales, zero points, W4, the group) from ``expert_kwargs``. The arguments are pointers and strides only: no
host sync, so a 4-bit call is CUDA-graph capturable as the 16-bit one is. Zero points whose strides differ from their scales' (the kernels index both with the scales' strides) are
made contiguous with the scales for the call (never for the usual contiguous checkpoint tensors). The TMA GEMMs never
take 4-bit weights (the 16-bit ones need ``q`` None, the FP8 ones e4m3 weights: ``triton_fp8_tma._ok``).
"""

from __future__ import annotations

import os

import torch

from . import w4_layout


W4_CODES = {"mxfp4": 1, "int4": 2}  # int4 with zero points: 3
# the K step's form (kernels/quant4.py: FORM; "mma": kernels/quant4_mma.py on ops/w4_layout.py's layout, opt-in)
FORMS = {"interleave": 0, "split": 1, "dot_scaled": 2, "asm": 3, "mma": 4}
MMA = FORMS["mma"]
DEFAULT_FORM = {"cuda": "dot_scaled"}  # by device type; others: "interleave" (module docstring)
MIN_BLOCK_K = 32  # the split loop multiplies two [BM, BLOCK_K / 2] halves: a 16-bit dot needs K >= 16
MIN_MMA_ROWS = 16  # the mma form's BLOCK_N: weight rows on the dot's M side (swap-AB)


def options(cfg: dict | None = None) -> dict:
    """{"w4_fold": 0 | 1, "w4_form": a ``FORMS`` name} of one call: MOECOMP_W4_FOLD / MOECOMP_W4_FORM when set, else
    the config's keys, else off / None (the device's ``DEFAULT_FORM``)."""
    fold = os.environ.get("MOECOMP_W4_FOLD") or None
    if fold is not None and fold not in ("0", "1"):
        raise ValueError(f"MOECOMP_W4_FOLD={fold!r}: expected '0' or '1'")
    form = os.environ.get("MOECOMP_W4_FORM") or (cfg or {}).get("w4_form") or None
    if form is not None and form not in FORMS:
        raise ValueError(f"w4_form / MOECOMP_W4_FORM={form!r}: expected one of {sorted(FORMS)}")
    return {"w4_fold": int(fold) if fold is not None else int((cfg or {}).get("w4_fold") or 0), "w4_form": form}


def quant4_kwargs(quant, scale: torch.Tensor, zero: torch.Tensor | None, opts: dict) -> dict:
    """Kernel arguments of one 4-bit GEMM: ``scale`` [E, rows, groups] (the spec's dtype), ``zero`` uint8 of the
    same shape (int4 with zero points) or None."""
    if quant.scale_dtype == "ue8m0":
        scale = scale.view(torch.uint8)
    w4 = W4_CODES[quant.weight]
    if quant.weight == "int4" and quant.zero_point:
        if zero is None:
            raise ValueError("int4 experts with zero points need w13_zero and w2_zero (uint8, the scales' shape)")
        w4 = 3
        if zero.stride() != scale.stride():
            scale, zero = scale.contiguous(), zero.contiguous()
    kw = dict(ws_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), stride_sk=scale.stride(2), W4=w4,
              Q_BLOCK_K=quant.block_k, UE8M0=quant.scale_dtype == "ue8m0", W_SCALE=0, A_QUANT=0)
    if w4 == 3:
        kw["zp_ptr"] = zero
    form = FORMS[opts.get("w4_form") or "interleave"]
    if w4 != 1 and opts.get("w4_fold") and form != MMA:  # (the mma form applies int4 scales after the dot)
        kw["W4_FOLD"] = 1
    if form in (2, 3) and w4 != 1:  # dot_scaled / asm take e2m1 codes with ue8m0 scales only
        form = 0
    if form:
        kw["W4_FORM"] = form
    return kw


def device_form(form: str | None, device: torch.device) -> str:
    """The K-step form a launch on ``device`` runs: ``form``, else the device's ``DEFAULT_FORM``; "asm" (inline
    PTX) runs as "split" off CUDA (the interpreter cannot run PTX)."""
    form = form or DEFAULT_FORM.get(device.type, "interleave")
    return "split" if form == "asm" and device.type != "cuda" else form


def expert_kwargs(quant, args: dict, cfg: dict | None) -> tuple[dict, dict]:
    """(gemm1's, gemm2's) ``quant4_kwargs`` of the routed experts (w13 / w2 scales and zeros from ``args``). The
    "mma" form only where both weights take its layout (``w4_layout.fits``: H and I multiples of 8), else the
    device's default form; with it, W4_K32 where the GEMM's K is a multiple of 32 (16-byte word loads)."""
    opts = options(cfg)
    if quant.layout == "mma":  # the weights are held in the mma layout (re-laid at optimize): only this form reads it
        opts["w4_form"] = "mma"
    elif opts["w4_form"] == "mma" and not (w4_layout.fits(args["w13"]) and w4_layout.fits(args["w2"])):
        opts["w4_form"] = None
    opts["w4_form"] = device_form(opts["w4_form"], args["w13"].device)
    q1 = quant4_kwargs(quant, args["w13_scale"], args.get("w13_zero"), opts)
    q2 = quant4_kwargs(quant, args["w2_scale"], args.get("w2_zero"), opts)
    for q, w in ((q1, args["w13"]), (q2, args["w2"])):
        if q.get("W4_FORM") == MMA and (2 * w.shape[-1]) % 32 == 0:  # K % 32: 16-byte word loads (mma_loop's K32)
            q["W4_K32"] = 1
    return q1, q2


def tile(c: dict, kw: dict) -> dict:
    """``c`` with a BLOCK_K the 4-bit loop takes: at least ``MIN_BLOCK_K``; a divisor of the group when the scale is
    applied after the dot (int4 unfolded), else a divisor or a multiple of it (folded: a step covers whole groups or
    lies in one). The groups are multiples of 32, so halving a power of two reaches 32, which divides them. The
    "mma" form also takes a BLOCK_N of at least ``MIN_MMA_ROWS`` (its weight rows are the dot's M side, which
    ``tl.dot`` wants >= 16 on the GPU; a decode tile of 4 or 8 columns is widened)."""
    bk, g = max(c["BLOCK_K"], MIN_BLOCK_K), kw["Q_BLOCK_K"]
    folded = kw["W4"] == 1 or kw.get("W4_FOLD")
    while g % bk and (not folded or bk % g):
        bk //= 2
    out = c if bk == c["BLOCK_K"] else dict(c, BLOCK_K=bk)
    if kw.get("W4_FORM") == MMA and out["BLOCK_N"] < MIN_MMA_ROWS:
        out = dict(out, BLOCK_N=MIN_MMA_ROWS)
    return out


def gemm_weights(quant, args: dict, q1: dict | None, q2: dict | None) -> tuple:
    """(w13, w2) the aligned GEMMs and the decode path's DIRECT / down-combine kernels read: ``args``' tensors as held
    when ``quant.layout`` is "mma" (re-laid once at optimize, in place); for packed weights the mma layout
    (``w4_layout.relaid``: a cached copy per weight tensor) when ``q1`` / ``q2`` ask for the "mma" form, else
    ``args``' packed tensors."""
    w13, w2 = args["w13"], args["w2"]
    if quant is None or quant.layout == "mma":  # 16-bit / FP8 experts, or 4-bit ones held re-laid: as held
        return w13, w2
    if q1 is not None and q1.get("W4_FORM") == MMA:
        w13 = w4_layout.relaid(w13, quant)
    if q2 is not None and q2.get("W4_FORM") == MMA:
        w2 = w4_layout.relaid(w2, quant)
    return w13, w2


def direct_kwargs(q: dict | None, device: torch.device, gemv: bool) -> dict | None:
    """``q`` for the decode path: the DIRECT gemm1 / gemm2 and the fused down-combine take every form, the "mma" one
    included (on ``gemm_weights``' re-laid tensors); the dot-free GEMV kernels (``gemv``) have no K-step form (they
    read the weights as held, packed or in the mma layout: ``triton_quant4_gemv.w4_mma``), so for them the "mma"
    form is replaced by the device's default form (never a ``w4_layout.relaid`` copy of packed weights)."""
    if q is None or q.get("W4_FORM") != MMA or not gemv:
        return q
    q = {k: v for k, v in q.items() if k not in ("W4_FORM", "W4_K32")}
    form = FORMS[device_form(None, device)]
    if form and not (form in (2, 3) and q["W4"] != 1):
        q["W4_FORM"] = form
    return q
