"""Quantized weights in the graph: a GEMM whose weight operand is ``dequant_fp8(q, scale, quant, halves)`` of an fp8
placeholder and a scale placeholder, and whose activation operand is ``fake_quant_act(x, quant, scale)`` (or x
itself: weight-only)::

    q [E, N, K] e4m3 ──[w[ids] | w[e]]──┐
    scale [E, n, k] ──[s[ids] | s[e]]───┴─► dequant_fp8(·, ·, quant, halves) ──┐
    x ──► fake_quant_act(x, quant, [a_scale[ids]]) ────────────────────────────┴─► GEMM

The two ops are moecomp's own tracing vocabulary (``moecomp/hf/fp8.py`` spells transformers' FP8 modules with them
while Dynamo traces): a quantized weight is one node whose inputs are the weight and its scales. What the graph says
is checked by meaning: the weight placeholder holds ``float8_e4m3fn``, the scale's shape is the blocked shape of the
weight (``QuantSpec.scale_shape``), a gated w13 is dequantized with its halves apart, every GEMM of one weight
agrees. The numeric check then compares the region with the reference on the real tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..spec import QuantSpec, SpecError
from . import _fx
from ._context import Context
from ._fx import arg, op_name
from ._reject import Reject

DEQUANT = "dequant_fp8"
ACT_QUANT = "fake_quant_act"
FP8 = torch.float8_e4m3fn


@dataclass
class GemmQuant:
    """One GEMM's quantization: the QuantSpec (activation as the GEMM's input shows it), the scale placeholder,
    the halves the weight was dequantized with, the static activation scale placeholder (or None)."""

    quant: QuantSpec
    scale: fx.Node
    halves: int
    act_scale: fx.Node | None


def dequant_of(n) -> fx.Node | None:
    """The ``dequant_fp8`` node ``n`` is (through views / casts), or None."""
    n = _fx.strip_views_casts(n)
    return n if isinstance(n, fx.Node) and op_name(n) == DEQUANT else None


def strip_act_quant(n):
    """``n`` through views / casts and an activation quantization (the tensor it quantizes)."""
    n = _fx.strip_views_casts(n)
    if isinstance(n, fx.Node) and op_name(n) == ACT_QUANT:
        n = _fx.strip_views_casts(arg(n, 0))
    return n


def quant_inputs(nodes) -> set:
    """Placeholders read as scales (weight or activation) by the tracing ops among ``nodes``."""
    out = set()
    for n in nodes:
        if op_name(n) == DEQUANT:
            out.add(_fx.weight_base(arg(n, 1)))
        elif op_name(n) == ACT_QUANT and isinstance(arg(n, 2), fx.Node):
            out.add(_fx.weight_base(arg(n, 2)))
    return out


def _act_quant(n) -> tuple[str, fx.Node | None]:
    """(activation scheme, static scale placeholder) of a GEMM's activation operand."""
    n = _fx.strip_views_casts(n)
    if not (isinstance(n, fx.Node) and op_name(n) == ACT_QUANT):
        return "none", None
    q = _key(arg(n, 1), n)
    a = arg(n, 2)
    return q.activation, (_fx.weight_base(a) if isinstance(a, fx.Node) else None)


def _key(k, n) -> QuantSpec:
    try:
        return QuantSpec.from_key(k)
    except SpecError as e:
        raise Reject(f"{n.name}: not a quantization spec ({e})") from None


