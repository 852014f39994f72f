"""One-block models of any size and weight format, random weights made on the device directly: what the memory
tests (``tests/test_memory.py``) and ``benchmarks/mem_optimize.py`` run ``moecomp.optimize`` on.

    model = one_block("deepseek_v3", "fp8", E=256, H=7168, I=2048, k=8, device="cuda")
    model.mlp                                  # the block (transformers' own class; experts in the format asked)

Families (transformers' block classes, built from a config of the given sizes):

* ``qwen3_moe``: softmax top-k, renormalised, gate / up "concat", silu; no shared expert;
* ``deepseek_v3``: sigmoid + correction bias, group-limited top-k (8 groups, 4 kept, when E allows), routed
  scaling, one shared expert of width I;
* ``gpt_oss``: router with a bias, top-k then softmax, interleaved swiglu_oai (clamped) with expert biases.

Formats: ``bf16`` / ``fp32`` (the block's own experts module), ``fp8`` (transformers' ``FP8Experts``, 128 x 128 block
scales, dynamic activations; a shared expert as ``FP8Linear``s), ``fp8-channel`` (the same with one scale per
output row), ``mxfp4`` / ``int4`` (``moecomp.formats.packed.PackedExperts``: e2m1 codes with e8m0 scales per 32
columns, or int4 codes with bf16 scales per 128 columns and zero points). Quantized weights are drawn a few experts
at a time (``CHUNK_BYTES`` of fp32) and quantized into their place: no whole float copy of the experts exists.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import quant as q8
from ..core.spec import QuantSpec

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
FORMATS = ("bf16", "fp32", "fp8", "fp8-channel", "mxfp4", "int4")
CHUNK_BYTES = 256 << 20  # fp32 working set of drawing and quantizing one chunk of experts
INT4 = QuantSpec.int4(group=128, zero_point=True, scale_dtype="bf16")


class OneBlock(nn.Module):
    """A model holding one MoE block as ``mlp`` (its forward is the block's)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.mlp = block

    def forward(self, hidden_states):
        return self.mlp(hidden_states)


def _config(family: str, E: int, H: int, I: int, k: int):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                              norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        groups = 8 if E % 8 == 0 and E // 8 >= 2 and k <= 4 * (E // 8) else 1
        return DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                                n_group=groups, topk_group=min(4, groups), n_shared_experts=1, num_hidden_layers=1,
                                first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4)
    if family == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def _block_class(family: str):
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as cls
    elif family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as cls
    return cls


def _rand(shape, g: torch.Generator, device, std: float, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * std).to(dtype)


