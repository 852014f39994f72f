"""gpt-oss MXFP4 checkpoints for tests and benchmarks: written in the real format, or made at random at full size.

    write_mxfp4_checkpoint(model, path)          a 16-bit GptOssForCausalLM (or one loaded packed) -> a real-format
                                                 checkpoint (``formats/mxfp4.py`` lists the tensors), experts quantized
                                                 with ``moecomp.core.quant.quantize_4bit`` (each group's scale the power
                                                 of two 2 ** ceil(log2(amax / 6)), codes the nearest e2m1 value)
    gpt_oss_config("20b" | "120b")               the real models' sizes
    random_packed_model(config, device)          the model with random packed experts, built on ``device`` directly
                                                 (no 16-bit expert ever allocated: gpt-oss-120b's experts are about
                                                 61 GB packed, 240 GB in bf16)
    write_random_mxfp4_checkpoint(config, path)  the same random weights written per layer (one shard a layer)
    dequantized_experts(model)                   a copy whose experts are transformers' 16-bit ``GptOssExperts``
                                                 holding the dequantized weights (the reference the tests compare to)

Random experts: codes uniform over the 16 e2m1 values (rms 2.9), scale bytes uniform in ``RANDOM_SCALE_BYTES``
(2 ** -9 .. 2 ** -6: weights of rms about 0.026, near transformers' 0.02 init); biases normal(0, 0.02). Other
tensors are initialised by the model's own ``_init_weights`` (random model) or normal(0, 0.02) / ones for norms
(random checkpoint).
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn

from ..core import quant as q8
from ..formats import checkpoint as ckpt_io
from ..formats.mxfp4 import GROUP, QUANT, SUFFIXES, from_checkpoint_tensors, swiglu_constants
from ..formats.packed import PackedExperts

RANDOM_SCALE_BYTES = (118, 122)  # [lo, hi): 2 ** (byte - 127)
INIT_STD = 0.02
# what gpt-oss's own config.json says is left unquantized (transformers' Mxfp4Config.to_dict: these two keys)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_config(size: str = "120b"):
    """transformers' ``GptOssConfig`` at gpt-oss-20b's or gpt-oss-120b's sizes (hidden 2880, intermediate 2880,
    top-4; 24 layers of 32 experts / 36 layers of 128): the defaults are 120b's."""
    from transformers import GptOssConfig

    if size not in ("20b", "120b"):
        raise ValueError(f"size must be '20b' or '120b', got {size!r}")
    return GptOssConfig(**(dict(num_hidden_layers=24, num_local_experts=32) if size == "20b" else {}))


def quantization_config() -> dict:
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(NOT_CONVERTED)}


def _is_dense_experts(m: nn.Module) -> bool:
    w, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(w, torch.Tensor) and isinstance(d, torch.Tensor) and w.dim() == 3 and d.dim() == 3
            and w.is_floating_point() and isinstance(getattr(m, "gate_up_proj_bias", None), torch.Tensor))


