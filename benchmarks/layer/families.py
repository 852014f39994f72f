"""The families (five, and Llama 4 Scout since issue 21): their configs (real and tiny sizes), the HF block built from transformers' own class, and the
``MoESpec`` moecomp's recogniser gives for it (the benchmark has no spec of its own)."""

from __future__ import annotations

import dataclasses
import importlib
import time

import torch

from . import common


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # key used by --families and in PEERS_MD
    label: str
    module: str  # transformers module holding config + block classes
    config_cls: str
    block_cls: str
    full: dict  # config kwargs at the real sizes
    tiny: dict  # config kwargs for --tiny (CPU smoke runs)
    aliases: tuple = ()
    tiny_fp8: dict = dataclasses.field(default_factory=dict)  # --tiny --dtype fp8: sizes the 128x128 blocks divide


def _attn(heads, kv, **extra):
    return dict(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, **extra)


# --tiny --dtype fp8: H and I multiples of 128 (vLLM's fp8 block kernel needs them; one 128x128 block per matrix)
_FP8_TINY = dict(hidden_size=128)

FAMILIES = {
    f.name: f
    for f in (
        Family("mixtral", "Mixtral-8x7B", "transformers.models.mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
               dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    router_jitter_noise=0.0, **_attn(32, 8)),
               dict(hidden_size=64, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                    router_jitter_noise=0.0, **_attn(4, 2)),
               tiny_fp8=dict(_FP8_TINY, intermediate_size=128)),
        Family("qwen3", "Qwen3-30B-A3B", "transformers.models.qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
               dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                    norm_topk_prob=True, **_attn(32, 4, head_dim=128)),
               dict(hidden_size=64, moe_intermediate_size=32, num_experts=32, num_experts_per_tok=8,
                    norm_topk_prob=True, **_attn(4, 2, head_dim=16)),
               ("qwen3_moe", "qwen3-30b-a3b"), tiny_fp8=dict(_FP8_TINY, moe_intermediate_size=128)),
        Family("qwen2", "Qwen1.5-MoE-A2.7B", "transformers.models.qwen2_moe", "Qwen2MoeConfig",
               "Qwen2MoeSparseMoeBlock",
               dict(hidden_size=2048, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                    num_experts_per_tok=4, norm_topk_prob=False, **_attn(16, 16)),
               dict(hidden_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=96, num_experts=12,
                    num_experts_per_tok=4, norm_topk_prob=False, **_attn(4, 2)),
               ("qwen2_moe", "qwen1.5", "qwen15"),
               tiny_fp8=dict(_FP8_TINY, moe_intermediate_size=128, shared_expert_intermediate_size=256)),
        Family("olmoe", "OLMoE-1B-7B", "transformers.models.olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
               dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                    norm_topk_prob=False, **_attn(16, 16)),
               dict(hidden_size=64, intermediate_size=32, num_experts=16, num_experts_per_tok=8,
                    norm_topk_prob=False, **_attn(4, 4)),
               tiny_fp8=dict(_FP8_TINY, intermediate_size=128)),
        Family("deepseek", "DeepSeek-V3 layer", "transformers.models.deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
               dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                    first_k_dense_replace=0, **_attn(128, 128)),
               # tiny: the shared expert's width (48) differs from E (32): the FX pass reads [E, H] tensors used in
               # the block as per-expert biases, so shared weights of [E, H] would make it refuse the block
               dict(hidden_size=64, moe_intermediate_size=48, n_routed_experts=32, num_experts_per_tok=8,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                    first_k_dense_replace=0, **_attn(4, 4)),
               ("deepseek_v3", "deepseek-v3", "dsv3"), tiny_fp8=dict(_FP8_TINY, moe_intermediate_size=128)),
    )
}
FAMILIES["llama4"] = Family(
    # transformers' Llama4TextMoe returns (out [T, H], router logits); the benchmark runs it through ``Llama4Block``
    # (below: its output only, in x's shape), which moecomp recognises like the model's own layer
    "llama4", "Llama 4 Scout", "transformers.models.llama4", "Llama4TextConfig", "Llama4Block",
    dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
         num_experts_per_tok=1, **_attn(40, 8, head_dim=128)),
    dict(hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=8, num_experts_per_tok=1,
         **_attn(4, 2, head_dim=16)),
    ("llama4_scout", "llama-4-scout"), tiny_fp8=dict(_FP8_TINY, intermediate_size=128))
GRID_FAMILIES = tuple(FAMILIES)  # bench_moe's "all": the layer grid (gpt-oss, below, is bench_quant4's)
for _name, _label, _E in (("gpt_oss20b", "gpt-oss-20b", 32), ("gpt_oss120b", "gpt-oss-120b", 128)):
    # transformers' GptOssMLP returns (out, router scores); ``GptOssBlock`` (below) returns the output only
    FAMILIES[_name] = Family(
        _name, _label, "transformers.models.gpt_oss", "GptOssConfig", "GptOssBlock",
        dict(hidden_size=2880, intermediate_size=2880, num_local_experts=_E, num_experts_per_tok=4,
             **_attn(64, 8, head_dim=64)),
        dict(hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=4,
             **_attn(4, 2, head_dim=16)),
        (_label,), tiny_fp8=dict(_FP8_TINY, intermediate_size=128))
FAMILY_ALIASES = {a: f.name for f in FAMILIES.values() for a in f.aliases}


