"""The torch path's routing (``ops/torch_moe.py``; the parallel path on the same backend): router logits -> expert
ids and weights, vectorised over tokens, experts and top-k slots, written for the op apart from the oracle
(``moecomp.oracle.reference``, which tests compare it with). ``moecomp.core.spec`` has the rules; the routing contract on NaN /
inf logits is stated in the oracle and holds here.

Selection is one ``torch.topk`` over keys with no ties: each value's fp32 bits mapped to an int64 whose order is
the float order (NaN above +inf, -0.0 read as +0.0), and below them the expert index reversed, so equal values go to
the lower index and the k picks come largest first (``ranked``). The rest follows from it:

    logits        sanitised: NaN -> -inf, +inf -> the largest finite fp32
    score_then_topk   choice = score (or logit) + correction bias; groups: each group's top-2 sum (or max), the
                      topk_group best groups kept, the others' experts filled with -inf (or 0: group_mask_zero);
                      ids = ranked(choice), weights = the scores at the ids
    topk_then_score   ids = ranked(logits), weights = softmax over the k picks (or sigmoid of each)
    sparsemixer       ids = ranked(logits) (round j picks the largest free logit: the j-th of the order); every
                      round's masked softmax at once over a [T, k, E] stack (free in round j: ranked after j - 1)
    hash routing      ids = hash_table[token_ids] (``hash_routing.lookup``), weights the scores at them
    replay            ids = routes_in (``ops/routes.py``), weights the scores at them (topk_then_score: the score
                      of the k logits at them); routes_out / route_weights_out get the selection and final weights
    then              expert capacity: pairs past it (``capacity.kept``) dropped, before or after the renormalisation;
                      renormalise (+ the shared experts' gammas in one denominator) and scale; expert_scale at the
                      ids; weight_scale; finite; rounded to x's dtype (round_weights)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.spec import MoESpec
from . import capacity as cap
from . import route_weights as rw
from . import routes
from .backend import Routed
from .hash_routing import lookup
from .router_input import router_in

_NEG = float("-inf")


def router_logits(r2: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    """r2 [T, H] @ router_w.T (+ router_b) -> [T, R (+ G)] in r2's dtype (fp32 with ``router_fp32``), times
    ``router_scale`` in that dtype."""
    dt = torch.float32 if spec.router_fp32 else r2.dtype
    b = args.get("router_b")
    out = F.linear(r2.to(dt), args["router_w"].to(dt), None if b is None else b.to(dt))
    return out if spec.router_scale == 1.0 else out * spec.router_scale


def sanitised(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits with NaN read as -inf and +inf as the largest finite fp32 (the routing contract)."""
    f = logits.float()
    return torch.where(torch.isnan(f), torch.full_like(f, _NEG), f).clamp(max=rw.FLT_MAX)


def ranked(v: torch.Tensor, k: int) -> torch.Tensor:
    """ids [T, k] int64 of the k largest entries of each row of v [T, n], largest first, equal values to the lower
    index (a NaN above everything): one top-k over distinct int64 keys (module docstring)."""
    f = v.float() + 0.0  # -0.0 -> +0.0 (equal values, equal keys)
    bits = f.view(torch.int32)
    bits = torch.where(torch.isnan(f), torch.full_like(bits, 0x7FFFFFFF), bits)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: magnitude order reversed
    n = v.shape[-1]
    low = (n - 1) - torch.arange(n, device=v.device)  # the lower index, the larger key
    keys = bits.long() * (1 << 32) + low  # the value's order in the high 32 bits, the index below
    return torch.topk(keys, k, dim=-1).indices


