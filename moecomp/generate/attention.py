"""Attention inside the engine's decode step: ``torch.ops.moecomp.decode_attention`` in place of transformers' own.

transformers' sdpa path, given a mask and grouped-query heads, repeats K and V to the query heads and attends over
the whole static cache (at batch 32 and a 768-slot cache that copy alone is most of a Qwen3-MoE decode step); its
eager path (gpt-oss: attention sinks, no sdpa) does the same in several kernels. The engine registers two functions
in transformers' ``AttentionInterface`` and, only while it runs a decode step (eagerly or under capture), points the
model's configs at them::

    attention module -> ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
      "moecomp_decode"        configs that were "sdpa"
      "moecomp_decode_eager"  configs that were "eager" and whose every attention module, on one tiny forward, gave
                              the output of ``reference_attention`` (attention_probe.py): softmax(q k^T * scaling +
                              mask [+ one sink logit per head]) v
    one query token, the engine's 4-D bool mask, no soft-cap / dropout
        -> decode_attention(q, k_cache, v_cache, keep = mask[:, 0, 0], n = cache positions written,
                            sinks = the module's sink logits [Hq] (passed as ``s_aux``), window)
    anything else -> transformers' sdpa ("moecomp_decode"), ``reference_attention`` ("moecomp_decode_eager")

``n`` (a device scalar the step sets before the forward) bounds the positions read. The mask is what decides which
positions take part; ``window`` only saves reading the cache below ``n - window`` in a sliding layer, and is passed
only where the probe saw that the modules asking for that window are exactly those given the sliding mask (otherwise
0: the whole cache is read and masked). Sinks are taken from "eager" configs only: transformers' sdpa ignores them, and
so does ``moecomp_decode``. Configs of other implementations (flash, flex, ...) are left as they are.
"""

from __future__ import annotations

import torch

from ..ops import attention as _attention_op  # noqa: F401  (registers torch.ops.moecomp.decode_attention)

NAME = "moecomp_decode"  # in place of "sdpa"
NAME_EAGER = "moecomp_decode_eager"  # in place of a recognised "eager"
# The running step's valid cache length ([] int64 on the device; None outside steps) and the window a module's
# ``sliding_window`` must equal to have the kernel read only its window (0: never).
STATE: dict = {"n": None, "window": 0}
_registered = False


def reference_attention(module, query, key, value, attention_mask, scaling=None, sinks=None):
    """softmax(q k^T * scaling + mask [+ sink]) v in fp32, grouped-query heads without copies: query [B, Hq, q, Dk],
    key / value [B, Hkv, L, D], attention_mask None / bool (True: attend) / additive [B or 1, 1, q, >= L], sinks
    None or [Hq] (a logit per head joining each softmax, no value) -> out [B, q, Hq, Dv] in the query's dtype."""
    B, Hq, T, _ = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = Hq // Hkv
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    qg = query.float().reshape(B, Hkv, G, T, -1)  # [B, Hkv, G, T, Dk]
    s = torch.einsum("bhgtd,bhld->bhgtl", qg, key.float()) * scale  # [B, Hkv, G, T, L]
    if attention_mask is not None:
        m = attention_mask[..., :L]  # [B or 1, 1, T, L]
        m = m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], Hkv, G, T, L)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    if sinks is None:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    else:
        sk = sinks.float().reshape(1, Hkv, G, 1, 1).expand(B, Hkv, G, T, 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :L]
    out = torch.einsum("bhgtl,bhld->bhgtd", p, value.float())  # [B, Hkv, G, T, Dv]
    return out.reshape(B, Hq, T, -1).transpose(1, 2).to(query.dtype), None


def sink_logits(module, query, kwargs):
    """The attention sinks a module passes (``s_aux``, or ``sinks``): (tensor [Hq] or None, ok). Not ok: something
    else under those names."""
    for name in ("s_aux", "sinks"):
        t = kwargs.get(name)
        if t is not None:
            ok = isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == query.shape[1]
            return (t if ok else None), ok
    return None, True


def _fast(query, key, attention_mask, dropout, softcap) -> bool:
    return (STATE["n"] is not None and query.shape[2] == 1 and not dropout and not softcap
            and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4 and attention_mask.shape[-1] == key.shape[2]
            and query.shape[1] % key.shape[1] == 0)


def _decode(query, key, value, attention_mask, scaling, sinks, sliding_window):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = STATE["window"] if sliding_window and sliding_window == STATE["window"] else 0
    out = torch.ops.moecomp.decode_attention(query[:, :, 0], key, value, attention_mask[:, 0, 0], STATE["n"],
                                             float(scale), sinks, int(window))
    return out[:, None], None  # [B, 1, Hq, Dv]


def decode_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, **kwargs):
    """In place of "sdpa" (transformers' attention-function contract): query [B, Hq, q, Dk], key / value
    [B, Hkv, L, D] -> (out [B, q, Hq, Dv], None). Sinks are not applied (sdpa does not)."""
    sinks, _ = sink_logits(module, query, kwargs)
    if not _fast(query, key, attention_mask, dropout, softcap) or sinks is not None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                                               **kwargs)
    return _decode(query, key, value, attention_mask, scaling, None, sliding_window)


def decode_attention_eager_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   sliding_window=None, softcap=None, **kwargs):
    """In place of a recognised "eager" (the probe found its modules compute ``reference_attention``): the decode
    kernel with the module's sinks; anything else through ``reference_attention`` (eval mode: no dropout)."""
    sinks, ok = sink_logits(module, query, kwargs)
    if not ok or softcap or dropout:
        raise ValueError(f"moecomp decode attention: an attention call the probe did not see (softcap {softcap!r}, "
                         f"dropout {dropout!r}, sinks {kwargs.get('s_aux', kwargs.get('sinks'))!r})")
    if not _fast(query, key, attention_mask, dropout, softcap):
        return reference_attention(module, query, key, value, attention_mask, scaling, sinks)
    return _decode(query, key, value, attention_mask, scaling, sinks, sliding_window)


def register() -> bool:
    """Add the engine's functions to transformers' AttentionInterface (once). False when this transformers has none."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionInterface.register(NAME_EAGER, decode_attention_eager_forward)
    _registered = True
    return True


def configs_of(model, impl: str) -> list:
    """The distinct config objects of ``model``'s modules that select the attention implementation ``impl``."""
    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and getattr(cfg, "_attn_implementation_internal", None) == impl:
            seen[id(cfg)] = cfg
    return list(seen.values())


class Swapped:
    """Context: each (config, name) pair's config selects ``name``; ``STATE`` holds ``n`` and ``window``."""

    def __init__(self, pairs, n: torch.Tensor, window: int = 0):
        self.pairs, self.n, self.window = pairs, n, window
        self.saved: list = []

    def __enter__(self):
        self.saved = [c._attn_implementation_internal for c, _ in self.pairs]
        for c, name in self.pairs:
            c._attn_implementation_internal = name
        STATE["n"], STATE["window"] = self.n, self.window
        return self

    def __exit__(self, *exc):
        for (c, _), impl in zip(self.pairs, self.saved):
            c._attn_implementation_internal = impl
        STATE["n"], STATE["window"] = None, 0
        return False
