"""fp8_linear: the dense FP8 linears left in a graph (attention projections, dense MLPs) -> ``moecomp.fp8_linear``.

While the compile backend traces, transformers' ``FP8Linear`` traces as its plain-PyTorch forward
(``moecomp/formats/fp8.py``), which the MoE pass reads inside a block (a shared expert) and this pass replaces
everywhere else::

    x ─[fake_quant_act(x, quant, [a]) | .float()]─┐
    w [N, K] e4m3, s ── dequant_fp8(w, s, quant, 1)┴─► linear ─► .to(x.dtype)
        =>
    torch.ops.moecomp.fp8_linear(x, w, s, None, a, quant)          (the bias add, if any, stays after it)

The op reads the fp8 weight and its scales as stored (nothing dequantized per call); ``quant`` carries the activation
scheme the graph shows.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ...core.spec import QuantSpec
from . import graph as _fx
from .graph import arg, op_name
from .moe_quant import ACT_QUANT, DEQUANT

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _placeholder(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "placeholder"


def _match(lin: fx.Node):
    """(out node to replace, x, w, s, act scale, quant key) for a plain FP8 linear, else None."""
    dq = arg(lin, 1)
    if not (isinstance(dq, fx.Node) and op_name(dq) == DEQUANT and arg(dq, 3) == 1 and arg(lin, 2) is None):
        return None
    w, s = arg(dq, 0), arg(dq, 1)
    if not (_placeholder(w) and _placeholder(s) and _fx.dtype_of(w) == torch.float8_e4m3fn):
        return None
    xin = arg(lin, 0)
    if isinstance(xin, fx.Node) and op_name(xin) == ACT_QUANT:
        x, a, act = arg(xin, 0), arg(xin, 2), QuantSpec.from_key(arg(xin, 1)).activation
    elif isinstance(xin, fx.Node) and op_name(xin) == "float":
        x, a, act = arg(xin, 0), None, "none"
    else:
        return None
    users = list(lin.users)
    if len(users) != 1 or len(dq.users) != 1 or len(xin.users) != 1:
        return None
    out = users[0]
    dt = _fx.dtype_of(x)
    if op_name(out) != "to" or dt not in _X_DTYPES or _fx.dtype_of(out) != dt:
        return None
    q = dataclasses.replace(QuantSpec.from_key(arg(dq, 2)), activation=act)
    return out, x, w, s, a, q.key


def rewrite_fp8_linears(gm: fx.GraphModule) -> int:
    """Replace every plain FP8 linear of ``gm`` (see the module docstring) in place; returns how many."""
    g = gm.graph
    done = 0
    for lin in [n for n in g.nodes if op_name(n) == "linear"]:
        m = _match(lin)
        if m is None:
            continue
        out, x, w, s, a, key = m
        with g.inserting_before(out):
            new = g.call_function(torch.ops.moecomp.fp8_linear.default, (x, w, s, None, a, key))
        new.meta = dict(out.meta)
        out.replace_all_uses_with(new)
        dq, xin = arg(lin, 1), arg(lin, 0)
        for n in (out, lin, dq, xin):
            if not n.users:
                g.erase_node(n)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done
