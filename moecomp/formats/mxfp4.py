"""gpt-oss MXFP4 checkpoints loaded with their experts packed (``PackedExperts``), never dequantized to 16 bits.

What a gpt-oss checkpoint holds per MoE layer (``model.layers.{i}.mlp.experts.``), E experts, hidden H, intermediate I:

    gate_up_proj_blocks  [E, 2I, H / 32, 16] uint8   two e2m1 codes a byte, column 2j in the low nibble of byte j;
                                                       rows interleaved gate / up (row 2i gate i, row 2i + 1 up i)
    gate_up_proj_scales  [E, 2I, H / 32]     uint8   one e8m0 scale per 32 columns: 2 ** (byte - 127)
    gate_up_proj_bias    [E, 2I]             bf16    (interleaved like the rows)
    down_proj_blocks     [E, H, I / 32, 16]  uint8
    down_proj_scales     [E, H, I / 32]      uint8
    down_proj_bias       [E, H]              bf16

which is exactly moecomp's packed layout (``QuantSpec.mxfp4()``, ``docs/QUANT4.md``): ``*_blocks.view(E, N, K / 2)``
is w13 [E, 2I, H / 2] / w2 [E, H, I / 2] and ``*_scales.view(torch.float8_e8m0fnu)`` the scales, both views of the
bytes read (no copy, no repack). The experts compute, per expert e and token x,

    h = x @ deq(w13[e]).T + b13[e];  gate, up = h[::2], h[1::2]
    a = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = clamp(gate, max=limit)     ("swiglu_oai")
    y = a @ deq(w2[e]).T + b2[e]

with gpt-oss's ``alpha`` (1.702) and ``limit`` (7.0) read from the model's own experts module.

:func:`load_checkpoint` (``moecomp.load``) builds the model on the meta device (``formats/checkpoint.py``), puts a
``PackedExperts`` where each experts module holding ``*_blocks`` keys was (the 16-bit ``GptOssExperts`` is never
allocated), and reads every other tensor into place. ``GptOssMLP`` calls its experts as ``experts(hidden [T, H],
router_indices [T, k], router_scores [T, k])`` (the top-k softmax weights) in transformers 5.17 and 5.24 alike, which
is ``PackedExperts.forward``'s convention: the MLP module itself is left as it is.

Tests and benchmarks: ``testing/mxfp4_write.py`` writes real-format checkpoints and builds random packed models.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..core.spec import QuantSpec
from . import checkpoint as ckpt_io
from .packed import PackedExperts

QUANT = QuantSpec.mxfp4()
GROUP = QUANT.block_k  # 32 values per scale (and per 16-byte block)
SUFFIXES = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
            "down_proj_scales", "down_proj_bias")
DEFAULT_ALPHA, DEFAULT_LIMIT = 1.702, 7.0  # gpt-oss's swiglu constants (transformers 5.17 hard-codes them)


def expected_shapes(E: int, H: int, I: int) -> dict[str, tuple]:
    """The checkpoint shape of each expert tensor (``SUFFIXES``)."""
    return {
        "gate_up_proj_blocks": (E, 2 * I, H // GROUP, GROUP // 2),
        "gate_up_proj_scales": (E, 2 * I, H // GROUP),
        "gate_up_proj_bias": (E, 2 * I),
        "down_proj_blocks": (E, H, I // GROUP, GROUP // 2),
        "down_proj_scales": (E, H, I // GROUP),
        "down_proj_bias": (E, H),
    }


def _sizes(config, experts: nn.Module | None = None) -> tuple[int, int, int]:
    E = int(getattr(experts, "num_experts", None) or config.num_local_experts)
    H = int(getattr(experts, "hidden_size", None) or config.hidden_size)
    I = int(getattr(experts, "intermediate_size", None) or config.intermediate_size)
    for name, v in (("hidden_size", H), ("intermediate_size", I)):
        if v % GROUP:
            raise ValueError(f"{name}={v}: MXFP4 experts need a multiple of {GROUP} (one scale per {GROUP} values)")
    return E, H, I


def swiglu_constants(experts: nn.Module | None, config=None) -> tuple[float, float]:
    """(alpha, limit) of gpt-oss's clamped SwiGLU: the experts module's own attributes (5.24 reads them from the
    config, 5.17 hard-codes them), else the config's, else gpt-oss's defaults."""
    alpha = getattr(experts, "alpha", None)
    limit = getattr(experts, "limit", None)
    if alpha is None:
        alpha = getattr(config, "swiglu_alpha", DEFAULT_ALPHA)
    if limit is None:
        limit = getattr(config, "swiglu_limit", DEFAULT_LIMIT)
    return float(alpha), float(limit)


def packed_experts(w13, w13_scale, w2, w2_scale, b13, b2, alpha: float, limit: float) -> PackedExperts:
    """gpt-oss's experts as a ``PackedExperts`` (interleaved gate / up, ``swiglu_oai``, biases) over these tensors:
    w13 [E, 2I, H / 2] uint8, w2 [E, H, I / 2] uint8, scales float8_e8m0fnu [E, rows, cols / 32] (held, not copied)."""
    return PackedExperts(QUANT, w13, w13_scale, w2, w2_scale, b13=b13, b2=b2, gate_up="interleaved",
                         activation="swiglu_oai", activation_alpha=alpha, activation_limit=limit)


def check_expert_tensors(prefix: str, found: dict, E: int, H: int, I: int) -> None:
    """``found``: {suffix: (shape, dtype)} of one layer's checkpoint tensors; ``ValueError`` naming the key and the
    shape / dtype expected when one is missing or does not fit."""
    want = expected_shapes(E, H, I)
    for suf in SUFFIXES:
        key = prefix + suf
        if suf not in found:
            raise ValueError(f"{key} is missing (expected shape {want[suf]})")
        shape, dtype = found[suf]
        if tuple(shape) != want[suf]:
            raise ValueError(f"{key} has shape {tuple(shape)}; expected {want[suf]} for E={E}, H={H}, I={I} "
                             f"(MXFP4: {GROUP} values per scale, 16 bytes per block)")
        if not suf.endswith("_bias") and dtype != torch.uint8:
            raise ValueError(f"{key} has dtype {dtype}; expected torch.uint8")
        if suf.endswith("_bias") and not dtype.is_floating_point:
            raise ValueError(f"{key} has dtype {dtype}; expected a floating dtype")


def from_checkpoint_tensors(t: dict, alpha: float, limit: float, dtype: torch.dtype) -> PackedExperts:
    """A ``PackedExperts`` from one layer's checkpoint tensors ``t`` ({suffix: tensor}, shapes checked): the blocks
    and scales viewed in moecomp's layout (no copy), the biases in ``dtype``."""
    E, N = t["gate_up_proj_blocks"].shape[:2]
    H = t["down_proj_blocks"].shape[1]
    w13 = t["gate_up_proj_blocks"].view(E, N, -1)  # [E, 2I, H / 2]
    w2 = t["down_proj_blocks"].view(E, H, -1)  # [E, H, I / 2]
    e8m0 = torch.float8_e8m0fnu
    s13, s2 = t["gate_up_proj_scales"].view(e8m0), t["down_proj_scales"].view(e8m0)
    b13, b2 = t["gate_up_proj_bias"].to(dtype), t["down_proj_bias"].to(dtype)
    return packed_experts(w13, s13, w2, s2, b13, b2, alpha, limit)