def _chunks(E: int, per_expert: int):
    n = max(1, CHUNK_BYTES // max(1, per_expert * 4))
    return [(e0, min(E, e0 + n)) for e0 in range(0, E, n)]


def _quantized(E: int, rows: int, cols: int, quant: QuantSpec, halves: int, g, device, std: float):
    """(q, scale, zero or None) of a random [E, rows, cols] weight N(0, std^2), drawn and quantized a chunk of
    experts at a time."""
    out = None
    for e0, e1 in _chunks(E, rows * cols):
        w = _rand((e1 - e0, rows, cols), g, device, std)
        got = q8.quantize_4bit(w, quant) if quant.packed else (*q8.quantize(w, quant, halves), None)
        del w
        if out is None:
            out = [None if t is None else torch.empty((E, *t.shape[1:]), dtype=t.dtype, device=device) for t in got]
        for o, t in zip(out, got):
            if o is not None:
                o[e0:e1] = t
    return tuple(out)


def _fill_float(block: nn.Module, g, device, dtype) -> None:
    """Every meta tensor of ``block`` made on ``device`` in ``dtype``: weights N(0, 1 / fan_in) (routers 2x, so that
    routing is decided), biases N(0, 0.02^2), router correction biases N(0, 0.05^2) in fp32."""
    for mname, m in block.named_modules():
        for n, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is None or t.device.type != "meta":
                continue
            shape = tuple(t.shape)
            if "bias" in n and len(shape) <= 2:
                std = 0.05 if "correction" in n else 0.02
                v = _rand(shape, g, device, std, torch.float32 if "correction" in n else dtype)
            else:
                fan = (shape[-2] if getattr(m, "is_transposed", False) else shape[-1]) if len(shape) >= 2 else 1
                std = (2.0 if mname.endswith(("gate", "router")) else 1.0) / fan**0.5
                v = torch.empty(shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                per = max(1, v[0].numel()) if v.dim() else 1
                for e0, e1 in _chunks(shape[0], per) if v.dim() >= 3 else [(None, None)]:
                    sl = v[e0:e1] if e0 is not None else v  # (stacked experts: drawn a chunk at a time)
                    sl.copy_(_rand(tuple(sl.shape), g, device, std))
            if n in m._parameters:
                m._parameters[n] = nn.Parameter(v, requires_grad=False)
            else:
                m._buffers[n] = v


def _fp8_experts(block: nn.Module, E: int, H: int, I: int, quant: QuantSpec, g, device) -> None:
    """``block.experts`` replaced by transformers' ``FP8Experts`` over random e4m3 weights (gated, no biases)."""
    from . import fp8_convert as C

    old = block.experts
    cls = C._fp8_experts_class(True)
    blk = (quant.block_n, quant.block_k) if quant.scale == "block" else None
    with torch.device("meta"):
        new = cls(old.config, **C._kwargs(cls.__init__, block_size=blk or (128, 128), activation_scheme="dynamic",
                                          scale_fmt="float", has_bias=False, has_gate=True, expert_dtype="fp8"))
    new.has_gate, new.has_bias, new.block_size = True, False, blk
    new.num_experts, new.hidden_dim, new.intermediate_dim = E, H, I
    for name, rows, cols, halves in (("gate_up_proj", 2 * I, H, 2), ("down_proj", H, I, 1)):
        q, s, _ = _quantized(E, rows, cols, quant, halves, g, device, 1.0 / cols**0.5)
        setattr(new, name, C._param(q))
        setattr(new, f"{name}_scale_inv", C._param(s))
    if hasattr(old, "act_fn"):
        new.act_fn = old.act_fn
    block.experts = new


def _packed_experts(block: nn.Module, family: str, E: int, H: int, I: int, quant: QuantSpec, g, device, dtype):
    """``block.experts`` replaced by a ``PackedExperts`` over random 4-bit weights (gpt-oss: its interleaved
    swiglu_oai and biases)."""
    from ..formats.packed import PackedExperts

    (w13, s13, z13), (w2, s2, z2) = (_quantized(E, r, c, quant, 1, g, device, 1.0 / c**0.5)
                                     for r, c in ((2 * I, H), (H, I)))
    if family == "gpt_oss":
        from ..formats.mxfp4 import swiglu_constants

        alpha, limit = swiglu_constants(block.experts, block.experts.config if hasattr(block.experts, "config")
                                        else None)
        b13, b2 = _rand((E, 2 * I), g, device, 0.02, dtype), _rand((E, H), g, device, 0.02, dtype)
        block.experts = PackedExperts(quant, w13, s13, w2, s2, z13, z2, b13, b2, gate_up="interleaved",
                                      activation="swiglu_oai", activation_alpha=alpha, activation_limit=limit)
    else:
        block.experts = PackedExperts(quant, w13, s13, w2, s2, z13, z2, gate_up="concat", activation="silu")


def _fp8_linears(block: nn.Module, quant: QuantSpec) -> None:
    """A shared expert's ``nn.Linear``s as ``FP8Linear`` (as an FP8 checkpoint loads them)."""
    from . import fp8_convert as C

    for name, mod in list(block.named_modules()):
        if type(mod) is nn.Linear and "shared" in name:
            C._convert_linear(block, name, mod, quant, "dynamic", 8.0 / 448.0)


def one_block(family: str, fmt: str, *, E: int, H: int, I: int, k: int, device="cpu", seed: int = 0,
              dtype: torch.dtype | None = None) -> OneBlock:
    """A :class:`OneBlock` holding ``family``'s block at these sizes, experts in ``fmt`` (module docstring), every
    tensor made on ``device``; ``dtype``: the model dtype (default bf16, fp32 for ``fmt="fp32"``)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    device = torch.device(device)
    dtype = dtype or (torch.float32 if fmt == "fp32" else torch.bfloat16)
    cfg = _config(family, E, H, I, k)
    cfg._experts_implementation = "grouped_mm"  # (what from_config / from_pretrained set by default)
    with torch.device("meta"):
        block = _block_class(family)(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    if fmt in ("mxfp4", "int4"):
        quant = QuantSpec.mxfp4() if fmt == "mxfp4" else INT4
        _packed_experts(block, family, E, H, I, quant, g, device, dtype)
    elif fmt.startswith("fp8"):
        if family == "gpt_oss":
            raise ValueError("fmt 'fp8': transformers' FP8Experts has no expert biases (gpt_oss)")
        quant = QuantSpec(scale="block", block_n=128, block_k=128) if fmt == "fp8" else QuantSpec(scale="channel")
        _fp8_experts(block, E, H, I, quant, g, device)
    _fill_float(block, g, device, dtype)
    if fmt.startswith("fp8"):
        _fp8_linears(block, quant)
    return OneBlock(block).eval()
