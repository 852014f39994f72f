"""RMSNorms folded into the skinny linears that read them: a pass over the graph Dynamo hands the engine's decode
compile, after ``fuse_linears`` (the same ``FusingBackend``).

An RMSNorm is found by what its nodes compute, then checked on probes; the subgraph (torch's or Python's spelling of
each step: ``.to`` / ``.float()`` / ``convert_element_type``, ``pow 2`` / ``x * x`` / ``square``, ...)::

    root ---------------------------.        root = x, or h = a + b (the residual add: two inputs of root's shape)
      |                              |
    [cast] = s --> square --> mean(-1, keepdim) --> + eps --> rsqrt
      |                                                         |
      '-------------------------------> mul <------------------'
                                         |
                                      [casts] --> mul <-- [casts] <-- [1 +] <-- [casts] <-- w  (a 1-D [K] tensor)
                                                   |
                                                [casts] = out

checked by evaluating exactly those nodes on random rows and weights against h / sqrt(mean(h^2) + eps) * w and
* (1 + w) (the probe decides which; eps read from the graph and checked at rows whose mean square is near it), in
the output dtype's rounding. Where every user of ``out`` is a ``moecomp::skinny_linear`` / ``fp8_linear`` /
``skinny_group`` call of the group form (``fuse_linears.member``: out as the input, one format, at most ``MAX_GROUP``
members in all), norm and calls become one ``moecomp::norm_group``, placed before the first of them; with a residual
add as root whose other users all come after that place, the add goes in too and its users read the op's h::

    n = rmsnorm(a + b)                        g = norm_group(a, b, w, eps, offset, [Wq, Wk, Wv], ...)
    q, k, v = skinny_group(n, [Wq, Wk, Wv])   --->   q, k, v, h = g[0], g[1], g[2], g[3]

In a Qwen3-MoE decoder layer's decode graph: the pre-attention norm before q / k / v folds (its residual add is in
the previous layer's graph); the post-attention norm (its user is ``moe_forward``) and q_norm / k_norm (their users
are views and rotary) are found and checked, but stay. No module or attribute name takes part. On by default for CUDA
graphs of at most ``AUTO_ROWS`` (2) rows, where it measured faster (H100, 2026-12-07: 6.5% off a batch-1 Qwen3 step);
``MOECOMP_FUSE_NORM=1`` folds every graph (the tests), ``=0`` none; ``moecomp.counters["fuse_norm"]`` counts the norms checked
("norms"), those folded ("folded"), the residual adds folded ("residuals") and the linears they feed ("linears").
"""

from __future__ import annotations

import math
import operator
import os

import torch

from ..core import policy
from ..core.counters import counters
from ..ops.linear_group import MAX_GROUP
from .fuse_linears import example_value, linear_ops, member


# Rows of a decode graph up to which the fold pays, by the H100 measurement of 2026-12-07 (``diag_fused_decode.py
# --parts norm``, Qwen3-30B-A3B's q / k / v: fused / unfused 0.72-0.97 at 1 and 2 rows, 1.16-2.04 at 4 rows, where
# 16-bit weights leave the skinny kernel and the op falls back to eager torch; the whole step at B = 1: 1.154 against
# 1.235 ms, results nvidia-h100-2026-12-07-1c088c1-s19-*).
AUTO_ROWS = 2


def mode() -> str:
    """``MOECOMP_FUSE_NORM``: "0" off, "1" on for every graph (the tests' and the A/B's setting), anything else
    (unset) "auto": CUDA graphs of at most ``AUTO_ROWS`` rows, where it measured faster."""
    v = os.environ.get("MOECOMP_FUSE_NORM", "")
    return {"0": "off", "1": "on"}.get(v, "auto")


def enabled() -> bool:
    return mode() != "off"


_CASTS = {"to", "float", "type", "type_as", "bfloat16", "half", "double"}
_TORCH = {"square": {torch.square}, "mean": {torch.mean}, "rsqrt": {torch.rsqrt},
          "mul": {operator.mul, torch.mul}, "add": {operator.add, torch.add}, "pow": {operator.pow, torch.pow}}


