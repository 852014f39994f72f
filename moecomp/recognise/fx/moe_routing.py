"""Routing: from a top-k back to the router linear, and forward from it to the routing weights the experts use::

    x ─[.float()]─► linear(·, router_w [E,H], [router_b]) = logits ─► [softmax | sigmoid | sqrt(softplus)] = scores
          ─► [+ correction_bias] ─► [group view ─ topk(2).sum | amax ─ topk(topk_group) ─ masked_fill(-inf | 0.0)]
          ─► topk(·, k) ─┬─► ids
                         └─► values | scores.gather(ids) | softmax(values) (topk_then_score)   = weights
                             | full(-inf).scatter(ids, values) ─► sigmoid | softmax  (topk_then_score, dense [T, E])
          weights ─► [/ max(sum(-1) (+ eps), renorm_min)] [* or / scalar] [.to(model dtype)] ─► the experts

``topk(logits + correction_bias)`` (bias on the logits) takes its weights as ``sigmoid(logits.gather(ids))`` or
``sigmoid(logits).gather(ids)``. Llama 4 scores the chosen logits densely: the top-k values scattered into a [T, E]
tensor of -inf, then a sigmoid (0 off the chosen experts), i.e. ``topk_then_score`` with sigmoid scoring. Blocks
whose ids come from a table lookup of token ids (hash routing) have no top-k: ``moe_hash`` reads them, with this
module's walks. Routings no spec expresses are refused with ``UNSUPPORTED_ROUTING``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject, unsupported_routing
from . import moe_gammas
from .moe_activation import CLAMPS, clamp_bounds

_SCORE_OPS = {"softmax": "softmax", "sigmoid": "sigmoid"}


@dataclass
class Routing:
    logits_linear: fx.Node
    x_router: fx.Node
    router_w: fx.Node
    router_b: fx.Node | None
    correction_bias: fx.Node | None
    scoring: str
    score_order: str
    top_k: int
    E: int
    H: int
    ids: fx.Node | None = None  # the top-k's indices
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    renormalize: bool = False
    renorm_eps: float = 0.0
    renorm_min: float = 0.0
    scaling: float = 1.0
    jitter_eps: float = 0.0  # sparsemixer routing (moe_sparsemixer)
    bias_on_logits: bool = False
    group_mask_zero: bool = False
    bias_shape: tuple | None = None  # the correction bias placeholder's shape when it is not (E,) (e.g. [1, E])
    round_weights: bool = False
    router_fp32: bool = False
    weights: fx.Node | None = None
    baked: dict = field(default_factory=dict)
    # hash routing (``moe_hash``): {"table", "tokens" (placeholders), "token_chain", "lookup_chain" (nodes)}
    hash: dict | None = None
    # shared-expert gammas (``moe_gammas``): router rows past the E, their [T, G] node; the weights' [1] scale
    gamma_rows: int = 0
    gammas: fx.Node | None = None
    weight_scale: fx.Node | None = None
    logit_scale: float = 1.0  # the router logits times a scalar before the scoring (MoESpec.router_scale)


@dataclass
class RouterWalk:
    """What lies between the router linear and the top-k."""

    lin: fx.Node | None = None
    scoring: str | None = None
    scoring_node: fx.Node | None = None  # output of the scoring function
    bias: fx.Node | None = None
    mask_fill: fx.Node | None = None
    mask_zero: bool = False
    lead_slice: fx.Node | None = None  # [..., :E] of a wider router output (the rest: shared-expert gammas)
    logit_scale: float = 1.0
    logit_scale_src: str | None = None  # the scalar attribute (placeholder) it was read from


# ------------------------------------------------------------------------------------------------------ routing
def routing(ctx: Context, t: fx.Node) -> Routing:
    """The routing that ends in top-k ``t``."""
    k = _fx.static_int(arg(t, 1))
    if k is None:
        raise Reject("top-k count is not a constant")
    choice = arg(t, 0)
    cs = _fx.shape_of(choice)
    if arg(t, 2, default=-1) not in (-1, len(cs) - 1):
        raise Reject(f"top-k over dim {arg(t, 2, default=-1)}, not the expert dim")
    if arg(t, 3, default=True) is False:
        raise unsupported_routing("top-k takes the smallest values")
    E = _fx.static_int(cs[-1])
    walk = walk_to_router(ctx, choice, E)
    R = from_router(ctx, walk, k, E)
    if walk.mask_fill is not None:
        _groups(ctx, R, walk.mask_fill, walk.lin)
        R.group_mask_zero = walk.mask_zero
    R.ids = [u for u in t.users if op_name(u) == "getitem" and u.args[1] == 1][0]
    if R.gamma_rows:  # the rows past E: gammas renormalised with the chosen weights (``moe_gammas``)
        _weight_chain(ctx, R, moe_gammas.joint_source(ctx, R, walk.lin, walk.scoring_node))
        moe_gammas.split_gammas(R)
        return R
    _weight_chain(ctx, R, _weights_source(ctx, R, t, walk))
    return R


def _scaled_linear(ctx: Context, n: fx.Node) -> bool:
    """``n`` multiplies (divides) a linear's output by a scalar constant or scalar attribute."""
    a, b = arg(n, 0), arg(n, 1)
    if op_name(n) == "mul" and not (isinstance(a, fx.Node) and ctx.as_linear(a) is not None):
        a, b = b, a
    if not (isinstance(a, fx.Node) and ctx.as_linear(a) is not None):
        return False
    if _fx.scalar_value(b, ctx.values) is not None:
        return True
    return isinstance(b, fx.Node) and b in ctx.static_ph and (_fx.shape_of(b) or ()) == ()