def _llama4_block():
    """transformers' Llama4TextMoe with the benchmark's block contract: x [1, T, H] -> [1, T, H] (no logits)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    class Llama4Block(Llama4TextMoe):
        def forward(self, hidden_states):
            return super().forward(hidden_states)[0].view(hidden_states.shape)

    return Llama4Block


def _gpt_oss_block():
    """transformers' GptOssMLP with the benchmark's block contract: x [1, T, H] -> [1, T, H] (no router scores)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    class GptOssBlock(GptOssMLP):
        def forward(self, hidden_states):
            return super().forward(hidden_states)[0].view(hidden_states.shape)

    return GptOssBlock


LOCAL_BLOCKS = {"Llama4Block": _llama4_block, "GptOssBlock": _gpt_oss_block}


def family_config(fam: Family, tiny: bool, fp8: bool = False) -> dict:
    """The config kwargs of a run: real sizes, tiny ones, or (tiny fp8) tiny ones with H and I multiples of 128."""
    if not tiny:
        return dict(fam.full)
    return dict(fam.tiny, **(fam.tiny_fp8 if fp8 else {}))


def build_block(fam: Family, tiny: bool, device: torch.device, seed: int, fp8: bool = False):
    """The HF block on ``device`` in the run's dtype (router / bias buffers keep the dtype the class gives them),
    every floating parameter and the correction bias drawn in place (never zeros)."""
    mod = importlib.import_module(fam.module)
    cfg = getattr(mod, fam.config_cls)(**family_config(fam, tiny, fp8))
    block_cls = LOCAL_BLOCKS[fam.block_cls]() if fam.block_cls in LOCAL_BLOCKS else getattr(mod, fam.block_cls, None)
    if block_cls is None:  # older layouts export the block from modeling_* only
        block_cls = getattr(importlib.import_module(f"{fam.module}.modeling_{fam.module.rsplit('.', 1)[1]}"),
                            fam.block_cls)
    try:  # set before construction too (some versions may read it in __init__)
        set_experts_impl(None, cfg, "grouped_mm")
    except Exception:
        pass
    prev = torch.get_default_dtype()
    torch.set_default_dtype(common.DTYPE)
    try:
        with torch.device(device):
            block = block_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    block.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.requires_grad_(False)
            if p.is_floating_point():
                p.normal_(0.0, common.INIT_STD, generator=gen)
        for name, b in block.named_buffers():
            if b.is_floating_point() and "bias" in name:
                b.normal_(0.0, common.CORRECTION_BIAS_STD, generator=gen)
    return cfg, block


def set_experts_impl(block, cfg, impl: str) -> None:
    """Select transformers' experts path ("eager" | "grouped_mm") on this block, across 5.17 .. 5.24 APIs.

    Both versions dispatch on ``experts.config._experts_implementation`` at call time; newer ones also have
    ``set_experts_implementation`` on PreTrainedModel (not on a bare block), used when a module offers it."""
    ex = getattr(block, "experts", None) if block is not None else None
    for obj in (block, ex):
        f = getattr(obj, "set_experts_implementation", None) if obj is not None else None
        if callable(f):
            try:
                f(impl)
            except Exception:
                pass
    configs = [cfg]
    ex_cfg = getattr(ex, "config", None)
    if ex_cfg is not None and ex_cfg is not cfg:
        configs.append(ex_cfg)
    for c in configs:
        c._experts_implementation = impl
    got = getattr(ex_cfg if ex_cfg is not None else cfg, "_experts_implementation", None)
    if got != impl:
        raise RuntimeError(f"could not select experts implementation {impl!r} (config says {got!r})")


# ------------------------------------------------------------------------------------- MoESpec from moecomp
class BlockRefused(RuntimeError):
    """moecomp's recogniser refused a family's block: the benchmark has no spec of its own to fall back to."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"moecomp refused the block [{code}]: {reason}")
        self.code, self.reason = code, reason


def block_spec(block, record: dict | None = None):
    """(MoESpec, {MOE_ARGS name: tensor or None}) for ``block``, from moecomp's own recogniser and verify stage
    (``moecomp.recognise.recognise.match_block``, as ``moecomp.optimize`` sees the block, without binding it); the tensors are
    the block's own (``moecomp.bind.bind.bound_tensors``). The block is put in eval mode first. Raises
    :class:`BlockRefused` (with the reject code) when moecomp does not take the block. ``record``, when given, receives
    how the block was recognised (for the JSON)."""
    from moecomp.core import reject
    from moecomp.bind.bind import bound_tensors
    from moecomp.core.args import MOE_ARGS
    from moecomp.recognise.recognise import match_block

    block.eval()
    t0 = time.perf_counter()
    try:
        v = match_block(block)
    except reject.Refused as e:
        code = getattr(e.code, "name", None) or str(e.code)
        if record is not None:
            record.update(refused=dict(code=code, reason=e.reason))
        raise BlockRefused(code, e.reason) from e
    m = v.match
    tensors = dict(zip(MOE_ARGS, bound_tensors(block, m.spec, m.bindings, m.derived)))
    if record is not None:
        record.update(method=m.evidence.method, checked=m.evidence.checked, verify_max_rel_err=v.max_rel_err,
                      bindings={k: p for k, p in m.bindings.items() if p is not None},
                      derived=[d.name for d in m.derived], notes=list(m.evidence.notes),
                      seconds=round(time.perf_counter() - t0, 2))
    return m.spec, tensors


def family_label(fam: Family, spec) -> str:
    sh = "-"
    if spec.shared is not None:
        sh = str(spec.shared.intermediate_size) + (" gated" if spec.shared.gate != "none" else "")
    topk = str(spec.top_k)
    if spec.n_group > 1:
        topk += f" grouped {spec.n_group}/{spec.topk_group}"
    return (f"{fam.label} ({spec.hidden_size}, {spec.intermediate_size}, {spec.num_experts}, {topk}, {sh})")
