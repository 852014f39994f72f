"""The block's region: its input ``x`` and every node computable from ``x`` plus weights::

    x_root ─[view | reshape | flatten]─► x_router ─► router linear          (chain: x_router back to x_root)
    region  = descendants of x_root whose inputs are all in the region, weight placeholders or support
    support = nodes computed from weights alone that the region reads (weight-only helpers, e.g. ``w.t()``)

Weights are the static-shape placeholders that are state (``Context.static_ph``), never the compiled call's own
arguments. Hash routing (``moe_hash``) adds the token-id lookup: its table lookup and casts are region nodes from the
start (the block computes its ids from them), the views of the token ids before it support (several blocks may read
one). The region may hold only deterministic ops and may mutate only tensors it created (:func:`check_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject

RANDOM_OPS = frozenset(
    {
        "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "uniform_", "normal_",
        "bernoulli", "bernoulli_", "multinomial", "exponential_", "random_", "cauchy_", "log_normal_",
        "geometric_", "normal", "poisson", "native_dropout",
    }
)


@dataclass
class Region:
    x_root: fx.Node  # the block input
    chain: list  # the router input, then back through views to x_root
    nodes: set  # descendants of x_root computable from it and weights
    support: set  # weight-only helpers the region reads

    @property
    def all(self) -> set:
        return self.nodes | self.support


def find_region(ctx: Context, x_router: fx.Node, hashed: dict | None = None) -> Region:
    """The region around the router input ``x_router`` (its ops are checked apart: :func:`check_ops`). ``hashed``:
    a hash routing's nodes (``Routing.hash``), seeded as described in the module docstring."""
    x_root, chain = _x_root(x_router)
    seed = (hashed["lookup_chain"], hashed["token_chain"]) if hashed else ((), ())
    nodes, support = _region(ctx, x_root, *seed)
    return Region(x_root, chain, nodes, support)


def _x_root(x_router: fx.Node):
    """The block input: the router input followed back through views that keep the hidden dim, and through a
    floating cast whose input something else reads too (Inkling2's router reads ``x.float().reshape(-1, H)``, its
    experts ``x``; a norm's closing ``.type_as(x)`` is not crossed: what it casts feeds nothing else)."""
    chain = [x_router]
    cur = x_router
    while op_name(cur) in ("view", "reshape", "flatten", "contiguous", "view_as", "reshape_as") or _read_uncast(cur):
        prev = arg(cur, 0)
        if not isinstance(prev, fx.Node):
            break
        ps, cs = _fx.shape_of(prev), _fx.shape_of(cur)
        if ps is None or cs is None or not _fx.same_dim(ps[-1], cs[-1]):
            break
        cur = prev
        chain.append(cur)
    return cur, chain


def _read_uncast(cur: fx.Node) -> bool:
    """``cur`` is a floating cast of a tensor that other nodes read as it is."""
    dt = _fx.cast_dtype(cur) if op_name(cur) in _fx.CAST_OPS else None
    prev = arg(cur, 0)
    return dt is not None and dt.is_floating_point and isinstance(prev, fx.Node) and len(prev.users) > 1


def _region(ctx: Context, x_root: fx.Node, seed_region=(), seed_support=()):
    """Nodes computable from x_root and weight-like placeholders: (descendants of x_root, weight-only helpers)."""
    region, support = {x_root, *seed_region}, set(seed_support)
    for _ in range(4):  # a fresh tensor the region writes into is the region's: then what reads it is too
        _grow(ctx, x_root, region, support)
        written = {b for n in region if (b := _fx._mut_base(n)) is not None and b in support}
        if not written:
            break
        support -= _users_within(written, support) | written
        region |= written
    # support nodes needed by the region only
    needed = set()
    for n in region:
        needed |= _fx.ancestors(n, support, pos=ctx.order)
    return region, needed


def _users_within(nodes: set, within: set) -> set:
    """The nodes of ``within`` that read ``nodes``, directly or through other nodes of ``within``."""
    seen, stack = set(), list(nodes)
    while stack:
        for u in stack.pop().users:
            if u in within and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _grow(ctx: Context, x_root: fx.Node, region: set, support: set) -> None:
    """One pass in graph order: nodes whose inputs are all region / support / weights join the region when they
    read a region node, the support otherwise."""
    for n in ctx.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr") or n in region or n in support:
            continue
        if ctx.order[n] < ctx.order[x_root] and not all(
            (a in ctx.static_ph or a in support) for a in n.all_input_nodes
        ):
            continue
        ins = n.all_input_nodes
        if not ins:
            support.add(n)
            continue
        if all(a in region or a in support or a in ctx.static_ph for a in ins):
            if any(a in region for a in ins):
                region.add(n)
            else:
                support.add(n)


def check_ops(nodes: set, x_root: fx.Node) -> None:
    """No random op, no dropout in training mode, no in-place write into a tensor the block did not create."""
    for n in nodes:
        name = op_name(n)
        if name in RANDOM_OPS or name.startswith("rand"):
            raise Reject(f"random op '{name}' inside the block")
        if name in ("dropout", "dropout_") and arg(n, 2, "training", True) and arg(n, 1, "p", 0.5):
            raise Reject("dropout in training mode inside the block")
        if _fx.is_inplace(n):
            tgt = _fx.base_tensor(_fx.mutated_arg(n))
            if tgt is None or tgt is x_root or tgt.op == "placeholder" or tgt not in nodes:
                raise Reject(f"'{n.name}' mutates a tensor the block did not create")


def pick_input(region: Region, out: fx.Node) -> fx.Node:
    """The alias of x whose shape equals the output's (the op returns its input's shape)."""
    os_ = _fx.shape_of(out)
    for n in [region.x_root] + list(reversed(region.chain)):
        if _fx.same_shape(_fx.shape_of(n), os_):
            return n
    raise Reject(f"output shape {os_} matches no view of the block input")