def _logit_scale(ctx: Context, n: fx.Node, w: RouterWalk) -> fx.Node:
    """``n`` = linear * c | c * linear | linear / c (``_scaled_linear``): records c (> 0, finite) in ``w``; returns the
    linear. A scale no spec expresses (zero, negative: the order of the logits flips) is refused."""
    a, b = arg(n, 0), arg(n, 1)
    if op_name(n) == "mul" and not (isinstance(a, fx.Node) and ctx.as_linear(a) is not None):
        a, b = b, a
    v = _fx.scalar_value(b, ctx.values)
    src = None
    if v is None:  # a 0-d static placeholder (a scalar attribute)
        t = ctx.values.get(b)
        if not isinstance(t, torch.Tensor) or _fx.is_fake(t):
            raise unsupported_routing(f"the router logits are scaled ({n.name}) by a value unknown at capture")
        v, src = float(t), b.name
    v = float(v)
    if op_name(n) == "div":
        v = 1.0 / v if v else math.inf
    if not (math.isfinite(v) and v > 0):
        raise unsupported_routing(f"the router logits are scaled by {v:g} ({n.name}): MoESpec.router_scale must be "
                                  "finite and > 0")
    w.logit_scale, w.logit_scale_src = v, src
    return a


def walk_to_router(ctx: Context, choice: fx.Node, E: int) -> RouterWalk:
    """Walk back from the top-k input to the router linear through casts, a group mask, a correction-bias add and
    the scoring function."""
    w, cur = RouterWalk(), choice
    while True:
        name = op_name(cur)
        if name in _fx.CAST_OPS or (name in ("view", "reshape") and isinstance(arg(cur, 0), fx.Node)
                                    and _fx.same_shape(_fx.shape_of(cur), _fx.shape_of(arg(cur, 0)))):
            cur = arg(cur, 0)  # a cast, or a view to the same shape (LongCat-Flash's scores.view(-1, E))
        elif (name in ("getitem", "narrow") and w.lead_slice is None
              and (cs := moe_gammas.column_slice(cur)) is not None and cs[1] == 0 and cs[2] == E):
            w.lead_slice, cur = cur, cs[0]  # the first E columns of a wider router output
        elif name == "masked_fill" and w.mask_fill is None and w.scoring is None:
            v = arg(cur, 2)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
                w.mask_zero = True  # dropped groups' experts get 0.0 (Mistral-4); only with group routing (_groups)
            elif not (isinstance(v, float) and v == -math.inf):
                raise unsupported_routing(f"top-k input is masked with {v!r}, neither -inf nor 0.0")
            w.mask_fill, cur = cur, arg(cur, 0)
        elif name == "add" and w.bias is None and w.scoring is None:
            a, b = arg(cur, 0), arg(cur, 1)
            pa, pb = _bias_ph(ctx, a, E), _bias_ph(ctx, b, E)
            if pb is None and pa is None:
                raise unsupported_routing("an add before the top-k that is not a per-expert bias")
            w.bias, cur = (pb, a) if pb is not None else (pa, b)
        elif name in ("softmax", "sigmoid") and w.scoring is None:
            if name == "softmax" and arg(cur, 1, default=None) not in (-1, len(_fx.shape_of(cur)) - 1):
                raise unsupported_routing("softmax over a dim other than the experts")
            w.scoring, w.scoring_node, cur = _SCORE_OPS[name], cur, arg(cur, 0)
        elif name == "sqrt" and w.scoring is None and op_name(arg(cur, 0)) == "softplus":
            sp = arg(cur, 0)
            if arg(sp, 1, "beta", 1) != 1 or arg(sp, 2, "threshold", 20) != 20:
                raise unsupported_routing("softplus with non-default beta / threshold")
            w.scoring, w.scoring_node, cur = "sqrtsoftplus", cur, arg(sp, 0)
        elif ctx.as_linear(cur) is not None:
            w.lin = cur
            return w
        elif name in ("mul", "div") and w.scoring is not None and w.logit_scale == 1.0 and _scaled_linear(ctx, cur):
            cur = _logit_scale(ctx, cur, w)  # logits * c before the scoring: MoESpec.router_scale
        else:
            raise unsupported_routing(f"unrecognised op '{name or cur.op}' between the router logits and the top-k")


