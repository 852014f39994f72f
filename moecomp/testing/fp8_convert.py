"""FP8 block-quantized HF models for tests and benchmarks, without a hub or a GPU.

    model = to_fp8(model)                      # in place: what from_pretrained builds for an FP8 checkpoint
    write_fp8_checkpoint(model, path)          # a real-format FP8 checkpoint of a 16-bit model
                                               # (both in moecomp.testing.fp8_convert)

:func:`to_fp8` turns a 16-bit / fp32 model (e.g. built from a config) into what transformers builds when it loads an
FP8 block checkpoint (``quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}``): each
``@use_experts_implementation`` experts module (a ``*.experts`` module with 3-D weights) becomes transformers' own
``FP8Experts`` class, decorated the way ``replace_with_fp8_linear`` decorates it (``use_experts_implementation(...,
experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)``), and every other ``nn.Linear`` (attention projections, dense MLPs,
shared experts) an ``FP8Linear``; routers, shared-expert gates and ``lm_head`` stay as they are (``KEEP``). Weights
are quantized with ``moecomp.core.quant.quantize`` (e4m3, fp32 scales per 128 x 128 block: a gated ``gate_up_proj``
holds gate and up blocked apart, as checkpoints quantize ``gate_proj`` and ``up_proj`` separately); the ``*_scale_inv``
tensors hold the dequantization multiplier. ``activation_scheme`` "dynamic" (default) or "static" (every activation
scale ``static_scale``).

:func:`write_fp8_checkpoint` writes a checkpoint in the real per-expert format (``experts.{i}.{gate,up,down}_proj.weight``
e4m3 + ``weight_scale_inv`` fp32 per expert, as transformers' own ``save_pretrained`` of the 16-bit model names them)
plus ``config.json`` with the ``quantization_config``, for ``from_pretrained`` on a GPU (on CPU transformers
dequantizes such a checkpoint to bf16 when it loads it, and needs ``accelerate``).
"""

from __future__ import annotations

import inspect
import json
import os

import torch
from torch import nn

from ..core import quant as q8
from ..core.spec import QuantSpec

# the last name components of linears that stay 16-bit (what FP8 checkpoints keep unquantized)
KEEP = ("lm_head", "gate", "router", "shared_expert_gate", "shared_gate", "shared_experts_gate")


def block_quant(block_size=(128, 128)) -> QuantSpec:
    return QuantSpec(scale="block", block_n=int(block_size[0]), block_k=int(block_size[1]))


def quantization_config(block_size=(128, 128), activation_scheme: str = "dynamic", keep=()) -> dict:
    return {"quant_method": "fp8", "weight_block_size": [int(block_size[0]), int(block_size[1])],
            "activation_scheme": activation_scheme, "modules_to_not_convert": sorted(set(keep)) or None}


def _kwargs(fn, **kw) -> dict:
    """The keyword arguments ``fn`` accepts (transformers 5.17's FP8Experts takes no ``expert_dtype``)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


def _fp8_experts_class(has_gate: bool):
    """transformers' FP8Experts, decorated as ``replace_with_fp8_linear`` decorates it (once per process: the
    decorator rewrites the class in place, and transformers' own loads may have decorated it already)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    co = getattr(FP8Experts.forward, "__code__", None)
    if co is None or not co.co_filename.replace("\\", "/").endswith("integrations/moe.py"):
        use_experts_implementation(FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False,
                                   has_gate=has_gate)
    return FP8Experts


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=t.is_floating_point())  # (as transformers allocates them)


def _convert_experts(model: nn.Module, name: str, mod: nn.Module, q: QuantSpec, scheme: str, static_scale: float):
    has_gate = bool(getattr(mod, "has_gate", True))
    w13 = getattr(mod, "gate_up_proj" if has_gate else "up_proj")
    w2 = mod.down_proj
    cls = _fp8_experts_class(has_gate)
    config = getattr(mod, "config", None) or model.config.get_text_config()
    with torch.device("meta"):
        new = cls(config, **_kwargs(cls.__init__, block_size=(q.block_n, q.block_k), activation_scheme=scheme,
                                    scale_fmt="float", has_bias=False, has_gate=has_gate, expert_dtype="fp8"))
    new.has_gate, new.has_bias = has_gate, False
    E, N, H = w13.shape
    new.num_experts, new.hidden_dim, new.intermediate_dim = E, H, w2.shape[2]
    for wname, w, halves in ((("gate_up_proj" if has_gate else "up_proj"), w13, 2 if has_gate else 1),
                             ("down_proj", w2, 1)):
        qw, s = q8.quantize(w.detach(), q, halves)
        setattr(new, wname, _param(qw))
        setattr(new, f"{wname}_scale_inv", _param(s))
        if scheme == "static":
            setattr(new, f"{wname}_activation_scale", _param(torch.full((E,), static_scale, device=w.device)))
    for a in ("act_fn",):  # the module's own activation (a config may name another one)
        if hasattr(mod, a):
            setattr(new, a, getattr(mod, a))
    model.set_submodule(name, new)


