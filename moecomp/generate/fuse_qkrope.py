"""q / k norms, rotary and the KV-cache write of each attention in one launch: a pass over the graph Dynamo hands the
engine's decode compile, after ``fuse_linears`` / ``fuse_norm`` (``shared_layers.later_passes``).

Between a decoder layer's q / k / v projections and ``moecomp::decode_attention`` the decode graph holds (a Qwen3
layer; docs/NOTES_generate.md lists the nodes of other families)::

    pq ---> view -> [q rmsnorm over D] -> transpose -> rope(cos, sin) -> [:, :, 0] ----------> decode_attention(q,
    pk ---> view -> [k rmsnorm over D] -> transpose -> rope(cos, sin) -> index_copy_(kc, 2, idx, .)        kc,
    pv ---> view -> transpose ---------------------------------------> index_copy_(vc, 2, idx, .)          vc, ...)

found from each attention call by meaning: its k / v caches are graph inputs written by exactly one ``index_copy_``
each (dim 2, one index node); the q it reads and the two written tensors are each traced back to their *leaves* (graph
inputs, or results of moecomp's ops or of a linear / matmul: the projections), and each leaf gets its role by its
shape: the projection (a computed [B, T, H*D]), the rotary table (two graph inputs [B, T, D] or [B, T, D / 2]), the
norm weight (a [D]), and in a graph of symbolic sizes (the later batch buckets: torch's automatic dynamic shapes) the
size inputs the views read (probed at their hints). Then the traced nodes are run on random leaves (probes) and must
give, within the model dtype's rounding, ``ops/qk_rope``'s formula for one of: cos / sin either way round, weight w or
1 + w (eps read from the norm's ``+ eps``, ``fuse_norm.match_norm``); v the plain [B, Hkv, T, D] view. All of it
becomes::

    q = qk_norm_rope_cache(pq, pk, pv, wq, wk, eps, offset, cos, sin, kc, vc, idx)   (k / v written in place)

placed before the first of the two writes and the attention's read of q; the traced nodes no other node reads are
erased. Left as it is (counted in ``moecomp.counters["fuse_qkrope_left"]`` by reason, and in the pass's ``found``
records): caches not graph inputs, an eps that is a graph input (a float made dynamic), writes of another form or more
than one, a leaf of no role, a probe that does not match, another read of a cache before its write, an input computed
after the placement. ``MOECOMP_FUSE_QKROPE=1`` turns the pass on (opt-in until measured on a GPU);
``moecomp.counters["fuse_qkrope"]`` counts the attentions seen ("attentions") and folded ("folded").
"""

from __future__ import annotations

import operator
import os

import torch

from ..core.counters import counters
from .fuse_linears import example_value
from .fuse_norm import is_step as _is, match_norm

TOL_ULPS = 8  # probe tolerance: |got - formula| <= TOL_ULPS * u * max|formula| (u: the dtype's roundoff)


def enabled() -> bool:
    return os.environ.get("MOECOMP_FUSE_QKROPE", "0") == "1"  # opt-in until measured on a GPU (ARCHITECTURE)


def make_pass():
    return QkRopePass()