# ------------------------------------------------------------------------------------------------ real format
def to_checkpoint(experts: nn.Module) -> dict[str, torch.Tensor]:
    """{suffix: tensor} of one experts module in the checkpoint format: a ``PackedExperts`` as held (views), a 16-bit
    ``GptOssExperts`` (gate_up_proj [E, H, 2I], down_proj [E, I, H]) quantized."""
    if isinstance(experts, PackedExperts):
        if experts.quant.layout != "packed":
            raise ValueError(f"PackedExperts holds its codes in the {experts.quant.layout!r} layout (re-laid by "
                             "optimize with MOECOMP_W4_FORM=mma): moecomp.unoptimize(model) restores the packed bytes")
        if (experts.quant != QUANT or experts.gate_up != "interleaved" or experts.activation != "swiglu_oai"
                or experts.b13 is None or experts.b2 is None):
            raise ValueError(f"PackedExperts ({experts.quant.weight}, {experts.gate_up}, {experts.activation}, "
                             f"biases b13 {experts.b13 is not None} / b2 {experts.b2 is not None}) is not gpt-oss's "
                             "(mxfp4, interleaved, swiglu_oai, both biases): the checkpoint format cannot hold it")
        w13, s13, w2, s2, b13, b2 = experts.w13, experts.w13_scale, experts.w2, experts.w2_scale, experts.b13, \
            experts.b2
    else:
        w13, s13, _ = q8.quantize_4bit(experts.gate_up_proj.detach().transpose(1, 2), QUANT)  # [E, 2I, H / 2]
        w2, s2, _ = q8.quantize_4bit(experts.down_proj.detach().transpose(1, 2), QUANT)  # [E, H, I / 2]
        b13, b2 = experts.gate_up_proj_bias, experts.down_proj_bias
    E, N, half = w13.shape
    H, Ih = w2.shape[1:]
    return {
        "gate_up_proj_blocks": w13.detach().reshape(E, N, half * 2 // GROUP, GROUP // 2),
        "gate_up_proj_scales": s13.detach().view(torch.uint8),
        "gate_up_proj_bias": b13.detach(),
        "down_proj_blocks": w2.detach().reshape(E, H, Ih * 2 // GROUP, GROUP // 2),
        "down_proj_scales": s2.detach().view(torch.uint8),
        "down_proj_bias": b2.detach(),
    }


def checkpoint_state(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names: experts in MXFP4 (``to_checkpoint``), every other floating
    tensor in ``dtype``; tied copies (``lm_head`` tied to the embeddings) left out, as transformers saves them."""
    experts = {n: m for n, m in model.named_modules() if n and (isinstance(m, PackedExperts) or _is_dense_experts(m))}
    out = {}
    for name, m in experts.items():
        out.update({f"{name}.{s}": t for s, t in to_checkpoint(m).items()})
    tied = set(ckpt_io._tied_targets(model)) if getattr(model.config, "tie_word_embeddings", False) else set()
    for k, t in model.state_dict().items():
        if any(k.startswith(n + ".") for n in experts) or k in tied:
            continue
        out[k] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
    for k, t in list(out.items()):
        if k.endswith("_bias") and any(k.startswith(n + ".") for n in experts):
            out[k] = t.to(dtype)
    return out


def write_mxfp4_checkpoint(model_or_state, path: str, config=None, dtype: torch.dtype = torch.bfloat16,
                           max_shard_bytes: int | None = None) -> str:
    """Write a gpt-oss model (16-bit, or loaded packed) or its ``checkpoint_state`` as a real-format MXFP4
    checkpoint at ``path``: safetensors (one file, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``) and ``config.json`` with ``quantization_config`` {"quant_method": "mxfp4",
    "modules_to_not_convert": [...]}, as gpt-oss-20b's. ``config``: needed with a state dict. Returns ``path``."""
    if isinstance(model_or_state, nn.Module):
        config = model_or_state.config if config is None else config
        state = checkpoint_state(model_or_state, dtype)
    else:
        if config is None:
            raise ValueError("write_mxfp4_checkpoint(state_dict, path) needs config=")
        state = dict(model_or_state)
    os.makedirs(path, exist_ok=True)
    _write_shards(path, [state] if not max_shard_bytes else _split(state, max_shard_bytes))
    write_config(config, path, dtype)
    return path


def write_config(config, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """``config.json`` of ``config`` with gpt-oss's MXFP4 ``quantization_config``."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config()
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def _split(state: dict, max_bytes: int) -> list[dict]:
    shards, cur, size = [], {}, 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = t
        size += n
    return shards + [cur] if cur else shards


def _write_shards(path: str, shards) -> None:
    """Write each {key: tensor} of ``shards`` (a list, or an iterator: each shard made only when written) as a
    safetensors file: one shard as ``model.safetensors``, more as ``model-0000i-of-0000n`` with the index."""
    from safetensors.torch import save_file

    if isinstance(shards, list) and len(shards) == 1:
        save_file({k: t.contiguous() for k, t in shards[0].items()}, os.path.join(path, ckpt_io.SINGLE),
                  metadata={"format": "pt"})
        return
    where, total, names = {}, 0, []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}.safetensors"
        save_file({k: t.contiguous() for k, t in shard.items()}, os.path.join(path, fname), metadata={"format": "pt"})
        names.append(fname)
        for k, t in shard.items():
            where[k] = fname
            total += t.numel() * t.element_size()
    final = {f: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, f in enumerate(names)}
    for f, g in final.items():
        os.replace(os.path.join(path, f), os.path.join(path, g))
    with open(os.path.join(path, ckpt_io.INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in where.items()}}, f,
                  indent=2)


# ------------------------------------------------------------------------------------------------ random weights
def random_expert_tensors(E: int, H: int, I: int, device, generator: torch.Generator,
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One layer's expert tensors in the checkpoint format ({suffix: tensor}), random (module docstring)."""
    lo, hi = RANDOM_SCALE_BYTES
    u8 = dict(dtype=torch.uint8, device=device, generator=generator)
    return {
        "gate_up_proj_blocks": torch.randint(0, 256, (E, 2 * I, H // GROUP, GROUP // 2), **u8),
        "gate_up_proj_scales": torch.randint(lo, hi, (E, 2 * I, H // GROUP), **u8),
        "gate_up_proj_bias": (torch.randn(E, 2 * I, device=device, generator=generator) * INIT_STD).to(dtype),
        "down_proj_blocks": torch.randint(0, 256, (E, H, I // GROUP, GROUP // 2), **u8),
        "down_proj_scales": torch.randint(lo, hi, (E, H, I // GROUP), **u8),
        "down_proj_bias": (torch.randn(E, H, device=device, generator=generator) * INIT_STD).to(dtype),
    }


def _meta_model(config, dtype):
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return ckpt_io.build_on_meta(config, dtype)


def random_packed_model(config, device=None, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """gpt-oss of ``config`` (e.g. gpt-oss-120b's) with random packed experts, built on ``device`` directly: the
    model on the meta device, each experts module replaced by a random ``PackedExperts`` made on ``device``, every
    other tensor made there and initialised by the model's ``_init_weights``. Peak memory: the packed model."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _meta_model(config, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, m in [(n, m) for n, m in model.named_modules() if n and _is_dense_experts(m)]:
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        alpha, limit = swiglu_constants(m, model.config)
        model.set_submodule(name, from_checkpoint_tensors(random_expert_tensors(E, H, I, device, g, dtype), alpha,
                                                          limit, dtype))
    init = model._init_weights
    torch.manual_seed(seed)  # (transformers' init draws from the global generators)
    with torch.no_grad():
        for mname, m in model.named_modules():
            own = [n for n, t in list(m._parameters.items()) + list(m._buffers.items())
                   if t is not None and t.device.type == "meta"]
            if not own:
                continue
            for n in own:
                t = getattr(m, n)
                ckpt_io.set_tensor(m, n, torch.empty(t.shape, dtype=t.dtype, device=device))
            init(m)
    model.tie_weights()
    from ..formats.mxfp4 import finish_model as _finish

    _finish(model, None, dtype)
    return model


def write_random_mxfp4_checkpoint(config, path: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    """A real-format MXFP4 checkpoint of ``config`` with random weights, one shard per decoder layer (plus one for
    the rest), each shard made only when written: memory peaks at one layer (gpt-oss-120b: about 1.7 GB)."""
    model = _meta_model(config, dtype)
    g = torch.Generator().manual_seed(seed)
    experts = {n: m for n, m in model.named_modules() if n and _is_dense_experts(m)}
    groups: dict[str, list] = {}
    tied = ckpt_io._tied_targets(model) if getattr(model.config, "tie_word_embeddings", False) else set()
    for k, t in model.state_dict().items():
        if any(k.startswith(n + ".") for n in experts) or k in tied:
            continue
        groups.setdefault(_layer_of(k), []).append((k, t))

    def shards():
        for layer, items in groups.items():
            out = {}
            for k, t in items:
                if not t.is_floating_point():
                    out[k] = torch.zeros(t.shape, dtype=t.dtype)
                elif k.endswith("norm.weight") or k.endswith("layernorm.weight"):
                    out[k] = torch.ones(t.shape, dtype=dtype)
                else:
                    out[k] = (torch.randn(t.shape, generator=g) * INIT_STD).to(dtype)
            for n, m in experts.items():
                if _layer_of(n + ".") == layer:
                    t = random_expert_tensors(m.num_experts, m.hidden_size, m.intermediate_size, "cpu", g, dtype)
                    out.update({f"{n}.{s}": t[s] for s in SUFFIXES})
            yield out

    os.makedirs(path, exist_ok=True)
    _write_shards(path, shards())
    write_config(model.config, path, dtype)
    return path


def _layer_of(key: str) -> str:
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return ""


# ------------------------------------------------------------------------------------------------ reference
def dequantized_experts(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A deep copy of ``model`` whose ``PackedExperts`` are transformers' own 16-bit ``GptOssExperts`` holding the
    exactly dequantized weights (in ``dtype``, default the biases' dtype): what transformers builds when it
    dequantizes the checkpoint on load."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    out = copy.deepcopy(model)
    for name, m in [(n, m) for n, m in out.named_modules() if isinstance(m, PackedExperts)]:
        dt = dtype or m.b13.dtype
        cfg = copy.copy(out.config)
        cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size = m.num_experts, m.hidden_size, \
            m.intermediate_size
        with torch.device("meta"):
            dense = GptOssExperts(cfg)
        E = m.num_experts
        w13 = m.dequantized("w13", torch.arange(E)).transpose(1, 2).to(dt)  # [E, H, 2I]
        w2 = m.dequantized("w2", torch.arange(E)).transpose(1, 2).to(dt)  # [E, I, H]
        for n, t in (("gate_up_proj", w13), ("down_proj", w2), ("gate_up_proj_bias", m.b13.to(dt)),
                     ("down_proj_bias", m.b2.to(dt))):
            dense._parameters[n] = nn.Parameter(t.contiguous(), requires_grad=False)
        dense.alpha, dense.limit = m.activation_alpha, m.activation_limit
        out.set_submodule(name, dense)
    return out
