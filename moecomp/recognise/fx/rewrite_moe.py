"""rewrite_moe: replace each matched MoE block with one ``torch.ops.moecomp.moe_forward`` call.

Before (one block, whatever its spelling; see detect_moe.py)::

    x ─┬─ router linear ─ scoring ─ top-k ─ renorm/scale ─┐
       ├─ dispatch ─ GEMM(w13) ─ gate ─ GEMM(w2) ─────────┴─ combine ─┐
       └─ [shared MLP (* sigmoid gate)] ──────────────────────────────(+)─ [view / cast] ─ out ─► users

After::

    x ─ moecomp.moe_forward(x, router_w, router_b, correction_bias, w13, b13, w2, b2,
                            shared_w1, shared_w3, shared_w2, shared_gate_w, spec.key) ─ [.to(out dtype)] ─► users

The op reads the same parameter placeholders the block read (so weight updates stay visible and nothing is copied;
a tensor the op needs in another shape, e.g. a ``[1, E]`` correction bias, is passed through a ``reshape`` node, and
one of which it reads the first rows, LongCat-Flash's ``[E + Z, 2I, H]`` gate_up_proj, through a ``narrow``, and
experts held flat in a 2-D matrix (or a weight stored transposed) through ``view`` + ``permute``: ``arg_views``);
scalar attributes (routed scaling, swiglu alpha / limit) are in ``spec.key``. Experts kept as per-expert modules
(``MoEMatch.stacked``) have no stacked tensor to read: the graph builds it, ``torch.stack`` of each expert's
``torch.cat`` (a copy of every expert weight per call; ``moecomp.api.backend`` leaves such blocks alone, and
``moecomp.optimize`` binds them to a stacked buffer their parameters share instead). The shared expert and its gate are
folded into the op (it overlaps them with the routed experts on a side stream): there is no separate overlap pass.

A tail the block applies to the MoE result (``MoEMatch.tail``, e.g. a post-MoE norm) is not part of the match: it
now reads the op's result and stays.

Dead-code elimination is alias-aware and limited to the block's nodes: a node stays when anything outside the block
still reads it (e.g. router logits or router scores a model also returns), and so does every in-place write into a
tensor that stays (``setitem``, ``index_add_``, ``scatter_``, ``/=`` ...).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...ops.moe_op import MOE_ARGS, OP_ARGS
from . import graph as _fx


def rewrite_moe(gm: fx.GraphModule, matches) -> int:
    """Rewrite every match of ``detect_moe(gm)`` in place; returns the number of blocks replaced."""
    done = 0
    for m in matches:
        _rewrite_one(gm, m)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _fake_like(node: fx.Node):
    v = _fx.meta_val(node)
    if isinstance(v, torch.Tensor):
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            with mode:
                return torch.empty_like(v)
    return v


def _rewrite_one(gm: fx.GraphModule, m) -> None:
    g = gm.graph
    ph = {n.name: n for n in g.nodes if n.op == "placeholder"}
    args = [ph[m.bindings[k]] if m.bindings.get(k) is not None else None for k in OP_ARGS]
    out = m.output
    with g.inserting_before(out):
        for k, per_expert in getattr(m, "stacked", {}).items():
            args[OP_ARGS.index(k)] = _stack(g, [[ph[n] for n in names] for names in per_expert])
        for i, k in enumerate(OP_ARGS):  # the first rows of a weight (zero experts: w13 [E + Z, ...] read as [E])
            rows = getattr(m, "arg_rows", {}).get(k)
            if rows is not None and args[i] is not None:
                v = g.call_method("narrow", (args[i], 0, 0, rows))
                fake = _fx.meta_val(args[i])
                if isinstance(fake, torch.Tensor):
                    v.meta["example_value"] = fake.narrow(0, 0, rows)
                args[i] = v
        for i, k in enumerate(OP_ARGS):  # experts held flat (or a weight stored transposed): a view, no copy
            fv = getattr(m, "arg_views", {}).get(k)
            if fv is not None and args[i] is not None:
                v = g.call_method("permute", (g.call_method("view", (args[i], *fv.shape)), *fv.perm))
                fake = _fx.meta_val(args[i])
                if isinstance(fake, torch.Tensor):
                    v.args[0].meta["example_value"] = fake.view(fv.shape)
                    v.meta["example_value"] = fv.apply(fake)
                args[i] = v
        for i, k in enumerate(OP_ARGS):  # e.g. a [1, E] correction bias the op takes as [E]
            shape = getattr(m, "arg_shapes", {}).get(k)
            if shape is not None and args[i] is not None:
                v = g.call_method("reshape", (args[i], *shape))
                fake = _fx.meta_val(args[i])
                if isinstance(fake, torch.Tensor):
                    v.meta["example_value"] = fake.reshape(shape)
                args[i] = v
        n = len(MOE_ARGS)
        scales = list(args[n:])  # scales, latent, hash and norm tensors: up to the last one given
        while scales and scales[-1] is None:
            scales.pop()
        new = g.call_function(torch.ops.moecomp.moe_forward.default, (m.x, *args[:n], m.spec.key, *scales))
        new.meta["example_value"] = _fake_like(m.x)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in out.meta:
                new.meta[key] = out.meta[key]
        result = new
        if m.output_dtype is not None:
            result = g.call_method("to", (new, m.output_dtype))
            result.meta["example_value"] = _fake_like(out)
    block = set(m.nodes)
    # outside readers only: in-place writes of the block into ``out`` (index_add_ into a zeros buffer) must not be
    # redirected into the op's result; they die with the block
    out.replace_all_uses_with(result, delete_user_cb=lambda u: u not in block)
    _dce(g, block)


def _stack(g: fx.Graph, per_expert: list) -> fx.Node:
    """``torch.stack([torch.cat(expert, 0) for expert in per_expert])`` as graph nodes (fake values in meta)."""
    rows = []
    for nodes in per_expert:
        row = nodes[0] if len(nodes) == 1 else g.call_function(torch.cat, (list(nodes), 0))
        rows.append(row)
        if len(nodes) > 1:
            _set_fake(row, lambda: torch.cat([_fx.meta_val(n) for n in nodes], 0), nodes[0])
    out = g.call_function(torch.stack, (rows, 0))
    _set_fake(out, lambda: torch.stack([_fx.meta_val(r) for r in rows], 0), rows[0])
    return out


def _set_fake(node: fx.Node, make, like: fx.Node) -> None:
    v = _fx.meta_val(like)
    mode = getattr(v, "fake_mode", None)
    if mode is not None:
        with mode:
            node.meta["example_value"] = make()


def _dce(g: fx.Graph, block: set) -> None:
    """Erase block nodes nothing outside the block needs any more (alias- and mutation-aware)."""
    block = {n for n in block if n.op not in ("placeholder", "output", "get_attr")}
    # in-place writes per written base tensor
    writes: dict[fx.Node, list[fx.Node]] = {}
    for n in block:
        b = _fx._mut_base(n)
        if b is not None:
            writes.setdefault(_root(b), []).append(n)
    live: set = set()
    stack = [n for n in block if any(u not in block for u in n.users)]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        for a in n.all_input_nodes:
            if a in block and a not in live:
                stack.append(a)
        for w in writes.get(_root(n), ()):
            if w not in live:
                stack.append(w)
    for n in reversed(list(g.nodes)):
        if n in block and n not in live:
            if n.users:  # every user is dead too and was erased before; anything left means a bug: keep it
                continue
            g.erase_node(n)


def _root(n: fx.Node) -> fx.Node:
    """The tensor a view (chain) aliases."""
    while isinstance(n, fx.Node) and _fx.op_name(n) in _fx.VIEW_OPS | _fx.CAST_OPS | {"getitem"}:
        a = _fx.arg(n, 0)
        if not isinstance(a, fx.Node) or not isinstance(_fx.meta_val(a), torch.Tensor):
            break
        n = a
    return n
