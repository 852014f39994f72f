"""compressed-tensors checkpoints (llm-compressor's FP8-dynamic, FP8-block, W4A16) loaded with their routed experts
kept quantized (``moecomp.load`` picks it by ``quantization_config.quant_method`` "compressed-tensors"; the schemes
and tensors read: ``formats/compressed.py``).

transformers (5.17 to 5.25) dequantizes a compressed-tensors MoE checkpoint's routed experts to 16-bit when it loads
it (its experts conversion folds every expert's scales into bf16 weights before fusing them; an asymmetric W4A16
checkpoint does not load at all), keeping only the dense linears compressed. This loader keeps both:

* each MoE block's experts (found by structure, ``recognise.structure``): FP8 -> the model's own fused experts module
  holding e4m3 w13 [E, 2I, H] (gate rows then up rows) / w2 [E, H, I] and fp32 scales ``<w>_scale`` (channel [E,
  rows] or 128 x 128 blocks), its forward the plain dequantized reference until ``optimize`` binds the block to
  ``moe_forward``; W4A16 -> a :class:`PackedExperts` (int4 codes as stored, scales in the checkpoint's dtype, zero
  points unpacked to bytes). The per-expert tensors are stacked once (a copy of the codes into the fused layout,
  nothing turned into floats);
* every other quantized ``nn.Linear`` (attention, shared experts, dense MLPs): FP8 -> the ``nn.Linear`` holding the
  e4m3 ``weight`` and an fp32 ``weight_scale`` (bound to ``moecomp.ops.fp8_linear`` by ``optimize``); W4A16 -> a
  :class:`Packed4Linear` whose codes are a view of the checkpoint's ``weight_packed`` (no copy).

A quantized MoE router (the op's routing reads a 16-bit router) is dequantized into ``dtype`` (logged). A scheme
moecomp does not read is a ``CTUnsupported`` (a ValueError) naming the linear and the reason code; transformers'
``from_pretrained`` still loads such a checkpoint (dequantized experts).
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import compressed as ct
from ..formats.fp8 import plain_experts_call, plain_linear_forward
from ..formats.packed import PackedExperts
from ..formats.packed_linear import Packed4Linear
from .load_gptq import (EXPERT_RE, PROJ_SLOTS, Checkpoint, check_linear_shape, check_parts, empty_model,
                        expert_activation, finish, install_linear, linear_targets, load_rest, matched_expert_blocks,
                        renamer)

_SUFFIX = {"w": "", "scale": "_scale", "zero": "_zero"}


def _stack(ckpt: Checkpoint, codec: ct.Codec, path: str, per_expert: dict, parts, device):
    """(scheme, QuantSpec, {w13, w13_scale, w2, w2_scale (, w13_zero, w2_zero)}) of one block's experts, each
    expert's gate / up / down converted (``Codec.convert``) and copied into place: w13 rows gate then up (a scale or
    zero tensor's rows likewise: its gate half, then its up half), w2 as is."""
    E = parts.num_experts
    if sorted(per_expert) != list(range(E)):
        raise ValueError(f"{path}: the checkpoint has quantized tensors for experts {sorted(per_expert)[:8]}...; "
                         f"the model's block has E={E} experts")
    want = {"gate": parts.intermediate_size, "up": parts.intermediate_size, "down": parts.hidden_size}
    out, first = {}, None
    for e in range(E):
        for slot in ("gate", "up", "down"):
            if slot not in per_expert[e]:
                raise ValueError(f"{path}.{e}.{slot}: no quantized tensors for this projection in the checkpoint")
            name, keys = per_expert[e][slot]  # (the model's name of the linear: its scheme is looked up by it)
            t = {k: ckpt.get(key, device) for k, key in keys.items()}
            scheme = codec.scheme(name, t)
            q, c = codec.convert(t, name)
            first = first or (scheme, q)
            if (scheme, q) != first:
                raise ValueError(f"{name}: quantized as {q}, unlike the block's other projections ({first[1]})")
            if c["w"].shape[0] != want[slot]:
                raise ValueError(f"{name}: weight of {c['w'].shape[0]} rows; the model's block needs {want[slot]}")
            kind = "w2" if slot == "down" else "w13"
            for part, src in c.items():
                if src is None:
                    continue
                key = kind + _SUFFIX[part]
                rows = src.shape[0] * (2 if kind == "w13" else 1)
                if key not in out:
                    out[key] = torch.empty((E, rows, *src.shape[1:]), dtype=src.dtype, device=src.device)
                if out[key].shape[1:] != (rows, *src.shape[1:]) or out[key].dtype != src.dtype:
                    raise ValueError(f"{name}: {key} {src.dtype} {list(src.shape)} unlike the other experts'")
                off = src.shape[0] if slot == "up" else 0
                out[key][e, off:off + src.shape[0]] = src
    return first[0], first[1], out


# ------------------------------------------------------------------------------------------------ modules
def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def fp8_linear_into(mod: nn.Linear, c: dict, scheme: ct.Scheme) -> None:
    """An ``nn.Linear`` holding the FP8 codes as its ``weight`` and fp32 ``weight_scale`` (the layout
    ``moecomp.formats.fp8`` reads; ``ct_scheme`` says how activations are quantized); its forward runs the plain
    dequantized reference until ``optimize`` binds it to ``moecomp.ops.fp8_linear``."""
    N, K = c["w"].shape
    if (N, K) != (mod.out_features, mod.in_features):
        raise ct.CTUnsupported("ct_bad_tensors", f"weight [{N}, {K}]; the model's Linear is "
                               f"[{mod.out_features}, {mod.in_features}]")
    mod.weight = _frozen(c["w"])
    mod.weight_scale = _frozen(c["scale"])
    mod.ct_scheme = scheme
    mod.forward = _PlainLinear(mod, plain_linear_forward)


