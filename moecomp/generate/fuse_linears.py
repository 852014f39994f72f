"""Sibling linears of the decode step in one launch: a pass over the graph Dynamo hands the engine's decode compile.

In the decode step every plain ``nn.Linear`` of the decoder layers runs ``moecomp::skinny_linear`` and every bound FP8
linear ``moecomp::fp8_linear`` (``shared_layers.method_forwards``); at batch 1 each is a latency-bound launch. Linears
that read the same tensor (q / k / v of attention, gate / up of a dense MLP or a shared expert outside a bound block)
are found by meaning: calls of one of those ops whose input is the same FX node, whose weights are of one format
(16-bit of x's dtype, or e4m3 of one QuantSpec whose activations are not statically scaled: weight-only, or dynamic,
which the FP8 linear runs weight-only at decode rows), and whose arguments all exist before the first of them.
Each such set (split in order into runs of at most ``MAX_GROUP``) becomes one ``moecomp::skinny_group`` call placed
where the first member was, and each member's users read their item of its result::

    q = skinny_linear(h, Wq, bq)          g = skinny_group(h, [Wq, Wk, Wv], [bq, bk, bv], [None] * 3, "")
    k = skinny_linear(h, Wk, bk)   --->   q, k, v = g[0], g[1], g[2]
    v = skinny_linear(h, Wv, bv)

No attribute or module name takes part: the graph's nodes and their example values are all the pass reads. A call
with a static activation scale (always w8a8), or whose weight is computed after the group's first member, stays as it
was; whether a grouped call then runs as one launch is the op's choice at run time (``ops/linear_group.py``: where
every member would take the skinny kernel alone). ``FusingBackend`` runs the pass and hands the graph on to the engine's backend (Inductor
on CUDA, "eager" in the CPU tests); the engine's compile of the decode step uses it (``shared_layers.compiled_run``)
with ``MOECOMP_FUSE_LINEARS=1`` (opt-in until measured on a GPU). Each backend call records how many groups and members it fused
(``FusingBackend.fused``) and ``moecomp.counters["fuse_linears"]`` counts them ("groups", "linears").
"""

from __future__ import annotations

import operator
import os
from collections import defaultdict

import torch

from ..core.counters import counters
from ..ops.linear_group import MAX_GROUP  # the kernel's member slots


def enabled() -> bool:
    return os.environ.get("MOECOMP_FUSE_LINEARS", "0") == "1"  # opt-in until measured on a GPU (ARCHITECTURE)


def linear_ops():
    import moecomp.ops  # noqa: F401  (registers the ops)

    ns = torch.ops.moecomp
    return {ns.skinny_linear: "16", ns.skinny_linear.default: "16", ns.fp8_linear: "fp8", ns.fp8_linear.default: "fp8"}


def example_value(node):
    """A node's example value (Dynamo's ``example_value``, else ``val``), None for non-nodes and unknowns."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


_SIG = {"16": ("x", "weight", "bias"), "fp8": ("x", "weight", "weight_scale", "bias", "act_scale", "quant")}


def member(node, kind: str):
    """(x, weight, bias, scale, quant key) of a call the group op can take, None otherwise."""
    names = _SIG[kind]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    a = dict(zip(names, node.args), **node.kwargs)
    if any(n not in a for n in names):
        return None
    x, w, b = a["x"], a["weight"], a["bias"]
    xv, wv = example_value(x), example_value(w)
    if not (isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node) and xv is not None and wv is not None):
        return None
    if kind == "16":
        return (x, w, b, None, "") if wv.dtype == xv.dtype else None
    from ..core.spec import QuantSpec

    quant = a["quant"]
    if a["act_scale"] is not None or not isinstance(quant, str) or QuantSpec.from_key(quant).activation == "static":
        return None  # a static activation scale: always w8a8 (the FP8 linear's MMA forms, not the skinny kernel)
    return x, w, b, a["weight_scale"], quant


def _inputs(member) -> list:
    return [n for n in member[1:4] if isinstance(n, torch.fx.Node)]


def fuse_sibling_linears(gm: torch.fx.GraphModule) -> list[int]:
    """Rewrite ``gm`` in place (module docstring); returns the size of each group it made."""
    ops = linear_ops()
    sets = defaultdict(list)  # (x node, format key, dtype) -> [call nodes] in graph order
    for n in gm.graph.nodes:
        kind = ops.get(n.target) if n.op == "call_function" else None
        m = member(n, kind) if kind else None
        if m is not None:
            sets[(m[0], m[4], example_value(m[0]).dtype)].append(n)
    made = []
    for calls in sets.values():
        while len(calls) >= 2:
            # args are re-read: an earlier group may have replaced a member this set reads (its x, a weight)
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            run, rest = [(calls[0], member(calls[0], ops[calls[0].target]))], []
            for n in calls[1:]:
                m = member(n, ops[n.target])
                if len(run) < MAX_GROUP and all(order[a] < order[calls[0]] for a in _inputs(m)):
                    run.append((n, m))
                else:  # its weight is computed after the first call, or the run is full: a later run's
                    rest.append(n)
            if len(run) >= 2:
                _replace(gm.graph, run)
                made.append(len(run))
            calls = rest
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _replace(graph: torch.fx.Graph, run: list) -> None:
    nodes = [n for n, _ in run]
    x, quant = run[0][1][0], run[0][1][4]
    ws, bs, ss = ([m[j] for _, m in run] for j in (1, 2, 3))
    with graph.inserting_before(nodes[0]):
        g = graph.call_function(torch.ops.moecomp.skinny_group.default, (x, ws, bs, ss, quant))
        g.meta["example_value"] = [example_value(n) for n in nodes]
        items = []
        for i, n in enumerate(nodes):
            it = graph.call_function(operator.getitem, (g, i))
            it.meta.update({k: v for k, v in n.meta.items() if k in ("example_value", "val", "stack_trace",
                                                                      "nn_module_stack", "source_fn_stack")})
            items.append(it)
    for n, it in zip(nodes, items):
        n.replace_all_uses_with(it)
        graph.erase_node(n)


class FusingBackend:
    """A Dynamo backend: ``fuse_sibling_linears`` on each graph (unless ``linears`` is False), then the pass ``then``
    (if any), then the passes of ``after`` in order, then ``backend`` (a name or a callable)."""

    def __init__(self, backend, linears: bool = True, then=None, after=()):
        self.backend = backend
        self.linears = linears  # False: this pass left out (only ``then`` / ``after`` run)
        self.then = then  # a further pass run on each graph after this one (``generate/fuse_norm.NormPass``)
        self.after = list(after)  # passes run after ``then`` (``shared_layers.LATER_PASSES``)
        self.fused: list[list[int]] = []  # per graph compiled: the sizes of the groups made

    def __call__(self, gm, example_inputs):
        made = fuse_sibling_linears(gm) if self.linears else []
        self.fused.append(made)
        counters["fuse_linears"]["groups"] += len(made)
        counters["fuse_linears"]["linears"] += sum(made)
        for p in ([self.then] if self.then is not None else []) + self.after:
            p(gm)
        inner = self.backend
        if isinstance(inner, str):
            from torch._dynamo import lookup_backend

            inner = lookup_backend(inner)
        return inner(gm, example_inputs)