def _aten(node, name: str) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and t.__name__.split(".")[0] == name


def _is(node, step: str) -> bool:
    """Whether ``node`` is the elementwise / reduction step ``step`` in any of its graph spellings."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method":
        return node.target == step or (step == "cast" and node.target in _CASTS)
    if node.op != "call_function":
        return False
    if step == "cast":
        return _aten(node, "convert_element_type") or _aten(node, "_to_copy")
    return node.target in _TORCH.get(step, ()) or _aten(node, step)


is_step = _is  # the public name (generate/fuse_oproj reads a norm's root with it)


def _only_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _other(node, one):
    """The operand of the binary ``node`` that is not ``one`` (None if ``one`` is not an operand)."""
    a = node.args[:2]
    if len(a) != 2 or node.kwargs:
        return None
    return a[1] if a[0] is one else a[0] if a[1] is one else None


def _square_of(node):
    if _is(node, "square") and len(node.args) == 1:
        return node.args[0]
    if _is(node, "pow") and len(node.args) == 2 and node.args[1] == 2:
        return node.args[0]
    if _is(node, "mul") and len(node.args) == 2 and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _walk_casts(node, chain: list):
    while (u := _only_user(node)) is not None and _is(u, "cast") and u.args[0] is node:
        chain.append(u)
        node = u
    return node


def _weight_leaf(node, chain: list):
    """(w, nodes between w and node): w a 1-D graph input reached through casts and an optional ``1 +``."""
    cur = node
    while True:
        if cur.op in ("placeholder", "get_attr"):
            return cur
        if _is(cur, "cast"):
            chain.append(cur)
            cur = cur.args[0]
        elif _is(cur, "add") and len(cur.args) == 2 and not cur.kwargs and any(a == 1 for a in cur.args
                                                                                  if isinstance(a, int | float)):
            chain.append(cur)
            cur = next(a for a in cur.args if isinstance(a, torch.fx.Node))
        else:
            return None
        if not isinstance(cur, torch.fx.Node):
            return None


def match_norm(mean):
    """The RMSNorm subgraph whose mean is ``mean`` as a dict (root, s, w, eps, out, nodes: the subgraph's nodes in
    graph order, root and w excluded), None where the nodes do not have the shape of one (module docstring)."""
    if not _is(mean, "mean") or not mean.args:
        return None
    s = _square_of(mean.args[0])
    if not isinstance(s, torch.fx.Node) or len(mean.args[0].users) != 1:
        return None
    root = s.args[0] if _is(s, "cast") and isinstance(s.args[0], torch.fx.Node) else s
    add = _only_user(mean)
    if add is None or not _is(add, "add") or len(add.args) != 2:
        return None
    eps = next((a for a in add.args if isinstance(a, int | float) and not isinstance(a, bool)), None)
    rs = _only_user(add)
    if eps is None or rs is None or not _is(rs, "rsqrt"):
        return None
    nrm = _only_user(rs)
    if nrm is None or not _is(nrm, "mul") or _other(nrm, rs) is not s:
        return None
    chain = [mean.args[0], mean, add, rs, nrm]
    cur = _walk_casts(nrm, chain)
    wmul = _only_user(cur)
    if wmul is None or not _is(wmul, "mul") or not isinstance(_other(wmul, cur), torch.fx.Node):
        return None
    wchain = []
    w = _weight_leaf(_other(wmul, cur), wchain)
    wv, rv = example_value(w), example_value(root)
    if w is None or wv is None or rv is None or wv.dim() != 1 or wv.shape[0] != rv.shape[-1]:
        return None
    chain.append(wmul)
    out = _walk_casts(wmul, chain)
    nodes = ([s] if s is not root else []) + chain + wchain
    return dict(root=root, s=s, w=w, eps=float(eps), out=out, nodes=nodes)


def _probe_graph(m) -> torch.fx.GraphModule:
    """The matched nodes alone, as a function of (root, w)."""
    g = torch.fx.Graph()
    env = {m["root"]: g.placeholder("x"), m["w"]: g.placeholder("w")}
    order = {n: i for i, n in enumerate(m["root"].graph.nodes)}
    for n in sorted(m["nodes"], key=order.__getitem__):
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[m["out"]])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def check_norm(m) -> tuple[bool | None, str]:
    """(offset, "") where the matched nodes compute h / rms(h) * w (False) or * (1 + w) (True) on probes, within the
    output dtype's rounding; (None, why) otherwise."""
    rv, wv, ov = (example_value(m[k]) for k in ("root", "w", "out"))
    if ov is None or ov.dtype != rv.dtype or ov.shape != rv.shape:
        return None, f"the norm's output ({getattr(ov, 'dtype', None)}) is not of its input's dtype and shape"
    try:
        gm = _probe_graph(m)
        gen = torch.Generator().manual_seed(0)
        shape = (4, int(rv.shape[-1]))  # on CPU, a few rows: only the last dim takes part
        w = torch.randn(shape[1], generator=gen).to(wv.dtype)
        u = torch.finfo(ov.dtype).eps
        found = None
        for scale in (1.0, math.sqrt(m["eps"]) if m["eps"] > 0 else 1e-3):
            x = (torch.randn(shape, generator=gen) * scale).to(rv.dtype)
            with torch.no_grad():
                y = gm(x, w).float()
            xf = x.float()
            unit = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + m["eps"])
            ok = []
            for offset in (False, True):
                ref = unit * (w.float() + 1.0 if offset else w.float())
                ok.append(bool(((y - ref).abs() <= policy.NORM_PROBE_EPS * u * ref.abs()
                                + policy.NORM_PROBE_ABS * ref.abs().amax()).all()))
            if ok.count(True) != 1 or found not in (None, ok.index(True)):
                return None, f"the probe does not compute an RMSNorm (scale {scale:g}: matches w, 1 + w: {ok})"
            found = ok.index(True)
    except Exception as e:  # a node that cannot run on its own: reported, the norm stays
        return None, f"the probe failed: {type(e).__name__}: {e}"
    return bool(found), ""