class _PlainLinear:
    """``forward`` of an FP8 linear the loader made: the plain reference (``formats.fp8.plain_linear_forward``)."""

    __slots__ = ("module", "fn")
    _moecomp_plain = "stored"  # (formats.fp8.plain_fp8 leaves it alone: already the stored-activation reference)

    def __init__(self, module, fn):
        self.module, self.fn = module, fn

    def __call__(self, x, *args, **kwargs):
        return self.fn(self.module, x)


def fp8_experts_into(experts: nn.Module, w13_name: str, w2_name: str, t: dict, scheme: ct.Scheme) -> None:
    """The model's own fused experts module holding FP8 codes: ``w13_name`` / ``w2_name`` [E, ., .] e4m3, their
    ``*_scale`` fp32 [E, rows] (channel) or blocks, and ``ct_scheme``; its forward is the plain reference
    (``formats.fp8.plain_experts_call``) until ``optimize`` binds the block."""
    for name, key in ((w13_name, "w13"), (w2_name, "w2")):
        setattr(experts, name, _frozen(t[key]))
        experts.register_parameter(f"{name}_scale", _frozen(t[key + "_scale"]))
    experts.ct_scheme = scheme
    fwd = plain_experts_call(experts)
    if fwd is None:
        raise ValueError(f"the experts module ({type(experts).__name__}) does not read as FP8 experts after loading: "
                         f"its 3-D weights are not named gate_up_proj / up_proj and down_proj")
    experts.forward = fwd


def _replace_experts(model, ckpt, codec, experts: dict, device) -> int:
    """Each MoE block's experts module holding the checkpoint's codes (FP8: the model's own module; int4: a
    PackedExperts in its place). Every block's experts must be quantized in the checkpoint."""
    blocks = matched_expert_blocks(model, experts, "quantized", "16-bit experts are read by transformers' "
                                   "from_pretrained")
    for path, parts in blocks.items():
        check_parts(path, parts)
        scheme, q, t = _stack(ckpt, codec, path, experts[path], parts, device)
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if q.packed:
            new = PackedExperts(q, t["w13"], t["w13_scale"], t["w2"], t["w2_scale"], t.get("w13_zero"),
                                t.get("w2_zero"), gate_up="concat", activation=expert_activation(model.config))
            setattr(owner, child, new)
        else:
            mod = getattr(owner, child)
            fp8_experts_into(mod, parts.w13.rpartition(".")[2], parts.w2.rpartition(".")[2], t, scheme)
    return len(blocks)


def _replace_linears(model, ckpt, codec, linears: dict, device) -> tuple[dict, list]:
    """Every quantized ``nn.Linear`` outside the routed experts kept quantized (FP8 in place, int4 as a
    Packed4Linear); returns ({name: tensors} left for ``load_rest`` to dequantize: routers and modules that are not an
    ``nn.Linear``, [checkpoint keys the model has no module for])."""
    targets, left, unexpected = linear_targets(model, linears, lambda name, d: list(d.values()))
    for name, d, mod in targets:
        t = {k: ckpt.get(key, device) for k, key in d.items()}
        scheme = codec.scheme(name, t)
        q, c = codec.convert(t, name)
        if not q.packed:
            fp8_linear_into(mod, c, scheme)
            continue
        check_linear_shape(name, c["w"], mod)
        install_linear(model, name, mod, Packed4Linear(q, c["w"], c["scale"], c["zero"]))
    return left, unexpected


def load_compressed(path: str, dtype: torch.dtype = torch.bfloat16, device="cpu", *, config=None,
                    quantization_config: dict | None = None) -> nn.Module:
    """A causal LM from a compressed-tensors safetensors checkpoint directory, routed experts kept quantized
    (module docstring). ``config`` / ``quantization_config``: as ``moecomp.load`` passes them (read from ``path``
    when not given). ValueError (``CTUnsupported``, with its reason code) for schemes that are not read; ValueError
    for blocks whose experts are not gated [out, in] matrices without biases, or 16-bit experts."""
    from transformers import AutoConfig

    config = config if config is not None else AutoConfig.from_pretrained(path)
    qc = quantization_config if quantization_config is not None else getattr(config, "quantization_config", None)
    codec = ct.Codec(ct.Config.read(qc))
    model = empty_model(config, dtype)
    ckpt = Checkpoint(path)
    quant, plain = ckpt.group(ct.SUFFIXES, ct.MAINS)
    rename = renamer(model)
    experts, linears = {}, {}
    for pre, d in quant.items():
        name = rename(pre + ".weight")[: -len(".weight")]
        m = EXPERT_RE.match(name)
        codec.aliases[name] = pre  # (the config's targets and ignore patterns name the checkpoint's linears)
        if m:
            experts.setdefault(m["experts"], {}).setdefault(int(m["e"]), {})[PROJ_SLOTS[m["proj"]]] = (name, d)
        else:
            linears[name] = d
    _replace_experts(model, ckpt, codec, experts, device)
    left, unexpected = _replace_linears(model, ckpt, codec, linears, device)
    load_rest(model, ckpt, codec, left, plain, rename, device, dtype, unexpected, who="load_compressed")
    finish(model, device)
    return model.eval()
