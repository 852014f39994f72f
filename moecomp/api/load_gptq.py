"""int4 GPTQ / AWQ ("gemm") checkpoints loaded with their routed experts kept 4-bit (``moecomp.load`` picks it by
``quantization_config.quant_method``; the checkpoint layouts and their conversion: ``formats/gptq.py``).

:func:`load_int4` builds a model from such a checkpoint (no hub, no gptqmodel / autoawq kernels): routed experts
become :class:`moecomp.formats.packed.PackedExperts` (w13 [E, 2I, H / 2] = gate rows then up rows, w2 [E, H, I / 2]);
every other int4 ``nn.Linear`` (attention, shared experts, dense MLPs, a quantized lm_head) becomes a
:class:`moecomp.formats.packed_linear.Packed4Linear` holding its codes the same way (forward: ``moecomp.linear_4bit``).
Only an MoE router's int4 weight (the op's routing reads a 16-bit router) or one of a module that is not an
``nn.Linear`` is dequantized into ``dtype`` (logged). Act-order experts (``g_idx`` not ``k // g``) are refused: a
group's inputs are then scattered along K, which moecomp's layout (groups of ``g`` consecutive inputs) cannot hold
without permuting the experts' inputs, different per expert; an act-order dense linear keeps its codes with the
columns sorted by group and gathers its input the same way (``act_order_perm``: one permutation per linear).
It sits at the API layer, not in ``formats/``: it finds the MoE blocks by structure (``recognise.structure.iter_blocks``).
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from torch import nn

from ..core.spec import QuantSpec
from ..formats.gptq import SCALE_DTYPES, Int4Format
from ..formats.packed import PackedExperts
from ..formats.packed_linear import Packed4Linear
from ..recognise.structure import iter_blocks

logger = logging.getLogger(__name__)

PROJ_SLOTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
EXPERT_RE = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(PROJ_SLOTS) + r")$")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu", "relu2": "relu2"}


# ------------------------------------------------------------------------------------------------ checkpoint
QSUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


class Checkpoint:
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

    def group(self, suffixes: tuple = QSUFFIXES, mains: tuple = ("qweight",)) -> tuple[dict, list]:
        """({linear prefix: {suffix: key}} of the quantized linears (those with one of ``mains``; by default GPTQ /
        AWQ's ``qweight``), [every other key])."""
        quant, plain = {}, []
        for k in self.where:
            pre, _, suffix = k.rpartition(".")
            if suffix in suffixes:
                quant.setdefault(pre, {})[suffix] = k
            else:
                plain.append(k)
        for pre in [p for p, d in quant.items() if not any(m in d for m in mains)]:
            plain += quant.pop(pre).values()
        return quant, plain


def renamer(model: nn.Module):
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
def empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The model of ``config`` on the meta device (nothing allocated), ``quantization_config`` dropped."""
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def expert_blocks(model: nn.Module) -> dict:
    """{experts module path: BlockParts} of the model's MoE blocks (``recognise.structure``, by what the blocks own)."""
    out = {}
    for name, _block, parts, _reason in iter_blocks(model):
        if parts is not None:
            out[f"{name}.{parts.experts}" if name else parts.experts] = parts
    return out


def router_modules(model: nn.Module) -> set:
    """Paths of the MoE blocks' router modules (``recognise.structure``): their weights stay 16-bit (the op's routing reads
    a 16-bit [E, H] router), so an int4 router is dequantized at load."""
    return {f"{name}.{parts.router_module}" if name else parts.router_module
            for name, _block, parts, _reason in iter_blocks(model) if parts is not None and parts.router_module}


def check_parts(path: str, parts) -> None:
    bad = [f for f, v in (("ungated experts", not parts.gated),
                          ("experts stored [in, out]", parts.w_layout != "out_in"),
                          ("separate 3-D gate / up weights", parts.split_gate_up is not None),
                          ("expert biases", parts.b13 is not None or parts.b2 is not None),
                          ("latent projections", parts.latent_size > 0), ("not 3-D experts", parts.kind != "fused"))
           if v]
    if bad:
        raise ValueError(f"{path}: int4 experts are read for gated [out, in] experts without biases (Mixtral, "
                         f"Qwen2/3-MoE, OLMoE, DeepSeek-V3 style); this block has {', '.join(bad)}")


def _stack_experts(ckpt: Checkpoint, fmt: Int4Format, path: str, per_expert: dict, parts, device) -> dict:
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
    check_parts(path, parts)
    t = _stack_experts(ckpt, fmt, path, per_expert, parts, device)
    quant = QuantSpec.int4(fmt.group, zero_point="w13_zero" in t, scale_dtype=SCALE_DTYPES[t["w13_scale"].dtype])
    return PackedExperts(quant, t["w13"], t["w13_scale"], t["w2"], t["w2_scale"], t.get("w13_zero"),
                         t.get("w2_zero"), gate_up="concat", activation=activation, gated=True)


def expert_activation(config) -> str:
    act = getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ValueError(f"config.hidden_act={act!r}: int4 experts are read for {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def matched_expert_blocks(model: nn.Module, experts: dict, what: str, missing: str) -> dict:
    """``expert_blocks(model)``, checked against the checkpoint's quantized experts ``experts`` ({block path: ...}):
    each side's paths must be the other's (ValueError naming the path; ``what``: the format, ``missing``: why a block
    without them is not read)."""
    blocks = expert_blocks(model)
    for path in experts:
        if path not in blocks:
            raise ValueError(f"{path}: {what} expert tensors in the checkpoint, but no MoE block of the model has its "
                             f"experts there (blocks' experts: {sorted(blocks)[:4]})")
    for path in blocks:
        if path not in experts:
            raise ValueError(f"{path}: the model's MoE block has no {what} experts in the checkpoint ({missing})")
    return blocks


def _replace_experts(model, ckpt, fmt: Int4Format, experts: dict, device) -> int:
    """Put a PackedExperts where each block's experts were; every block's experts must be int4 in the checkpoint."""
    blocks = matched_expert_blocks(model, experts, "int4", "16-bit experts next to int4 ones are not read")
    for path, parts in blocks.items():
        packed = _packed_experts(ckpt, fmt, path, experts[path], parts, device, expert_activation(model.config))
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
    return len(blocks)


def linear_targets(model: nn.Module, linears: dict, missing) -> tuple[list, dict, list]:
    """Split a checkpoint's quantized linears ({module name: tensors}): ([(name, tensors, module)] of the
    ``nn.Linear`` modules to replace, {name: tensors} left for ``load_rest`` to dequantize (an MoE router's: 16-bit
    for the op's routing; a module's that is not an ``nn.Linear``), [checkpoint keys the model has no module for:
    ``missing(name, tensors)``])."""
    targets, left, unexpected = [], {}, []
    routers = router_modules(model)
    for name, d in linears.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            unexpected += missing(name, d)
            continue
        if type(mod) is not nn.Linear or name in routers:
            left[name] = d
        else:
            targets.append((name, d, mod))
    return targets, left, unexpected


def check_linear_shape(name: str, w: torch.Tensor, mod: nn.Linear) -> None:
    """Packed int4 codes ``w`` [N, K / 2] against the model's Linear."""
    if (w.shape[0], 2 * w.shape[1]) != (mod.out_features, mod.in_features):
        raise ValueError(f"{name}: int4 weight [{w.shape[0]}, {2 * w.shape[1]}]; the model's Linear is "
                         f"[{mod.out_features}, {mod.in_features}]")


def install_linear(model: nn.Module, name: str, mod: nn.Linear, packed: nn.Module) -> None:
    """``packed`` where the model's Linear ``mod`` was, its bias slot kept (on the meta device: the checkpoint's bias
    is loaded into it with the rest)."""
    if mod.bias is not None:
        packed.bias = nn.Parameter(mod.bias, requires_grad=False)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, packed)


def _replace_linears(model, ckpt, fmt: Int4Format, linears: dict, device) -> tuple[dict, list]:
    """Put a ``Packed4Linear`` (the checkpoint's codes repacked, never dequantized) where each int4 linear's
    ``nn.Linear`` was (``linear_targets``: what is left, what is unexpected)."""
    targets, left, unexpected = linear_targets(model, linears, lambda name, d: [name + ".qweight"])
    for name, d, mod in targets:
        w, scale, zero, perm = fmt.convert_linear({k: ckpt.get(key, device) for k, key in d.items()}, name)
        check_linear_shape(name, w, mod)
        try:
            packed = Packed4Linear(fmt.quant(scale, zero), w, scale, zero, None, perm)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        install_linear(model, name, mod, packed)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, Packed4Linear) and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("the output embeddings (lm_head) are int4 in the checkpoint but config.tie_word_embeddings "
                         "ties them to the 16-bit input embeddings: a contradictory checkpoint")
    return left, unexpected


def load_rest(model, ckpt, fmt, left: dict, plain: list, rename, device, dtype, unexpected: list,
              who: str = "load_int4") -> None:
    """Every tensor but the experts' and the Packed4Linears' codes, in the dtype of the model's tensor it replaces
    (biases included); ``left``: int4 weights of routers and of modules that are not an ``nn.Linear``, dequantized
    (logged)."""
    ref = model.state_dict()
    state = {}
    for key in plain:
        name = rename(key)
        if EXPERT_RE.match(name.rpartition(".")[0]):
            raise ValueError(f"{key}: a 16-bit tensor of a routed expert next to quantized experts is not read")
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
        logger.warning("%s: %d quantized weights of MoE routers or of modules that are not an nn.Linear (e.g. %s) "
                       "dequantized to %s at load (routers run 16-bit)", who, len(left), next(iter(left)), dtype)
    if unexpected:
        logger.warning("%s: %d checkpoint tensors the model has no place for, not read (e.g. %s)", who,
                       len(unexpected), unexpected[0])
    model.load_state_dict(state, strict=False, assign=True)


def finish(model, device) -> None:
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
    experts module (found by structure: ``recognise.structure``) becomes a :class:`PackedExperts` holding the checkpoint's
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
    model = empty_model(config, dtype)
    ckpt = Checkpoint(path)
    quant, plain = ckpt.group()
    rename = renamer(model)
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
    load_rest(model, ckpt, fmt, left, plain, rename, device, dtype, unexpected)
    finish(model, device)
    return model.eval()