def checkpoint_experts(model: nn.Module, keys) -> dict[str, nn.Module]:
    """{module path: module} of the model's experts modules whose checkpoint holds MXFP4 blocks."""
    keys = set(keys)
    return {name: m for name, m in model.named_modules() if name and f"{name}.gate_up_proj_blocks" in keys}


def load_checkpoint(directory: str, dtype: torch.dtype = torch.bfloat16, device=None,
                    quantization_config: dict | None = None, config=None) -> nn.Module:
    """The gpt-oss model of an MXFP4 checkpoint directory: experts as ``PackedExperts`` (packed bytes and e8m0
    scales as stored), every other tensor in ``dtype`` on ``device``. ``config`` (without its quantization
    config) may be given when the caller read it already."""
    directory = ckpt_io.resolve_dir(directory)
    if config is None:
        config, quantization_config = ckpt_io.load_config(directory)
    if quantization_config is not None and quantization_config.get("quant_method") != "mxfp4":
        raise ValueError(f"{directory}: quantization_config.quant_method is "
                         f"{quantization_config.get('quant_method')!r}, not 'mxfp4'")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = ckpt_io.build_on_meta(config, dtype)
    ck = ckpt_io.Checkpoint(directory, device)
    try:
        found = checkpoint_experts(model, ck.keys())
        if not found:
            raise ValueError(f"{directory}: no MXFP4 experts (no '*.gate_up_proj_blocks' key of an experts module)")
        taken = set()
        for name, meta in found.items():
            E, H, I = _sizes(config, meta)
            prefix = f"{name}."
            check_expert_tensors(prefix, {s: (ck.shape(prefix + s), _dtype(ck, prefix + s)) for s in SUFFIXES
                                          if prefix + s in ck}, E, H, I)
            alpha, limit = swiglu_constants(meta, config)
            new = from_checkpoint_tensors({s: ck.get(prefix + s) for s in SUFFIXES}, alpha, limit, dtype)
            model.set_submodule(name, new)
            taken |= {prefix + s for s in SUFFIXES}
        ckpt_io.load_tensors(model, ck, dtype, skip=set(found), taken=taken)
    finally:
        ck.close()
    finish_model(model, directory, dtype)
    return model


_ST_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "F8_E8M0": torch.float8_e8m0fnu}


def _dtype(ck: ckpt_io.Checkpoint, key: str) -> torch.dtype:
    """The stored dtype of ``key`` (read from the safetensors header, the tensor itself not read)."""
    name = ck.dtype_name(key)
    if name not in _ST_DTYPES:
        raise ValueError(f"{key} has safetensors dtype {name}, which moecomp does not read")
    return _ST_DTYPES[name]


def finish_model(model: nn.Module, directory: str | None, dtype: torch.dtype) -> None:
    """Eval mode, the model dtype in its config, the generation config of the directory (when it has one)."""
    model.eval()
    try:
        model.config.dtype = dtype
    except Exception:  # noqa: BLE001  (older configs call it torch_dtype)
        model.config.torch_dtype = dtype
    if directory is not None and os.path.exists(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
