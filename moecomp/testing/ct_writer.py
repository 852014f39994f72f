"""compressed-tensors checkpoints written by the ``compressed-tensors`` package itself (tests and benchmarks; the
reader is ``moecomp.formats.compressed`` / ``moecomp.api.load_compressed``; docs/FP8.md, docs/QUANT4.md).

    write_ct_checkpoint(model, path, "FP8_DYNAMIC" | "W4A16" | "W4A16_ASYM" | "FP8_BLOCK")
        transformers' save_pretrained of the 16-bit model (per-expert keys), then every routed expert's gate / up /
        down ``weight`` and every attention / shared-expert / dense-MLP projection quantized and compressed by the
        package (its preset scheme, ``initialize_module_for_quantization``, min-max scales from its
        ``calculate_qparams``, ``compress_module``: what llm-compressor's memoryless min-max observer and its
        save path do), and ``quantization_config`` written by the package's ``ModelCompressor.update_config``
        (targets ["Linear"], ignore ["lm_head", "re:.*mlp.gate$"]: the routers and the output layer stay 16-bit)
    dequantized_checkpoint(path, out)
        the same checkpoint with every quantized linear decompressed by the package (fp32 scales, so the products are
        exact), config without quantization: the reference model ``from_pretrained`` builds from it

Nothing here runs without ``compressed-tensors`` installed (imported on use).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .int4_writer import ATTENTION_KEY, DENSE_KEY, EXPERT_KEY

IGNORE = ["lm_head", "re:.*mlp.gate$"]


def _scheme(preset: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def _observe(w: torch.Tensor, args):
    """(min, max) per the scheme's strategy: the min-max observer's statistics."""
    N, K = w.shape
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = args.group_size
        v = torch.nn.functional.pad(w, (0, -K % g)).view(N, -1, g) if K % g else w.view(N, -1, g)
        return v.amin(-1), v.amax(-1)
    if args.strategy == "block":
        bn, bk = args.block_structure
        v = torch.nn.functional.pad(w, (0, -K % bk, 0, -N % bn))
        v = v.view(v.shape[0] // bn, bn, v.shape[1] // bk, bk)
        return v.amin((1, 3)), v.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def compress_linear(w: torch.Tensor, scheme) -> dict:
    """One linear's weight [N, K] -> its compressed tensors {suffix: tensor}, by the package."""
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.quantization import initialize_module_for_quantization
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    initialize_module_for_quantization(lin, scheme)
    lo, hi = _observe(w.float(), scheme.weights)
    scale, zero = calculate_qparams(lo, hi, scheme.weights)
    with torch.no_grad():
        lin.weight_scale.copy_(scale.reshape(lin.weight_scale.shape))
        if hasattr(lin, "weight_zero_point"):
            lin.weight_zero_point.copy_(zero.reshape(lin.weight_zero_point.shape))
    compress_module(lin)
    return {k: v.detach().contiguous() for k, v in lin.state_dict().items()}


def _quantized_key(key: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and bool(EXPERT_KEY.search(key) or ATTENTION_KEY.search(key) or DENSE_KEY.search(key))


def write_ct_checkpoint(model: nn.Module, path: str, preset: str = "FP8_DYNAMIC") -> str:
    """``model`` (16-bit / fp32) as a compressed-tensors checkpoint at ``path`` (module docstring); returns ``path``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import load_file, save_file

    scheme = _scheme(preset)
    fmt = CompressionFormat.pack_quantized if scheme.weights.type == "int" else CompressionFormat.float_quantized
    model.save_pretrained(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"{path}: write_ct_checkpoint writes single-file checkpoints, got {files}")
    fpath = os.path.join(path, files[0])
    out = {}
    for key, t in load_file(fpath).items():
        if not _quantized_key(key, t):
            out[key] = t
            continue
        pre = key[: -len("weight")]
        out.update({pre + k: v for k, v in compress_linear(t, scheme).items()})
    save_file(out, fpath, metadata={"format": "pt"})
    scheme.format = fmt.value
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE, format=fmt.value,
                            quantization_status=QuantizationStatus.COMPRESSED)
    ModelCompressor(quantization_config=qc).update_config(path)
    return path


def dequantized_checkpoint(path: str, out: str) -> str:
    """The checkpoint at ``path`` with every quantized linear's weight decompressed by the package (scales made fp32
    first: the products are exact), written to ``out`` without a quantization config; returns ``out``."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    qc = QuantizationConfig.model_validate(cfg.pop("quantization_config"))
    scheme = next(iter(qc.config_groups.values()))
    comp = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    os.makedirs(out, exist_ok=True)
    sd = {}
    for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        sd.update(load_file(os.path.join(path, fname)))
    groups, plain = {}, {}
    for k, t in sd.items():
        pre, _, suf = k.rpartition(".")
        (groups.setdefault(pre, {}).__setitem__(suf, t) if suf.startswith("weight") and suf != "weight"
         or (suf == "weight" and f"{pre}.weight_scale" in sd) else plain.__setitem__(k, t))
    for pre, d in groups.items():
        d = dict(d, weight_scale=d["weight_scale"].float())
        plain[f"{pre}.weight"] = comp.decompress(d, scheme)["weight"].float().contiguous()
    save_file(plain, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out
