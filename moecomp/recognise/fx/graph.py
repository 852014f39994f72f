"""Small helpers for reading Dynamo's torch-level FX graphs (shared by the passes; no pass logic here).

Dynamo hands a backend a graph whose nodes are ``placeholder`` (inputs, parameters, buffers, scalar module
attributes, SymInts), ``call_function`` (torch functions, ``operator.*``, ``torch.ops.*`` overloads) and
``call_method`` (Tensor methods). The same computation can appear in several spellings (``x.sigmoid()``,
``torch.sigmoid(x)``, ``F.sigmoid(x)``, ``aten.sigmoid.default``); :func:`op_name` folds them into one canonical
lower-case name, and :func:`arg` reads an argument by position or keyword whatever the spelling.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

# Spellings that differ from the canonical name.
_ALIASES = {
    "_grouped_mm": "grouped_mm",
    "grouped_mm_fallback": "grouped_mm",
    "truediv": "div",
    "true_divide": "div",
    "divide": "div",
    "itruediv": "div_",
    "iadd": "add_",
    "imul": "mul_",
    "isub": "sub_",
    "multiply": "mul",
    "subtract": "sub",
    "floor_divide": "floordiv",
    "amax": "amax",
    "__and__": "and",
    "and_": "and",
    "invert": "invert",
    "bitwise_not": "invert",
    "logical_not": "invert",
    "negative": "neg",
    "clip": "clamp",
}

# Ops that only reinterpret / re-lay-out their first argument (no arithmetic).
VIEW_OPS = frozenset(
    {
        "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "permute",
        "transpose", "t", "contiguous", "view_as", "reshape_as", "narrow", "select", "detach", "alias", "clone",
        "movedim", "swapaxes", "swapdims", "_unsafe_view",
    }
)
CAST_OPS = frozenset({"to", "float", "type", "half", "bfloat16", "double", "type_as", "_to_copy"})

# Positional names of the arguments we read, per canonical op name (self first for methods).
_SIGNATURES = {
    "linear": ("input", "weight", "bias"),
    "topk": ("input", "k", "dim", "largest", "sorted"),
    "softmax": ("input", "dim", "_stacklevel", "dtype"),
    "log_softmax": ("input", "dim", "_stacklevel", "dtype"),
    "sum": ("input", "dim", "keepdim", "dtype"),
    "logsumexp": ("input", "dim", "keepdim"),
    "amax": ("input", "dim", "keepdim"),
    "max": ("input", "dim", "keepdim"),
    "chunk": ("input", "chunks", "dim"),
    "split": ("input", "split_size_or_sections", "dim"),
    "gather": ("input", "dim", "index"),
    "masked_fill": ("input", "mask", "value"),
    "clamp": ("input", "min", "max"),
    "gelu": ("input", "approximate"),
    "histc": ("input", "bins", "min", "max"),
    "view": ("input",),
    "reshape": ("input",),
    "to": ("input",),
    "type": ("input", "dtype"),
    "transpose": ("input", "dim0", "dim1"),
    "repeat_interleave": ("input", "repeats", "dim"),
    "grouped_mm": ("input", "weight", "offs"),
    "bmm": ("input", "mat2"),
    "matmul": ("input", "other"),
    "mm": ("input", "mat2"),
    "einsum": ("equation",),
    "index_add_": ("input", "dim", "index", "source", "alpha"),
    "index_add": ("input", "dim", "index", "source", "alpha"),
    "scatter_": ("input", "dim", "index", "src"),
    "add": ("input", "other", "alpha"),
    "add_": ("input", "other", "alpha"),
    "mul": ("input", "other"),
    "div": ("input", "other"),
    "div_": ("input", "other"),
    "getitem": ("input", "index"),
    "one_hot": ("input", "num_classes"),
}


def op_name(node: fx.Node) -> str:
    """Canonical name of what ``node`` computes ('' for placeholders / outputs / get_attr)."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            name = t._opname
        elif isinstance(t, torch._ops.OpOverloadPacket):
            name = getattr(t, "__name__", None) or str(t).split(".")[-1]
            name = name.split(".")[-1]
        elif t is torch.Tensor.__getitem__:
            name = "getitem"
        else:
            name = getattr(t, "__name__", str(t))
            if t is torch.nn.functional.linear or name == "linear":
                name = "linear"
    else:
        return ""
    name = name.strip("_") if name.startswith("__") and name.endswith("__") else name
    if name == "setitem":
        return "setitem"
    return _ALIASES.get(name, name)


