"""Custom ops (``torch.ops.moecomp.*``) and their launch wrappers. Importing this registers the ops."""

from .attention import decode_attention
from .fp8_linear import fp8_linear
from .linear16 import skinny_linear
from .linear_group import skinny_group
from .linear4 import linear_4bit
from .linear_add_norm import linear_add_norm
from .norm_group import norm_group
from .qk_rope import qk_norm_rope_cache
from .moe_op import (EXPERT_ARGS, HASH_ARGS, LATENT_ARGS, MOE_ARGS, OP_ARGS, QUANT_ARGS, check_args, moe_experts,
                     moe_forward)

__all__ = ["MOE_ARGS", "EXPERT_ARGS", "QUANT_ARGS", "LATENT_ARGS", "HASH_ARGS", "OP_ARGS", "check_args", "moe_forward",
           "moe_experts", "decode_attention", "fp8_linear", "skinny_linear", "skinny_group",
           "norm_group", "qk_norm_rope_cache", "linear_4bit", "linear_add_norm"]
