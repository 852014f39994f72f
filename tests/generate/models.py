"""Tiny random-weight HF causal LMs for the generate() tests (built from config, no downloads)."""

from __future__ import annotations

import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=96, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=8,
                                                                 num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(moe_intermediate_size=32, num_experts=6,
                                                                 num_experts_per_tok=2,
                                                                 shared_expert_intermediate_size=48)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=None)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, first_k_dense_replace=0)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
}


def build(family: str, device="cpu", dtype=torch.float32, layers: int = 2, seed: int = 0, **over):
    import transformers

    cls, cfg_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(num_hidden_layers=layers, **{**TINY, **extra, **over})
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, cls)._from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "correction_bias" in n:
                p.normal_(0.0, 0.01)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model


def prompts(vocab: int, batch: int, length: int, seed: int = 0, left_pad: tuple = ()) -> tuple:
    """(input_ids, attention_mask): random tokens >= 3 (not pad / bos / eos); row i is left-padded by left_pad[i]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(left_pad):
        ids[i, :n] = 0
        mask[i, :n] = 0
    return ids, mask


def greedy_cpu_engine(ref, new: int = 4) -> tuple:
    """``moecomp.optimize`` of a copy of ``ref``, then greedy ``generate`` (batch 2, 7 prompt tokens, one left-padded
    by 2) on the CPU engine with compiled layers (Dynamo's "eager" backend): (tokens, the lm_head's output of every
    step, the engine). The compile and ``new - 1`` decode steps checked."""
    import copy

    import moecomp

    opt = moecomp.optimize(copy.deepcopy(ref))
    opt.generate.cpu = True
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "eager"
    seen = []
    hook = opt.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=9, left_pad=(0, 2))
    try:
        out = opt.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    finally:
        hook.remove()
    assert opt.generate.last["layers"] == "compiled" and eng.compile_error is None, eng.compile_traceback
    assert opt.generate.last["decode_steps"] == new - 1  # the prefill gives the first token
    return out, seen, eng


def logits_close(logits_on, logits_off, steps: int = 4) -> None:
    """Each step's lm_head output within 1e-5 of the largest |logit| of the other run's."""
    assert len(logits_on) == len(logits_off) == steps
    for a, b in zip(logits_on, logits_off):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
