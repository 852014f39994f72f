"""The attention output projection, the residual add after it and the RMSNorm of the sum in one launch: a pass over
the graph Dynamo hands the engine's decode compile, run after ``fuse_norm`` (``shared_layers.later_passes``).

``fuse_norm`` folds an RMSNorm into the linears that read it; the post-attention norm of a MoE decoder layer is read
by the MoE op instead, so it stays. This pass folds it backwards, into the linear before it::

    a = skinny_linear(o, Wo, bo)        (or fp8_linear, weight-only)     a: read by the add alone
    h = r + a                           (either operand order)           h: the norm's root, and later residual
    n = rmsnorm(h) * w                  (fuse_norm's subgraph, checked on its probes: w or 1 + w, eps)
    y = anything(n)                     (moe_forward, ...)
                        --->
    t = linear_add_norm(o, Wo, bo, scale, quant, r, w, eps, offset, round_unit);  h, n = t[0], t[1]

The norm is found and checked by ``fuse_norm``'s own matcher and prober (``match_norm`` / ``check_norm``); its root
must be a two-operand add of which one operand is a call of ``moecomp::skinny_linear`` / ``fp8_linear`` in the group
form (``fuse_linears.member``: no static activation scale) with that add as its only user, the other (the residual)
of the linear's output shape and dtype, and the norm weight must exist before the add (the op goes where the add
was; every user of h and n comes after it). Where the rows are a known number, the fold also needs the op to take
its one launch there (``ops/linear_add_norm.refusal``: the linear takes the skinny kernel, rows <=
``MOECOMP_FUSE_OPROJ_ROWS``); with symbolic rows the op decides at run time. ``round_unit`` (the op's rounding of
h * rsqrt before the weight multiply) is read from the graph: a cast to a narrower dtype than fp32 between the two
(``rounds_unit``). No module or attribute name takes part.

In a Qwen3-MoE (or gpt-oss) decoder layer's decode graph exactly one norm folds: the post-attention one (the
pre-attention norm's root is the layer input, q_norm / k_norm read views of q / k). ``MOECOMP_FUSE_OPROJ=1`` turns
the pass on (opt-in until measured on a GPU); ``moecomp.counters["fuse_oproj"]`` counts the linear -> add -> norm
chains it checked ("matched") and those it folded ("folded"); ``OprojPass.found`` holds one record per graph.
"""

from __future__ import annotations

import operator
import os

import torch

from ..core.counters import counters
from .fuse_linears import example_value, linear_ops, member
from .fuse_norm import check_norm, is_step, match_norm


def enabled() -> bool:
    return os.environ.get("MOECOMP_FUSE_OPROJ", "0") == "1"  # opt-in until measured on a GPU (ARCHITECTURE)


def make_pass():
    return OprojPass()


def _linear_into(root, ops):
    """(linear call, its member tuple, the residual) where ``root`` is linear + residual as the docstring draws it;
    None otherwise."""
    if not (is_step(root, "add") and len(root.args) == 2 and not root.kwargs):
        return None
    rv = example_value(root)
    for lin, res in (root.args, root.args[::-1]):
        kind = ops.get(lin.target) if isinstance(lin, torch.fx.Node) and lin.op == "call_function" else None
        m = member(lin, kind) if kind else None
        if m is None or list(lin.users) != [root] or not isinstance(res, torch.fx.Node):
            continue
        lv, resv = example_value(lin), example_value(res)
        if rv is None or any(v is None or v.shape != rv.shape or v.dtype != rv.dtype for v in (lv, resv)):
            continue
        return lin, m, res
    return None


def _refusal(m) -> str | None:
    """Why the op would not take its one launch at the graph's rows (None: it would, or the rows are symbolic)."""
    from ..ops.linear_add_norm import quant_spec, refusal

    x, w = example_value(m[0]), example_value(m[1])
    K = x.shape[-1]
    rows = x.numel() // K if isinstance(K, int) else None
    if not isinstance(rows, int):
        return None  # symbolic rows: the op decides at run time
    return refusal(x, w, quant_spec(m[4]))


def rounds_unit(norm) -> bool:
    """Whether the norm rounds h * rsqrt to a narrower dtype than fp32 before the weight multiply (transformers'
    Llama / Qwen form: a cast between the rsqrt's multiply and the weight's), the op's ``round_unit``."""
    rs = next(n for n in norm["nodes"] if is_step(n, "rsqrt"))
    cur = next(iter(rs.users))  # h * rsqrt (match_norm: its only user)
    while len(cur.users) == 1 and is_step(u := next(iter(cur.users)), "cast") and u.args[0] is cur:
        v = example_value(u)
        if v is not None and v.dtype.is_floating_point and torch.finfo(v.dtype).eps > torch.finfo(torch.float32).eps:
            return True
        cur = u
    return False


def fold(gm: torch.fx.GraphModule, norm, offset: bool, lin, mem, res) -> None:
    """Replace the linear ``lin``, the add (the norm's root) and the norm by one ``moecomp::linear_add_norm``."""
    graph = gm.graph
    add = norm["root"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    x, w, b, s, quant = mem
    with graph.inserting_before(add):
        call = graph.call_function(torch.ops.moecomp.linear_add_norm.default,
                                   (x, w, b, s, quant, res, norm["w"], norm["eps"], offset, rounds_unit(norm)))
        h = graph.call_function(operator.getitem, (call, 0))
        n = graph.call_function(operator.getitem, (call, 1))
    vals = (example_value(add), example_value(norm["out"]))
    call.meta["example_value"] = vals
    h.meta["example_value"], n.meta["example_value"] = vals
    norm["out"].replace_all_uses_with(n)
    for node in sorted(norm["nodes"], key=order.__getitem__, reverse=True):  # the norm's nodes no other node reads
        if not node.users:
            graph.erase_node(node)
    add.replace_all_uses_with(h)
    graph.erase_node(add)
    graph.erase_node(lin)


class OprojPass:
    """The pass, called on each decode graph; ``found`` holds one record per graph: the chains checked
    ("matched"), those folded ("folded") and why the others stayed ("skipped")."""

    def __init__(self):
        self.found: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule) -> dict:
        ops = linear_ops()
        rec = dict(matched=0, folded=0, skipped=[])
        for mean in [n for n in gm.graph.nodes if is_step(n, "mean")]:
            if getattr(mean, "_erased", False):
                continue
            norm = match_norm(mean)
            found = _linear_into(norm["root"], ops) if norm is not None else None
            if found is None:
                continue  # not a norm, or its root is not linear + residual (a layer input, q_norm's view)
            lin, mem, res = found
            offset, why = check_norm(norm)
            if offset is None:
                rec["skipped"].append(f"{norm['out'].name}: {why}")
                continue
            rec["matched"] += 1
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            why = _refusal(mem)
            if why is None and order[norm["w"]] > order[norm["root"]]:
                why = "the norm weight comes after the residual add"
            if why is not None:
                rec["skipped"].append(f"{norm['out'].name}: {why}")
                continue
            fold(gm, norm, offset, lin, mem, res)
            rec["folded"] += 1
        if rec["folded"]:
            gm.graph.lint()
            gm.recompile()
        self.found.append(rec)
        counters["fuse_oproj"]["matched"] += rec["matched"]
        counters["fuse_oproj"]["folded"] += rec["folded"]
        return rec
