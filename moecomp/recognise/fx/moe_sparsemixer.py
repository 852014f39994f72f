"""Sparsemixer routing (PhiMoE's eval-mode router): k rounds of argmax over the router logits instead of a top-k::

    x ─[.float()]─► linear(·, router_w [E,H]) = logits [T,E]
          round j: ─► max(·, dim=-1) = (m_j, i_j) over the logits with the earlier picks set to -inf (scatter)
                   ─► (m_j - logits) / max(|logits|, m_j) > c ─► masked_fill(-inf) ─► softmax ─► gather(i_j) = w_j
          ids = cat(i_1 .. i_k, -1) ;  weights = cat(w_1 .. w_k, -1)  [/ renorm] [* scale] [.to(model dtype)]

What is matched is decided by what the graph computes, not by this spelling. The structure only names the
candidate: an integer [T, k] concatenation (k >= 2) of indices of maxima over the last dim whose ids reach the
stacked experts (:func:`selectors`), the router linear of E outputs they descend from, and a float concatenation of
k [T, 1] parts beside it (the weights). The scalar operands of comparisons and products between the linear and the
weights give candidate thresholds c (``jitter_eps = c / 2``; a scalar attribute lifted by Dynamo is recorded in
``baked``). The routing part of the graph (logits -> ids, weights) is then cut out and run on probe logits
(``policy.sparsemixer_probe_logits``: rows straddling the candidate's threshold in every round, for positive and
negative maxima, exact ties, zeros, random rows) against ``reference.route`` with score_order "sparsemixer"; the
first candidate (weights node, threshold) that agrees on every probe row is taken (16-bit graphs: rows whose ratio
is within a rounding of the threshold, ``policy.SPARSEMIXER_MASK_REL``, are left out). The whole block is then
checked like every match (``numeric``).

Refused with ``UNSUPPORTED_ROUTING``: a random op between the router and the ids (sparsemixer in training mode draws
its experts by Gumbel sampling: not deterministic, no spec expresses it), and argmax rounds that do not compute
sparsemixer routing on the probes.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ...core import policy
from ...oracle import reference
from ...core.spec import MoESpec, SpecError
from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .numeric import extract_region as _extract, run_disabled as _run_disabled, placeholder_value as _value
from .refuse import Reject, unsupported_routing
from .moe_region import RANDOM_OPS
from .moe_routing import (Routing, RouterWalk as _Walk, from_router as _from_router,
                          weight_chain as _weight_chain)

_CATS = ("cat", "concat", "concatenate")
_THRESHOLD_OPS = ("gt", "lt", "ge", "le", "mul", "div")
_SCALAR_OPS = {"mul": operator.mul, "div": operator.truediv, "add": operator.add, "sub": operator.sub}


def _argmax_input(n) -> fx.Node | None:
    """``n`` (through views) as the index of a maximum over the last dim, ``max(t, dim=-1)[1]`` or
    ``argmax(t, dim=-1)``: returns ``t``, else None."""
    n = _fx.strip_views_casts(n)
    if not isinstance(n, fx.Node):
        return None
    if op_name(n) == "getitem" and n.args[1] == 1 and isinstance(arg(n, 0), fx.Node) and op_name(arg(n, 0)) == "max":
        src, dim = arg(arg(n, 0), 0), arg(arg(n, 0), 1, "dim")
    elif op_name(n) == "argmax":
        src, dim = arg(n, 0), arg(n, 1, "dim")
    else:
        return None
    s = _fx.shape_of(src)
    return src if s and dim in (-1, len(s) - 1) else None


def _parts(n: fx.Node) -> list | None:
    """The tensors ``n`` concatenates along its last dim (None if ``n`` is not such a concatenation)."""
    if op_name(n) not in _CATS or not isinstance(arg(n, 0), (list, tuple)):
        return None
    s = _fx.shape_of(n)
    if not s or arg(n, 1, "dim", default=0) not in (-1, len(s) - 1):
        return None
    return list(arg(n, 0))


def selectors(ctx: Context) -> list[fx.Node]:
    """Concatenations of k >= 2 argmax indices over E experts whose values reach a stacked [E, ., .] weight."""
    ph3 = {p: s[0] for p in ctx.static_ph if (s := ctx.pshape(p)) is not None and len(s) == 3}
    out = []
    for n in ctx.graph.nodes:
        parts = _parts(n)
        if parts is None or len(parts) < 2:
            continue
        srcs = [_argmax_input(p) for p in parts]
        if any(s is None for s in srcs):
            continue
        E = {_fx.static_int(_fx.shape_of(s)[-1]) for s in srcs}
        if len(E) != 1 or None in E:
            continue
        E = E.pop()
        reach = _fx.descendants(n)
        if any(ph3.get(_fx.weight_base(a)) == E for r in reach for a in r.all_input_nodes):
            out.append(n)
    return out


# --------------------------------------------------------------------------------------------------- routing
def routing(ctx: Context, ids: fx.Node) -> Routing:
    """The sparsemixer routing whose ids are the concatenation ``ids`` (from :func:`selectors`), proven on probes."""
    srcs = [_argmax_input(p) for p in _parts(ids)]
    k, E = len(srcs), _fx.static_int(_fx.shape_of(srcs[0])[-1])
    lin = _router_linear(ctx, srcs[0], E)
    after = {n for n in _fx.descendants(lin) if ctx.order[n] > ctx.order[lin]}
    between = _fx.ancestors(ids, after, pos=ctx.order) | {ids}
    rand = sorted({op_name(n) for n in between if op_name(n) in RANDOM_OPS or op_name(n).startswith("rand")})
    if rand:
        raise unsupported_routing(
            f"the expert choice is sampled (random op(s) {rand} between the router logits and the ids: e.g. "
            "sparsemixer in training mode, which draws its experts by Gumbel sampling): not deterministic, no "
            "routing MoESpec expresses it")
    R = _from_router(ctx, _Walk(lin=lin, scoring="softmax"), k, E)
    R.ids, R.score_order = ids, "sparsemixer"
    errors = []
    for w in _weight_candidates(ctx, ids, after, k):
        w_from = _fx.ancestors(w, after, pos=ctx.order)
        rand = sorted({op_name(n) for n in w_from if op_name(n) in RANDOM_OPS or op_name(n).startswith("rand")})
        if rand:
            errors.append(f"{w.name}: random op(s) {rand}")
            continue
        thresholds = _thresholds(ctx, w_from)
        if not thresholds:
            errors.append(f"{w.name}: no constant a threshold could be")
        for c, src in thresholds:
            try:
                why = _probe(ctx, lin, ids, w, after, R, c / 2)
            except Reject as e:  # this weights node cannot be cut out with the logits as its only input
                errors.append(f"{w.name}: {e.message}")
                break
            if why is None:
                R.jitter_eps = c / 2
                if src is not None:
                    R.baked["jitter_eps"] = src.name
                _weight_chain(ctx, R, w)
                return R
            errors.append(f"{w.name}, jitter_eps={c / 2:g}: {why}")
    raise unsupported_routing("argmax rounds over the router logits that do not compute sparsemixer routing on "
                              "probe logits (" + ("; ".join(errors[:3]) or "no [T, k] weights beside the ids") + ")")


def _router_linear(ctx: Context, src: fx.Node, E: int) -> fx.Node:
    """The router linear (E outputs) the first round's argmax reads: directly (through casts / views), else the latest
    such linear among its ancestors."""
    direct = _fx.strip_views_casts(src)
    if isinstance(direct, fx.Node) and ctx.as_linear(direct) is not None:
        cands = [direct]
    else:
        cands = sorted((n for n in _fx.ancestors(src, pos=ctx.order) if ctx.as_linear(n) is not None),
                       key=ctx.order.get, reverse=True)
    for n in cands:
        if ctx.pshape(ctx.as_linear(n)[1])[0] == E:
            return n
    raise Reject(f"argmax rounds over {E} values that do not descend from a router linear of {E} outputs")


def _scalar(ctx: Context, v):
    """(value, source placeholder | None) of a scalar operand: a literal, ``p.item()``, or +-*/ of such; else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v), None
    if not isinstance(v, fx.Node):
        return None
    name = op_name(v)
    if name == "item":
        val = _fx.scalar_value(v, ctx.values)
        return None if val is None else (val, arg(v, 0))
    if name in _SCALAR_OPS and v.op == "call_function" and len(v.args) == 2 and not v.kwargs:
        a, b = _scalar(ctx, v.args[0]), _scalar(ctx, v.args[1])
        if a is None or b is None or (a[1] is not None and b[1] is not None):
            return None
        try:
            return float(_SCALAR_OPS[name](a[0], b[0])), a[1] or b[1]
        except ZeroDivisionError:
            return None
    return None


