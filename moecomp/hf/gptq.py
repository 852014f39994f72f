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

:func:`load_int4` builds a model from such a checkpoint (no hub, no gptqmodel / autoawq kernels): routed experts
become :class:`moecomp.formats.packed.PackedExperts` (w13 [E, 2I, H / 2] = gate rows then up rows, w2 [E, H, I / 2]);
every other int4 ``nn.Linear`` (attention, shared experts, dense MLPs, a quantized lm_head) becomes a
:class:`moecomp.formats.packed_linear.Packed4Linear` holding its codes the same way (forward: ``moecomp.linear_4bit``).
Only an MoE router's int4 weight (the op's routing reads a 16-bit router) or one of a module that is not an
``nn.Linear`` is dequantized into ``dtype`` (logged). Act-order experts (``g_idx`` not ``k // g``) are refused: a
group's inputs are then scattered along K, which moecomp's layout (groups of ``g`` consecutive inputs) cannot hold
without permuting the experts' inputs, different per expert; an act-order dense linear keeps its codes with the
columns sorted by group and gathers its input the same way (``act_order_perm``: one permutation per linear).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..core import quant as q8
from ..core.spec import QuantSpec
from ..formats.packed import PackedExperts
from ..formats.packed_linear import Packed4Linear
from .structure import iter_blocks

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: nibble i of a word holds output column 8c + AWQ_ORDER[i]
AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # the nibble holding column 8c + j: 0, 4, 1, 5, 2, 6, 3, 7
SCALE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
PROJ_SLOTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
EXPERT_RE = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(PROJ_SLOTS) + r")$")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu", "relu2": "relu2"}


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


# ------------------------------------------------------------------------------------------------ checkpoint
QSUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


class _Checkpoint:
    """The tensors of a safetensors checkpoint directory (one file, or shards with an index), read one by one."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
            files = sorted(set(where.values()))
        else:
            files, where = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")), None
        if not files:
            raise ValueError(f"{path}: no *.safetensors files")
        self._files = {f: safe_open(os.path.join(path, f), "pt", device="cpu") for f in files}
        self.where = where or {k: f for f, h in self._files.items() for k in h.keys()}

    def get(self, key: str, device) -> torch.Tensor:
        return self._files[self.where[key]].get_tensor(key).to(device)

    def group(self) -> tuple[dict, list]:
        """({linear prefix: {suffix: key}} of the int4 linears (those with a ``qweight``), [every other key])."""
        quant, plain = {}, []
        for k in self.where:
            pre, _, suffix = k.rpartition(".")
            if suffix in QSUFFIXES:
                quant.setdefault(pre, {})[suffix] = k
            else:
                plain.append(k)
        for pre in [p for p, d in quant.items() if "qweight" not in d]:
            plain += quant.pop(pre).values()
        return quant, plain


def _renamer(model: nn.Module):
    """checkpoint key -> the model's name for it: transformers' own renamings for the model's family (e.g.
    Mixtral's ``block_sparse_moe`` -> ``mlp``; its WeightConverters, which fuse experts, are not applied) and the
    base-model prefix added or dropped as the model's keys need."""
    renames = []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renames = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError):  # a transformers without conversion mappings: names as stored
        pass
    known = set(model.state_dict())
    base = getattr(model, "base_model_prefix", "") or ""

    def rename(key: str) -> str:
        for t in renames:
            key = t.rename_source_key(key)[0]
        if key not in known and base:
            if key.startswith(base + ".") and key[len(base) + 1:] in known:
                key = key[len(base) + 1:]
            elif f"{base}.{key}" in known:
                key = f"{base}.{key}"
        return key

    return rename


# ------------------------------------------------------------------------------------------------ loading
def _empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The model of ``config`` on the meta device (nothing allocated), ``quantization_config`` dropped."""
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _expert_blocks(model: nn.Module) -> dict:
    """{experts module path: BlockParts} of the model's MoE blocks (``hf.structure``, by what the blocks own)."""
    out = {}
    for name, _block, parts, _reason in iter_blocks(model):
        if parts is not None:
            out[f"{name}.{parts.experts}" if name else parts.experts] = parts
    return out