def from_router(ctx: Context, walk: RouterWalk, k: int, E: int) -> Routing:
    a, w, b = ctx.as_linear(walk.lin)
    ws = ctx.pshape(w)
    if ws[0] != E and not (walk.lead_slice is not None and ws[0] > E):
        raise Reject(f"router weight {tuple(ws)} does not produce the {E} logits the top-k reads")
    cast = _fx.strip_views_casts(a, casts=False)  # x.float().reshape(-1, H) (Inkling2) casts before the view
    router_fp32 = _fx.cast_dtype(cast) == torch.float32 if op_name(cast) in _fx.CAST_OPS else False
    R = Routing(
        logits_linear=walk.lin, x_router=_fx.strip_views_casts(a, views=False), router_w=w, router_b=b,
        correction_bias=walk.bias, scoring=walk.scoring or "none", score_order="score_then_topk", top_k=k, E=E,
        H=ws[1], router_fp32=router_fp32,
        bias_on_logits=walk.scoring is None and walk.bias is not None,  # topk(logits + bias): scores after gather
        logit_scale=walk.logit_scale,
    )
    if walk.logit_scale_src is not None:
        R.baked["router_scale"] = walk.logit_scale_src
    if walk.bias is not None and ctx.pshape(walk.bias) != (E,):
        R.bias_shape = ctx.pshape(walk.bias)
    R.gamma_rows = ws[0] - E
    return R


def _weights_source(ctx: Context, R: Routing, t: fx.Node, walk: RouterWalk) -> fx.Node:
    """The node holding the routing weights right after the top-k: gathered scores, the top-k values, or their
    softmax (topk_then_score; sets ``R.scoring`` / ``R.score_order``)."""
    if R.bias_on_logits:
        return _weights_after_biased_logits(ctx, R, R.ids, walk.lin)
    sn = walk.scoring_node
    w0 = None
    for u in R.ids.users:
        if op_name(u) == "gather":
            src = arg(u, 0)
            if sn is not None and _fx.strip_views_casts(src, views=False) is sn or src is sn:
                if arg(u, 1) not in (1, -1):
                    raise unsupported_routing("weights gathered over a dim other than the experts")
                w0 = u
    if w0 is not None:
        return w0
    if walk.bias is not None or walk.mask_fill is not None:
        raise unsupported_routing("biased / group-limited top-k without gathering the unbiased scores")
    vals = [u for u in t.users if op_name(u) == "getitem" and u.args[1] == 0]
    if not vals:
        raise Reject("top-k values unused and no gather of the scores")
    sm = [u for u in vals[0].users if op_name(u) == "softmax"]
    if walk.scoring is None and sm:
        if len(sm) != 1 or arg(sm[0], 1, default=None) not in (-1, 1):
            raise unsupported_routing("softmax of the top-k values over an unexpected dim")
        R.scoring, R.score_order = "softmax", "topk_then_score"
        return sm[0]
    dense = _scored_scatter(ctx, R, vals[0]) if walk.scoring is None else None
    return vals[0] if dense is None else dense


