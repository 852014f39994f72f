"""Write int4 GPTQ / AWQ checkpoints in their real on-disk format (tests and benchmarks; docs/QUANT4.md).

An independent writer for the reader (:mod:`moecomp.formats.gptq`, :mod:`moecomp.api.load_gptq`): the packers here
follow the checkpoint layouts word by word (a shift and an OR per nibble, as the quantizers that write such
checkpoints do), where the reader repacks bytes; the tests check one against the other through known codes.

    pack_gptq(codes [K, N], zeros [G, N], scales [G, N])  -> qweight int32 [K / 8, N], qzeros int32 [G, N / 8],
                                                              scales, g_idx int32 [K] (k // g)
    pack_awq(codes [K, N], zeros [G, N], scales [G, N])   -> qweight int32 [K, N / 8], qzeros int32 [G, N / 8],
                                                              scales   (nibble i of a word: column 8c + AWQ_ORDER[i])
    write_int4_checkpoint(model, path, fmt, group, sym)   transformers' save_pretrained (per-expert keys), then every
                                                              routed expert's gate / up / down ``weight`` (and, with
                                                              ``attention=True``, the attention projections;
                                                              with ``dense=True``, shared experts and dense MLPs)
                                                              replaced by its int4 tensors; config.json gets the
                                                              ``quantization_config`` GPTQ / AWQ checkpoints carry

The codes come from ``moecomp.core.quant.quantize_4bit`` (round to nearest with an fp16 scale per row and group;
symmetric: zero 8, asymmetric: a zero per row and group), so the checkpoint's weights are exactly
``moecomp.core.quant.dequantize(*quantize_4bit(W))``: the reference a test compares the loaded model with.
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

from ..core import quant as q8
from ..core.spec import QuantSpec
from ..formats.gptq import AWQ_ORDER

EXPERT_KEY = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
ATTENTION_KEY = re.compile(r"\.self_attn\.[a-z_]*proj[a-z_]*\.weight$")
DENSE_KEY = re.compile(r"\.mlp\.(shared_experts?\.)?(gate_proj|up_proj|down_proj)\.weight$")  # shared / dense MLPs


def _words(nibbles: list[torch.Tensor]) -> torch.Tensor:
    """Eight code tensors (0..15) -> int32 words, the i-th in bits 4i..4i+3 (two's complement above 2^31)."""
    w = torch.zeros(nibbles[0].shape, dtype=torch.int64)
    for i, c in enumerate(nibbles):
        w |= (c.to(torch.int64) & 15) << (4 * i)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, *, v1: bool = True,
              group: int | None = None):
    """GPTQ tensors of one Linear from its codes [K, N] (0..15, input-major as GPTQ stores them), zeros [G, N]
    and scales [G, N]: (qweight [K / 8, N], qzeros [G, N / 8], scales, g_idx [K] = k // group, group K / G when
    not given). ``v1``: zeros stored minus one (checkpoint_format "gptq"); a zero of 0 cannot be stored that way
    (ValueError)."""
    K, N = codes.shape
    G = zeros.shape[0]
    if K % 8 or N % 8:
        raise ValueError(f"codes [K, N] = {list(codes.shape)}: GPTQ packs eight inputs (and zeros of eight outputs) "
                         f"a word; K and N must be multiples of 8")
    if v1 and bool((zeros == 0).any()):
        raise ValueError("zeros: a zero point of 0 has no GPTQ v1 encoding (stored minus one)")
    qweight = _words([codes[i::8, :] for i in range(8)])  # word r holds inputs 8r .. 8r + 7
    z = zeros.to(torch.int64) - (1 if v1 else 0)
    qzeros = _words([z[:, i::8] for i in range(8)])  # word c holds outputs 8c .. 8c + 7
    g_idx = (torch.arange(K) // (group or K // G)).to(torch.int32)
    return qweight, qzeros, scales.contiguous(), g_idx


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor):
    """AWQ "gemm" tensors of one Linear from its codes [K, N], zeros [G, N], scales [G, N]: (qweight [K, N / 8],
    qzeros [G, N / 8], scales); nibble i of a word holds output column 8c + AWQ_ORDER[i]."""
    if codes.shape[1] % 8:
        raise ValueError(f"codes [K, N] = {list(codes.shape)}: AWQ packs eight outputs a word; N % 8 must be 0")
    qweight = _words([codes[:, AWQ_ORDER[i]::8] for i in range(8)])
    qzeros = _words([zeros[:, AWQ_ORDER[i]::8] for i in range(8)])
    return qweight, qzeros, scales.contiguous()


