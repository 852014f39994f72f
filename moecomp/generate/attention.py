"""Attention inside the engine's decode step: ``torch.ops.moecomp.decode_attention`` in place of transformers' sdpa.

transformers' sdpa path, given a mask and grouped-query heads, repeats K and V to the query heads and attends over
the whole static cache (at batch 32 and a 768-slot cache that copy alone is most of a Qwen3-MoE decode step). The
engine registers ``moecomp_decode`` in transformers' ``AttentionInterface`` and, only while it runs a decode step
(eagerly or under capture), points the model's configs at it::

    attention module -> ALL_ATTENTION_FUNCTIONS[config._attn_implementation = "moecomp_decode"]
        one query token, the engine's 4-D bool mask, no sliding window / soft-cap / sinks / dropout
            -> decode_attention(q, k_cache, v_cache, keep = mask[:, 0, 0], n = cache positions written)
        anything else -> transformers' sdpa, unchanged

``n`` (a device scalar the step sets before the forward) bounds the positions read. Configs whose implementation is
not "sdpa" (eager attention, flash, flex, ...) are left as they are.
"""

from __future__ import annotations

import torch

from ..ops import attention as _attention_op  # noqa: F401  (registers torch.ops.moecomp.decode_attention)

NAME = "moecomp_decode"
STATE: dict = {"n": None}  # the running step's valid cache length ([] int64 on the device), None outside steps
_registered = False


def decode_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function contract: query [B, Hq, q, Dk], key / value [B, Hkv, L, D] ->
    (out [B, q, Hq, Dv], None)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    n = STATE["n"]
    if (n is None or query.shape[2] != 1 or dropout or sliding_window or softcap
            or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None
            or not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool
            or attention_mask.dim() != 4 or attention_mask.shape[-1] != key.shape[2]
            or query.shape[1] % key.shape[1] != 0):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                                               **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.moecomp.decode_attention(query[:, :, 0], key, value, attention_mask[:, 0, 0], n, float(scale))
    return out[:, None], None  # [B, 1, Hq, Dv]


def register() -> bool:
    """Add ``moecomp_decode`` to transformers' AttentionInterface (once). False when this transformers has none."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, decode_attention_forward)
    _registered = True
    return True


def sdpa_configs(model) -> list:
    """The distinct config objects of ``model``'s modules that select transformers' sdpa attention."""
    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and getattr(cfg, "_attn_implementation_internal", None) == "sdpa":
            seen[id(cfg)] = cfg
    return list(seen.values())


class Swapped:
    """Context: the given configs select ``moecomp_decode`` and ``STATE["n"]`` is ``n``."""

    def __init__(self, configs, n: torch.Tensor):
        self.configs, self.n = configs, n

    def __enter__(self):
        for c in self.configs:
            c._attn_implementation_internal = NAME
        STATE["n"] = self.n
        return self

    def __exit__(self, *exc):
        for c in self.configs:
            c._attn_implementation_internal = "sdpa"
        STATE["n"] = None
        return False