def _users(out, ops):
    """(the members [(x, w, b, scale, quant)], the calls) where every user of ``out`` is a skinny-linear call of the
    group form taking it as input; (None, why) otherwise."""
    group = torch.ops.moecomp.skinny_group.default
    members, calls = [], []
    for u in out.users:
        kind = ops.get(u.target) if u.op == "call_function" else None
        if kind is not None:
            m = member(u, kind)
            if m is None or m[0] is not out:
                return None, f"{u.name} is not a skinny linear of the norm's output in the group form"
            members.append(m)
        elif u.op == "call_function" and u.target == group and len(u.args) == 5 and not u.kwargs and u.args[0] is out:
            if any(it.target is not operator.getitem or not isinstance(it.args[1], int) for it in u.users):
                return None, f"{u.name}'s results are not read item by item"
            ws, bs, ss, quant = u.args[1:]
            members += [(out, w, b, sc, quant) for w, b, sc in zip(ws, bs, ss)]
        else:
            return None, f"{u.name} ({u.target}) is not a skinny linear"
        calls.append(u)
    if not members:
        return None, "the norm's output has no users"
    if len({m[4] for m in members}) != 1 or len(members) > MAX_GROUP:
        return None, f"{len(members)} linears of {len({m[4] for m in members})} formats (one format, <= {MAX_GROUP})"
    return members, calls


def _residual(m, first, order):
    """(a, b) where the norm's root is a + b of two inputs of its shape and dtype whose other users all come after
    ``first``; None otherwise."""
    root = m["root"]
    if not (_is(root, "add") and len(root.args) == 2 and not root.kwargs):
        return None
    a, b = root.args
    rv = example_value(root)
    for t in (a, b):
        tv = example_value(t)
        if tv is None or tv.shape != rv.shape or tv.dtype != rv.dtype:
            return None
    inside = set(m["nodes"])
    if any(order[u] < order[first] for u in root.users if u not in inside):
        return None
    return a, b