def int4_spec(group: int, sym: bool) -> QuantSpec:
    return QuantSpec.int4(group, zero_point=not sym, scale_dtype="fp16")


def quantize_linear(w: torch.Tensor, group: int, sym: bool):
    """A float weight [N, K] -> (codes [K, N] uint8, zeros [G, N] uint8, scales [G, N] fp16): GPTQ / AWQ's
    input-major orientation of ``moecomp.core.quant.quantize_4bit``'s answer."""
    packed, scale, zero = q8.quantize_4bit(w.float(), int4_spec(group, sym))
    if zero is None:
        zero = torch.full_like(scale, q8.INT4_ZERO, dtype=torch.uint8)
    return q8.unpack_4bit(packed).t().contiguous(), zero.t().contiguous(), scale.t().contiguous()


def quantization_config(fmt: str, group: int, sym: bool, v1: bool = True) -> dict:
    """The ``quantization_config`` of config.json, with the keys GPTQ (gptqmodel / AutoGPTQ) and AWQ (AutoAWQ)
    checkpoints carry."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", "pack_dtype": "int32",
            "meta": {"quantizer": ["moecomp"]}}


def _convert_key(key: str, t: torch.Tensor, fmt: str, group: int, sym: bool, v1: bool) -> dict:
    codes, zeros, scales = quantize_linear(t, group, sym)
    pre = key[: -len(".weight")]
    if fmt == "awq":
        names, tensors = ("qweight", "qzeros", "scales"), pack_awq(codes, zeros, scales)
    else:
        names, tensors = ("qweight", "qzeros", "scales", "g_idx"), pack_gptq(codes, zeros, scales, v1=v1, group=group)
    return {f"{pre}.{n}": x.contiguous() for n, x in zip(names, tensors)}


def write_int4_checkpoint(model: nn.Module, path: str, fmt: str = "gptq", group: int = 128, sym: bool = True, *,
                          attention: bool = False, dense: bool = False, v1: bool = True,
                          max_shard_size: str | None = None) -> str:
    """Write ``model`` (16-bit / fp32) as a real-format int4 checkpoint at ``path`` (module docstring); returns
    ``path``. ``fmt`` "gptq" (``v1``: checkpoint_format "gptq", else "gptq_v2") or "awq" (always zero points:
    ``sym`` must be False). ``attention``: the attention projections whose shapes allow it (N % 8 == 0, K a
    multiple of ``group``) are int4 too, as in real checkpoints; ``dense``: the shared experts' and dense MLPs'
    gate / up / down projections likewise (``DENSE_KEY``). ``max_shard_size``: save_pretrained's, for
    sharded checkpoints (the index is updated)."""
    from safetensors.torch import load_file, save_file

    if fmt not in ("gptq", "awq"):
        raise ValueError(f"fmt must be 'gptq' or 'awq', got {fmt!r}")
    if fmt == "awq" and sym:
        raise ValueError("AWQ checkpoints always carry zero points: sym must be False")
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    moved: dict[str, str] = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        out = {}
        for key, t in load_file(fpath).items():
            other = (attention and ATTENTION_KEY.search(key)) or (dense and DENSE_KEY.search(key))
            quantize = EXPERT_KEY.search(key) or (other and t.dim() == 2 and t.shape[0] % 8 == 0
                                                  and t.shape[1] % group == 0)
            if not quantize:
                out[key] = t
                continue
            new = _convert_key(key, t, fmt, group, sym, v1)
            out.update(new)
            moved.update({k: fname for k in new})
            moved[key] = None
        save_file(out, fpath, metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        for k, fname in moved.items():
            if fname is None:
                idx["weight_map"].pop(k, None)
            else:
                idx["weight_map"][k] = fname
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config(fmt, group, sym, v1)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path