_SCATTERS = ("scatter", "scatter_")
_FILLS = {"full_like": 1, "full": 1, "new_full": 2}  # op -> position of the fill value


def _scored_scatter(ctx: Context, R: Routing, vals: fx.Node) -> fx.Node | None:
    """The top-k values of raw logits scattered by the ids into a [T, E] tensor of -inf, then (through casts) a
    sigmoid or a softmax over the experts (Llama 4): the topk_then_score weights in dense form, exactly 0 off the
    chosen experts. Sets ``R.scoring`` / ``R.score_order`` and returns the scoring node; None when ``vals`` is not
    used so."""
    for u in vals.users:
        if op_name(u) not in _SCATTERS or arg(u, 3, "src") is not vals or arg(u, 2, "index") is not R.ids:
            continue
        base = arg(u, 0)
        if arg(u, 1, "dim") not in (-1, 1) or not isinstance(base, fx.Node) or op_name(base) not in _FILLS:
            continue
        fill = arg(base, _FILLS[op_name(base)], "fill_value")
        if not (isinstance(fill, float) and fill == -math.inf):
            continue
        # the scattered tensor: the scatter's result, or (in place) its base read after it
        heads = [u] + ([base] if op_name(u) == "scatter_" else [])
        found = []
        for h in heads:
            todo = [h]
            while todo:
                cur = todo.pop()
                for v in cur.users:
                    if ctx.order[v] <= ctx.order[u]:
                        continue
                    if op_name(v) in _fx.CAST_OPS:
                        todo.append(v)
                    elif op_name(v) == "sigmoid" or (
                            op_name(v) == "softmax" and arg(v, 1, default=None) in (-1, 1)):
                        found.append(v)
        if not found:
            continue
        if len(found) > 1:
            raise unsupported_routing("top-k values scattered into -inf: expected one sigmoid or softmax of them, "
                                      f"found {len(found)}")
        R.scoring, R.score_order = op_name(found[0]), "topk_then_score"
        return found[0]
    return None


def _bias_ph(ctx: Context, n, E: int):
    """``n`` as a per-expert bias: a static placeholder with E elements ([E], or [1, E] squeezed / viewed), through
    views and casts; else None."""
    base = _fx.strip_views_casts(n)
    if not (isinstance(base, fx.Node) and base.op == "placeholder" and base in ctx.static_ph):
        return None
    s = ctx.pshape(base)
    if s is None or E not in s or math.prod(s) != E:
        return None
    return base


