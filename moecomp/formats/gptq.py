"""int4 group-wise weight-only checkpoints (GPTQ, AWQ "gemm") loaded with their routed experts kept 4-bit.

Checkpoint layouts (docs/QUANT4.md, "int4 checkpoints", with sources), for one Linear of weight W [N, K]
(N outputs, K inputs, g the group size, G = ceil(K / g)); every int32 holds eight 4-bit codes, bits 4i..4i+3
the i-th (lowest first):

    GPTQ  qweight int32 [K / 8, N]   word (r, n): codes of inputs k = 8r + i of output n        (packed along K)
          qzeros  int32 [G, N / 8]   word (j, c): zeros of outputs n = 8c + i of group j          (packed along N)
          scales  fp16  [G, N]       g_idx int32 [K] (the group of input k; k // g unless act-order)
          W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n];  format "gptq" (v1) stores z - 1, "gptq_v2" z
    AWQ   qweight int32 [K, N / 8]   word (k, c): codes of outputs n = 8c + AWQ_ORDER[i] of input k (packed along N)
          qzeros  int32 [G, N / 8]   the same order;  scales fp16 [G, N];  W[n, k] = (q[k, n] - z[k // g, n]) * s

moecomp's int4 layout (``moecomp.core.quant``): w [N, K / 2] uint8, the code of input 2j in the low nibble of byte j,
scale [N, G] (the checkpoint's dtype), zero [N, G] uint8 (or None: symmetric, zero 8). :func:`gptq_to_packed` /
:func:`awq_to_packed` repack one Linear into it: the codes stay 4-bit codes (quantized weights stay quantized;
nothing is dequantized), so ``moecomp.core.quant.dequantize`` of the result is the checkpoint's W exactly. GPTQ's
qweight needs no nibble shuffling at all: on a little-endian machine its bytes, read per output column, are
already moecomp's bytes (a transpose of [K / 8, N, 4] bytes).

The loader (:func:`moecomp.api.load_gptq.load_int4`) sits at the API layer: it finds the MoE blocks by
structure (``recognise/structure.py``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..core import quant as q8
from ..core.spec import QuantSpec

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: nibble i of a word holds output column 8c + AWQ_ORDER[i]
AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # the nibble holding column 8c + j: 0, 4, 1, 5, 2, 6, 3, 7
SCALE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


# ------------------------------------------------------------------------------------------------ converters
def _check(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, what: str) -> None:
    """ValueError naming ``name`` unless ``t`` has ``shape`` (None: any size) and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {what}, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}; expected {want} ({what})")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))} ({what})")


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8n]: nibble i of word w at position 8w + i (lowest bits first)."""
    if sys.byteorder != "little":
        raise ValueError("int4 checkpoints are read through a byte view of their int32 words: little-endian only")
    return q8.unpack_4bit(words.contiguous().view(torch.uint8))  # byte b holds nibbles 2b (low) and 2b + 1


def _group_of(K: int, G: int, group: int | None, name: str) -> int:
    g = group if group is not None else (K // G if G and K % G == 0 else None)
    if g is None or g <= 0 or -(-K // g) != G:
        raise ValueError(f"{name} has {G} group rows, which no group size {group if group else ''} gives for K={K} "
                         f"inputs (expected ceil(K / group) rows; pass group= when K is not a multiple of it)")
    return g


def _scales_zeros(qzeros, scales, G: int, N: int, order, offset: int):
    """(scale [N, G], zero [N, G] uint8) from the checkpoint's [G, N] scales and [G, N / 8] packed zeros."""
    _check("qzeros", qzeros, (G, N // 8), (torch.int32,), f"[G, N / 8] packed zeros, G={G}, N={N}")
    z = _nibbles(qzeros)
    if order is not None:
        z = z.reshape(G, N // 8, 8)[..., list(order)].reshape(G, N)
    z = z + offset  # GPTQ v1 stores zero - 1 (a stored 15 reads 16, as GPTQ's own kernels read it)
    return scales.t().contiguous(), z.t().contiguous()


def _check_g_idx(g_idx, K: int, g: int) -> None:
    if g_idx is None:
        return
    _check("g_idx", g_idx, (K,), (torch.int32, torch.int64), f"the group of each of the K={K} inputs")
    trivial = torch.arange(K, device=g_idx.device) // g
    if not torch.equal(g_idx.long(), trivial):
        raise ValueError(f"g_idx is not k // {g} (an act-order / desc_act checkpoint): each group's inputs are "
                         f"scattered along K, and moecomp's int4 layout holds groups of {g} consecutive inputs; "
                         f"act-order experts are not read (dequantize them, or use a desc_act=False checkpoint)")


def gptq_to_packed(qweight, qzeros, scales, g_idx=None, *, sym: bool, v1_offset: bool, group: int | None = None):
    """One GPTQ Linear -> (w [N, K / 2] uint8, scale [N, G] in ``scales``' dtype, zero [N, G] uint8 or None).

    A repack, not a dequantization: the 4-bit codes are moved, never turned into floats. ``v1_offset``: the
    checkpoint is GPTQ v1 (``checkpoint_format`` "gptq"), whose zeros are stored minus one. ``sym``: the config
    says symmetric; the zeros must then all be 8 (ValueError otherwise) and None is returned for them. ``group``:
    the group size, needed only when K is not a multiple of it (else K / G). ``g_idx`` other than ``k // group``
    (act-order) is refused with a ValueError (module docstring)."""
    _check("qweight", qweight, (None, None), (torch.int32,), "GPTQ [K / 8, N]: eight 4-bit codes along K a word")
    K, N = 8 * qweight.shape[0], qweight.shape[1]
    _check("scales", scales, (None, N), tuple(SCALE_DTYPES), f"GPTQ [G, N] group scales, N={N}")
    if N % 8:
        raise ValueError(f"qweight has N={N} outputs; GPTQ packs the zeros eight outputs a word (N % 8 == 0)")
    G = scales.shape[0]
    g = _group_of(K, G, group, "scales")
    scale, zero = _scales_zeros(qzeros, scales, G, N, None, 1 if v1_offset else 0)
    _check_g_idx(g_idx, K, g)
    w = qweight.contiguous().view(torch.uint8).reshape(K // 8, N, 4).permute(1, 0, 2).reshape(N, K // 2)
    if sym:
        if not bool((zero == q8.INT4_ZERO).all()):
            bad = sorted(set(zero.unique().tolist()) - {q8.INT4_ZERO})[:4]
            raise ValueError(f"qzeros: sym=True but zero points other than {q8.INT4_ZERO} are stored ({bad} "
                             f"{'after' if v1_offset else 'without'} the v1 offset): a wrong checkpoint_format?")
        zero = None
    return w.contiguous(), scale, zero


def awq_to_packed(qweight, qzeros, scales, *, group: int | None = None):
    """One AWQ "gemm" Linear -> (w [N, K / 2] uint8, scale [N, G] in ``scales``' dtype, zero [N, G] uint8): the
    codes un-interleaved (``AWQ_ORDER``) and repacked along K, still 4-bit (nothing dequantized)."""
    _check("qweight", qweight, (None, None), (torch.int32,), "AWQ [K, N / 8]: eight 4-bit codes along N a word")
    K, N = qweight.shape[0], 8 * qweight.shape[1]
    _check("scales", scales, (None, N), tuple(SCALE_DTYPES), f"AWQ [G, N] group scales, N={N}")
    if K % 2:
        raise ValueError(f"qweight has K={K} inputs; moecomp packs two inputs a byte (K must be even)")
    G = scales.shape[0]
    _group_of(K, G, group, "scales")
    codes = _nibbles(qweight).reshape(K, N // 8, 8)[..., list(AWQ_UNDO)].reshape(K, N)  # [K, N]
    scale, zero = _scales_zeros(qzeros, scales, G, N, AWQ_UNDO, 0)
    return q8.pack_4bit(codes.t()).contiguous(), scale, zero


def dequantize_gptq(qweight, qzeros, scales, g_idx=None, *, v1_offset: bool, group: int | None = None):
    """fp32 W [N, K] of one GPTQ Linear, act-order ``g_idx`` included (a reference for tests and tools)."""
    w, scale, zero = gptq_to_packed(qweight, qzeros, scales, None, sym=False, v1_offset=v1_offset, group=group)
    K = 2 * w.shape[1]
    g = _group_of(K, scales.shape[0], group, "scales")
    if g_idx is None:
        gi = torch.arange(K, device=w.device) // g
    else:
        _check("g_idx", g_idx, (K,), (torch.int32, torch.int64), f"the group of each of the K={K} inputs")
        gi = g_idx.long()
    return (q8.unpack_4bit(w).float() - zero[:, gi].float()) * scale[:, gi].float()


def act_order_perm(g_idx, K: int, g: int) -> torch.Tensor | None:
    """None for ``g_idx`` None or ``k // g``; else (act-order) ``perm`` [K] int64, the inputs sorted by group (stable),
    such that ``g_idx[perm]`` is ``k // g``: the columns ``perm`` taken in order form groups of g consecutive columns,
    moecomp's layout. ValueError when no such order exists (a group with other than g inputs)."""
    if g_idx is None:
        return None
    _check("g_idx", g_idx, (K,), (torch.int32, torch.int64), f"the group of each of the K={K} inputs")
    trivial = torch.arange(K, device=g_idx.device) // g
    gi = g_idx.long()
    if torch.equal(gi, trivial):
        return None
    perm = torch.sort(gi, stable=True).indices
    if not torch.equal(gi[perm], trivial):
        raise ValueError(f"g_idx: the groups do not each hold {g} inputs (sorted by group, g_idx is not k // {g}): "
                         f"no order of the inputs gives moecomp's groups of consecutive inputs")
    return perm


def gptq_linear_to_packed(qweight, qzeros, scales, g_idx=None, *, sym: bool, v1_offset: bool,
                          group: int | None = None):
    """One GPTQ Linear that is not a routed expert -> (w [N, K / 2] uint8, scale, zero or None, perm [K] or None):
    ``gptq_to_packed``, and for act-order (``g_idx`` not ``k // g``) the codes' columns reordered by ``perm``
    (``act_order_perm``) so that each group is g consecutive columns; the module then gathers ``x[..., perm]``
    (``Packed4Linear``). Still a repack: codes stay 4-bit codes."""
    w, scale, zero = gptq_to_packed(qweight, qzeros, scales, None, sym=sym, v1_offset=v1_offset, group=group)
    K = 2 * w.shape[1]
    perm = act_order_perm(g_idx, K, _group_of(K, scales.shape[0], group, "scales"))
    if perm is not None:
        w = q8.pack_4bit(q8.unpack_4bit(w)[:, perm]).contiguous()
    return w, scale, zero, perm


# ------------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's ``quantization_config`` says about its int4 tensors."""

    method: str  # "gptq" | "awq"
    group: int
    sym: bool = False  # GPTQ: zeros all 8 (returned as None)
    v1_offset: bool = False  # GPTQ v1: zeros stored minus one

    @staticmethod
    def from_config(qc) -> "Int4Format":
        """From a ``quantization_config`` dict (or transformers' config object); ValueError on what is not read."""
        if qc is not None and not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        if not qc:
            raise ValueError("the checkpoint's config.json has no quantization_config: not an int4 checkpoint")
        method = str(qc.get("quant_method", "")).lower()
        if method not in ("gptq", "awq"):
            raise ValueError(f"quantization_config.quant_method={method!r}: load_int4 reads 'gptq' and 'awq'")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config.bits={bits!r}: only 4-bit checkpoints are read")
        group = qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(group, int) or group <= 0:
            raise ValueError(f"quantization_config.group_size={group!r}: a positive group size is needed (-1, one "
                             f"scale per output row over all inputs, is not read)")
        if qc.get("dynamic"):
            raise ValueError("quantization_config.dynamic (per-module bits / group sizes) is not read")
        if method == "awq":
            version = str(qc.get("version") or qc.get("format") or "gemm").lower()
            if version != "gemm":
                raise ValueError(f"quantization_config.version={version!r}: only AWQ's 'gemm' packing is read")
            return Int4Format("awq", group)
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r}: 'gptq' (v1) and 'gptq_v2' are read")
        return Int4Format("gptq", group, sym=bool(qc.get("sym", True)), v1_offset=fmt == "gptq")

    def convert(self, t: dict, name: str):
        """(w, scale, zero) of one Linear from its checkpoint tensors ``t`` (qweight / qzeros / scales / g_idx)."""
        try:
            if self.method == "awq":
                return awq_to_packed(t["qweight"], t["qzeros"], t["scales"], group=self.group)
            return gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), sym=self.sym,
                                  v1_offset=self.v1_offset, group=self.group)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def convert_linear(self, t: dict, name: str):
        """(w, scale, zero, perm) of one Linear outside the routed experts (act-order read: ``perm``)."""
        try:
            if self.method == "awq":
                return (*awq_to_packed(t["qweight"], t["qzeros"], t["scales"], group=self.group), None)
            return gptq_linear_to_packed(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), sym=self.sym,
                                         v1_offset=self.v1_offset, group=self.group)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def quant(self, scale: torch.Tensor, zero) -> QuantSpec:
        return QuantSpec.int4(self.group, zero_point=zero is not None, scale_dtype=SCALE_DTYPES[scale.dtype])

    def dequantize(self, t: dict, name: str) -> torch.Tensor:
        """fp32 W [N, K] of one Linear (any g_idx)."""
        w, scale, zero, perm = self.convert_linear(t, name)
        wf = q8.dequantize(w, scale, self.quant(scale, zero), zero=zero)
        if perm is None:
            return wf
        out = torch.empty_like(wf)
        out[:, perm] = wf
        return out
