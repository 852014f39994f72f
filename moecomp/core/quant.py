"""Quantized weights and activations in plain PyTorch: the oracle of ``MoESpec.quant`` (``moecomp.core.spec.QuantSpec``).

    dequantize(q, scale)      w = q * s_w             s_w per [block_n, block_k] block, per row, or per matrix
    quantize(w)               (q, s_w) from a float weight (tests, benchmarks, checkpoint writers)
    quantize_act(x)           (x_q e4m3, s_a): s_a = max|x| / 448 per token and group of 128 columns ("dynamic"),
                              or per token over the whole row (``act_group`` 0), or the given static scale; x_q = e4m3(clamp(x * (1 / s_a), +-448))
    fake_quant_act(x)         x_q * s_a in fp32: what a w8a8 GEMM multiplies

4-bit weights (weight-only, "group" scales: one per row and ``block_k`` input columns; docs/QUANT4.md):

    packed [..., rows, cols / 2] uint8     code of column 2j in the low nibble of byte j, column 2j + 1 in the high
    mxfp4:  w = E2M1[code] * 2 ** (scale_byte - 127)        E2M1 = 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives
    int4:   w = (code - zero) * scale                       zero: w13_zero / w2_zero (zero_point), else 8
    quantize_4bit(w)          (packed, scale, zero or None) from a float weight (tests, benchmarks, checkpoint writers)

The kernels (``kernels/fp8.py``) compute the same numbers: the same scale (an IEEE division by 448, then a
reciprocal), the same product x * (1 / s), the same round-to-nearest-even cast. Weights are [..., rows, cols]
(a leading expert dim or none); a gated w13 [E, 2I, H] holds gate and up blocks apart (``halves=2``: rows
``[0, I)`` use scale rows ``[0, ceil(I / block_n))``, rows ``[I, 2I)`` the next ``ceil(I / block_n)``).
"""

from __future__ import annotations

import dataclasses

import torch

from . import policy
from .spec import FP8_MAX, QuantSpec

FP8 = torch.float8_e4m3fn
E8M0 = getattr(torch, "float8_e8m0fnu", None)
ACT_EPS = 1e-10  # the smallest activation amax a dynamic scale is taken from (an all-zero group)


_SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# e2m1 values by code (bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
INT4_ZERO = 8  # the zero of symmetric int4 (GPTQ's sym=True stores codes with zero 8)


def scale_dtype(quant: QuantSpec) -> torch.dtype:
    if quant.scale_dtype == "ue8m0":
        if E8M0 is None:
            raise ValueError("quant.scale_dtype='ue8m0' needs torch.float8_e8m0fnu (torch >= 2.7)")
        return E8M0
    return _SCALE_DTYPES[quant.scale_dtype]


def scales_float(scale: torch.Tensor) -> torch.Tensor:
    """Weight scales as fp32 (ue8m0 bytes decoded: 2 ** (e - 127))."""
    return scale.float()


