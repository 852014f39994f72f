"""Shared experts scaled by router gammas (``MoESpec.shared_gamma`` "joint_renorm", Inkling), read by meaning::

    linear(x, router_w [E + G, H]) = logits ─► [scores ─►] [..., :E] ─► (+ bias) ─► topk ─► ids
    cat([ (scores | logits)[:, :E].gather(ids), (scores | logits)[:, E:] ], -1)      [T, k + G]
       ─► renormalised together:  sigmoid(·) / sum(·)  |  exp(logsigmoid(·) - logsumexp(logsigmoid(·)))
       ─► [* scalar] [* a [1] tensor: weight_scale] [.to(dtype)]
       ─┬─► [..., :k]          the routing weights
        └─► [..., k:] | [-G:]   the gammas, each scaling one shared expert
    shared experts stacked [S, I, H] (S = G): bmm(x.expand(S, T, H), gate^T), bmm(·, up^T) ─► act(g) * u (* gammas)
       ─► bmm(·, down^T) ─► [* gammas] ─► sum(0) ─► (+ routed)

Which gamma scales which expert, and where, is left to the numeric check (``numeric``), which runs the cut-out
graph against the reference with the derived spec; the structure here only says what to bind.
"""

from __future__ import annotations

import torch.fx as fx

from ...core.spec import SharedExpertSpec
from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject, unsupported_routing
from .moe_activation import activation


def column_slice(n) -> tuple | None:
    """``n`` = src[..., a:b] (a getitem slicing the last dim only, step 1; or ``narrow(-1, a, len)``): (src, a, b) with
    a, b resolved against src's static last dim; None otherwise."""
    if not isinstance(n, fx.Node):
        return None
    src = arg(n, 0)
    shape = _fx.shape_of(src) if isinstance(src, fx.Node) else None
    N = _fx.static_int(shape[-1]) if shape else None
    if N is None:
        return None
    if op_name(n) == "narrow":
        d, a, ln = arg(n, 1), _fx.static_int(arg(n, 2)), _fx.static_int(arg(n, 3))
        if d not in (-1, len(shape) - 1) or a is None or ln is None:
            return None
        return src, a, a + ln
    if op_name(n) != "getitem":
        return None
    idx = arg(n, 1)
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not idx or not isinstance(idx[-1], slice):
        return None
    lead = idx[:-1]
    if not (lead == (Ellipsis,) or (len(lead) == len(shape) - 1
                                   and all(isinstance(s, slice) and s == slice(None) for s in lead))):
        return None
    s = idx[-1]
    if s.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
        return None
    a, b, _ = s.indices(N)
    return src, a, b


def joint_source(ctx: Context, R, lin: fx.Node, scored: fx.Node | None) -> fx.Node:
    """The node holding the k chosen and the G shared values, renormalised together (the weights before any scale):
    the cat of the gathered routed values and the shared columns, then the renormalisation. Sets
    ``R.renormalize`` for the logsumexp spelling (the sum spelling is read by ``_weight_chain``)."""
    E, G = R.E, R.gamma_rows
    for g in R.ids.users:
        if op_name(g) != "gather" or arg(g, 1) not in (1, -1):
            continue
        head = _columns(arg(g, 0), lin, scored, R.scoring)
        if head is None or head[1:] != (0, E):
            continue
        for c in g.users:
            if op_name(c) != "cat" or arg(c, 1, "dim", 0) not in (-1, 1):
                continue
            parts = list(arg(c, 0))
            if len(parts) != 2 or parts[0] is not g:
                continue
            tail = _columns(parts[1], lin, scored, R.scoring)
            if tail != (head[0], E, E + G):
                continue
            if head[0] == "scores":
                return c  # scores of both: the renormalisation follows (``_weight_chain``)
            return _scored_joint(c, R)
    raise unsupported_routing(f"the router has {G} rows past the {E} experts the top-k reads, and they are not "
                              "renormalised together with the chosen ones as shared-expert gammas")


def _columns(v, lin: fx.Node, scored: fx.Node | None, scoring: str) -> tuple | None:
    """``v`` (through views / casts) as columns [a, b) of the router's logits or scores: ("logits" | "scores", a, b)
    for logits[..., a:b], scores[..., a:b] (``scored``: the scoring of the whole output), or score(logits[..., a:b])
    (the scoring applied to the slice, the same function as the routing's); None otherwise."""
    v = _fx.strip_views_casts(v, views=False)
    kind = None
    if isinstance(v, fx.Node) and op_name(v) == scoring == "sigmoid":
        kind, v = "scores", _fx.strip_views_casts(arg(v, 0), views=False)
    cs = column_slice(v)
    if cs is None:
        return None
    base = _fx.strip_views_casts(cs[0], views=False)
    if base is lin:
        return (kind or "logits", cs[1], cs[2])
    if base is scored and scored is not None and kind is None and op_name(scored) == "sigmoid" and \
            _fx.strip_views_casts(arg(scored, 0), views=False) is lin:
        return ("scores", cs[1], cs[2])
    return None