def _weights_after_biased_logits(ctx: Context, R: Routing, ids: fx.Node, lin: fx.Node) -> fx.Node:
    """``topk(logits + bias)`` (Kolibri-1): the weights are the scores of the chosen experts, scored before or after
    the gather (an elementwise scoring commutes with it): ``sigmoid(logits.gather(ids))`` or
    ``sigmoid(logits).gather(ids)``. Sets ``R.scoring``; returns the weights node."""
    found = []
    for u in ids.users:
        if op_name(u) != "gather":
            continue
        if arg(u, 1) not in (1, -1):
            raise unsupported_routing("weights gathered over a dim other than the experts")
        src = _fx.strip_views_casts(arg(u, 0), views=False)
        if src is lin:
            after = [v for v in u.users if op_name(v) in ("sigmoid", "softmax", "sqrt", "softplus")]
            if not after:
                found.append(("none", u))
            elif len(after) == 1 and op_name(after[0]) == "sigmoid":
                found.append(("sigmoid", after[0]))
            else:
                raise unsupported_routing(
                    f"biased top-k of the logits, then '{op_name(after[0])}' of the gathered logits: not a scoring "
                    "the spec knows (only an elementwise sigmoid commutes with the gather)")
        elif op_name(src) in ("sigmoid", "softmax") and _fx.strip_views_casts(arg(src, 0), views=False) is lin:
            if op_name(src) == "softmax" and arg(src, 1, default=None) not in (-1, len(_fx.shape_of(src)) - 1):
                raise unsupported_routing("softmax over a dim other than the experts")
            found.append((op_name(src), u))
    if len(found) != 1:
        raise unsupported_routing("top-k of the biased logits: the weights are not the scores of the chosen "
                                  f"experts ({len(found)} candidate gathers)")
    R.scoring = found[0][0]
    return found[0][1]


