"""What the engine learns about a model's attention from one tiny forward (no source reading, no family names).

    base model (ids [1, S], positions 0..S-1, use_cache=False,
                attention_mask = M, or {"full_attention": Mf, "sliding_attention": Ms} for a model with both)
      with the configs pointed at a recording attention function ("moecomp_probe"), which notes each call
      (module, query, key, value, mask, kwargs) and answers as the config's own implementation would (sdpa) or as
      ``reference_attention`` (eager); forward pre-hooks keep each attention module's inputs
    1. mask per layer type: every attention module of decoder layer i was given the mask of ``layer_types[i]``
       (S = min(window, 254) + 2 and Ms is cut to S - 2 positions at most, so Mf and Ms differ); and the modules that
       ask for a window (``sliding_window`` = the config's) are exactly those given Ms
    2. eager attention the decode kernel can run: every attention module of an "eager" config, run again on its
       recorded inputs, gives the same output with the config's own implementation and with ``reference_attention``
       (softmax(q k^T * scaling + mask [+ the sink logit per head]) v, the sinks being the module's own [Hq]
       parameter passed as ``s_aux``); no soft-cap, no dropout

    fp32 models: max |own - ours| <= 1e-4 max |own|; 16-bit: 3e-2 (eager rounds the softmax to 16 bits: 5e-3 seen on a
    tiny bf16 gpt-oss, where leaving the sinks out differs by 0.5).
The forward writes no cache and leaves the configs as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import attention

PROBE = "moecomp_probe"
SHORT_WINDOW = 254  # the probe's sequence: S = min(window, SHORT_WINDOW) + 2 (8 without sliding layers)
TOL = {torch.float32: 1e-4, torch.float64: 1e-6}
TOL_16 = 3e-2
_ORIGIN: dict = {}  # id(config) -> its implementation, while a probe runs
_CALLS: list = []  # (module, mask, kwargs) of the running probe


@dataclass
class Probe:
    mask_per_type: bool = False  # the base model takes {"full_attention": ..., "sliding_attention": ...}
    why_mask: str | None = None
    window_kwarg: bool = False  # modules asking for the window are exactly those given the sliding mask
    eager: list = field(default_factory=list)  # "eager" configs whose attention modules compute reference_attention
    why_eager: str | None = None


def _record(module, query, key, value, attention_mask, **kwargs):
    _CALLS.append((module, attention_mask, kwargs))
    if _ORIGIN.get(id(module.config)) == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    sinks, _ = attention.sink_logits(module, query, kwargs)
    return attention.reference_attention(module, query, key, value, attention_mask, kwargs.get("scaling"), sinks)


def _masks(S: int, window: int | None, additive: bool, dtype, device):
    """The probe's masks [1, 1, S, S]: causal, and causal cut to ``window`` (None: no sliding mask)."""
    i = torch.arange(S, device=device)
    full = i[None, :] <= i[:, None]  # [S, S]
    out = {"full_attention": full}
    if window is not None:
        out["sliding_attention"] = full & (i[:, None] - i[None, :] < window)
    for k, m in out.items():
        m = m[None, None]
        out[k] = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min) \
            if additive else m
    return out


def _layer_of(layers) -> dict:
    return {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}


def _same(a, b) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                      and bool(torch.equal(a, b)))


def _check_masks(calls, masks, types, layers, window) -> tuple[str | None, bool]:
    """(why the layers did not get their layer type's mask, or None; whether ``sliding_window`` marks the sliding
    mask's modules exactly)."""
    where = _layer_of(layers)
    kwarg_ok = True
    for module, mask, kw in calls:
        i = where.get(id(module))
        if i is None or i >= len(types):
            return f"an attention module outside the decoder layers ({type(module).__name__})", False
        if not _same(mask, masks[types[i]]):
            other = [t for t, m in masks.items() if _same(mask, m)]
            return (f"layer {i} ({types[i]}) was given the mask of {other[0]}" if other else
                    f"layer {i} ({types[i]}) was given another mask than the one passed for its type"), False
        sliding = types[i] == "sliding_attention"
        kwarg_ok &= (kw.get("sliding_window") == window) == sliding
    return None, kwarg_ok