def _scored_joint(c: fx.Node, R) -> fx.Node:
    """cat of logits ─► sigmoid (the sum renormalisation follows) | the logsumexp form of sigmoid / sum."""
    for u in c.users:
        if op_name(u) == "sigmoid" and R.scoring == "sigmoid":
            return u
        if op_name(u) in ("log_sigmoid", "logsigmoid") and R.scoring == "sigmoid":
            for s in u.users:
                if op_name(s) != "sub" or arg(s, 0) is not u:
                    continue
                lse = arg(s, 1)
                if (op_name(lse) == "logsumexp" and arg(lse, 0) is u and arg(lse, 1) in (-1, 1, [-1], [1], (-1,))
                        and arg(lse, 2, "keepdim", False)):
                    for e in s.users:
                        if op_name(e) == "exp":
                            R.renormalize = True
                            return e
    raise unsupported_routing("the chosen and shared router logits are concatenated but not scored and "
                              "renormalised together (sigmoid / sum, or exp(logsigmoid - logsumexp))")


def weight_scale_step(ctx: Context, R, cur: fx.Node, u: fx.Node) -> fx.Node | None:
    """``u`` = cur * t with t a [1] (or 0-d) floating tensor of the block (through casts): the weights' learned scale
    (``has_weight_scale``, bound to t, read at every call)."""
    if op_name(u) not in ("mul", "mul_") or R.weight_scale is not None:
        return None
    other = arg(u, 1) if arg(u, 0) is cur else arg(u, 0)
    base = _fx.strip_views_casts(other, views=False)
    if not (isinstance(base, fx.Node) and base.op == "placeholder" and base in ctx.static_ph):
        return None
    if ctx.pshape(base) not in ((1,),):
        return None
    R.weight_scale = base
    return u


def split_gammas(R) -> None:
    """``R.weights`` [T, k + G] ─► its [..., :k] (the routing weights, ``R.weights``) and [..., k:] (``R.gammas``)."""
    k, G = R.top_k, R.gamma_rows
    head = tail = None
    for u in R.weights.users:
        cs = column_slice(u)
        if cs is None:
            continue
        if cs[1:] == (0, k):
            head = u
        elif cs[1:] == (k, k + G):
            tail = u
    if head is None or tail is None:
        raise unsupported_routing("the jointly renormalised weights are not split into the k routing weights and "
                                  "the shared experts' gammas")
    R.weights, R.gammas = head, tail


def stacked_shared(ctx: Context, R, region: set, exclude: frozenset) -> tuple | None:
    """Shared experts whose weights are stacked [S, ., .] and read by ``bmm`` (through a transpose): (spec, bind,
    down node) or None when the block has no such bmm."""
    bmms = []
    for n in region:
        if op_name(n) not in ("bmm", "matmul") or n in exclude:
            continue
        w = arg(n, 1)
        if not (isinstance(w, fx.Node) and op_name(w) in ("transpose", "permute", "mT")):
            continue
        ph = ctx.weight_ph(arg(w, 0), 3)
        if ph is not None and ph is not R.router_w and ph not in exclude:
            bmms.append((n, ph))
    if not bmms:
        return None
    H = R.H
    x_like = {_fx.strip_views_casts(R.x_router)}
    ins = [(n, p) for n, p in bmms if ctx.pshape(p)[2] == H and _root(arg(n, 0)) in x_like]
    outs = [(n, p) for n, p in bmms if ctx.pshape(p)[1] == H and ctx.pshape(p)[2] != H]
    if not ins:
        return None  # no bmm of the block input by stacked weights: not stacked shared experts
    if len(outs) != 1 or len(ins) not in (1, 2):
        raise Reject(f"stacked shared experts: expected one down bmm and one or two input bmms, found "
                     f"{[n.name for n, _ in bmms]}")
    down, wd = outs[0]
    S, _, Is = ctx.pshape(wd)
    if any(ctx.pshape(p) != (S, Is, H) for _, p in ins):
        raise Reject("stacked shared experts: input and down weights of different sizes")
    between = set()
    down_anc = _fx.ancestors(down, region, pos=ctx.order)
    for n, _ in ins:
        between |= _fx.descendants(n, region) & down_anc
    between -= set(_fx.ancestors(R.gammas, region, pos=ctx.order)) | {R.gammas} if R.gammas is not None else set()
    baked: dict = {}
    bind = dict(shared_w1=None, shared_w3=None, shared_w2=wd, shared_gate_w=None)
    if len(ins) == 2:
        acts = {n for n in between if op_name(n) in ("silu", "gelu", "relu")}
        gate = [(n, p) for n, p in ins if any(_fx.strip_views_casts(arg(a, 0)) is n for a in acts)]
        if len(gate) != 1:
            raise Reject("stacked shared experts: cannot tell the gate from the up projection")
        up = [(n, p) for n, p in ins if n is not gate[0][0]][0]
        bind.update(shared_w1=gate[0][1], shared_w3=up[1])
        act = activation(ctx, between, True, baked, "stacked shared experts")
        gated = True
    else:
        bind.update(shared_w3=ins[0][1])
        act = activation(ctx, between, False, baked, "stacked shared experts")
        gated = False
    if len(act.names) != 1 or act.clamp or act.clamp_after:
        raise Reject(f"stacked shared experts: activation {act.names} (clamped: {act.clamp or act.clamp_after}) not "
                     "supported")
    return SharedExpertSpec(Is, activation=act.names[0], gated=gated, stacked=S), bind, down


def _root(n):
    """``n`` back through views, casts and ``expand`` (x.reshape(1, T, H).expand(S, T, H))."""
    while isinstance(n, fx.Node):
        b = _fx.strip_views_casts(n)
        if isinstance(b, fx.Node) and op_name(b) in ("expand", "expand_as", "unsqueeze"):
            n = arg(b, 0)
            continue
        return b
    return n
