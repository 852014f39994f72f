"""Routed experts kept as per-expert modules (``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` of 2-D
weights), in a loop over the experts that Dynamo unrolled::

    ids ─► selector_e:  ids == e  (also of slices ids[:, j], views, casts)                       (e: a constant)
                      |  one_hot(ids, E)[.. e ..] (through permute / transpose / casts / sum over another axis)
                      |  scatter(zeros [T, E], 1, ids, weights)[:, e] | [tok, e] | [:, e:e+1]  (a dense weight)
    sparse:  tok, slot = where(selector_e) ─► x[tok] ─► expert_e ─► * weights[tok, slot] ─► index_add_(out, tok, ·)
    dense:   x ─► expert_e ─► * (weights * selector_e).sum(-1, keepdim=True) ─► out += ·
    expert_e: down(act(gate x) * up x)  |  down(act(gate_up x))  |  down(act(up x))     (act: moe_activation)
              each a linear of a 2-D weight [out, in] (``nn.Linear``, ``F.linear``, ``x @ W.T``,
              ``torch.matmul(x, W.t())``), optionally biased

Experts are told apart by the graph alone: a linear belongs to expert e when selector_e is among its ancestors
(dispatch) or, for a linear computed on every token, when the routing weight its value is first multiplied by is
computed from selector_e (the combine weight); where both exist they must agree (expert e's output is weighted by
the routing weight of id e, not another's). Each e in 0..E-1 must have exactly one expert, all of the same
structure and shapes; an expert applied more than once on the same weights (a loop over the top-k slots, then the
experts) is read from its first application. A top-k of a router-shaped linear whose ids select no expert, where
per-expert linears are there, is refused by name (``Unselected``: e.g. ``stack([expert(x) ...])`` weighted by a
dense [T, E] matrix; a data-dependent ``ids.unique()`` loop). A graph traced with real values
(``capture_block(..., real_values=True)``) holds only the experts the example input reached: the others are named in
the rejection (``NOT_RECOGNISED``), so that the caller can trace again with more tokens.

The op's tensors are built from the experts' placeholders (``Experts.stacked``): per expert, w13 = [gate; up] (gate
rows first, ``gate_up="concat"``) or the fused / plain first weight, w2 = down, b13 / b2 likewise; layout
``out_in``.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import NotACandidate, Reject
from .moe_activation import Activation, activation, strip_gate_clamp
from .moe_experts import GEMMS, Experts, gate_ups, gated_width
from .moe_region import Region
from .moe_routing import Routing

_ID_VIEWS = ("view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "clone", "detach")
_ACT_OPS = ("silu", "gelu", "relu", "sigmoid")
UNSELECTED = "select no expert by a constant index"  # in the Unselected refusal (recognise/recognise.py reads it)


@dataclass(frozen=True)
class _Form:
    """What every expert must share: sizes, weight shapes, biases, gating, gate split, activation, ops between."""

    sizes: tuple  # (N, I): first GEMM outputs, down GEMM inputs
    shapes: tuple
    biased: tuple  # (the first GEMM's linears have biases, the down linear has one)
    gated: bool
    gate_ups: tuple
    activation: tuple
    ops: tuple


@dataclass
class _Expert:
    e: int
    first: list  # the first linear(s): [gate, up] (gated, separate), [gate_up] or [up]
    down: fx.Node
    between: set  # the nodes between the first linears and the down linear
    gated: bool = False
    act: Activation | None = None
    copies: list = dataclasses.field(default_factory=list)  # further applications: their linears, down last


# ------------------------------------------------------------------------------------------------- selectors
class Unselected(Reject):
    """A top-k that ranks a router-shaped linear selects no expert, but per-expert linears are there."""


def selector_topks(ctx: Context) -> dict[fx.Node, bool]:
    """Top-k nodes over a static expert count whose indices are compared with constants / one-hot encoded (-> True),
    or that rank the outputs of a router-shaped linear (a 2-D weight [E, H], E the top-k's width) (-> False): the
    latter, with no selector, are refused (:class:`Unselected`) by :func:`per_expert` when per-expert linears are
    there; any other refusal of theirs is not reported (they may be no router)."""
    out = {}
    for n in ctx.graph.nodes:
        if op_name(n) != "topk" or not _fx.shape_of(arg(n, 0)):
            continue
        ids = [u for u in n.users if op_name(u) == "getitem" and u.args[1] == 1]
        width = _fx.static_int(_fx.shape_of(arg(n, 0))[-1])
        if width is None or not ids:
            continue
        if expert_selectors(ids[0]):
            out[n] = True
        elif _ranks_router(ctx, arg(n, 0), width):
            out[n] = False
    return out


def _ranks_router(ctx: Context, n, width: int) -> bool:
    """Is ``n`` a linear of a 2-D weight [width, .] through single-tensor elementwise ops (softmax, casts, ...)?"""
    for _ in range(8):
        if not isinstance(n, fx.Node):
            return False
        lin = ctx.as_linear(n)
        if lin is not None:
            s = ctx.pshape(ctx.weight_ph(lin[1], 2))
            return s is not None and s[0] == width
        if op_name(n) not in ("softmax", "sigmoid", "log_softmax", "float", "to", "type_as", "contiguous") \
                or len(n.all_input_nodes) != 1:
            return False
        n = arg(n, 0)
    return False


def expert_selectors(ids: fx.Node) -> dict[fx.Node, int]:
    """Nodes that select the (token, slot) pairs routed to one expert, with the expert: ``ids == e`` (``torch.eq``)
    and slices ``[e]`` on the expert axis of ``one_hot(ids)`` or of a dense [T, E] tensor ``scatter(·, d, ids, ·)``;
    through views, casts and row / slot slices (``ids[:, j]``) of ids."""
    out, stack, seen = {}, [ids], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            nm = op_name(u)
            if (nm in _ID_VIEWS or nm in _fx.CAST_OPS or nm in ("getitem", "select", "index_select")) \
                    and arg(u, 0) is n:
                stack.append(u)  # still expert ids, of some (token, slot) pairs
            elif nm == "eq":
                c = arg(u, 1) if arg(u, 0) is n else arg(u, 0)
                if isinstance(c, int) and not isinstance(c, bool):
                    out[u] = c
            elif nm == "one_hot" and _fx.shape_of(u):
                out.update(_one_hot_slices(u, len(_fx.shape_of(u)) - 1))
            elif nm in ("scatter", "scatter_") and _fx.shape_of(u) and _scatter_index(u) is n:
                d = u.kwargs.get("dim", u.args[1] if len(u.args) > 1 else None)
                if isinstance(d, int) and not isinstance(d, bool):
                    out.update(_one_hot_slices(u, d % len(_fx.shape_of(u))))
    return out


def _scatter_index(u: fx.Node):
    return u.kwargs.get("index", u.args[2] if len(u.args) > 2 else None)


def _is_int(a) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


def _one_hot_slices(n: fx.Node, axis: int) -> dict[fx.Node, int]:
    """Slices at one expert of a tensor ``n`` whose axis ``axis`` is the expert axis (one-hot of the ids, or a dense
    [T, E] scatter of them), through permutes / transposes, casts and reductions over other axes."""
    out = {}
    ndim = len(_fx.shape_of(n) or ())
    for u in n.users:
        nm = op_name(u)
        ints = [a for a in u.args[1:] if _is_int(a)]
        if arg(u, 0) is not n:
            continue
        if nm == "permute":
            dims = u.args[1] if len(u.args) == 2 and isinstance(u.args[1], (list, tuple)) else u.args[1:]
            if len(dims) == ndim and all(isinstance(d, int) for d in dims):
                out.update(_one_hot_slices(u, [d % ndim for d in dims].index(axis)))
        elif nm == "transpose" and len(ints) == 2 == len(u.args) - 1:
            d0, d1 = (d % ndim for d in ints)
            out.update(_one_hot_slices(u, d1 if axis == d0 else d0 if axis == d1 else axis))
        elif nm in _fx.CAST_OPS or nm in ("contiguous", "clone", "detach"):
            out.update(_one_hot_slices(u, axis))
        elif nm in ("sum", "any", "amax") and _fx.shape_of(u) is not None:
            d = u.kwargs.get("dim", u.args[1] if len(u.args) > 1 else None)
            keep = u.kwargs.get("keepdim", u.args[2] if len(u.args) > 2 else False)
            if _is_int(d) and d % ndim != axis:
                out.update(_one_hot_slices(u, axis if keep or d % ndim > axis else axis - 1))
        elif nm == "select" and len(ints) == 2 == len(u.args) - 1 and ints[0] % ndim == axis:
            out[u] = ints[1]
        elif nm == "getitem":
            e = _index_at(u.args[1], axis)
            if e is not None:
                out[u] = e
    return out


def _index_at(idx, axis: int) -> int | None:
    """The expert an index ``[.., e, ..]`` / ``[.., e:e+1, ..]`` takes on ``axis`` (entries before it: full slices
    or tensor indices, one dimension each), or None."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) <= axis or not all(s == slice(None) or isinstance(s, fx.Node) for s in idx[:axis]):
        return None
    a = idx[axis]
    if _is_int(a):
        return a
    if isinstance(a, slice) and _is_int(a.start) and a.stop == a.start + 1 and a.step in (None, 1) and a.start >= 0:
        return a.start
    return None


# ------------------------------------------------------------------------------------------------- the experts
def per_expert(ctx: Context, R: Routing, region: Region) -> Experts:
    """The routed experts as per-expert modules, one per expert 0..E-1 (see the module docstring)."""
    nodes = region.all
    all_sels = expert_selectors(R.ids)
    sels = {s: e for s, e in all_sels.items() if s in nodes}
    groups = _group_linears(ctx, R, region.nodes, sels)
    if not all_sels:
        _refuse_unselected(ctx, R, region.nodes)
    if not groups:
        raise NotACandidate("no stacked 3-D expert weights [E, ., .] and no per-expert linears selected by the "
                            "expert ids")
    _check_gemms(ctx, region.nodes)
    bad = sorted(e for e in groups if not 0 <= e < R.E)
    if bad:
        raise Reject(f"experts {bad} selected, but the router scores {R.E} experts")
    missing = sorted(set(range(R.E)) - set(groups))
    if missing:
        raise Reject(f"experts {missing} of {R.E} are not in the graph: the example input routed no token to them "
                     f"(only {sorted(groups)} were reached; trace with more tokens)")
    experts = [_expert(ctx, e, groups[e], nodes) for e in range(R.E)]
    return _experts_of(ctx, R, experts)


def _refuse_unselected(ctx: Context, R: Routing, region: set) -> None:
    """No selector of one expert: where the region still holds per-expert linears (2-D weights besides the router,
    at least one per expert), say that the tie of the ids to the experts is what was not understood."""
    lins = [n for n in region if n is not R.logits_linear and ctx.as_linear(n) is not None]
    if len(lins) >= R.E:
        raise Unselected(f"{len(lins)} linears of 2-D weights (per-expert modules?) read the block input, but the "
                         "top-k ids select no expert by a constant index (ids == e, one_hot(ids)[.., e], a dense "
                         "scatter(·, 1, ids, weights)[:, e]): which expert each output is weighted for is not "
                         "understood")


def _group_linears(ctx: Context, R: Routing, region: set, sels: dict) -> dict[int, list]:
    """expert -> its linears: every linear of a 2-D weight (not the router) tied to exactly one expert."""
    sel_of = _selected_by(ctx, region, sels)
    weighted = _fx.descendants(R.weights, region) | {R.weights}
    groups: dict[int, list] = {}
    for n in sorted(region, key=ctx.order.get):
        if n is R.logits_linear or ctx.as_linear(n) is None:
            continue
        dispatch, combine = sel_of[n], _combine_weight(ctx, n, region, sel_of, weighted)
        if dispatch and combine and combine != dispatch:
            raise Reject(f"{n.name} computes for expert {sorted(dispatch)} but is weighted by the routing weight of "
                         f"expert {sorted(combine)}")
        owner = dispatch or combine
        if len(owner) == 1:
            groups.setdefault(next(iter(owner)), []).append(n)
    return groups


def _selected_by(ctx: Context, region: set, sels: dict) -> dict[fx.Node, frozenset]:
    """node -> the experts whose selectors are among its ancestors (through arguments)."""
    sel_of: dict = {}
    for n in sorted(region, key=ctx.order.get):
        s = frozenset().union(*(sel_of.get(a, frozenset()) for a in n.all_input_nodes))
        sel_of[n] = s | {sels[n]} if n in sels else s
    return sel_of


def _combine_weight(ctx: Context, lin: fx.Node, region: set, sel_of: dict, weighted: set) -> frozenset:
    """The experts whose selectors the combine weight of ``lin``'s value is computed from: at the first multiply
    (graph order) of a value computed from ``lin`` by one computed from the routing weights (``weighted``), the
    selectors of the latter; empty when there is no such multiply."""
    reached, heap = {lin}, [(ctx.order[u], id(u), u) for u in lin.users if u in region]
    heapq.heapify(heap)
    while heap:
        _, _, n = heapq.heappop(heap)
        if n in reached:
            continue
        reached.add(n)
        factors = [a for a in n.all_input_nodes if a not in reached and a in weighted]
        if op_name(n) in ("mul", "mul_") and factors:
            return frozenset().union(*(sel_of.get(a, frozenset()) for a in factors))
        for u in n.users:
            if u in region and u not in reached:
                heapq.heappush(heap, (ctx.order[u], id(u), u))
    return frozenset()


def _check_gemms(ctx: Context, region: set) -> None:
    """Every GEMM of a 2-D weight must be a linear form: an expert read otherwise (``x @ W`` with W stored
    [in, out], ``W @ x.T``, einsum) would be missing from the groups, and reported as not reached."""
    def weight_2d(a):
        while isinstance(a, fx.Node) and (op_name(a) in _fx.VIEW_OPS | _fx.CAST_OPS or op_name(a) == "getattr"):
            a = arg(a, 0)
        return isinstance(a, fx.Node) and ctx.weight_ph(a, 2) is not None

    for n in region:
        if op_name(n) in GEMMS and ctx.as_linear(n) is None and any(weight_2d(a) for a in n.all_input_nodes):
            raise Reject(f"{n.name} ({op_name(n)}) multiplies by a 2-D weight in a form the pass does not read: "
                         "per-expert weights are read as linears of [out, in] weights (nn.Linear, F.linear, "
                         "x @ W.T)")


def _expert(ctx: Context, e: int, lins: list, nodes: set) -> _Expert:
    """Expert ``e`` from its linears: the first linear(s) read no other linear of the expert, the down one does.
    An expert applied more than once (a loop over the top-k slots, then the experts) is read from its first
    application; the others must read the same weights (``copies``)."""
    anc = {n: _fx.ancestors(n, nodes, pos=ctx.order) for n in lins}
    first = [n for n in lins if not any(m in anc[n] for m in lins)]
    down = [n for n in lins if n not in first]
    apps = _applications(ctx, lins, down, anc)
    if apps is not None:
        x = _expert(ctx, e, apps[0], nodes)
        x.copies = apps[1:]
        return x
    if len(down) != 1 or len(first) not in (1, 2) or any(m not in anc[down[0]] for m in first):
        raise Reject(f"expert {e}: linears {[n.name for n in lins]} are not one gate / up / down MLP")
    between = set()
    for n in first:
        between |= _fx.descendants(n, nodes) & anc[down[0]]
    ex = _Expert(e, first, down[0], between)
    if len(first) == 2:
        ex.first = _gate_first(e, first, between)
    return ex


def _applications(ctx: Context, lins: list, down: list, anc: dict) -> list | None:
    """Where several down linears read one weight: the linears of each application (a down linear and the linears
    it reads), when every application reads the same weights once each; else None."""
    weight = {n: ctx.as_linear(n)[1] for n in lins}
    if len(down) < 2 or len({weight[d] for d in down}) != 1:
        return None
    apps = [[n for n in lins if n is d or n in anc[d]] for d in down]
    names = [sorted(weight[n].name for n in app) for app in apps]
    if any(nm != names[0] for nm in names) or len(set(names[0])) != len(names[0]) or \
            sum(map(len, apps)) != len(lins):
        return None
    return [sorted(app, key=ctx.order.get) for app in apps]


def _gate_first(e: int, first: list, between: set) -> list:
    """[gate, up]: the gate is the projection an activation reads (through views, casts, a gate clamp)."""
    feeds = [n for n in first if any(n in _act_inputs(u) for u in between if op_name(u) in _ACT_OPS)]
    if len(feeds) != 1:
        raise Reject(f"expert {e}: cannot tell the gate projection from the up projection")
    return [feeds[0]] + [n for n in first if n is not feeds[0]]


def _act_inputs(u: fx.Node) -> set:
    """What activation ``u`` is applied to: its input, or the non-constant factors of ``sigmoid(alpha * g)``."""
    a = arg(u, 0)
    if op_name(u) == "sigmoid" and isinstance(a, fx.Node) and op_name(a) == "mul":
        return {strip_gate_clamp(f) for f in (arg(a, 0), arg(a, 1)) if isinstance(f, fx.Node)}
    return {strip_gate_clamp(a)}


def _experts_of(ctx: Context, R: Routing, experts: list) -> Experts:
    """The Experts record of per-expert ``experts`` (0..E-1), all of one structure."""
    baked: dict = {}
    forms = [_read(ctx, R, x, baked if x.e == 0 else {}) for x in experts]
    x0, f0 = experts[0], forms[0]
    for x, f in zip(experts, forms):
        diff = [k.name for k in dataclasses.fields(f) if getattr(f, k.name) != getattr(f0, k.name)]
        if diff:
            raise Reject(f"expert {x.e} differs from expert 0 in {', '.join(diff)} "
                         f"({', '.join(f'{getattr(f, k)} vs {getattr(f0, k)}' for k in diff)})")

    def per_expert_arg(pos: int, which: str) -> list:  # pos 1: weights, 2: biases
        return [[ctx.as_linear(n)[pos] for n in (x.first if which == "first" else [x.down])] for x in experts]

    stacked = {"w13": per_expert_arg(1, "first"), "w2": per_expert_arg(1, "down")}
    if f0.biased[0]:
        stacked["b13"] = per_expert_arg(2, "first")
    if f0.biased[1]:
        stacked["b2"] = per_expert_arg(2, "down")
    downs = {x.down for x in experts} | {app[-1] for x in experts for app in x.copies}
    return Experts(
        I=f0.sizes[1], gated=x0.gated, layouts=["out_in"], gate_ups=list(f0.gate_ups), act=x0.act,
        g1={n for x in experts for n in x.first}, g2_all=downs, g2=max(downs, key=ctx.order.get), stacked=stacked,
        linears=frozenset(n for x in experts for n in x.first + [x.down] + sum(x.copies, [])), baked=baked,
    )


def _read(ctx: Context, R: Routing, x: _Expert, baked: dict) -> _Form:
    """Expert ``x``'s sizes, activation and gate split (sets ``x.gated`` / ``x.act``)."""
    forms = [ctx.as_linear(n) for n in x.first]
    down = ctx.as_linear(x.down)
    shapes = [ctx.pshape(w) for _, w, _ in forms]
    sd = ctx.pshape(down[1])
    if sd[0] != R.H or any(s[1] != R.H for s in shapes):
        raise Reject(f"expert {x.e}: weights {shapes} / {sd} do not fit hidden size {R.H}")
    I = sd[1]
    N = sum(s[0] for s in shapes)
    if len(forms) == 2 and shapes != [(I, R.H), (I, R.H)]:
        raise Reject(f"expert {x.e}: gate / up weights {shapes} do not match the down weight {sd}")
    x.gated = gated_width(N, I)
    if len({b is None for *_, b in forms}) != 1:  # gate and up apart: both biased or neither (b13 holds both)
        raise Reject(f"expert {x.e}: only one of its gate / up linears has a bias")
    x.act = activation(ctx, x.between, x.gated, baked, f"expert {x.e}")
    return _Form(
        sizes=(N, I), shapes=tuple(shapes) + (sd,), biased=(forms[0][2] is not None, down[2] is not None),
        gated=x.gated,
        gate_ups=tuple(["concat"] if len(forms) == 2 else gate_ups(x.between, x.gated)),
        activation=(tuple(x.act.names), x.act.clamp, x.act.clamp_after, x.act.alpha, x.act.limit, x.act.gate_softcap,
                    x.act.up_softcap),
        ops=tuple(sorted(op_name(n) for n in x.between)),
    )
