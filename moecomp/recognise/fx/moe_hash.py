"""Hash routing (``MoESpec.hash_routing``; DeepSeek-V4's ``hash_moe`` layers): the expert ids are looked up in a
frozen integer table by the tokens' ids, and the weights are the router's scores at those ids::

    token_ids (a call input, integer) ─[views / casts]─► table[·] | index_select(table, 0, ·) | embedding(·, table)
        (table: a static integer [V, k] placeholder)  ─[integer casts]─► ids [T, k] ─► dispatch to 3-D weights
    x ─► linear(router_w [E, H]) ─► softmax | sigmoid | sqrt(softplus) | none ─► scores ─► scores.gather(-1, ids)
        ─► [/ (sum (+ eps))] [* scale] [.to(model dtype)] = weights

Found by meaning: the ids are a lookup whose index is an integer call input (never a weight or a computed tensor:
the token ids of the call) and whose result reaches a 3-D expert weight's consumer; the weights are a gather of the
scores of a router linear by those ids (``moe_routing``'s walk from the scores back to the router and its forward
walk over renormalisation / scaling / casts). Whether the experts then compute what the spec says, with these ids
and weights, is the numeric check's question (``numeric``: random token ids in [0, V) against the reference).

Refused (``UNSUPPORTED_ROUTING``): a correction bias or group mask between the scores and the gather (no choice for
them to steer), a lookup whose ids are not gathered from router scores, tables that are not [V, k]. A table whose
known values leave [0, E) is ``SPEC_INVALID`` (the op would refuse it; the block itself would index out of range).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from ...core.reject import RejectCode
from .refuse import Reject, unsupported_routing
from .moe_routing import (Routing, from_router as _from_router, walk_to_router as _walk_to_router,
                          weight_chain as _weight_chain)

_LOOKUPS = ("getitem", "index_select", "embedding", "index")
_INT_CASTS = frozenset({"long", "int", "to", "type", "_to_copy"})


def _integer(n) -> bool:
    v = _fx.meta_val(n)
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool


def _table_and_index(ctx: Context, u: fx.Node):
    """(table placeholder, index node) when ``u`` looks a static 2-D integer placeholder up by a tensor index."""
    name = op_name(u)
    if name == "embedding":
        table, idx = arg(u, 1, "weight"), arg(u, 0, "input")
    elif name == "index_select":
        if arg(u, 1, "dim") not in (0, -2):
            return None
        table, idx = arg(u, 0), arg(u, 2, "index")
    elif name in ("getitem", "index"):
        table, idx = arg(u, 0), arg(u, 1)
        if isinstance(idx, (tuple, list)):
            idx = idx[0] if len(idx) == 1 else None
    else:
        return None
    if not (isinstance(table, fx.Node) and table.op == "placeholder" and table in ctx.static_ph
            and isinstance(idx, fx.Node) and _integer(table) and len(ctx.pshape(table) or ()) == 2):
        return None
    return table, idx


def _token_source(ctx: Context, idx: fx.Node):
    """(token-id placeholder, the view / cast nodes from it to ``idx``) when ``idx`` is an integer call input
    through views and casts only; else None."""
    chain, cur = [], idx
    while cur.op != "placeholder":
        if op_name(cur) not in _fx.VIEW_OPS | _fx.CAST_OPS | _INT_CASTS or not isinstance(arg(cur, 0), fx.Node):
            return None
        chain.append(cur)
        cur = arg(cur, 0)
    if cur in ctx.static_ph or not _integer(cur) or _fx.is_call_input(cur, ctx.values.get(cur)) is False:
        return None
    return cur, chain


def hash_lookups(ctx: Context) -> list[tuple[fx.Node, dict]]:
    """Candidate hash routings: (ids node, {"table", "tokens", "token_chain", "lookup_chain"}) for each lookup of a
    table by token ids whose result reaches a consumer of a 3-D weight."""
    ph3 = {p for p in ctx.static_ph if len(ctx.pshape(p) or ()) == 3}
    out = []
    for n in ctx.graph.nodes:
        found = _table_and_index(ctx, n) if op_name(n) in _LOOKUPS else None
        if found is None:
            continue
        table, idx = found
        src = _token_source(ctx, idx)
        if src is None:
            continue
        ids, chain = n, [n]
        while True:  # integer casts of the looked-up ids (DeepSeek-V4: ``.long()``)
            casts = [u for u in ids.users if op_name(u) in _INT_CASTS and _integer(u)]
            if len(casts) != 1 or len(ids.users) != 1:
                break
            ids = casts[0]
            chain.append(ids)
        if not any(_fx.weight_base(a) in ph3 for r in _fx.descendants(ids) for a in r.all_input_nodes):
            continue
        out.append((ids, dict(table=table, tokens=src[0], token_chain=src[1], lookup_chain=chain)))
    return out


def hash_routing(ctx: Context, ids: fx.Node, found: dict) -> Routing:
    """The routing of hash lookup ``ids`` (see the module docstring); ``Routing.hash`` holds ``found``."""
    V, k = ctx.pshape(found["table"])
    ids_shape = _fx.shape_of(ids)
    if not ids_shape or len(ids_shape) != 2 or _fx.static_int(ids_shape[-1]) != k:
        raise unsupported_routing(f"table lookup of shape {ids_shape}: expected [T, k={k}] expert ids per token")
    gathers = [u for u in ids.users if op_name(u) == "gather"]
    if len(gathers) != 1:
        raise unsupported_routing(f"expert ids looked up in a table by token ids (hash routing), but {len(gathers)} "
                                  "gathers of router scores by them (expected one: the routing weights)")
    g = gathers[0]
    if arg(g, 2, "index") is not ids or arg(g, 1, "dim") not in (1, -1):
        raise unsupported_routing("hash routing: the ids gather over a dim other than the experts")
    scores = arg(g, 0)
    E = _fx.static_int((_fx.shape_of(scores) or (None,))[-1])
    if E is None:
        raise Reject("hash routing: the scores' expert count is not a constant")
    table = ctx.values.get(found["table"])
    if isinstance(table, torch.Tensor) and not _fx.is_fake(table) and table.numel():
        lo, hi = int(table.min()), int(table.max())
        if lo < 0 or hi >= E:
            raise Reject(f"hash_table {found['table'].name} holds expert ids in [{lo}, {hi}]; expected every id in "
                         f"[0, {E}) (the router's experts)", RejectCode.SPEC_INVALID)
    walk = _walk_to_router(ctx, scores, E)
    if walk.bias is not None or walk.mask_fill is not None:
        raise unsupported_routing("hash routing with a bias or a mask on the scores: there is no choice for them to "
                                  "steer (the table gives the ids)")
    R = _from_router(ctx, walk, k, E)
    R.ids, R.hash = ids, found
    _weight_chain(ctx, R, g)
    return R