def _moecomp_op(node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and str(t).split(".")[0] == "moecomp"


_LINEARS = {torch.nn.functional.linear, torch._C._nn.linear, torch.matmul, operator.matmul}


def _is_leaf(node) -> bool:
    """Where a trace stops: graph inputs, and the results of moecomp's ops or of a linear / matmul (projections)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_function" and (_moecomp_op(node) or node.target in _LINEARS
                                       or getattr(node.target, "__name__", "").split(".")[0] in ("linear", "mm",
                                                                                                 "addmm", "matmul")):
        return True
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
            and _moecomp_op(node.args[0]))


def trace(root) -> tuple[list, list] | str:
    """(nodes computing ``root`` from its leaves, the leaves); a reason where a node on the way mutates something."""
    nodes, leaves, seen, todo = [], [], set(), [root]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_leaf(n):
            leaves.append(n)
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "").split(".")[0]
        if (n.op not in ("call_function", "call_method") or n.target is operator.setitem
                or (name.endswith("_") and not name.startswith("__"))):
            return f"{n.name} ({n.op} {n.target}) is not a pure step"
        nodes.append(n)
        todo.extend(n.all_input_nodes)
    return nodes, leaves


def _is_write(node, cache) -> bool:
    if node.op == "call_method" and node.target == "index_copy_":
        ok = True
    else:
        ok = node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] == "index_copy_"
    return ok and len(node.args) == 4 and not node.kwargs and node.args[0] is cache and node.args[1] in (2, -2)


def _hint(s) -> int | None:
    """A size as an int: a symbolic one (the decode graph of the later batch buckets) by its hint, None unknown."""
    if isinstance(s, torch.SymInt):
        h = s.node.hint
        return None if h is None else int(h)
    return int(s)


def _shape(v) -> tuple | None:
    return tuple(_hint(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _roles(leaves, B, T, HD, D) -> dict | str:
    """{"proj", "tables", "weight", "sizes"} of a trace's leaves by shape (module docstring); sizes: the symbolic
    sizes a dynamic-shape graph passes as inputs (the views read them)."""
    r = {"proj": [], "tables": [], "weight": [], "sizes": []}
    for n in leaves:
        v = example_value(n)
        shape = _shape(v)
        if n.op == "placeholder" and isinstance(v, torch.SymInt) and _hint(v) is not None:
            r["sizes"].append(n)
        elif shape == (B, T, HD) and n.op not in ("placeholder", "get_attr"):
            r["proj"].append(n)
        elif shape in ((B, T, D), (B, T, D // 2)) and n.op in ("placeholder", "get_attr"):
            r["tables"].append(n)
        elif shape == (D,) and n.op in ("placeholder", "get_attr"):
            r["weight"].append(n)
        else:
            return f"leaf {n.name} {shape} has no role"
    if len(r["proj"]) != 1 or len(r["weight"]) > 1:
        return f"{len(r['proj'])} projections, {len(r['weight'])} norm weights (1 and <= 1 wanted)"
    return r


def _run(nodes, env_in, out):
    g = torch.fx.Graph()
    env = {n: g.placeholder(f"x{i}") for i, n in enumerate(env_in)}
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    for n in sorted(nodes, key=order.__getitem__):
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _rand(node, gen):
    v = example_value(node)
    if isinstance(v, torch.SymInt):
        return _hint(v)
    return torch.randn(_shape(v), generator=gen).to(v.dtype)


def _close(y, ref) -> bool:
    if y.shape != ref.shape or y.dtype != ref.dtype:
        return False
    u = torch.finfo(ref.dtype).eps
    return bool(((y.float() - ref.float()).abs() <= TOL_ULPS * u * ref.float().abs().amax()).all())


def probe_rope(nodes, roles, out, H, D, eps) -> tuple | str:
    """((cos, sin), offset) under which the traced nodes compute ``ops/qk_rope``'s formula on random leaves."""
    from ..ops.qk_rope import norm_rope_heads

    pr, (t0, t1), w = roles["proj"][0], roles["tables"], (roles["weight"] or [None])[0]
    gen = torch.Generator().manual_seed(0)
    leaves = [pr, t0, t1] + ([w] if w is not None else []) + roles["sizes"]
    try:
        vals = [_rand(n, gen) for n in leaves]
        with torch.no_grad():
            y = _run(nodes, leaves, out)(*vals)
    except Exception as e:  # a node that cannot run on its own: reported, the nodes stay
        return f"the probe failed: {type(e).__name__}: {e}"
    found = []
    for (c, s), (ci, si) in (((vals[1], vals[2]), (t0, t1)), ((vals[2], vals[1]), (t1, t0))):
        for offset in ((False, True) if w is not None else (False,)):
            ref = norm_rope_heads(vals[0], vals[3] if w is not None else None, eps, offset, c, s, H, D)  # [B, H, T, D]
            if ref.numel() == y.numel() and y.dim() in (3, 4) and _close(y, ref.reshape(y.shape)):
                found.append(((ci, si), offset))
    if len(found) != 1:
        return f"the probe matches {len(found)} of the rotary forms (1 wanted)"
    return found[0]


def _side(root, B, T, H, D, rope: bool) -> dict | str:
    """The traced, probed path to ``root`` (q or k: norm + rope; v: a view)."""
    t = trace(root)
    if isinstance(t, str):
        return t
    nodes, leaves = t
    roles = _roles(leaves, B, T, H * D, D)
    if isinstance(roles, str):
        return roles
    if not rope:
        if roles["tables"] or roles["weight"]:
            return "the value path reads more than its projection"
        ins = roles["proj"] + roles["sizes"]
        x, *sizes = [_rand(n, torch.Generator().manual_seed(1)) for n in ins]
        y = _run(nodes, ins, root)(x, *sizes)
        ok = y.shape == (B, H, T, D) and torch.equal(y, x.reshape(B, T, H, D).transpose(1, 2))
        return dict(proj=roles["proj"][0], nodes=nodes) if ok else "the value path is not a plain head view"
    if len(roles["tables"]) != 2:
        return f"{len(roles['tables'])} rotary tables (2 wanted)"
    eps = None
    if roles["weight"]:
        norms = [m for n in nodes if _is(n, "mean") and (m := match_norm(n)) is not None]
        if len(norms) != 1:
            return f"{len(norms)} norms on the path (1 wanted with a weight)"
        eps = norms[0]["eps"]
    p = probe_rope(nodes, roles, root, H, D, eps or 0.0)
    if isinstance(p, str):
        return p
    w = roles["weight"][0] if roles["weight"] else None
    return dict(proj=roles["proj"][0], nodes=nodes, tables=p[0], offset=p[1] if w is not None else None, weight=w,
                eps=eps)


def _attention_ops():
    import moecomp.ops  # noqa: F401  (registers the ops)

    a = torch.ops.moecomp.decode_attention
    return {a, a.default}


def match(attn) -> dict | str:
    """The fold of one ``decode_attention`` call (the leaves and traced paths of q, k, v; the writes), or why not."""
    q, kc, vc = attn.args[:3]
    if not all(isinstance(c, torch.fx.Node) and c.op == "placeholder" for c in (kc, vc)) or kc is vc:
        return "the caches are not two graph inputs"
    writes = [[u for u in c.users if _is_write(u, c)] for c in (kc, vc)]
    if [len(w) for w in writes] != [1, 1] or writes[0][0].args[2] is not writes[1][0].args[2]:
        return f"cache writes {[len(w) for w in writes]} (one index_copy_ each, one index, wanted)"
    wk, wv = writes[0][0], writes[1][0]
    kv, qv, iv = example_value(kc), example_value(q), example_value(wk.args[2])
    if kv is None or qv is None or iv is None or iv.dim() != 1 or qv.dim() not in (3, 4):
        return "no example values"
    B, Hkv, _, D = _shape(kv)
    T, Hq = _hint(iv.shape[0]), _hint(qv.shape[1])
    if None in (B, Hkv, D, T, Hq):
        return "a size without a hint"
    if qv.dim() == 3 and T != 1:
        return "a 3-D q with more than one token"
    sides = [_side(q, B, T, Hq, D, True), _side(wk.args[3], B, T, Hkv, D, True), _side(wv.args[3], B, T, Hkv, D, False)]
    for name, s in zip("qkv", sides):
        if isinstance(s, str):
            return f"{name}: {s}"
    sq, sk, sv = sides
    if sq["tables"] != sk["tables"]:
        return "q and k read other rotary tables (or in another order)"
    normed = [s for s in (sq, sk) if s["weight"] is not None]
    if len({(s["eps"], s["offset"]) for s in normed}) > 1:
        return "q and k norms of other eps / form"
    return dict(attn=attn, q=q, kc=kc, vc=vc, wk=wk, wv=wv, idx=wk.args[2], sides=sides,
                eps=normed[0]["eps"] if normed else 0.0, offset=bool(normed and normed[0]["offset"]))


def _placement(m, order) -> tuple | str:
    """(the node the op goes before) where every input exists before it and no other node touches a cache between
    it and that cache's write; why not otherwise."""
    first = min([m["wk"], m["wv"]] + list(m["q"].users), key=order.__getitem__)
    sq, sk, sv = m["sides"]
    ins = [sq["proj"], sk["proj"], sv["proj"], m["idx"], *sq["tables"]] + [s["weight"] for s in (sq, sk) if s["weight"]]
    if any(order[n] >= order[first] for n in ins):
        return f"an input comes after {first.name}"
    for c, w in ((m["kc"], m["wk"]), (m["vc"], m["wv"])):
        if any(order[first] <= order[u] < order[w] for u in c.users if u is not w):
            return f"{c.name} is used between {first.name} and its write"
    return (first,)


def fold(gm: torch.fx.GraphModule, m) -> int:
    """Replace the matched nodes by one ``moecomp::qk_norm_rope_cache``; returns how many nodes went."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = _placement(m, order)[0]
    sq, sk, sv = m["sides"]
    cos, sin = sq["tables"]
    args = (sq["proj"], sk["proj"], sv["proj"], sq["weight"], sk["weight"], float(m["eps"]), m["offset"], cos, sin,
            m["kc"], m["vc"], m["idx"])
    qv = example_value(m["q"])
    before = len(graph.nodes)
    with graph.inserting_before(first):
        call = graph.call_function(torch.ops.moecomp.qk_norm_rope_cache.default, args)
        call.meta["example_value"] = qv.new_empty(qv.shape[0], qv.shape[1], example_value(m["idx"]).shape[0],
                                                  qv.shape[-1])
        new = call
        if qv.dim() == 3:  # the attention reads q[:, :, 0]
            new = graph.call_function(operator.getitem, (call, (slice(None), slice(None), 0)))
            new.meta["example_value"] = qv
    m["q"].replace_all_uses_with(new)
    for w, c in ((m["wk"], m["kc"]), (m["wv"], m["vc"])):
        w.replace_all_uses_with(c)  # index_copy_ returns its cache
        graph.erase_node(w)
    dead = {n for s in m["sides"] for n in s["nodes"]}
    for n in sorted(dead, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
    return before - len(graph.nodes)


class QkRopePass:
    """The pass, called on each decode graph; ``found`` holds one record per graph: the attentions seen, the folds
    (nodes removed each) and why the others stayed."""

    def __init__(self):
        self.found: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule) -> dict:
        rec = dict(attentions=0, folded=[], left=[])
        ops = _attention_ops()
        for attn in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]:
            rec["attentions"] += 1
            m = match(attn)
            if isinstance(m, dict):
                p = _placement(m, {n: i for i, n in enumerate(gm.graph.nodes)})
                m = p if isinstance(p, str) else m
            if isinstance(m, str):
                rec["left"].append(f"{attn.name}: {m}")
                counters["fuse_qkrope_left"][m] += 1
                continue
            rec["folded"].append(fold(gm, m))
        if rec["folded"]:
            gm.graph.lint()
            gm.recompile()
        self.found.append(rec)
        counters["fuse_qkrope"]["attentions"] += rec["attentions"]
        counters["fuse_qkrope"]["folded"] += len(rec["folded"])
        return rec
