"""Where the MoE result is, and what scales it::

    expert GEMMs (g2) ──► * weights ──► combine ──► [* s | / s] ──► [+ shared] ──► [view] ──► block_out ──► (read
                                                   scalar s: constant or                                 outside)
                                                   scalar attribute
    block_out = the one region node that depends on the experts and is read outside the region (or returned);
    output candidates = block_out, then earlier nodes every path from the g2s to block_out passes through (latest
    first): the MoE may end there and a tail (a post-MoE norm) begin.

A scalar multiply of the combined routed output that every path from the g2s to the output passes through, before
any shared-expert add, is folded into ``routed_scaling_factor`` (:func:`output_scale`). A constant multiply after
the shared add, through which both the routed and the shared paths pass (Cohere2-MoE's "average":
``(routed + shared) / 2``), scales both: ``routed_scaling_factor`` and ``SharedExpertSpec.scale``
(:func:`common_scale`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject

MAX_OUTPUT_CANDIDATES = 8  # earlier nodes tried as the MoE output when the block's result does not agree


def block_output(region: set, g2: fx.Node) -> fx.Node:
    """The region node read outside the region (or returned) that depends on the second expert GEMM."""
    dep = _fx.descendants(g2, region) | {g2}
    outs = []
    for n in region:
        if n not in dep or not isinstance(_fx.meta_val(n), torch.Tensor):
            continue
        if any(u not in region for u in n.users):
            outs.append(n)
    outs = [n for n in outs if not _fx.is_inplace(n) or op_name(n) in ("div_", "add_", "mul_")]
    if len(outs) != 1:
        raise Reject(f"block has {len(outs)} outputs depending on the experts: {[n.name for n in outs]}")
    return outs[0]


def output_paths(ctx: Context, region: set, g2s: set, out: fx.Node) -> set:
    """The nodes on some path from a g2 to ``out`` (``out`` included)."""
    anc = _fx.ancestors(out, region, pos=ctx.order)
    path = set()
    for g in g2s:
        path |= _fx.descendants(g, region) & anc
    return path | {out}


def bypasses(g2s: set, path: set, out: fx.Node, skip: fx.Node) -> bool:
    """Does some path (along users) from a g2 reach ``out`` without passing through ``skip``?"""
    seen, stack = set(), [u for g in g2s for u in g.users if u in path and u is not skip]
    while stack:
        n = stack.pop()
        if n is out:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in n.users if u in path and u is not skip and u not in seen)
    return False


def output_candidates(ctx: Context, region: set, g2s: set, block_out: fx.Node, H: int) -> list:
    """``block_out``, then the nodes before it (latest first) that every path from the expert GEMMs to it passes
    through and that hold a [..., H] tensor: the places where the MoE result may end and a tail begin."""
    path = output_paths(ctx, region, g2s, block_out)
    out = [block_out]
    for n in sorted(path - {block_out} - g2s, key=ctx.order.get, reverse=True):
        s = _fx.shape_of(n)
        if not s or (H is not None and _fx.static_int(s[-1]) != H) or _fx.is_inplace(n):
            continue
        if not bypasses(g2s, path, block_out, n):
            out.append(n)
    return out


def scalar_operand(ctx: Context, v):
    """(value, placeholder name or None) when ``v`` is a scalar constant or a scalar attribute, else None."""
    val = _fx.scalar_value(v, ctx.values)
    src = v
    while isinstance(src, fx.Node) and op_name(src) in ("item", "neg"):
        src = arg(src, 0)
    name = src.name if isinstance(src, fx.Node) and src.op == "placeholder" else None
    if val is not None:
        return val, name
    if isinstance(v, fx.Node) and v.op == "placeholder" and v in ctx.static_ph:
        t = ctx.values.get(v)
        if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() and not _fx.is_fake(t):
            return float(t), v.name
    return None


def output_scale(ctx: Context, region: set, g2s: set, out: fx.Node, shared_down) -> tuple[float, dict]:
    """Scalar multiplies (or divides) of the combined routed output before any shared-expert add
    (``experts(x) * routed_scaling_factor``): as the combine is linear they equal scaling the routing weights.
    Returns (scale, {"routed_scaling_factor": placeholder name} when read from a scalar attribute)."""
    path = output_paths(ctx, region, g2s, out)
    after_shared = _fx.descendants(shared_down, region) | {shared_down} if shared_down is not None else set()
    out_anc = None
    scale, baked = 1.0, {}
    for n in sorted(path, key=ctx.order.get):
        sc = scalar_factor(ctx, n, path) if n not in after_shared else None
        if sc is None or bypasses(g2s, path, out, n):  # every path from the expert GEMMs passes through n
            continue
        if out is not n:
            out_anc = _fx.ancestors(out, region, pos=ctx.order) if out_anc is None else out_anc
            if n not in out_anc:
                continue
        v, src = sc
        scale *= v
        if src is not None:
            baked["routed_scaling_factor"] = src
    return scale, baked


def common_scale(ctx: Context, region: set, g2s: set, out: fx.Node, shared_down: fx.Node) -> float:
    """The product of constant multiplies (divides) after the shared-expert add that every path from the routed
    experts and from the shared expert to ``out`` passes through; 1.0 when there are none. A scalar *attribute*
    there is not folded (the match then ends before it, and the block is refused for its tail)."""
    srcs = set(g2s) | {shared_down}
    path = output_paths(ctx, region, srcs, out)
    after_shared = _fx.descendants(shared_down, region)
    scale = 1.0
    for n in sorted(path & after_shared, key=ctx.order.get):
        sc = scalar_factor(ctx, n, path)
        if sc is None or sc[1] is not None or bypasses(srcs, path, out, n):
            continue
        scale *= sc[0]
    return scale


def scalar_factor(ctx: Context, n: fx.Node, path: set):
    """``n`` as path-value * scalar or path-value / scalar: (factor, placeholder name or None); else None."""
    nm = op_name(n)
    if nm not in ("mul", "div"):
        return None
    a, b = arg(n, 0), arg(n, 1)
    if nm == "mul" and not (isinstance(a, fx.Node) and a in path):
        a, b = b, a
    if not (isinstance(a, fx.Node) and a in path):
        return None
    sc = scalar_operand(ctx, b)
    if sc is None:
        return None
    v, src = sc
    if nm == "div":
        if v == 0:
            return None
        v = 1.0 / v
    return v, src