def fold(gm: torch.fx.GraphModule, m, offset: bool, members, calls) -> bool:
    """Replace the norm ``m`` and its users ``calls`` by one ``moecomp::norm_group``; returns whether the residual
    add went in too."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(calls, key=order.__getitem__)
    res = _residual(m, first, order)
    x, r = res if res is not None else (m["root"], None)
    ws, bs, ss = ([mm[j] for mm in members] for j in (1, 2, 3))
    args = (x, r, m["w"], m["eps"], offset, ws, bs, ss, members[0][4])
    with graph.inserting_before(first):
        call = graph.call_function(torch.ops.moecomp.norm_group.default, args)
        items = [graph.call_function(operator.getitem, (call, i)) for i in range(len(members) + (r is not None))]
    vals, i = [], 0
    for c in calls:
        if c.target is torch.ops.moecomp.skinny_group.default:
            n = len(c.args[1])
            for it in list(c.users):
                it.replace_all_uses_with(items[i + it.args[1]])
                graph.erase_node(it)
            vals += list(example_value(c) or [None] * n)
        else:
            n = 1
            c.replace_all_uses_with(items[i])
            vals.append(example_value(c))
        graph.erase_node(c)
        i += n
    if r is not None:
        vals.append(example_value(m["root"]))
    call.meta["example_value"] = vals
    for it, v in zip(items, vals):
        it.meta["example_value"] = v
    for n in sorted(m["nodes"], key=order.__getitem__, reverse=True):  # the norm's nodes no other node reads
        if not n.users:
            graph.erase_node(n)
    if r is not None:
        m["root"].replace_all_uses_with(items[-1])
        graph.erase_node(m["root"])
    return r is not None


def _inputs_before(members, first, order) -> bool:
    return all(order[a] < order[first] for mm in members for a in mm[1:4] if isinstance(a, torch.fx.Node))


class NormPass:
    """The pass, called on each decode graph (``FusingBackend(..., then=NormPass())``); ``found`` holds one record
    per graph: the norms checked, those folded (members, residual folded) and why the others stayed."""

    def __init__(self, auto: bool = False):
        self.found: list[dict] = []
        self.auto = auto  # fold only CUDA graphs of at most AUTO_ROWS rows (``mode()`` "auto")

    def _outside_auto(self, m) -> str:
        """Why the "auto" mode leaves this norm (not on CUDA, more rows than ``AUTO_ROWS``), "" where it folds."""
        if not self.auto:
            return ""
        rv = example_value(m["root"])
        rows = rv.numel() // max(int(rv.shape[-1]), 1)
        if rv.device.type != "cuda":
            return f"auto: a {rv.device.type} graph (the fold is measured on CUDA only)"
        return f"auto: {rows} rows > {AUTO_ROWS} (measured slower)" if rows > AUTO_ROWS else ""

    def __call__(self, gm: torch.fx.GraphModule) -> dict:
        ops = linear_ops()
        rec = dict(norms=0, folded=[], skipped=[])
        for mean in [n for n in gm.graph.nodes if _is(n, "mean")]:
            if getattr(mean, "_erased", False):
                continue  # erased by an earlier fold
            m = match_norm(mean)
            if m is None:
                continue
            offset, why = check_norm(m)
            if offset is None:
                rec["skipped"].append(f"{m['out'].name}: {why}")
                continue
            rec["norms"] += 1
            why = self._outside_auto(m)
            if why:
                rec["skipped"].append(f"{m['out'].name}: {why}")
                continue
            members, calls = _users(m["out"], ops)
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            if members is None or not _inputs_before(members, min(calls, key=order.__getitem__), order):
                rec["skipped"].append(f"{m['out'].name}: {calls if members is None else 'a weight comes later'}")
                continue
            res = fold(gm, m, offset, members, calls)
            rec["folded"].append((len(members), res))
        if rec["folded"]:
            gm.graph.lint()
            gm.recompile()
        self.found.append(rec)
        c = counters["fuse_norm"]
        c["norms"] += rec["norms"]
        c["folded"] += len(rec["folded"])
        c["residuals"] += sum(r for _, r in rec["folded"])
        c["linears"] += sum(n for n, _ in rec["folded"])
        return rec
