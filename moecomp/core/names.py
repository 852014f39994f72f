"""The attribute names the attribute reader (:mod:`moecomp.recognise.fallback`) reads a block's settings from, in one place.

Each tuple lists the spellings seen in transformers and remote-code models, most common first. The binder and the
attribute snapshot read ``JITTER_NAMES`` at call time (router / input jitter forces the original forward in
training). The FX recogniser reads none of these: it reads values from the graph.
"""

from __future__ import annotations

import torch
from torch import nn

TOPK_NAMES = ("top_k", "num_experts_per_tok", "moe_topk", "top_k_experts", "num_experts_per_token", "topk",
              "moe_k", "n_activated_experts")
NORM_NAMES = ("norm_topk_prob", "normalize_expert_weights", "renormalize")
GROUP_NAMES = ("num_group", "n_group", "num_expert_group", "n_expert_groups")
TOPK_GROUP_NAMES = ("topk_group", "num_limited_groups", "n_limited_groups")
SCORING_NAMES = ("scoring_func", "score_func", "expert_selection_fn", "router_score_function")
SCALE_NAMES = ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor",
               "routed_scaling", "scaling_factor")
# how routed and shared outputs combine: "average" halves both ((routed + shared) / 2, Cohere2-MoE), "sum" adds them
SHARED_COMBINE_NAMES = ("shared_expert_combination_strategy",)
# the block forward's argument carrying the tokens' ids (hash routing, DeepSeek-V4: ``tid2eid[input_ids]``)
TOKEN_ID_NAMES = ("input_ids", "token_ids")
JITTER_NAMES = ("jitter_noise", "router_jitter_noise", "input_jitter_noise")
LIMIT_NAMES = ("limit", "swiglu_limit", "clamp_limit", "activation_limit")
ALPHA_NAMES = ("alpha", "swiglu_alpha", "activation_alpha")
ACT_NAMES = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
             "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu", "relu2": "relu2"}


def read_attr(sources, names, kinds=(int, float, bool, str)):
    """The first plain value (not a module or tensor, of one of ``kinds``) found under one of ``names`` on the
    ``sources``, most specific source first; None when there is none."""
    for src in sources:
        for n in names:
            try:
                v = getattr(src, n)
            except Exception:
                continue
            if v is None or isinstance(v, (nn.Module, torch.Tensor)) or not isinstance(v, kinds):
                continue
            return v
    return None