def scored(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Sanitised logits [T, n] -> scores: softmax over the row, sigmoid, sqrt(softplus) or the logits ("none")."""
    if scoring == "softmax":
        e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "sqrtsoftplus":
        return torch.logaddexp(logits, torch.zeros_like(logits)).sqrt()
    if scoring == "none":
        return logits
    raise ValueError(f"scoring={scoring!r}; expected softmax, sigmoid, sqrtsoftplus or none")


def _group_limited(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """choice [T, E] with the experts outside the ``topk_group`` best groups filled (-inf, or 0 with
    ``group_mask_zero``); groups scored by their top-2 sum or max, equal scores to the lower group."""
    T, G = choice.shape[0], spec.n_group
    grouped = choice.view(T, G, spec.num_experts // G)  # [T, G, E / G]
    if spec.group_score == "max":
        gs = grouped.amax(dim=-1)
    else:
        best2 = grouped.sort(dim=-1, descending=True).values
        gs = best2[..., 0] + best2[..., 1]
    keep = torch.zeros(T, G, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, ranked(gs, spec.topk_group), True)
    fill = torch.full_like(grouped, 0.0 if spec.group_mask_zero else _NEG)
    return torch.where(keep[:, :, None], grouped, fill).reshape(T, spec.num_experts)


def _sparsemixer(logits: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's rounds on sanitised logits [T, E] -> (weights [T, k], ids [T, k]), all rounds at once: round j's
    pick m = the j-th ranked logit; its weight the softmax, at it, over the experts still free in round j whose gap
    passes (m - s) / max(|s|, m) <= 2 * eps (a 0 / 0 passes)."""
    T, E = logits.shape
    ids = ranked(logits, k)  # [T, k]
    m = logits.gather(1, ids)[:, :, None]  # [T, k, 1]
    s = logits[:, None, :]  # [T, 1, E]
    slot = torch.full((T, E), k, dtype=torch.long, device=logits.device)
    slot.scatter_(1, ids, torch.arange(k, device=logits.device).expand(T, k))  # each expert's round (k: never)
    free = slot[:, None, :] >= torch.arange(k, device=logits.device)[None, :, None]  # [T, k, E]
    far = (m - s) / torch.maximum(s.abs(), m) > 2 * eps
    w = scored(torch.where(free & ~far, s, torch.full_like(far, _NEG, dtype=s.dtype)), "softmax")  # [T, k, E]
    return w.gather(2, ids[:, :, None]).squeeze(2), ids


def _scores_at(scores: torch.Tensor, ids: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """The scores at ids; scoring "none": a -inf logit weighs 0."""
    w = scores.gather(1, ids)
    return w.masked_fill(w == _NEG, 0.0) if spec.scoring == "none" else w


def select(logits: torch.Tensor, bias, spec: MoESpec, given: torch.Tensor | None = None,
           replay: torch.Tensor | None = None):
    """Sanitised logits [T, R] -> (raw weights [T, k] fp32, ids [T, k] int64): the chosen experts' scores, before
    renormalisation and scaling (``given``: hash routing's ids; ``replay``: replayed ids, ``ops/routes.py``: the
    scores at them, or with topk_then_score the score of the k logits at them)."""
    k = spec.top_k
    if replay is not None:
        if spec.score_order == "topk_then_score":
            return scored(logits.gather(1, replay), spec.scoring), replay
        return _scores_at(scored(logits, spec.scoring), replay, spec), replay
    if spec.score_order == "sparsemixer":
        return _sparsemixer(logits, k, spec.jitter_eps)
    if given is not None:
        return _scores_at(scored(logits, spec.scoring), given, spec), given
    if spec.score_order == "topk_then_score":
        ids = ranked(logits, k)
        return scored(logits.gather(1, ids), spec.scoring), ids
    scores = scored(logits, spec.scoring)
    choice = scores
    if spec.has_correction_bias:
        choice = (logits if spec.bias_on_logits else scores) + bias.float()
    choice = torch.where(torch.isnan(choice), torch.full_like(choice, _NEG), choice)
    if spec.n_group > 1:
        choice = _group_limited(choice, spec)
    ids = ranked(choice, k)
    return _scores_at(scores, ids, spec), ids


def _weighed(w, gam, ids, keep, args: dict, spec: MoESpec):
    """Raw weights [T, k] (and raw gammas [T, G]) -> as the op uses them: dropped pairs (``keep`` False) zeroed before
    the renormalisation (renorm_after_drop) or after it; one denominator over the k and the G; scaling,
    expert_scale at the ids, weight_scale; finite."""
    if keep is not None and spec.renorm_after_drop:
        w = w.masked_fill(~keep, 0.0)
    total = None
    if gam is not None:
        total = w.sum(-1, keepdim=True) + gam.sum(-1, keepdim=True)
        gam = rw.normalised(gam, spec, total)
    w = rw.normalised(w, spec, total)
    if spec.expert_scale:
        w = w * args["expert_scale"].float()[ids]
    if keep is not None:
        w = w.masked_fill(~keep, 0.0)
    if spec.has_weight_scale:  # the learned scale of everything the routing gives
        ws = args["weight_scale"].float().reshape(())
        if gam is None:
            w = rw.finite(w)  # without gammas the routing's weights are final (finite) before the scale
        w, gam = w * ws, None if gam is None else gam * ws
    return rw.finite(w), None if gam is None else rw.finite(gam)


def route_logits(logits: torch.Tensor, args: dict, spec: MoESpec, group: int | None = None,
                 dtype: torch.dtype = torch.float32) -> Routed:
    """Router logits [T, R (+ G)] (any float dtype; NaN / inf read as the routing contract says) -> Routed(ids [T, k]
    int64, weights [T, k] fp32, gammas [T, G] fp32 | None, gate None). ``args``: the op's tensors the routing reads
    (correction_bias, hash_table / token_ids, expert_scale, weight_scale; routes_in / routes_out / route_weights_out:
    ``ops/routes.py``). ``group``: tokens per capacity group
    (default: all T); dropped pairs' ids -1, weight 0. Weights and gammas rounded through ``dtype`` where
    ``spec.round_weights``."""
    logits = sanitised(logits)
    R, G = spec.router_width, spec.gamma_rows
    given = lookup(args["hash_table"], args["token_ids"], spec) if spec.hash_routing else None
    w, ids = select(logits[:, :R], args.get("correction_bias"), spec, given, routes.given(args, spec))
    chosen = ids  # routes_out: the selection, before an expert capacity's drop
    gam = scored(logits[:, R:R + G], spec.scoring) if G else None
    keep = cap.kept(ids, spec, logits.shape[0] if group is None else group) if spec.has_capacity else None
    w, gam = _weighed(w.float(), gam, ids, keep, args, spec)
    if keep is not None:
        ids = ids.masked_fill(~keep, -1)
    if spec.round_weights:
        w = rw.rounded(w, dtype)
        gam = None if gam is None else rw.rounded(gam, dtype)
    routes.record(args, chosen, w)
    return Routed(ids, w, gam, None)


def route_all(x2: torch.Tensor, args: dict, spec: MoESpec, shape) -> Routed:
    """The op's routing of x2 [T, H] (``args`` with the fused gate split; ``shape``: x's, for the capacity's groups):
    the router's input and GEMM, then ``route_logits`` (rounding through x's dtype)."""
    logits = router_logits(router_in(x2, args, spec), args, spec)  # [T, R (+ G)]
    return route_logits(logits, args, spec, cap.group_tokens(shape, spec), x2.dtype)