def arg(node: fx.Node, index: int, name: str | None = None, default=None):
    """Argument ``index`` (counting ``self`` as 0 for methods) or keyword ``name`` of ``node``."""
    if name is None:
        sig = _SIGNATURES.get(op_name(node))
        if sig and index < len(sig):
            name = sig[index]
    if index < len(node.args):
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    if name == "input" and "self" in node.kwargs:
        return node.kwargs["self"]
    return default


def meta_val(node) :
    """The FakeTensor / SymInt Dynamo recorded for ``node`` (None when absent)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", None)
    if v is None:
        v = node.meta.get("val", None)
    return v


_CALL_INPUT_KEY = "moecomp_call_input"  # node.meta key: is_call_input's answer, kept after Dynamo's cleanup


def is_call_input(node: fx.Node, value=None) -> bool | None:
    """Is placeholder ``node`` an argument of the compiled call (activations, token ids, masks) rather than state
    the code reads (parameters, buffers, tensor / scalar attributes)? None when the graph does not say.

    Dynamo records where each graph input came from (``node.meta["grapharg"].source``): ``L['x']``,
    ``L['args'][0]`` or ``L['kwargs']['input_ids']`` (a local, or items of one) are call inputs;
    ``L['self']._modules['mlp']._parameters['weight']``, ``L['self'].scale`` (anything reached through an attribute),
    globals and closures are state. An ``nn.Parameter`` value is state wherever it came from. Dynamo deletes that
    record once the backend returns; :func:`record_input_roles` keeps the answer in ``node.meta`` for graphs that are
    analysed later (``moecomp.recognise.capture``). Without either (graphs from other tracers) the answer is None and callers
    fall back to shapes.

    Shapes alone cannot tell: with static shapes (``dynamic=False`` / the first compile of ``dynamic=None``, or a
    size-1 dim specialised under ``dynamic=True``) token ids and hidden states are as static as any weight.
    """
    if isinstance(value, torch.nn.Parameter) or isinstance(meta_val(node), torch.nn.Parameter):
        return False
    if _CALL_INPUT_KEY in node.meta:
        return node.meta[_CALL_INPUT_KEY]
    return _source_is_call_input(getattr(node.meta.get("grapharg", None), "source", None))


def record_input_roles(gm: fx.GraphModule) -> None:
    """Store :func:`is_call_input` of every placeholder in its meta while Dynamo's ``grapharg`` is still there
    (call it inside a backend, before Dynamo's cleanup)."""
    for n in gm.graph.nodes:
        if n.op == "placeholder" and _CALL_INPUT_KEY not in n.meta:
            role = _source_is_call_input(getattr(n.meta.get("grapharg", None), "source", None))
            if role is not None:
                n.meta[_CALL_INPUT_KEY] = role


def _source_is_call_input(src) -> bool | None:
    if src is None:
        return None
    try:
        from torch._dynamo import source as S
    except Exception:  # pragma: no cover
        return None
    item_sources = tuple(
        c for c in (getattr(S, n, None) for n in ("GetItemSource", "DictGetItemSource", "DictSubclassGetItemSource"))
        if isinstance(c, type)
    )
    cur = src
    while True:
        if isinstance(cur, S.LocalSource):
            return True  # a local (argument) of the traced frame, or an item of one
        if isinstance(cur, item_sources) and getattr(cur, "base", None) is not None:
            cur = cur.base
            continue
        return False  # an attribute, a global, a closure, a tensor property, ...: state, not a call argument


def shape_of(node) -> tuple | None:
    v = meta_val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype_of(node) -> torch.dtype | None:
    v = meta_val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def static_int(v) -> int | None:
    """``v`` as a Python int when it is one (or a SymInt with a constant value), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        try:
            expr = v.node.expr
            if expr.is_number:
                return int(expr)
        except Exception:
            return None
    return None


def same_dim(a, b) -> bool:
    """Two (possibly symbolic) sizes are provably equal, without installing guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return str(a) == str(b)


def same_shape(a: Iterable | None, b: Iterable | None) -> bool:
    if a is None or b is None:
        return False
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def is_inplace(node: fx.Node) -> bool:
    """Does ``node`` mutate its first argument?"""
    if node.op == "call_method":
        t = str(node.target)
        return t.endswith("_") and not t.startswith("_")
    if node.op == "call_function":
        t = node.target
        if t in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                 operator.ifloordiv, operator.imod, operator.iand, operator.ior, operator.ixor):
            return True
        if "out" in node.kwargs:
            return True
        if isinstance(t, torch._ops.OpOverload):
            return bool(t._schema.is_mutable)
        name = getattr(t, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def mutated_arg(node: fx.Node):
    if "out" in node.kwargs and isinstance(node.kwargs["out"], fx.Node):
        return node.kwargs["out"]
    return node.args[0] if node.args else None


def is_view(node: fx.Node) -> bool:
    name = op_name(node)
    if name in VIEW_OPS:
        return True
    if name in ("getitem", "chunk", "split", "unbind"):
        # getitem on a tensor with slices / ints is a view; on a tuple result (topk, chunk) it is a projection
        return True
    return False


def strip_views_casts(node, *, casts: bool = True, views: bool = True):
    """Follow ``node`` back through view / cast ops on a single tensor."""
    while isinstance(node, fx.Node):
        name = op_name(node)
        if (views and name in VIEW_OPS) or (casts and name in CAST_OPS):
            node = arg(node, 0)
        else:
            break
    return node


def cast_dtype(node: fx.Node):
    """The dtype a cast node casts to (None when not a cast or not readable)."""
    name = op_name(node)
    if name == "float":
        return torch.float32
    if name == "double":
        return torch.float64
    if name == "half":
        return torch.float16
    if name == "bfloat16":
        return torch.bfloat16
    if name in ("to", "type", "type_as", "_to_copy"):
        for a in list(node.args[1:]) + list(node.kwargs.values()):
            if isinstance(a, torch.dtype):
                return a
            if isinstance(a, fx.Node) and name == "type_as":
                return dtype_of(a)
        return dtype_of(node)
    return None


def _mut_base(node: fx.Node):
    """The tensor an in-place node writes into, followed back through views (None when not in-place)."""
    if not is_inplace(node):
        return None
    b = mutated_arg(node)
    while isinstance(b, fx.Node) and op_name(b) in VIEW_OPS | CAST_OPS | {"getitem"} and isinstance(
        meta_val(arg(b, 0)) if isinstance(arg(b, 0), fx.Node) else None, torch.Tensor
    ):
        b = arg(b, 0)
    return b if isinstance(b, fx.Node) else None


def descendants(node: fx.Node, within: set | None = None) -> set:
    """Nodes that read ``node``'s value, directly or through a tensor it was written into in place."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        nxt = list(n.users)
        base = _mut_base(n) if n is not node or is_inplace(n) else None
        if base is not None and base is not node:
            nxt.append(base)
            nxt.extend(base.users)
        for u in nxt:
            if u not in seen and (within is None or u in within):
                seen.add(u)
                stack.append(u)
    return seen


def _positions(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def ancestors(node: fx.Node, within: set | None = None, pos: dict | None = None) -> set:
    """Nodes ``node`` depends on, including in-place writes into any of them made before they were read."""
    pos = pos if pos is not None else _positions(node.graph)
    seen, stack = set(), [(node, pos[node])]
    while stack:
        n, limit = stack.pop()
        prev = [(a, pos[n]) for a in n.all_input_nodes]
        for u in n.users:
            if u is not node and pos[u] < limit and _mut_base(u) is n:
                prev.append((u, limit))
        for a, lim in prev:
            if a not in seen and (within is None or a in within):
                seen.add(a)
                stack.append((a, lim))
    return seen


def scalar_value(v, placeholder_values: dict):
    """A Python number for ``v``: a literal, ``p.item()`` of a scalar placeholder, or a SymFloat constant."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, fx.Node):
        name = op_name(v)
        if name == "item":
            src = arg(v, 0)
            if isinstance(src, fx.Node) and src.op == "placeholder" and src in placeholder_values:
                val = placeholder_values[src]
                if isinstance(val, torch.Tensor) and val.numel() == 1 and not _is_fake(val):
                    return float(val.item())
            return None
        if name == "neg":
            inner = scalar_value(arg(v, 0), placeholder_values)
            return None if inner is None else -inner
        if v.op == "placeholder" and v in placeholder_values:
            val = placeholder_values[v]
            if isinstance(val, (int, float)):
                return float(val)
    return None


def _is_fake(t) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor)
    except Exception:  # pragma: no cover
        return False


def is_fake(t) -> bool:
    return _is_fake(t)


def base_tensor(n):
    """The tensor a view / getitem chain starts from (None when it is not a node)."""
    while isinstance(n, fx.Node) and is_view(n) and op_name(n) != "getitem":
        n = arg(n, 0)
    while isinstance(n, fx.Node) and op_name(n) == "getitem" and isinstance(arg(n, 0), fx.Node) and isinstance(
        meta_val(arg(n, 0)), torch.Tensor
    ):
        n = arg(n, 0)
    return n if isinstance(n, fx.Node) else None


def weight_base(n):
    """Follow a (gathered / sliced / transposed / cast) weight back to what it was taken from."""
    while isinstance(n, fx.Node):
        name = op_name(n)
        if name in VIEW_OPS or name in CAST_OPS or name in ("getitem", "index_select", "mT", "chunk", "split"):
            n = arg(n, 0)
        else:
            break
    return n