def _check_eager(calls, inputs, tol) -> str | None:
    """Why an eager module's own output differs from its output through ``reference_attention`` (None: none did)."""
    seen = set()
    for module, _, kw in calls:
        if id(module) in seen:
            continue
        seen.add(id(module))
        name = type(module).__name__
        if kw.get("softcap") or kw.get("dropout"):
            return f"{name} passes softcap {kw.get('softcap')!r} / dropout {kw.get('dropout')!r}"
        sinks = kw.get("s_aux", kw.get("sinks"))
        if sinks is not None and not any(sinks is p for p in module.parameters()):
            return f"{name} passes sinks that are not a parameter of it"
        args, kwargs = inputs[id(module)]
        cfg = module.config
        outs = []
        for impl in ("eager", PROBE):
            cfg._attn_implementation_internal = impl
            out = module(*args, **kwargs)
            outs.append((out[0] if isinstance(out, tuple) else out).float())
        cfg._attn_implementation_internal = PROBE
        own, ours = outs
        err = float((own - ours).abs().max() / own.abs().max().clamp_min(1e-30))
        if not err <= tol:
            return f"{name}: its eager output and softmax(q k^T * scaling + mask [+ sinks]) v differ by {err:.2g}"
    return None


@torch.no_grad()
def probe(model, types: list | None, window: int | None, eager: bool) -> Probe:
    """One tiny forward of ``model``'s base model. ``types``/``window``: the decoder layers' types and the sliding
    window (None: no sliding layers, no mask mapping asked); ``eager``: whether to probe the "eager" configs."""
    res = Probe()
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if base is None or not isinstance(layers, torch.nn.ModuleList) or not attention.register():
        res.why_mask = res.why_eager = "no base model with a list of decoder layers (or no AttentionInterface)"
        return res
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, _record)
    configs = {impl: attention.configs_of(model, impl) for impl in ("sdpa", "eager")}
    emb = model.get_input_embeddings()
    dtype, device = emb.weight.dtype, emb.weight.device
    S = min(window, SHORT_WINDOW) + 2 if types else 8
    ids = torch.arange(S, device=device)[None] * 7 % emb.num_embeddings  # [1, S]
    top = model.config._attn_implementation
    masks = _masks(S, min(window, S - 2) if types else None, top == "eager", dtype, device)
    inputs: dict = {}
    eager_ids = {id(c) for c in configs["eager"]}
    hooks = [m.register_forward_pre_hook(lambda m, a, k: inputs.setdefault(id(m), (a, k)), with_kwargs=True)
             for m in model.modules() if eager and id(getattr(m, "config", None)) in eager_ids and m is not base]
    _CALLS.clear()
    _ORIGIN.update({id(c): impl for impl, cs in configs.items() for c in cs})
    try:
        with attention.Swapped([(c, PROBE) for cs in configs.values() for c in cs], None):
            base(input_ids=ids, position_ids=torch.arange(S, device=device)[None],
                 attention_mask=masks if types else masks["full_attention"], use_cache=False)
            if not _CALLS:
                res.why_mask = res.why_eager = "no attention call in the probe's forward"
                return res
            if types:
                res.why_mask, res.window_kwarg = _check_masks(_CALLS, masks, types, layers, window)
                res.mask_per_type = res.why_mask is None
            calls = [c for c in _CALLS if id(c[0].config) in eager_ids]
            if eager and calls:
                res.why_eager = _check_eager(calls, inputs, TOL.get(dtype, TOL_16))
                if res.why_eager is None:
                    used = {id(c[0].config) for c in calls}
                    res.eager = [c for c in configs["eager"] if id(c) in used]
    except Exception as e:  # noqa: BLE001 - e.g. a model that cannot take the probe's masks: nothing recognised
        why = f"the probe's forward failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        return Probe(why_mask=why, why_eager=why)
    finally:
        for h in hooks:
            h.remove()
        _CALLS.clear()
        _ORIGIN.clear()
    return res
