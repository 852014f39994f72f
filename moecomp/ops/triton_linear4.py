"""``torch.ops.moecomp.linear_4bit``'s Triton path (``kernels/linear4.py``): y = x @ w.T (+ bias), w 4-bit.

    linear_4bit(x, q, scale, zero, bias, quant)   x [..., K] -> [..., N] in x's dtype
        M <= 4 rows where ``skinny.use_skinny`` takes a quantized weight (one and two rows always, four up to 8M
        weight elements: the FP8 sweep's rule; 4-bit reads half the bytes, not measured apart) -> skinny4_kernel
        else                                                                                   -> linear4_kernel

``linear4_config`` picks the MMA form's tiles: BLOCK_M 16 up to 16 rows with BLOCK_N for about two programs per SM
(weight-bound, as ``tuning.fp8_linear_config``), 32 / 64 rows up to 64, then the 4-bit grouped GEMMs' large-row
tiles (``tuning._quant4_heuristic``: 128 x 64 for int4, 128 x 128 for mxfp4, 8 warps; they compiled without spills
for sm90). BLOCK_K: ``triton_quant4.tile`` (a divisor of the int4 group, since the scale multiplies the step's
product). The skinny form's tiles: ``skinny.skinny_config`` at the e4m3 column counts (a 4-bit tile of as many
columns holds half the bytes and decodes to the same fp32 registers), BLOCK_K then a divisor or a multiple of the
group. The arguments are pointers and strides only (no host sync: CUDA-graph capturable).
"""

from __future__ import annotations

import os

import torch
import triton

from ..kernels import linear4 as lin4_k
from . import skinny
from .common import on_device as _on_device, dot_precision as _precision, sm_count as _sm_count, upcast_bf16 as _upcast
from .triton_quant4 import FORMS, W4_CODES, device_form, options, tile

MAX_SKINNY_ROWS = skinny.MAX_ROWS


def linear4_config(M: int, N: int, K: int, device, sms: int, weight: str) -> dict:
    """Tiles of the MMA form (module docstring); ``weight`` "mxfp4" or "int4"."""
    if device.type != "cuda":  # the interpreter: small tiles
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
    if M <= 16:
        bn = 64 if -(-N // 64) >= 2 * sms else 32
        return dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=32 if M <= 32 else 64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=64 if weight == "int4" else 128, BLOCK_K=64, GROUP_M=8, num_warps=8,
                num_stages=3)


def _w4(q, zero) -> int:
    return 3 if q.weight == "int4" and zero is not None else W4_CODES[q.weight]


def _group_step(bk: int, g: int) -> int:
    """The largest power-of-two step <= bk that divides group g or is a multiple of it (groups: multiples of 32)."""
    while g % bk and bk % g:
        bk //= 2
    return bk


def uses_skinny(M: int, N: int, K: int) -> bool:
    return M <= MAX_SKINNY_ROWS and skinny.use_skinny(M, N, K, True) and os.environ.get("MOECOMP_SKINNY", "1") != "0"


def linear_4bit(x, q, scale, zero, bias, quant, cfg: dict | None = None):
    """x [..., K] x 4-bit q [N, K / 2] -> [..., N] in x's dtype (arguments checked by the op). ``cfg``: explicit
    tiles (a benchmark's sweep or a test; its "skinny" key 1 / 0 forces the form, "w4_fold" / "w4_form" the MMA
    form's options as for the experts: ``triton_quant4.options``), else the rules above."""
    N, K = q.shape[0], 2 * q.shape[1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = x.new_empty(M, N)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    if q.stride(-1) != 1:
        q = q.contiguous()
    ue8m0 = quant.scale_dtype == "ue8m0"
    ws = scale.view(torch.uint8) if ue8m0 else scale
    w4 = _w4(quant, zero)
    if w4 == 3 and zero.stride() != ws.stride():  # the kernels index the zeros with the scales' strides
        ws, zero = ws.contiguous(), zero.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    zp = zero if w4 == 3 else None
    sms = _sm_count(x.device)
    use_sk = uses_skinny(M, N, K) if cfg is None or "skinny" not in cfg else bool(cfg["skinny"]) and M <= MAX_SKINNY_ROWS
    g = quant.block_k
    if use_sk:
        c = dict(cfg) if cfg is not None else skinny.skinny_config(M, N, K, 1, x.device, sms)
        bk = _group_step(max(c["BLOCK_K"], 32), g)

        def launch():
            lin4_k.skinny4_kernel[(triton.cdiv(N, c["BLOCK_N"]),)](
                x2, q, ws, zp, bias, y, N, K, x2.stride(0), q.stride(0), ws.stride(0), ws.stride(1), y.stride(0),
                ROWS=M, HAS_BIAS=bias is not None, W4=w4, Q_BLOCK_K=g, UE8M0=ue8m0, BLOCK_N=c["BLOCK_N"],
                BLOCK_K=bk, REDUCE_END=c["REDUCE_END"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    else:
        c = dict(cfg) if cfg is not None else linear4_config(M, N, K, x.device, sms, quant.weight)
        opts = options(c)  # MOECOMP_W4_FOLD / MOECOMP_W4_FORM, else the config's keys (triton_quant4)
        fold, form = int(opts["w4_fold"]) if w4 != 1 else 0, FORMS[device_form(_form(opts), x.device)]
        if form in (2, 3) and w4 != 1:  # dot_scaled / asm: e2m1 codes with ue8m0 scales only
            form = 0
        c = tile(c, {"W4": w4, "Q_BLOCK_K": g, "W4_FOLD": fold})
        grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)

        def launch():
            lin4_k.linear4_kernel[grid](
                x2, q, ws, zp, bias, y, M, N, K, x2.stride(0), q.stride(0), ws.stride(0), ws.stride(1), y.stride(0),
                HAS_BIAS=bias is not None, W4=w4, Q_BLOCK_K=g, UE8M0=ue8m0, UPCAST=_upcast(x2),
                DOT_PRECISION=_precision(x2), BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                GROUP_M=c["GROUP_M"], FOLD=fold, FORM=form,
                num_warps=c["num_warps"], num_stages=c["num_stages"])
    if x.is_cuda:
        _on_device(x, launch)
    else:
        launch()
    return y.reshape(*x.shape[:-1], N)


def _form(opts: dict) -> str | None:
    """The asked K-step form; "mma" (the routed experts' aligned GEMMs only) takes the device's default."""
    return None if opts["w4_form"] == "mma" else opts["w4_form"]