def _router_modules(model: nn.Module) -> set:
    """Paths of the MoE blocks' router modules (``hf.structure``): their weights stay 16-bit (the op's routing reads
    a 16-bit [E, H] router), so an int4 router is dequantized at load."""
    return {f"{name}.{parts.router_module}" if name else parts.router_module
            for name, _block, parts, _reason in iter_blocks(model) if parts is not None and parts.router_module}


def _check_parts(path: str, parts) -> None:
    bad = [f for f, v in (("ungated experts", not parts.gated),
                          ("experts stored [in, out]", parts.w_layout != "out_in"),
                          ("separate 3-D gate / up weights", parts.split_gate_up is not None),
                          ("expert biases", parts.b13 is not None or parts.b2 is not None),
                          ("latent projections", parts.latent_size > 0), ("not 3-D experts", parts.kind != "fused"))
           if v]
    if bad:
        raise ValueError(f"{path}: int4 experts are read for gated [out, in] experts without biases (Mixtral, "
                         f"Qwen2/3-MoE, OLMoE, DeepSeek-V3 style); this block has {', '.join(bad)}")


def _stack_experts(ckpt: _Checkpoint, fmt: Int4Format, path: str, per_expert: dict, parts, device) -> dict:
    """{w13, w13_scale, w2, w2_scale (, w13_zero, w2_zero)}: every expert's gate / up / down repacked and stacked
    in place (w13 [E, 2I, H / 2]: gate rows then up rows; w2 [E, H, I / 2])."""
    E, H, I = parts.num_experts, parts.hidden_size, parts.intermediate_size
    if sorted(per_expert) != list(range(E)):
        raise ValueError(f"{path}: the checkpoint has int4 tensors for experts {sorted(per_expert)[:8]}...; the "
                         f"model's block has E={E} experts")
    rows = {"gate": ("w13", slice(0, I), (I, H // 2)), "up": ("w13", slice(I, 2 * I), (I, H // 2)),
            "down": ("w2", slice(0, H), (H, I // 2))}
    out, zeros = {}, None
    for e in range(E):
        for slot, (kind, sl, want) in rows.items():
            name = f"{path}.{e}.{slot}"
            if slot not in per_expert[e]:
                raise ValueError(f"{name}: no int4 tensors for this projection in the checkpoint")
            w, s, z = fmt.convert({k: ckpt.get(key, device) for k, key in per_expert[e][slot].items()}, name)
            if tuple(w.shape) != want:
                raise ValueError(f"{name}: packed weight {list(w.shape)}; expected [N, K / 2] = {list(want)} for "
                                 f"H={H}, I={I}")
            zeros = z is not None if zeros is None else zeros
            if zeros != (z is not None):
                raise ValueError(f"{name}: zero points on some experts' projections and not on others")
            for suffix, t in (("", w), ("_scale", s), ("_zero", z)):
                if t is None:
                    continue
                key = kind + suffix
                if key not in out:
                    out[key] = torch.empty((E, 2 * I if kind == "w13" else H, t.shape[1]), dtype=t.dtype,
                                           device=t.device)
                if out[key].dtype != t.dtype or out[key].shape[2] != t.shape[1]:
                    raise ValueError(f"{name}: {key} {t.dtype} {list(t.shape)} unlike the other experts' "
                                     f"{out[key].dtype} {list(out[key].shape[1:])}")
                out[key][e, sl] = t
    return out


def _packed_experts(ckpt, fmt: Int4Format, path: str, per_expert: dict, parts, device, activation) -> PackedExperts:
    _check_parts(path, parts)
    t = _stack_experts(ckpt, fmt, path, per_expert, parts, device)
    quant = QuantSpec.int4(fmt.group, zero_point="w13_zero" in t, scale_dtype=SCALE_DTYPES[t["w13_scale"].dtype])
    return PackedExperts(quant, t["w13"], t["w13_scale"], t["w2"], t["w2_scale"], t.get("w13_zero"),
                         t.get("w2_zero"), gate_up="concat", activation=activation, gated=True)


def _activation(config) -> str:
    act = getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ValueError(f"config.hidden_act={act!r}: int4 experts are read for {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _replace_experts(model, ckpt, fmt: Int4Format, experts: dict, device) -> int:
    """Put a PackedExperts where each block's experts were; every block's experts must be int4 in the checkpoint."""
    blocks = _expert_blocks(model)
    for path in experts:
        if path not in blocks:
            raise ValueError(f"{path}: int4 expert tensors in the checkpoint, but no MoE block of the model has its "
                             f"experts there (blocks' experts: {sorted(blocks)[:4]})")
    for path, parts in blocks.items():
        if path not in experts:
            raise ValueError(f"{path}: the model's MoE block has no int4 experts in the checkpoint (16-bit experts "
                             f"next to int4 ones are not read)")
        packed = _packed_experts(ckpt, fmt, path, experts[path], parts, device, _activation(model.config))
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
    return len(blocks)


def _replace_linears(model, ckpt, fmt: Int4Format, linears: dict, device) -> tuple[dict, list]:
    """Put a ``Packed4Linear`` (the checkpoint's codes repacked, never dequantized) where each int4 linear's
    ``nn.Linear`` was, its bias slot kept (loaded with the other tensors). Returns ({name: tensors} of the int4
    weights left for ``_load_rest`` to dequantize: an MoE router's (16-bit for the op's routing), or a module's that
    is not an ``nn.Linear``; [checkpoint keys the model has no module for])."""
    left, unexpected = {}, []
    routers = _router_modules(model)
    for name, d in linears.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            unexpected.append(name + ".qweight")
            continue
        if type(mod) is not nn.Linear or name in routers:
            left[name] = d
            continue
        w, scale, zero, perm = fmt.convert_linear({k: ckpt.get(key, device) for k, key in d.items()}, name)
        if (w.shape[0], 2 * w.shape[1]) != (mod.out_features, mod.in_features):
            raise ValueError(f"{name}: int4 weight [{w.shape[0]}, {2 * w.shape[1]}]; the model's Linear is "
                             f"[{mod.out_features}, {mod.in_features}]")
        try:
            packed = Packed4Linear(fmt.quant(scale, zero), w, scale, zero, None, perm)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if mod.bias is not None:  # (on the meta device: the checkpoint's bias is loaded into it with the rest)
            packed.bias = nn.Parameter(mod.bias, requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, Packed4Linear) and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("the output embeddings (lm_head) are int4 in the checkpoint but config.tie_word_embeddings "
                         "ties them to the 16-bit input embeddings: a contradictory checkpoint")
    return left, unexpected


def _load_rest(model, ckpt, fmt: Int4Format, left: dict, plain: list, rename, device, dtype,
               unexpected: list) -> None:
    """Every tensor but the experts' and the Packed4Linears' codes, in the dtype of the model's tensor it replaces
    (biases included); ``left``: int4 weights of routers and of modules that are not an ``nn.Linear``, dequantized
    (logged)."""
    ref = model.state_dict()
    state = {}
    for key in plain:
        name = rename(key)
        if EXPERT_RE.match(name.rpartition(".")[0]):
            raise ValueError(f"{key}: a 16-bit tensor of a routed expert next to int4 experts is not read")
        if name not in ref:
            unexpected.append(key)
            continue
        state[name] = ckpt.get(key, device).to(ref[name].dtype)
    for name, d in left.items():
        if name + ".weight" not in ref:
            unexpected.append(name + ".qweight")
            continue
        w = fmt.dequantize({k: ckpt.get(key, device) for k, key in d.items()}, name)
        if tuple(w.shape) != tuple(ref[name + ".weight"].shape):
            raise ValueError(f"{name}: dequantized weight {list(w.shape)}; the model's is "
                             f"{list(ref[name + '.weight'].shape)}")
        state[name + ".weight"] = w.to(ref[name + ".weight"].dtype)
    if left:
        logger.warning("load_int4: %d int4 weights of MoE routers or of modules that are not an nn.Linear (e.g. %s) "
                       "dequantized to %s at load (routers run 16-bit)", len(left), next(iter(left)), dtype)
    if unexpected:
        logger.warning("load_int4: %d checkpoint tensors the model has no place for, not read (e.g. %s)",
                       len(unexpected), unexpected[0])
    model.load_state_dict(state, strict=False, assign=True)


def _finish(model, device) -> None:
    """Tie the embeddings, compute the rotary buffers (not in checkpoints), and refuse what is still unloaded."""
    model.tie_weights()
    for name, mod in model.named_modules():
        meta = [n for n, b in mod.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not meta:
            continue
        if "RotaryEmbedding" not in type(mod).__name__ or not hasattr(mod, "original_inv_freq"):
            raise ValueError(f"{name}: buffers {meta} are not in the checkpoint and not rotary frequencies")
        for n in meta:
            mod.register_buffer(n, torch.empty_like(getattr(mod, n), device=device),
                                persistent=n not in mod._non_persistent_buffers_set)
        model._init_weights(mod)  # transformers' own rotary init (what from_pretrained runs for these buffers)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the checkpoint has no tensors for {len(left)} of the model's: {left[:6]}")


def load_int4(path: str, dtype: torch.dtype = torch.bfloat16, device="cpu", *, config=None,
              quantization_config: dict | None = None) -> nn.Module:
    """A causal LM from an int4 GPTQ / AWQ ("gemm") safetensors checkpoint directory, routed experts kept 4-bit.

    The model is built from ``config.json`` on the meta device (``quantization_config`` dropped); each MoE block's
    experts module (found by structure: ``hf.structure``) becomes a :class:`PackedExperts` holding the checkpoint's
    codes (``...experts.{i}.{gate_proj,up_proj,down_proj}`` or Mixtral's ``w1 / w3 / w2``: ``qweight``, ``qzeros``,
    ``scales``, ``g_idx``) repacked, never dequantized, with the group scales in the checkpoint's dtype. Every other
    tensor is read into the dtype of the model's tensor (``dtype``, or fp32 where the model keeps it); int4
    ``nn.Linear`` modules outside the routed experts (attention, shared experts, dense MLPs) become
    :class:`Packed4Linear` (codes kept, act-order ones with an input permutation; their biases in ``dtype``); an
    int4 MoE router is dequantized (logged). ValueError for what is not read: bits other than 4, group_size -1,
    ``dynamic`` configs, AWQ other than "gemm", act-order experts, 16-bit experts, blocks whose experts are not gated
    [out, in] matrices, an int4 lm_head tied to the embeddings.

    ``config`` / ``quantization_config``: already read by the caller (``moecomp.load``'s loader convention: a
    loader is called as ``fn(directory, dtype=, device=, quantization_config=, config=)``); read from ``path``
    when not given."""
    from transformers import AutoConfig

    config = config if config is not None else AutoConfig.from_pretrained(path)
    qc = quantization_config if quantization_config is not None else getattr(config, "quantization_config", None)
    fmt = Int4Format.from_config(qc)
    model = _empty_model(config, dtype)
    ckpt = _Checkpoint(path)
    quant, plain = ckpt.group()
    rename = _renamer(model)
    experts, linears = {}, {}
    for pre, d in quant.items():
        name = rename(pre + ".weight")[: -len(".weight")]
        m = EXPERT_RE.match(name)
        if m:
            experts.setdefault(m["experts"], {}).setdefault(int(m["e"]), {})[PROJ_SLOTS[m["proj"]]] = d
        else:
            linears[name] = d
    _replace_experts(model, ckpt, fmt, experts, device)
    left, unexpected = _replace_linears(model, ckpt, fmt, linears, device)
    _load_rest(model, ckpt, fmt, left, plain, rename, device, dtype, unexpected)
    _finish(model, device)
    return model.eval()