def _thresholds(ctx: Context, nodes: set) -> list[tuple[float, fx.Node | None]]:
    """Candidate thresholds c = 2 * jitter_eps, in graph order: each scalar operand v >= 0 of a comparison or of a
    product / quotient among ``nodes`` gives v (``ratio > v``) and 2 v (``gap > v * max(|s|, m)`` with v = eps
    spelled as half the threshold, e.g. ``2 * eps``'s eps), with the placeholder it was read from. The probes decide
    which (if any) is the graph's."""
    out, seen = [], set()
    for n in sorted(nodes, key=ctx.order.get):
        if op_name(n) not in _THRESHOLD_OPS:
            continue
        for a in n.args[:2]:
            got = _scalar(ctx, a) if not (isinstance(a, fx.Node) and a in nodes and _fx.shape_of(a)) else None
            if got is None or not got[0] >= 0 or not math.isfinite(got[0]):
                continue
            for c in (got[0], 2 * got[0]):
                if c not in seen:
                    seen.add(c)
                    out.append((c, got[1]))
    return out


def _weight_candidates(ctx: Context, ids: fx.Node, after: set, k: int) -> list[fx.Node]:
    """Floating concatenations of k [T, 1] tensors with the ids' shape, computed from the logits, in graph order."""
    shape = _fx.shape_of(ids)
    out = []
    for n in sorted(after, key=ctx.order.get):
        parts = _parts(n)
        dt = _fx.dtype_of(n)
        if parts is not None and len(parts) == k and n is not ids and dt is not None and dt.is_floating_point \
                and _fx.same_shape(_fx.shape_of(n), shape):
            out.append(n)
    return out


