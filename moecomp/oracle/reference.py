"""Plain-PyTorch MoE: the oracle every test compares against.

Written for clarity, not speed: fp32 (or fp64) math, a loop over experts, nothing fused. It takes exactly the
arguments of ``torch.ops.moecomp.moe_forward`` (see ``moecomp.ops.moe_op.MOE_ARGS``) plus a ``MoESpec``.
Zero experts (``spec.zero_experts``): routing runs over the router's E + Z logits; ids >= E add ``weight * x``
(:func:`zero_expert_term`). Sparsemixer routing (``score_order == "sparsemixer"``, PhiMoE): :func:`sparsemixer`.
Latent experts (``spec.latent_size``): the routed experts run on
``latent_in(x)`` [T, L] and their combined output goes through ``latent_out`` [L -> H] before the shared experts
(which read x) are added (:func:`latent_in` / :func:`latent_out`). Hash routing (``spec.hash_routing``): the ids are
``hash_table[token_ids]`` (:func:`hash_ids`), the weights the scores at them (:func:`route` with ``ids`` given).
Expert capacity (``spec.capacity`` / ``capacity_factor``): :func:`capacity_kept` ranks each group's pairs; a dropped
pair leaves :func:`route` with id -1 and weight 0, and the experts loop never meets it.
The router's own input (``spec.router_input`` / ``router_norm`` / ``router_in_scale`` / ``router_in_const``):
:func:`router_input`; per-expert weight multipliers (``spec.expert_scale``): :func:`expert_scaled`, in :func:`route`.
Router logit scale (``spec.router_scale``): in :func:`router_logits`. Norms (``spec.latent_norm`` on the latent
input, ``spec.expert_norm`` on each pair's expert output, ``shared.norm`` on the shared one): :func:`rms_norm`. (These
steps live in ``reference_steps.py``, the experts' activations (:func:`gated_activation`, :func:`spec_gated`) in
``reference_activations.py``; both re-exported here.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from .reference_quant import dequantize_weight as _deq, fake_quant_act as _act_q
from .reference_activations import (  # noqa: F401  (re-exported: reference.gated_activation, ...)
    activation, gated_activation, softcap, spec_gated)
from .reference_steps import (  # noqa: F401  (re-exported: reference.rms_norm, ... as before the split)
    expert_scaled, latent_in, latent_out, rms_norm, router_input, router_logits)
from ..core.spec import MoESpec


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    return logits


def _topk_low_index_ties(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k that breaks ties by the lower index (what our kernels do), in any order-insensitive use."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def group_scores(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """[T, E] -> [T, n_group]: each group's top-2 sum (or max)."""
    T, E, G = choice.shape[0], spec.num_experts, spec.n_group
    g = choice.view(T, G, E // G)
    return g.topk(2, dim=-1).values.sum(-1) if spec.group_score == "top2_sum" else g.max(dim=-1).values


def _kept_experts(gs: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Group scores [T, n_group] -> [T, E] bool: the experts of the topk_group best groups (ties: lower index)."""
    T, E, G = gs.shape[0], spec.num_experts, spec.n_group
    _, keep = _topk_low_index_ties(gs, spec.topk_group)  # [T, topk_group]
    mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
    return mask[:, :, None].expand(T, G, E // G).reshape(T, E)


# The routing contract on rows that hold NaN or +-inf (every path: this oracle, the CPU path, the Triton kernel):
#  - a NaN logit is read as -inf, a +inf logit as the largest finite fp32 (so softmax splits a row's weight evenly
#    over its +inf entries, sigmoid gives 1); a NaN choice value (a NaN correction bias, a softmax over a row with no
#    finite logit) is read as -inf;
#  - each token gets k distinct ids in [0, E): the k largest choice values, ties (-inf ones included) to the lower
#    index, so a row with no candidate left (all NaN) takes the lowest ids its group selection leaves;
#  - weights are finite: a selected raw score ("none" scoring) of -inf weighs 0, a NaN weight (0 / 0 in the
#    renormalisation of an all-NaN row, a softmax over no finite logit) is 0, +-inf is clamped to +-FLT_MAX.
#  Rows with only finite logits are unchanged by all of this.
FLT_MAX = float(torch.finfo(torch.float32).max)


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf, +inf -> FLT_MAX (the routing contract above); finite values and -inf unchanged."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=FLT_MAX, neginf=float("-inf"))


def finite_weights(w: torch.Tensor, limit: float = FLT_MAX) -> torch.Tensor:
    """NaN -> 0, then clamped to [-limit, limit] (the routing contract's last step)."""
    return torch.nan_to_num(w, nan=0.0, posinf=limit, neginf=-limit).clamp(-limit, limit)


def hash_ids(hash_table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Hash routing's ids: ``hash_table[token_ids]`` [T, k] int64 (one row per token id, flattened). Plain indexing:
    the oracle assumes ids in range (the op checks them)."""
    return hash_table[token_ids.reshape(-1).long()].long()


def group_size(shape, spec: MoESpec) -> int:
    """Tokens per capacity group of an input x of ``shape`` [..., H] (``spec.capacity_per``): x's second-to-last dim
    for "sequence" (a 2-D x is one sequence), every token for "call"."""
    if spec.capacity_per == "sequence" and len(shape) >= 3:
        return int(shape[-2])
    return math.prod(shape[:-1])


def capacity_ranks(ids: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """[T, k] int64: each pair's rank in its expert (ids in [0, width)), per group of ``group`` consecutive tokens:
    the number of pairs to the same expert before it in slot-major order (a cumulative sum over the one-hot)."""
    T, k = ids.shape
    if T == 0:
        return torch.zeros_like(ids, dtype=torch.long)
    G = T // group
    pairs = F.one_hot(ids.long(), width).reshape(G, group, k, width).transpose(1, 2).reshape(G, k * group, width)
    rank = ((pairs.cumsum(1) - pairs) * pairs).sum(-1)  # [G, k * group]
    return rank.reshape(G, k, group).transpose(1, 2).reshape(T, k)


def capacity_kept(ids: torch.Tensor, spec: MoESpec, group: int) -> torch.Tensor:
    """[T, k] bool: the pairs an expert capacity keeps (the rule in ``moecomp.core.spec``): rank (:func:`capacity_ranks`)
    below ``spec.capacity_for(group)``."""
    return capacity_ranks(ids, spec.router_width, group) < spec.capacity_for(group)


def renorm_and_scale(weights: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """The routing weights [T, k] renormalised (``spec.renormalize``: over the k, denominator ``max(sum +
    renorm_eps, renorm_min)``) and times ``routed_scaling_factor``."""
    if spec.renormalize:
        denom = weights.sum(-1, keepdim=True) + spec.renorm_eps
        if spec.renorm_min > 0:
            denom = denom.clamp(min=spec.renorm_min)
        weights = weights / denom
    return weights * spec.routed_scaling_factor


def replay_refusal(spec: MoESpec) -> str | None:
    """Why replaying given ids into this spec's routing is not meaningful (None where it is): sparsemixer's weights
    are rounds over the experts its own picks left free, and hash routing's ids are the table's, not a choice."""
    if spec.score_order == "sparsemixer":
        return "sparsemixer routing (PhiMoE): each weight depends on the rounds of its own selection"
    if spec.hash_routing:
        return "hash routing: the ids are hash_table[token_ids], not chosen from the scores"
    return None


def replayed(logits: torch.Tensor, ids: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Routing replay (issue 43): the raw weights [T, k] of given ids [T, k] over sanitised logits [T, E]: the
    scores at the ids (softmax / sigmoid / ... over all E), or with ``topk_then_score`` the score of the k given
    logits (softmax over them, or sigmoid of each). No selection: the correction bias and the group limits, which
    only select, play no part; the renormalisation and scaling follow in :func:`route`."""
    why = replay_refusal(spec)
    if why is not None:
        raise ValueError(f"routes_in: replaying given routes is not meaningful for {why}")
    ids = ids.long()
    if spec.score_order == "topk_then_score":
        return score(logits.gather(1, ids), spec.scoring)
    weights = score(logits, spec.scoring).gather(1, ids)
    return weights.masked_fill(weights == float("-inf"), 0.0) if spec.scoring == "none" else weights


def route(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, spec: MoESpec, acc=torch.float32,
    ids: torch.Tensor | None = None, group: int | None = None, expert_scale: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing from router logits [T, E] -> (weights [T, k] in ``acc``, ids [T, k] int64). Rows with NaN / inf
    logits follow the contract above. ``ids`` [T, k]: hash routing's ids (``spec.hash_routing``, :func:`hash_ids`):
    no selection, the weights are the scores at them. An expert capacity (``spec.has_capacity``; ``group``: tokens
    per group, :func:`group_size`, default all T) drops pairs: their id is -1 and their weight 0. ``expert_scale``
    [E (+ Z)] (``spec.expert_scale``): each weight times it at its id, after the renormalisation and scaling.
    ``replay`` [T, k]: given ids instead of the selection (:func:`replayed`); the capacity then drops as it would."""
    logits = sanitize_logits(logits.to(acc))
    k = spec.top_k
    neg = float("-inf")
    if replay is not None:
        ids = replay.long()
        weights = replayed(logits, ids, spec)
    elif spec.score_order == "sparsemixer":
        weights, ids = sparsemixer(logits, k, spec.jitter_eps)
    elif spec.hash_routing:
        if ids is None:
            raise ValueError("route: a hash_routing spec needs the ids (hash_table[token_ids])")
        ids = ids.long()
        weights = score(logits, spec.scoring).gather(1, ids)
        if spec.scoring == "none":
            weights = weights.masked_fill(weights == neg, 0.0)
    elif spec.score_order == "topk_then_score":
        vals, ids = _topk_low_index_ties(logits, k)
        weights = score(vals, spec.scoring)  # softmax over the k chosen, or sigmoid of each
    else:
        scores = score(logits, spec.scoring)
        choice = scores
        if spec.has_correction_bias:
            choice = (logits if spec.bias_on_logits else scores) + correction_bias.to(acc)
        choice = choice.masked_fill(torch.isnan(choice), neg)
        if spec.n_group > 1:
            mask = _kept_experts(group_scores(choice, spec), spec)
            choice = choice.masked_fill(~mask, 0.0 if spec.group_mask_zero else neg)
        _, ids = _topk_low_index_ties(choice, k)
        weights = scores.gather(1, ids)
        if spec.scoring == "none":
            weights = weights.masked_fill(weights == neg, 0.0)
    keep = capacity_kept(ids, spec, logits.shape[0] if group is None else group) if spec.has_capacity else None
    if keep is not None and spec.renorm_after_drop:
        weights = weights.masked_fill(~keep, 0.0)
    weights = expert_scaled(renorm_and_scale(weights, spec), ids, expert_scale, spec)
    if keep is not None:
        weights, ids = weights.masked_fill(~keep, 0.0), ids.masked_fill(~keep, -1)
    return finite_weights(weights), ids


def route_with_gammas(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, spec: MoESpec, acc=torch.float32,
    weight_scale: torch.Tensor | None = None, ids: torch.Tensor | None = None, group: int | None = None,
    expert_scale: torch.Tensor | None = None, replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`route`, plus what ``shared_gamma`` and ``has_weight_scale`` add: (weights [T, k], ids [T, k], gammas
    [T, G] or None), in ``acc``. logits [T, R (+ G)]: with ``shared_gamma`` "joint_renorm" the last G
    (``spec.gamma_rows``) columns are the shared experts' logits, scored like the routed ones; the k chosen scores
    and the G shared ones are renormalised together (one denominator, ``max(sum + renorm_eps, renorm_min)``) and
    all times ``routed_scaling_factor``; then everything times ``weight_scale`` (a [1] tensor) where the spec has
    one. Rows with NaN / inf logits follow the routing contract (NaN -> -inf, so a NaN shared logit weighs 0).
    ``expert_scale``: as in :func:`route` (the spec checks refuse it together with gammas)."""
    G = spec.gamma_rows
    ws = None if not spec.has_weight_scale else weight_scale.to(acc).reshape(())
    if not G:
        w, ids = route(logits, correction_bias, spec, acc, ids=ids, group=group, expert_scale=expert_scale,
                       replay=replay)
        return (w if ws is None else finite_weights(w * ws)), ids, None
    R = spec.router_width
    lg = sanitize_logits(logits.to(acc))
    w, ids = route(lg[:, :R], correction_bias, _unscaled(spec), acc, ids=ids, group=group,
                   replay=replay)  # the chosen scores
    both = torch.cat([w, score(lg[:, R:R + G], spec.scoring)], dim=-1)  # [T, k + G]
    both = renorm_and_scale(both, spec)
    if ws is not None:
        both = both * ws
    both = finite_weights(both)
    return both[:, : spec.top_k], ids, both[:, spec.top_k:]


@functools.lru_cache(maxsize=64)
def _unscaled(spec: MoESpec) -> MoESpec:
    """``spec``'s routing without the renormalisation, scaling and gammas: the chosen experts' scores as they are."""
    return spec.replace(shared_gamma="none", renormalize=False, routed_scaling_factor=1.0, has_weight_scale=False)


@functools.lru_cache(maxsize=64)
def _one_shared(spec: MoESpec) -> MoESpec:
    """``spec`` with one 2-D shared expert and no gammas: what each of its stacked shared experts computes."""
    return spec.replace(shared=dataclasses.replace(spec.shared, stacked=0), shared_gamma="none")


def sparsemixer(logits: torch.Tensor, k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's eval-mode routing (the formula in ``moecomp.core.spec``): sanitised logits [T, E] -> (weights [T, k] in
    the logits' dtype, ids [T, k] int64), k rounds over the experts not taken yet. Round j takes the largest free
    logit m (lowest index on ties; a free one even when all are -inf) and weighs it by the softmax, at it, over the
    free logits within the relative threshold: dropped where (m - s) / max(|s|, m) > 2 * jitter_eps (a 0 / 0 is NaN,
    not greater: kept). A round with no finite free logit has a NaN weight (0 after ``finite_weights``)."""
    T, E = logits.shape
    thr = 2 * jitter_eps
    neg = float("-inf")
    free = torch.ones(T, E, dtype=torch.bool, device=logits.device)
    ws, ids = [], []
    for _ in range(k):
        cand = logits.masked_fill(~free, neg)  # [T, E]
        m = cand.amax(-1, keepdim=True)  # [T, 1]
        i = (free & (cand == m)).to(torch.uint8).argmax(-1, keepdim=True)  # [T, 1]: the first free maximum
        drop = (m - logits) / torch.maximum(logits.abs(), m) > thr  # [T, E]
        ws.append(torch.softmax(cand.masked_fill(drop, neg), -1).gather(1, i))
        ids.append(i)
        free = free.scatter(1, i, False)
    return torch.cat(ws, 1), torch.cat(ids, 1)


def sparsemixer_contested(logits: torch.Tensor, spec: MoESpec, gap=0.0, rel: float = 0.0) -> torch.Tensor:
    """[T] bool: tokens where some round's threshold test could flip: |(m - s) - t| <= gap + rel * t for a free
    logit s other than the round's pick m, t = 2 * jitter_eps * max(|s|, m) (``gap``: how far the gap m - s may
    move, a number or [T, 1]; ``rel``: how far the ratio may, relative to the threshold). Rounds as
    :func:`sparsemixer` takes them, on sanitised logits."""
    logits = sanitize_logits(logits.float())
    T, E = logits.shape
    _, ids = sparsemixer(logits, spec.top_k, spec.jitter_eps)
    free = torch.ones(T, E, dtype=torch.bool, device=logits.device)
    out = torch.zeros(T, dtype=torch.bool, device=logits.device)
    for j in range(spec.top_k):
        i = ids[:, j : j + 1]
        m = logits.gather(1, i)  # [T, 1]
        free = free.scatter(1, i, False)  # (the pick itself is always kept)
        t = 2 * spec.jitter_eps * torch.maximum(logits.abs(), m)  # [T, E]
        off = (m - logits - t).abs()
        out |= (free & torch.isfinite(off) & (off <= gap + rel * t)).any(-1)
    return out


def round_weights(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Routing weights rounded through ``dtype`` (``spec.round_weights``), clamped to its largest finite value first
    so that a finite weight stays finite."""
    limit = min(float(torch.finfo(dtype).max), float(torch.finfo(weights.dtype).max))
    return weights.clamp(-limit, limit).to(dtype).to(weights.dtype)


def near_tie_tokens(x2: torch.Tensor, router_w, router_b, correction_bias, spec: MoESpec, rel: float) -> torch.Tensor:
    """[T] bool: tokens whose expert (or group) selection could change if each router logit moved by up to
    ``rel * max|logit|`` of its token, i.e. where two correct implementations whose router GEMMs round differently
    may pick different experts. 16-bit routers have exact ties often (bf16 keeps 8 bits), and ``torch.topk`` breaks
    them in no documented order, while our kernels take the lower expert index.

    Each expert's choice value gets an interval [lo, hi] over that logit range (scores are monotone in their logit;
    softmax moves by at most a factor e^(+-2 delta)); a selection is near a tie when the worst chosen lower bound does
    not clear the best unchosen upper bound."""
    if spec.fused_shared_gate or spec.gamma_rows:  # the gate / gamma rows take no part in the selection
        router_w = router_w[: spec.router_width]
    logits = router_logits(x2, router_w, router_b, spec).float()  # [T, E], rounded like the block's own router
    T, k = logits.shape[0], spec.top_k
    d = rel * logits.abs().amax(-1, keepdim=True)  # [T, 1]
    bias = correction_bias.float().reshape(-1) if spec.has_correction_bias else None
    if spec.score_order in ("topk_then_score", "sparsemixer"):  # sparsemixer's ids: the top-k of the logits
        choice, lo, hi = logits, logits - d, logits + d
    elif spec.has_correction_bias and spec.bias_on_logits:
        choice, lo, hi = logits + bias, logits + bias - d, logits + bias + d
    else:
        choice = score(logits, spec.scoring)
        if spec.scoring == "softmax":
            lo, hi = choice * torch.exp(-2 * d), choice * torch.exp(2 * d)
        else:
            lo, hi = score(logits - d, spec.scoring), score(logits + d, spec.scoring)
        if bias is not None:
            choice, lo, hi = choice + bias, lo + bias, hi + bias

    def contested(c, lo_, hi_, n):
        """c/lo/hi [T, m]; pick n by c: can an unpicked one overtake a picked one within the intervals?"""
        if n >= c.shape[-1]:
            return torch.zeros(c.shape[0], dtype=torch.bool, device=c.device)
        _, idx = _topk_low_index_ties(c, n)
        picked = torch.zeros_like(c, dtype=torch.bool).scatter_(1, idx, True)
        worst_in = lo_.masked_fill(~picked, float("inf")).amin(-1)
        best_out = hi_.masked_fill(picked, float("-inf")).amax(-1)
        return worst_in <= best_out

    near = torch.zeros(T, dtype=torch.bool, device=logits.device)
    if spec.n_group > 1 and spec.score_order == "score_then_topk":
        gs = group_scores(choice, spec)
        near |= contested(gs, group_scores(lo, spec), group_scores(hi, spec), spec.topk_group)
        mask = _kept_experts(gs, spec)
        fill = 0.0 if spec.group_mask_zero else float("-inf")
        choice, lo, hi = (v.masked_fill(~mask, fill) for v in (choice, lo, hi))
    near |= contested(choice, lo, hi, k)
    if spec.score_order == "sparsemixer":  # the gap moves by 2d, its threshold 2 eps max(|s|, m) by 2 eps d
        near |= sparsemixer_contested(logits, spec, gap=(2 + 2 * spec.jitter_eps) * d)
    return near


def _expert_in(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, layout: str) -> torch.Tensor:
    y = x @ (w.T if layout == "out_in" else w)
    return y if b is None else y + b


def expert_mlp(x: torch.Tensor, w13, b13, w2, b2, spec: MoESpec) -> torch.Tensor:
    """One expert on rows x [n, H] -> [n, H]; w13 / w2 are that expert's matrices."""
    h = _expert_in(x, w13, b13, spec.w_layout)  # [n, 2I] or [n, I]
    I = spec.intermediate_size
    if spec.gated:
        if spec.gate_up == "concat":
            gate, up = h[:, :I], h[:, I:]
        else:
            gate, up = h[:, 0::2], h[:, 1::2]
        h = spec_gated(gate, up, spec)
    else:
        h = activation(h, spec.activation)
    return _expert_in(h, w2, b2, spec.w_layout)


def experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, b13, w2, b2, spec: MoESpec, acc=torch.float32,
    w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None, expert_norm_w=None, w13_zero=None, w2_zero=None,
) -> torch.Tensor:
    """Routed experts: x [T, H], ids / weights [T, k] -> [T, H] in ``acc``. ``spec.expert_norm``: each pair's output,
    rounded to x's dtype, normalised (:func:`rms_norm`, weight ``expert_norm_w``) before its routing weight.
    Quantized (``spec.quant``): each expert's
    weights dequantized (4-bit: with the int4 zeros ``w13_zero`` / ``w2_zero``; expert biases added in fp32), and
    its GEMM inputs quantized as the spec says (``moecomp.core.quant``).
    ``spec.weight_on_input``: each pair's expert runs on ``weight * x`` (in ``acc``) and its output is summed as is.
    ``spec.zero_experts``: pairs whose id is >= E add ``weight * x`` (:func:`zero_expert_term`)."""
    qs = spec.quant
    if qs is not None:
        out = _experts_quantized(x, ids, weights, (w13, b13, w2, b2), spec, acc, (w13_scale, w2_scale, a13_scale,
                                                                                    a2_scale, w13_zero, w2_zero))
        return out + zero_expert_term(x, ids, weights, spec, acc) if spec.zero_experts else out
    dtype = x.dtype
    x = x.to(acc)
    out = zero_expert_term(x, ids, weights, spec, acc) if spec.zero_experts else torch.zeros_like(x)
    for e in range(spec.num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w = weights[tok, slot, None].to(acc)
        y = expert_mlp(
            x[tok] * w if spec.weight_on_input else x[tok],
            w13[e].to(acc),
            None if b13 is None else b13[e].to(acc),
            w2[e].to(acc),
            None if b2 is None else b2[e].to(acc),
            spec,
        )
        if spec.expert_norm != "none":  # "rms_per_expert": expert e's row of expert_norm_w [E, width]
            nw = expert_norm_w[e] if spec.expert_norm == "rms_per_expert" else expert_norm_w
            y = rms_norm(y.to(dtype), nw, spec.expert_norm, spec.expert_norm_eps, dtype, acc).to(acc)
        out.index_add_(0, tok, y if spec.weight_on_input else y * w)
    return out


def _experts_quantized(x, ids, weights, tensors, spec: MoESpec, acc, scales):
    w13, b13, w2, b2 = tensors
    w13_scale, w2_scale, a13_scale, a2_scale, w13_zero, w2_zero = scales
    qs = spec.quant
    halves = 2 if spec.gated else 1
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in range(spec.num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        a13 = None if a13_scale is None else a13_scale[e]
        a2 = None if a2_scale is None else a2_scale[e]
        w = weights[tok, slot, None].to(acc)
        xe = _act_q(_on_input(x[tok], w, spec), qs, a13).to(acc)
        h = xe @ _deq(w13[e], w13_scale[e], qs, halves, _at(w13_zero, e)).to(acc).T
        h = _gate_up(h if b13 is None else h + b13[e].to(acc), spec)
        he = _act_q(h.to(x.dtype) if x.dtype != acc else h, qs, a2).to(acc)
        y = he @ _deq(w2[e], w2_scale[e], qs, zero=_at(w2_zero, e)).to(acc).T
        y = y if b2 is None else y + b2[e].to(acc)
        out.index_add_(0, tok, y if spec.weight_on_input else y * w)
    return out


def zero_expert_term(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec,
                     acc=torch.float32) -> torch.Tensor:
    """What the zero-computation experts add: x [T, H], ids / weights [T, k] -> [T, H] in ``acc``,
    ``sum_{j: ids[:, j] >= E} weights[:, j] * x`` (the same with ``weight_on_input``: the identity of weight * x).
    Weights of the other pairs are never read (a NaN there does not leak in)."""
    w = torch.where(ids >= spec.num_experts, weights.to(acc), 0.0)  # [T, k]
    return w.sum(-1, keepdim=True) * x.to(acc)


def _at(t: torch.Tensor | None, e: int):
    return None if t is None else t[e]


def _on_input(xs: torch.Tensor, w: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """A quantized GEMM's input rows: ``w * xs`` (in w's dtype, ``acc``) with ``spec.weight_on_input``, else ``xs``."""
    return xs.to(w.dtype) * w if spec.weight_on_input else xs


def _gate_up(h: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """h [n, 2I] (or [n, I]) after the first GEMM -> the activation input of the second, [n, I]."""
    I = spec.intermediate_size
    if not spec.gated:
        return activation(h, spec.activation)
    gate, up = (h[:, :I], h[:, I:]) if spec.gate_up == "concat" else (h[:, 0::2], h[:, 1::2])
    return spec_gated(gate, up, spec)


def shared_experts(x: torch.Tensor, shared_w1, shared_w3, shared_w2, shared_gate_w, spec: MoESpec, acc=torch.float32,
                   shared_w1_scale=None, shared_w3_scale=None, shared_w2_scale=None, gammas=None,
                   shared_norm_w=None):
    """The shared experts' sum: x [T, H] -> [T, H] in ``acc``. Stacked (``shared.stacked`` = S): expert s reads
    the s-th matrices, and its output is times ``gammas[:, s]`` where given ([T, S], ``shared_gamma``).
    ``shared.norm``: the output, rounded to x's dtype, normalised with ``shared_norm_w`` (:func:`rms_norm`) before
    its gate and scale."""
    sh = spec.shared
    if sh.norm != "none":
        one = spec.replace(shared=dataclasses.replace(sh, norm="none", gate="none", scale=1.0))
        y = shared_experts(x, shared_w1, shared_w3, shared_w2, None, one, acc, shared_w1_scale, shared_w3_scale,
                           shared_w2_scale)
        y = rms_norm(y.to(x.dtype), shared_norm_w, sh.norm, sh.norm_eps, x.dtype, acc).to(acc)
        if sh.gate == "sigmoid":
            y = y * torch.sigmoid(x.to(acc) @ shared_gate_w.to(acc).T)
        return y * sh.scale if sh.scale != 1.0 else y
    if sh.stacked or gammas is not None:
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        one = _one_shared(spec)
        for s in range(sh.count):
            pick = (lambda t: None if t is None else t[s]) if sh.stacked else (lambda t: t)
            y = shared_experts(x, pick(shared_w1), pick(shared_w3), pick(shared_w2), None, one, acc)
            out += y if gammas is None else y * gammas[:, s : s + 1].to(acc)
        return out
    if sh.quant is not None:
        return _shared_quantized(x, shared_w1, shared_w3, shared_w2, shared_gate_w, spec, acc, shared_w1_scale,
                                 shared_w3_scale, shared_w2_scale)
    x = x.to(acc)
    if sh.gated:
        if sh.layout == "concat":
            g, u = (x @ shared_w1.to(acc).T).chunk(2, dim=-1)
        else:
            g, u = x @ shared_w1.to(acc).T, x @ shared_w3.to(acc).T
        h = spec_gated(g, u, sh)
    else:
        h = activation(x @ shared_w3.to(acc).T, sh.activation)
    y = h @ shared_w2.to(acc).T
    if sh.gate == "sigmoid":
        y = y * torch.sigmoid(x @ shared_gate_w.to(acc).T)
    return y * sh.scale if sh.scale != 1.0 else y


def quantized_linear(x: torch.Tensor, w, scale, quant, acc=torch.float32) -> torch.Tensor:
    """x [n, in] @ dequantize(w [out, in], scale).T, x quantized as ``quant.activation`` says."""
    return _act_q(x, quant).to(acc) @ _deq(w, scale, quant).to(acc).T


def _shared_quantized(x, w1, w3, w2, gate_w, spec: MoESpec, acc, s1, s3, s2):
    sh, qs = spec.shared, spec.shared.quant
    if sh.gated:
        h = spec_gated(quantized_linear(x, w1, s1, qs, acc), quantized_linear(x, w3, s3, qs, acc), sh)
    else:
        h = activation(quantized_linear(x, w3, s3, qs, acc), sh.activation)
    y = quantized_linear(h.to(x.dtype) if x.dtype != acc else h, w2, s2, qs, acc)
    if sh.gate == "sigmoid":
        y = y * torch.sigmoid(x.to(acc) @ gate_w.to(acc).T)
    return y * sh.scale if sh.scale != 1.0 else y


def _pick(d: dict, *names) -> dict:
    unknown = set(d) - set(_EXTRA_NAMES)
    if unknown:
        raise TypeError(f"unknown argument(s) {sorted(unknown)}; expected among {_EXTRA_NAMES}")
    return {n: d.get(n) for n in names}


_QUANT_NAMES = ("w13_scale", "w2_scale", "a13_scale", "a2_scale", "shared_w1_scale", "shared_w3_scale",
                "shared_w2_scale")
_LATENT_NAMES = ("latent_in_w", "latent_in_b", "latent_out_w", "latent_out_b")
_HASH_NAMES = ("hash_table", "token_ids")
_ROUTER_IN_NAMES = ("router_x", "router_in_scale", "expert_scale")
_NORM_NAMES = ("latent_norm_w", "expert_norm_w", "shared_norm_w")
_ZERO_NAMES = ("w13_zero", "w2_zero")
_EXTRA_NAMES = (_QUANT_NAMES + _LATENT_NAMES + _HASH_NAMES + _ROUTER_IN_NAMES + ("weight_scale",) + _NORM_NAMES
                + _ZERO_NAMES + ("routes_in",))


def moe_forward(
    x,
    router_w,
    router_b,
    correction_bias,
    w13,
    b13,
    w2,
    b2,
    shared_w1,
    shared_w3,
    shared_w2,
    shared_gate_w,
    spec: MoESpec | str,
    acc=torch.float32,
    **extra,
) -> torch.Tensor:
    """The whole block: x [..., H] -> [..., H] in x's dtype, math in ``acc``. ``extra``: the scale tensors of
    quantized weights, the latent projections, hash routing's table / token ids and the norms' weights by their op
    argument names (``moecomp.core.args.QUANT_ARGS``, ``LATENT_ARGS``, ``HASH_ARGS``, ``NORM_ARGS``); ``routes_in``
    [T, k]: replayed ids (:func:`route`'s ``replay``)."""
    if isinstance(spec, str):
        spec = MoESpec.from_key(spec)
    if spec.fused_shared_gate:  # router_w [E + 1, H]: the last row is the shared-expert gate
        router_w, shared_gate_w = router_w[: spec.num_experts], router_w[spec.num_experts :]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [T, H]
    # The router reads x in the model dtype (like HF), unless the spec says fp32; or its own input (router_x).
    ri = _pick(extra, *_ROUTER_IN_NAMES)
    r2 = router_input(x2, ri["router_x"], ri["router_in_scale"], spec)
    logits = router_logits(r2, router_w, router_b, spec)  # [T, E]
    h = _pick(extra, *_HASH_NAMES)
    given = hash_ids(h["hash_table"], h["token_ids"]) if spec.hash_routing else None
    weights, ids, gammas = route_with_gammas(logits, correction_bias, spec, acc, extra.get("weight_scale"), ids=given,
                                             group=group_size(shape, spec), expert_scale=ri["expert_scale"],
                                             replay=extra.get("routes_in"))
    if spec.round_weights:
        weights = round_weights(weights, x.dtype)
        gammas = None if gammas is None else round_weights(gammas, x.dtype)
    lat = _pick(extra, *_LATENT_NAMES)
    # latent: the projections' inputs rounded to x's dtype, as the model's linears (and the op) see them
    xe = latent_in(x2, lat["latent_in_w"], lat["latent_in_b"], acc).to(x.dtype) if spec.latent_size else x2
    nw = _pick(extra, *_NORM_NAMES)
    if spec.latent_norm != "none":  # the latent input normalised (rounded to x's dtype) before the experts
        xe = rms_norm(xe, nw["latent_norm_w"], spec.latent_norm, spec.latent_norm_eps, x.dtype, acc)
    out = experts(xe, ids, weights, w13, b13, w2, b2, spec.experts_spec(), acc,
                  **_pick(extra, "w13_scale", "w2_scale", "a13_scale", "a2_scale", *_ZERO_NAMES),
                  expert_norm_w=nw["expert_norm_w"])  # [T, L] or [T, H]
    if spec.latent_size:
        out = latent_out(out.to(x.dtype), lat["latent_out_w"], lat["latent_out_b"], acc)  # [T, H]
    if spec.shared is not None:
        out = out + shared_experts(x2, shared_w1, shared_w3, shared_w2, shared_gate_w, spec, acc,
                                   **_pick(extra, "shared_w1_scale", "shared_w3_scale", "shared_w2_scale"),
                                   gammas=gammas, shared_norm_w=nw["shared_norm_w"])
    return out.to(x.dtype).reshape(shape)