def _convert_linear(model: nn.Module, name: str, mod: nn.Linear, q: QuantSpec, scheme: str, static_scale: float):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    with torch.device("meta"):
        new = FP8Linear(mod.in_features, mod.out_features, **_kwargs(
            FP8Linear.__init__, block_size=(q.block_n, q.block_k), activation_scheme=scheme, scale_fmt="float",
            has_bias=mod.bias is not None, bias=mod.bias is not None))
    qw, s = q8.quantize(mod.weight.detach(), q)
    new.weight, new.weight_scale_inv = _param(qw), _param(s)
    if mod.bias is not None:
        new.bias = _param(mod.bias.detach().clone())
    if scheme == "static":
        new.activation_scale = _param(torch.tensor(static_scale, device=qw.device))
    model.set_submodule(name, new)


def _is_experts(name: str, mod: nn.Module) -> bool:
    w13 = getattr(mod, "gate_up_proj", None)
    if not isinstance(w13, torch.Tensor):
        w13 = getattr(mod, "up_proj", None)
    w2 = getattr(mod, "down_proj", None)
    return (name.endswith(".experts") and isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
            and w13.dim() == 3 and w2.dim() == 3 and w13.dtype != q8.FP8 and not getattr(mod, "has_bias", False)
            and not getattr(mod, "is_transposed", False))


def kept(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in KEEP


def to_fp8(model: nn.Module, *, block_size=(128, 128), activation_scheme: str = "dynamic",
           static_scale: float = 8.0 / 448.0) -> nn.Module:
    """Convert ``model`` in place to what transformers builds for an FP8 block checkpoint (module docstring); returns
    it. ``static_scale``: every activation scale of ``activation_scheme="static"`` (8 / 448: activations up to 8)."""
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(f"activation_scheme must be 'dynamic' or 'static', got {activation_scheme!r}")
    q = block_quant(block_size)
    keep = []
    for name, mod in list(model.named_modules()):
        if _is_experts(name, mod):
            _convert_experts(model, name, mod, q, activation_scheme, static_scale)
        elif type(mod) is nn.Linear:
            if kept(name):
                keep.append(name)
            else:
                _convert_linear(model, name, mod, q, activation_scheme, static_scale)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg.quantization_config = quantization_config(block_size, activation_scheme, keep)
    return model


# ------------------------------------------------------------------------------------------------ checkpoint
def _quantized_keys(model: nn.Module) -> tuple[set, list]:
    """(module paths whose ``.weight`` a checkpoint stores quantized, linears kept 16-bit)."""
    lin, keep = set(), []
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear:
            if kept(name):
                keep.append(name)
            else:
                lin.add(name)
    return lin, keep


def write_fp8_checkpoint(model: nn.Module, path: str, *, block_size=(128, 128)) -> str:
    """Write ``model`` (16-bit / fp32, not converted) as a real-format FP8 block checkpoint at ``path``: transformers'
    ``save_pretrained`` names the tensors (per-expert keys), then every weight :func:`to_fp8` would quantize is
    stored e4m3 with its ``weight_scale_inv`` (fp32) beside it; ``config.json`` gets the ``quantization_config``
    (dynamic activations). Returns ``path``."""
    from safetensors.torch import load_file, save_file

    q = block_quant(block_size)
    model.save_pretrained(path)
    lin, keep = _quantized_keys(model)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    added: dict[str, str] = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        tensors = load_file(fpath)
        out = {}
        for key, t in tensors.items():
            halves = _quantize_as(key, t, lin)
            if halves is None:
                out[key] = t
                continue
            qw, s = q8.quantize(t, q, halves)
            skey = key[: -len("weight")] + "weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"
            out[key], out[skey] = qw.contiguous(), s.contiguous()
            added[skey] = fname
        save_file(out, fpath, metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"].update(added)
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config(block_size, "dynamic", keep)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def _quantize_as(key: str, t: torch.Tensor, lin: set) -> int | None:
    """How a checkpoint tensor is quantized: None (kept), 1 (one matrix), 2 (a fused gate_up: halves apart)."""
    if not t.is_floating_point() or t.dtype == q8.FP8:
        return None
    if t.dim() == 2 and key.endswith(".weight") and (key[: -len(".weight")] in lin or ".experts." in key):
        return 1
    if t.dim() == 3 and ".experts." in key + "." and key.rsplit(".", 1)[-1] in ("gate_up_proj", "up_proj",
                                                                               "down_proj"):
        return 2 if key.endswith("gate_up_proj") else 1  # (a transformers that saves the fused layout)
    return None
