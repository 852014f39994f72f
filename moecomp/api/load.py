"""``moecomp.load(path)``: a local checkpoint directory -> a model whose quantized experts stay quantized.

    model = moecomp.load("gpt-oss-20b-dir")       # experts: PackedExperts (MXFP4 bytes + e8m0 scales, as stored)
    moecomp.optimize(model)                        # each MoE block -> one moe_forward call with spec.quant set
    model.generate(...)

transformers' ``from_pretrained`` dequantizes MXFP4 experts to bf16 unless the hub's kernels are installed (they are
never reachable here), so quantized checkpoints are read by moecomp's own loaders, picked by the config's
``quantization_config.quant_method`` (``LOADERS``). A checkpoint without a quantization config is loaded with
transformers' ``AutoModelForCausalLM.from_pretrained`` (local files only). ``docs/QUANT4.md`` says what is read.
"""

from __future__ import annotations

import importlib

import torch

# quant_method -> "module:function"; the function is called as fn(directory, dtype=, device=,
# quantization_config=, config=) and returns the model
LOADERS: dict[str, str] = {
    "mxfp4": "moecomp.formats.mxfp4:load_checkpoint",  # gpt-oss: experts as PackedExperts (mxfp4)
    "gptq": "moecomp.api.load_gptq:load_int4",  # int4 GPTQ / AWQ ("gemm"): experts as PackedExperts (int4)
    "awq": "moecomp.api.load_gptq:load_int4",
    # llm-compressor's FP8-dynamic / FP8-block / W4A16: experts kept FP8 (channel / block) or int4 (PackedExperts)
    "compressed-tensors": "moecomp.api.load_compressed:load_compressed",
}


def register_loader(quant_method: str, target: str) -> None:
    """Read checkpoints of ``quant_method`` with ``target`` ("module:function", called as in ``LOADERS``)."""
    LOADERS[quant_method] = target


def load(path_or_dir, dtype: torch.dtype = torch.bfloat16, device=None):
    """The model of a local checkpoint directory (or a file in it), on ``device`` (default: CUDA when available,
    else CPU), non-quantized tensors in ``dtype``. Quantized experts are kept as stored (``LOADERS``); an unknown
    ``quant_method`` is a ``ValueError``."""
    from ..formats import checkpoint as ckpt_io

    directory = ckpt_io.resolve_dir(path_or_dir)
    config, qc = ckpt_io.load_config(directory)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if qc is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True).to(device).eval()
    method = qc.get("quant_method")
    target = LOADERS.get(method)
    if target is None:
        raise ValueError(f"{directory}: quantization_config.quant_method={method!r} has no moecomp loader "
                         f"(known: {sorted(LOADERS)})")
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)(directory, dtype=dtype, device=device, quantization_config=qc,
                                                     config=config)