def _row_blocks(rows: int, quant: QuantSpec, halves: int, device) -> torch.Tensor:
    """[rows] -> the scale row each weight row reads."""
    per = rows // halves
    nb = -(-per // quant.block_n)
    r = torch.arange(rows, device=device)
    return (r // per) * nb + (r % per) // quant.block_n


def expand_scales(scale: torch.Tensor, rows: int, cols: int, quant: QuantSpec, halves: int = 1) -> torch.Tensor:
    """The scale of every weight element, [..., rows, cols] fp32 (broadcastable for "channel" / "tensor")."""
    s = scales_float(scale)
    if quant.scale == "tensor":
        return s[..., None, None]
    if quant.scale == "channel":
        return s[..., :, None]
    if quant.scale == "group":
        return s[..., torch.arange(cols, device=s.device) // quant.block_k]
    rb = _row_blocks(rows, quant, halves, s.device)
    cb = torch.arange(cols, device=s.device) // quant.block_k
    return s[..., rb, :][..., :, cb]


def dequantize(q: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, halves: int = 1,
               zero: torch.Tensor | None = None) -> torch.Tensor:
    """[..., rows, cols] fp8 (or [..., rows, cols / 2] packed 4-bit) + scales (+ int4 zeros) -> fp32 weights
    [..., rows, cols]: exact (each weight a code times a power of two, or a small integer times the stored scale).
    Packed 4-bit codes only: the "mma" layout (``QuantSpec.layout``) is a ValueError (read it back first:
    ``ops/w4_layout.restore``; the oracle has its own decode)."""
    if quant.packed and quant.layout != "packed":
        raise ValueError(f"quant.layout={quant.layout!r}: dequantize reads packed 4-bit codes; restore the mma bytes "
                         f"to the packed layout first (moecomp.ops.w4_layout.restore)")
    if quant.packed:
        return _dequantize_4bit(q, scale, quant, zero)
    rows, cols = q.shape[-2:]
    w = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q)  # (contiguous: viewed as blocks below)
    blocks = _scale_blocks(w, scale, quant, halves)
    if blocks is not None:  # (the same products, without an fp32 copy of the scales at the weight's size)
        blocks[0].mul_(blocks[1])
        return w
    return w.mul_(expand_scales(scale, rows, cols, quant, halves))


def _scale_blocks(w: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, halves: int):
    """(a view of ``w`` [..., rows, cols] as its scale blocks, the scales viewed to broadcast over it) when the
    blocks tile ``w`` exactly, else None: "channel" / "tensor" / "group" scales always, "block" scales when each half
    of the rows is a whole number of ``block_n`` blocks and the columns of ``block_k`` ones."""
    rows, cols = w.shape[-2:]
    s = scales_float(scale)
    lead = w.shape[:-2]
    if quant.scale == "tensor":
        return w, s[..., None, None]
    if quant.scale == "channel":
        return w, s[..., :, None]
    if cols % quant.block_k:
        return None
    kb = cols // quant.block_k
    if quant.scale == "group":
        return w.view(*lead, rows, kb, quant.block_k), s[..., None]
    if rows % halves or (rows // halves) % quant.block_n:
        return None
    nb = rows // quant.block_n
    return w.view(*lead, nb, quant.block_n, kb, quant.block_k), s.view(*lead, nb, 1, kb, 1)


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] uint8 codes (low nibble first)."""
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes 0..15 -> [..., n] uint8, column 2j in the low nibble of byte j."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


# rows of 4-bit codes unpacked at a time: the codes (one byte each) and int32 indices (mxfp4's table lookup) of
# 1/64 of ``policy.WORKING_MEMORY_BYTES`` in weights exist at once beside the fp32 result (1 GiB: 16M weights, 80 MB
# of temporaries; a gpt-oss-120b expert's w13 in two steps), at least DEQUANT_CHUNK_MIN_WEIGHTS
DEQUANT_CHUNK_MIN_WEIGHTS = 1 << 16


def _dequant_chunk() -> int:
    return max(DEQUANT_CHUNK_MIN_WEIGHTS, policy.working_bytes() // 64)


def _dequantize_4bit(packed, scale, quant: QuantSpec, zero) -> torch.Tensor:
    """Working memory: the fp32 result, plus the codes and indices of a chunk of weights at a time (above);
    the scales (and zeros) broadcast over their groups, never expanded to the weight's size."""
    *lead, rows, half = packed.shape
    cols = 2 * half
    v = torch.empty(*lead, rows, cols, dtype=torch.float32, device=packed.device)
    flat_p, flat_v = packed.reshape(-1, half), v.view(-1, cols)
    table = torch.tensor(E2M1, device=packed.device) if quant.weight == "mxfp4" else None
    step = max(1, _dequant_chunk() // max(1, cols))
    for r0 in range(0, flat_p.shape[0], step):
        codes = unpack_4bit(flat_p[r0:r0 + step])  # [n, cols] uint8
        if table is None:
            flat_v[r0:r0 + step] = codes
        else:  # (written in place: no fp32 temporary)
            torch.index_select(table, 0, codes.view(-1).int(), out=flat_v[r0:r0 + step].view(-1))
    blocks = _scale_blocks(v, scale, quant, 1)
    if blocks is None:  # (columns not a whole number of groups)
        if table is None:
            v.sub_(INT4_ZERO if zero is None else expand_scales(zero, rows, cols, quant))  # zeros: scales' layout
        return v.mul_(expand_scales(scale, rows, cols, quant))
    vb, s = blocks
    if table is None:
        vb.sub_(INT4_ZERO if zero is None else zero.float()[..., None])
    vb.mul_(s)
    return v


def quantize_4bit(w: torch.Tensor, quant: QuantSpec):
    """A float weight [..., rows, cols] (cols even) -> (packed uint8 [..., rows, cols / 2], scale [..., rows, groups]
    in the spec's dtype, zero uint8 [..., rows, groups] or None). mxfp4: each group's scale the power of two
    2 ** ceil(log2(amax / 6)) (nothing saturates), codes the nearest e2m1 value (ties to the smaller magnitude).
    int4: symmetric s = amax / 7, code = round(w / s) + 8; with zero points s = (max - min) / 15, zero =
    round(-min / s), code = round(w / s) + zero; codes clamped to 0..15, taken with the stored (rounded) scale."""
    rows, cols = w.shape[-2:]
    g = quant.block_k
    G = -(-cols // g)
    wf = torch.nn.functional.pad(w.float(), (0, G * g - cols)).reshape(*w.shape[:-1], G, g)  # [..., rows, G, g]
    zero = None
    if quant.weight == "mxfp4":
        amax = wf.abs().amax(-1).clamp(min=2.0 ** -126)
        e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        s = torch.exp2(e)
        mag = torch.tensor(E2M1[:8], device=w.device)
        v = wf / s[..., None]
        code = (v.abs()[..., None] - mag).abs().argmin(-1) + 8 * (v < 0)
        scale = s.to(scale_dtype(quant))
    else:
        if quant.zero_point:
            lo, hi = wf.amin(-1).clamp(max=0), wf.amax(-1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype(quant))
            z = torch.round(-lo / scale.float()).clamp(0, 15)
            zero = z.to(torch.uint8)
        else:
            scale = (wf.abs().amax(-1) / 7).clamp(min=1e-8).to(scale_dtype(quant))
            z = torch.full_like(scale, INT4_ZERO, dtype=torch.float32)
        code = torch.round(wf / scale.float()[..., None] + z[..., None]).clamp(0, 15)
    code = code.reshape(*w.shape[:-1], G * g)[..., :cols]
    return pack_4bit(code), scale, zero


QUANTIZE_CHUNK_BYTES = 1 << 30  # fp32 working set of one ``quantize`` step over stacked experts


def quantize(w: torch.Tensor, quant: QuantSpec, halves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., rows, cols] -> (q e4m3, scale in the spec's layout and dtype): each block (row, matrix)
    scaled so its largest magnitude maps to 448 (ue8m0: rounded up to a power of two, so nothing saturates).
    Stacked experts [E, rows, cols] go a few matrices at a time (``QUANTIZE_CHUNK_BYTES`` of fp32 working set): a
    DeepSeek-V3 layer's w13 would otherwise take 30 GB of fp32 temporaries at once. 4-bit formats: ``quantize_4bit``
    (a symmetric spec's (packed, scale) here too)."""
    if quant.packed:
        if quant.zero_point:
            raise ValueError("quant.zero_point: use quantize_4bit, which returns the zeros too")
        return quantize_4bit(w, quant)[:2]
    per = w[0].numel() * 4 if w.dim() > 2 else 0
    if per and w.numel() * 4 > QUANTIZE_CHUNK_BYTES:
        n = max(1, QUANTIZE_CHUNK_BYTES // per)
        parts = [_quantize(w[i:i + n], quant, halves) for i in range(0, w.shape[0], n)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return _quantize(w, quant, halves)


def _quantize(w: torch.Tensor, quant: QuantSpec, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape[-2:]
    w = w.float()
    lead = w.shape[:-2]
    if quant.scale == "tensor":
        amax = w.abs().amax(dim=(-2, -1))
    elif quant.scale == "channel":
        amax = w.abs().amax(dim=-1)
    else:
        nb = -(-(rows // halves) // quant.block_n)
        kb = -(-cols // quant.block_k)
        rb = _row_blocks(rows, quant, halves, w.device)
        cb = torch.arange(cols, device=w.device) // quant.block_k
        flat = (rb[:, None] * kb + cb[None, :]).expand(rows, cols).reshape(-1)
        amax = torch.zeros(*lead, halves * nb * kb, device=w.device)
        amax = amax.scatter_reduce(-1, flat.expand(*lead, -1), w.abs().reshape(*lead, -1), "amax")
        amax = amax.reshape(*lead, halves * nb, kb)
    s = amax.clamp(min=1e-12) / FP8_MAX
    if quant.scale_dtype == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    s = s.to(scale_dtype(quant))
    q = (w / expand_scales(s, rows, cols, quant, halves)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def act_group(K: int, quant: QuantSpec) -> int:
    """Columns per dynamic activation scale for rows of K: ``act_group``, or K when it is 0 (per token)."""
    return quant.act_group or max(K, 1)


def act_scales(x: torch.Tensor, quant: QuantSpec) -> torch.Tensor:
    """Dynamic scales of x [T, K]: [T, ceil(K / act_group)] fp32, max|x| / 448 per token and group ([T, 1] per
    token: ``act_group`` 0)."""
    T, K = x.shape
    g = act_group(K, quant)
    G = -(-K // g)
    xf = torch.nn.functional.pad(x.float().abs(), (0, G * g - K)).view(T, G, g)
    amax = xf.amax(-1).clamp(min=ACT_EPS)
    # an IEEE division, as the kernels do (on CUDA, dividing by a Python scalar multiplies by its fp32 reciprocal)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_act(x: torch.Tensor, quant: QuantSpec, static_scale: torch.Tensor | None = None):
    """x [T, K] -> (x_q e4m3 [T, K], s_a): s_a [T, G] ("dynamic") or the static scale (0-d / [1])."""
    T, K = x.shape
    if quant.activation == "static":
        s = static_scale.float().reshape(())
        inv = torch.ones((), device=x.device) / s
        return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8), s
    s = act_scales(x, quant)  # [T, G]
    inv = torch.ones((), device=x.device) / s
    cols = torch.arange(K, device=x.device) // act_group(K, quant)
    return (x.float() * inv[:, cols]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fake_quant_act(x: torch.Tensor, quant: QuantSpec, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> fp32 x_q * s_a (x itself, in fp32, for activation "none")."""
    if quant.activation == "none":
        return x.float()
    q, s = quantize_act(x, quant, static_scale)
    if quant.activation == "static":
        return q.float() * s
    cols = torch.arange(x.shape[1], device=x.device) // act_group(x.shape[1], quant)
    return q.float() * s[:, cols]


def weight_only(quant: QuantSpec | None) -> QuantSpec | None:
    """The spec's quantization with 16-bit activations (what the op's weight-only kernels compute)."""
    if quant is None:
        return None
    return dataclasses.replace(quant, activation="none", act_group=quant.act_group or 128)  # (act_group 0: dynamic only)