# ----------------------------------------------------------------------------------------------------- probes
def _probe(ctx: Context, lin, ids, w, after: set, R: Routing, eps: float) -> str | None:
    """Run the cut-out routing (logits -> ids, w) on the probe logits for ``eps``: None when it agrees with the
    reference's sparsemixer routing on every row (16-bit: rows at a rounding of the threshold left out), else why
    not."""
    try:
        spec = MoESpec(num_experts=R.E, top_k=R.top_k, hidden_size=R.H, intermediate_size=1, scoring="softmax",
                       score_order="sparsemixer", jitter_eps=eps, renormalize=False)
    except SpecError as e:
        return f"no valid spec ({e})"
    dtype = _fx.dtype_of(lin) or torch.float32
    rw = ctx.values.get(R.router_w)
    dev = rw.device if isinstance(rw, torch.Tensor) and not _fx.is_fake(rw) else torch.device("cpu")
    logits = policy.sparsemixer_probe_logits(R.E, R.top_k, eps).to(device=dev, dtype=dtype)
    got, before = [], _fx.ancestors(lin, pos=ctx.order) | {lin}
    last = max(ctx.order[ids], ctx.order[w])  # (nothing after the routing: in-place writes later in a model graph)
    for out in (ids, w):
        side = _fx.ancestors(out, pos=ctx.order) - before - after  # scalar / weight-only helpers (2 * eps.item())
        sub, inputs = _extract(ctx, {n for n in after | side if ctx.order[n] <= last}, lin, out)
        args = [logits]
        for p in inputs[1:]:
            if p not in ctx.static_ph or isinstance(_fx.meta_val(p), torch.SymInt):
                raise Reject(f"the routing reads {p.name} (sizes or call inputs), not only the router logits")
            args.append(_value(ctx, p, torch.Generator().manual_seed(0)))
        with torch.no_grad():
            try:
                got.append(_run_disabled(sub, args))
            except Exception as e:  # noqa: BLE001
                return f"the routing graph failed on the probes ({type(e).__name__}: {str(e)[:120]})"
    g_ids, g_w = got
    ref_w, ref_ids = reference.route(logits.float(), None, spec)
    keep = torch.ones(logits.shape[0], dtype=torch.bool, device=dev)
    rel = policy.SPARSEMIXER_MASK_REL.get(dtype)
    if rel:
        keep = ~reference.sparsemixer_contested(logits, spec, rel=rel)
    return _differs(g_ids, g_w, ref_ids, ref_w, keep, policy.routing_match_tolerance(dtype))


def _differs(ids, w, ref_ids, ref_w, keep, tol: float) -> str | None:
    """None when the kept rows pick the same experts (as sets) with the same weights (rtol / atol ``tol``)."""
    if ids.shape != ref_ids.shape or w.shape != ref_w.shape or ids.is_floating_point():
        return f"ids / weights of shape {tuple(ids.shape)} / {tuple(w.shape)}, expected {tuple(ref_ids.shape)}"
    a_ids, a_ord = ref_ids[keep].sort(-1)
    b_ids, b_ord = ids[keep].long().sort(-1)
    if not torch.equal(a_ids, b_ids):
        bad = (a_ids != b_ids).any(-1).nonzero().flatten().tolist()
        return f"other experts on {len(bad)} of {int(keep.sum())} probe rows"
    a, b = ref_w[keep].float().gather(-1, a_ord), w[keep].float().gather(-1, b_ord)
    if not torch.allclose(b, a, rtol=tol, atol=tol):
        return f"weights off by up to {float((a - b).abs().max()):.3g} on the probe rows"
    return None