def gemm_quant(ctx: Context, gemm: fx.Node, w_src, w_ph: fx.Node, lead: tuple, rows: int, cols: int,
               who: str) -> GemmQuant | None:
    """The quantization of ``gemm``, which reads weight ``w_ph`` [*lead, rows, cols] through ``w_src``; None when the
    weight reaches it as it is (not quantized)."""
    dq = dequant_of(w_src)
    if dq is None:
        if _fx.dtype_of(w_ph) == FP8:
            raise Reject(f"{who} {w_ph.name} is {FP8} but reaches its GEMM without its scales")
        return None
    q, halves = _key(arg(dq, 2), dq), arg(dq, 3)
    if _fx.weight_base(arg(dq, 0)) is not w_ph or _fx.dtype_of(w_ph) != FP8:
        raise Reject(f"{who}: {dq.name} does not dequantize the {FP8} weight {w_ph.name}")
    scale = _fx.weight_base(arg(dq, 1))
    if not (isinstance(scale, fx.Node) and scale.op == "placeholder" and scale in ctx.static_ph):
        raise Reject(f"{who}: the scales of {w_ph.name} are not a tensor of the block")
    want = tuple(lead) + q.scale_shape(rows, cols, halves)
    if ctx.pshape(scale) != want:
        raise Reject(f"{who}: scales {scale.name} {ctx.pshape(scale)} do not fit {w_ph.name} {tuple(lead)} + "
                     f"({rows}, {cols}) ({q.block_n}x{q.block_k} {q.scale}: need {want})")
    others = [a for a in (arg(gemm, 0), arg(gemm, 1)) if isinstance(a, fx.Node) and dequant_of(a) is None]
    act, a_ph = _act_quant(others[0]) if len(others) == 1 else ("none", None)
    return GemmQuant(dataclasses.replace(q, activation=act), scale, int(halves), a_ph)


def one_quant(found: list, who: str):
    """The one quantization of several GEMMs (all the same, or all None)."""
    qs = {None if g is None else (g.quant, g.scale, g.halves, g.act_scale) for g in found}
    if len(qs) != 1:
        raise Reject(f"{who}: GEMMs of one weight are quantized differently (or only some)")
    return found[0]


def experts_quant(ctx: Context, E: int, w13: fx.Node, u13, w2: fx.Node, u2, gated: bool, layouts: list):
    """(QuantSpec | None, {op argument: placeholder}) of the routed experts' two stacked weights."""
    s13, s2 = ctx.pshape(w13), ctx.pshape(w2)
    g13 = one_quant([gemm_quant(ctx, g, src, w13, (E,), s13[1], s13[2], "w13") for g, _, src in u13], "w13")
    g2 = one_quant([gemm_quant(ctx, g, src, w2, (E,), s2[1], s2[2], "w2") for g, _, src in u2], "w2")
    if g13 is None and g2 is None:
        return None, {}
    if g13 is None or g2 is None or g13.quant != g2.quant:
        raise Reject("the two expert weights are quantized differently (or only one of them)")
    if "out_in" not in layouts:
        raise Reject("quantized experts stored [in, out] (the op reads the checkpoints' [out, in])")
    if g13.halves != (2 if gated else 1) or g2.halves != 1:
        raise Reject(f"w13 dequantized with halves={g13.halves} ({'gated' if gated else 'not gated'} experts)")
    bind = {"w13_scale": g13.scale, "w2_scale": g2.scale}
    if g13.quant.activation == "static":
        for k, a in (("a13_scale", g13.act_scale), ("a2_scale", g2.act_scale)):
            if a is None or ctx.pshape(a) != (E,):
                raise Reject(f"static activation scales: {k} is not a [{E}] tensor of the block")
            bind[k] = a
    return g13.quant, bind


def shared_quant(ctx: Context, linears: dict):
    """(QuantSpec | None, {op argument: placeholder}) of the shared expert's linears (``{op argument: (linear node,
    weight placeholder)}``, shared_w1 / shared_w3 / shared_w2)."""
    found = {}
    for k, (n, w) in linears.items():
        s = ctx.pshape(w)
        found[k] = gemm_quant(ctx, n, arg(n, 1), w, (), s[0], s[1], f"shared expert {k}")
    vals = list(found.values())
    if all(v is None for v in vals):
        return None, {}
    if any(v is None for v in vals) or len({v.quant for v in vals}) != 1:
        raise Reject("shared expert linears are quantized differently (or only some of them)")
    if any(v.act_scale is not None for v in vals):
        raise Reject("shared expert linears with static activation scales are not supported")
    return vals[0].quant, {f"{k}_scale": v.scale for k, v in found.items()}