# ------------------------------------------------------------------------------------------- group-limited top-k
def _groups(ctx: Context, R: Routing, mask_fill: fx.Node, lin: fx.Node) -> None:
    """Group-limited routing: read n_group / topk_group / group score from the mask's ancestry."""
    # (only nodes after the router: descendants() follows in-place writes back to the tensors they alias, which in
    # a whole-model graph can reach the residual stream and the attention before the block)
    after_lin = {n for n in _fx.descendants(lin) if ctx.order[n] > ctx.order[lin]}
    anc = _fx.ancestors(arg(mask_fill, 1), after_lin, pos=ctx.order)
    gtopk = [n for n in anc if op_name(n) == "topk"]
    views = [n for n in anc if op_name(n) in ("view", "reshape") and len(_fx.shape_of(n) or ()) >= 3]
    if not gtopk or not views:
        raise unsupported_routing("masked top-k without a recognisable group selection")
    # the group-select top-k: input [T, G]; group-score top-k: input [T, G, E/G] with k=2
    sel = [n for n in gtopk if len(_fx.shape_of(arg(n, 0)) or ()) == 2]
    if len(sel) != 1:
        raise unsupported_routing("group selection: expected one top-k over group scores")
    sel = sel[0]
    G = _fx.static_int(_fx.shape_of(arg(sel, 0))[-1])
    kg = _fx.static_int(arg(sel, 1))
    if G is None or kg is None:
        raise Reject("group sizes are not constants")
    gview = [n for n in views if _fx.static_int(_fx.shape_of(n)[-2]) == G
             and _fx.static_int(_fx.shape_of(n)[-1]) == R.E // G]
    if not gview:
        raise unsupported_routing("no [T, n_group, E/n_group] view of the scores")
    users = set().union(*[_fx.descendants(v) for v in gview]) & anc
    names = {op_name(n) for n in users}
    in_topk = [n for n in gtopk if n is not sel and n in users]
    if in_topk and _fx.static_int(arg(in_topk[0], 1)) == 2 and "sum" in names:
        R.group_score = "top2_sum"
    elif names & {"amax", "max"}:
        R.group_score = "max"
    else:
        raise unsupported_routing("group score is neither top-2 sum nor max")
    R.n_group, R.topk_group = G, kg


# --------------------------------------------------------------------------------------------- weights forward
def _weight_chain(ctx: Context, R: Routing, w0: fx.Node) -> None:
    """Follow the routing weights forward through renormalise / scale / cast; ``R.weights`` is where it ends."""
    cur, seen_cast = w0, False
    while True:
        sums = rowsums(cur)
        nxt = None
        for u in list(cur.users):
            nxt = _renorm_step(ctx, R, cur, u, sums)
            if nxt is None:
                nxt = _scale_step(ctx, R, cur, u)
            if nxt is None:
                nxt = moe_gammas.weight_scale_step(ctx, R, cur, u)
            if nxt is None and not seen_cast:
                nxt = _cast_step(R, u)
                seen_cast = nxt is not None
            if nxt is not None:
                break
        if nxt is None:
            break
        cur = nxt
    R.weights = cur


# moe_hash and moe_sparsemixer read the weight chain too (a test patches ``_weight_chain`` here)
weight_chain = _weight_chain


def _renorm_step(ctx: Context, R: Routing, cur: fx.Node, u: fx.Node, sums: list) -> fx.Node | None:
    """``u`` = cur / max(sum(cur) (+ eps), min): sets the renormalisation fields and returns ``u``; else None."""
    if op_name(u) not in ("div", "div_") or arg(u, 0) is not cur or not sums:
        return None
    d = arg(u, 1)
    eps, lo = 0.0, 0.0
    if op_name(d) in CLAMPS:  # max(sum (+ eps), min): ERNIE-4.5's clamp(sum, min=norm_min)
        lo_v, hi_v = clamp_bounds(ctx, d, R.baked, "renorm_min")
        if hi_v is not None or lo_v is None:
            raise unsupported_routing("renormalisation denominator clamped from above")
        lo, d = lo_v, arg(d, 0)
    if op_name(d) == "add" and arg(d, 0) in sums:
        e = _fx.scalar_value(arg(d, 1), ctx.values)
        if e is None:
            raise unsupported_routing("renormalisation eps is not a constant")
        eps, d = e, arg(d, 0)
    if op_name(d) in CLAMPS and arg(d, 0) in sums:
        raise unsupported_routing("renormalisation denominator clamped before the eps is added (max(sum, m) + eps)")
    if d not in sums:
        return None
    if R.renormalize:
        raise unsupported_routing("weights renormalised twice")
    R.renormalize, R.renorm_eps, R.renorm_min = True, eps, lo
    return u


def _scale_step(ctx: Context, R: Routing, cur: fx.Node, u: fx.Node) -> fx.Node | None:
    """``u`` = cur / scalar or cur * scalar (constant or scalar attribute): folded into ``R.scaling``."""
    name = op_name(u)
    if name in ("div", "div_") and arg(u, 0) is cur:  # weights / scalar (e.g. `router_scores / top_k`)
        v = _fx.scalar_value(arg(u, 1), ctx.values)
        if v is not None and v != 0 and math.isfinite(v):
            R.scaling /= v
            return u
    if name in ("mul", "mul_"):
        a, b = arg(u, 0), arg(u, 1)
        other = b if a is cur else a
        v = _fx.scalar_value(other, ctx.values)
        if v is None and isinstance(other, fx.Node) and op_name(other) == "item":
            raise Reject("routed scaling read from a tensor whose value is unknown (no example inputs)")
        if v is not None:
            src = arg(other, 0) if isinstance(other, fx.Node) and op_name(other) == "item" else None
            if src is not None:
                R.baked["routed_scaling_factor"] = src.name
            R.scaling *= v
            return u
    return None


def _cast_step(R: Routing, u: fx.Node) -> fx.Node | None:
    """``u`` = a floating cast of the weights (the first one): to the model dtype means ``round_weights``."""
    if op_name(u) not in _fx.CAST_OPS:
        return None
    dt = _fx.cast_dtype(u)
    if dt is None or not dt.is_floating_point:
        return None
    if dt == _fx.dtype_of(R.x_router):
        R.round_weights = True
    return u


def rowsums(cur: fx.Node) -> list[fx.Node]:
    """Nodes holding cur.sum(-1) shaped to divide cur: ``sum(-1, keepdim=True)`` or ``sum(-1)`` then
    ``unsqueeze(-1)`` / ``[:, None]`` / ``view(-1, 1)``."""
    ndim = len(_fx.shape_of(cur) or ())
    last = (-1, ndim - 1, [-1], [ndim - 1], (-1,), (ndim - 1,))
    out = []
    for u in cur.users:
        if op_name(u) != "sum" or arg(u, 1) not in last:
            continue
        if arg(u, 2, default=False):
            out.append(u)
            continue
        for v in u.users:
            if op_name(v) in ("unsqueeze", "view", "reshape", "getitem") and _fx.same_shape(
                _fx.shape_of(v), tuple(_fx.shape_of(cur)[:-1]) + (1,)
            ):
                out.append(v)
    return out
