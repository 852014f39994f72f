"""Quantized weights in the graph: a GEMM whose weight operand is ``dequant_fp8(q, scale, quant, halves)`` of an fp8
placeholder and a scale placeholder, and whose activation operand is ``fake_quant_act(x, quant, scale)`` (or x
itself: weight-only)::

    q [E, N, K] e4m3 ──[w[ids] | w[e]]──┐
    scale [E, n, k] ──[s[ids] | s[e]]───┴─► dequant_fp8(·, ·, quant, halves) ──┐
    x ──► fake_quant_act(x, quant, [a_scale[ids]]) ────────────────────────────┴─► GEMM

or a 4-bit weight (``QuantSpec.packed``: mxfp4, int4; ``formats/packed.py``'s ``PackedExperts`` spells it), always
weight-only::

    q [E, N, K / 2] uint8 ──[w[ids]]──┐
    scale [E, N, K / g] ──[s[ids]]────┼─► dequant_4bit(·, ·, ·, quant) ──► GEMM
    zero [E, N, K / g] uint8 | None ──┘   (int4 with zero points)

The weight's logical shape is then [E, N, K] (``unpacked_shape``: two codes a byte along the input dim).

The two ops are moecomp's own tracing vocabulary (``moecomp/formats/fp8.py`` spells transformers' FP8 modules with them
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

from ...core.spec import QuantSpec, SpecError
from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject

DEQUANT = "dequant_fp8"
DEQUANT4 = "dequant_4bit"
DEQUANTS = (DEQUANT, DEQUANT4)
ACT_QUANT = "fake_quant_act"
FP8 = torch.float8_e4m3fn
PACKED = torch.uint8


@dataclass
class GemmQuant:
    """One GEMM's quantization: the QuantSpec (activation as the GEMM's input shows it), the scale placeholder,
    the halves the weight was dequantized with, the static activation scale placeholder (or None)."""

    quant: QuantSpec
    scale: fx.Node
    halves: int
    act_scale: fx.Node | None
    zero: fx.Node | None = None  # int4 zero points (4-bit weights with ``quant.zero_point``)


def dequant_of(n) -> fx.Node | None:
    """The ``dequant_fp8`` / ``dequant_4bit`` node ``n`` is (through views / casts), or None."""
    n = _fx.strip_views_casts(n)
    return n if isinstance(n, fx.Node) and op_name(n) in DEQUANTS else None


def unpacked_shape(ctx: Context, p: fx.Node, nodes) -> tuple | None:
    """The logical shape of weight placeholder ``p``: a packed 4-bit weight (uint8 that a ``dequant_4bit`` among
    ``nodes`` reads as its weight) has its last dim doubled; other placeholders their own shape."""
    s = ctx.pshape(p)
    if s is None or _fx.dtype_of(p) != PACKED:
        return s
    if any(op_name(n) == DEQUANT4 and _fx.weight_base(arg(n, 0)) is p for n in nodes):
        return s[:-1] + (2 * s[-1],)
    return s


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
        elif op_name(n) == DEQUANT4:
            out |= {_fx.weight_base(a) for a in (arg(n, 1), arg(n, 2)) if isinstance(a, fx.Node)}
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
    """The quantization of ``gemm``, which reads weight ``w_ph`` [*lead, rows, cols] (logical shape: a packed 4-bit
    weight's cols are twice its bytes) through ``w_src``; None when the weight reaches it as it is (not quantized)."""
    dq = dequant_of(w_src)
    if dq is None:
        if _fx.dtype_of(w_ph) in (FP8, PACKED):
            raise Reject(f"{who} {w_ph.name} is {_fx.dtype_of(w_ph)} but reaches its GEMM without its scales")
        return None
    four = op_name(dq) == DEQUANT4
    q = _key(arg(dq, 3 if four else 2), dq)
    halves = 1 if four else arg(dq, 3)
    want_dtype = PACKED if four else FP8
    if _fx.weight_base(arg(dq, 0)) is not w_ph or _fx.dtype_of(w_ph) != want_dtype or q.packed != four:
        raise Reject(f"{who}: {dq.name} does not dequantize the {want_dtype} weight {w_ph.name}")
    scale = _block_tensor(ctx, arg(dq, 1), f"{who}: the scales of {w_ph.name}")
    want = tuple(lead) + q.scale_shape(rows, cols, halves)
    if ctx.pshape(scale) != want:
        lay = f"one per {q.block_k} columns" if four else f"{q.block_n}x{q.block_k} {q.scale}"
        raise Reject(f"{who}: scales {scale.name} {ctx.pshape(scale)} do not fit {w_ph.name} {tuple(lead)} + "
                     f"({rows}, {cols}) ({lay}: need {want})")
    zero = None
    if four and (q.zero_point or arg(dq, 2) is not None):
        if not q.zero_point or arg(dq, 2) is None:
            raise Reject(f"{who}: {dq.name} " + ("reads zero points its quant spec has no zero_point for"
                                                 if not q.zero_point else "has no zero points but quant.zero_point"))
        zero = _block_tensor(ctx, arg(dq, 2), f"{who}: the zero points of {w_ph.name}")
        if ctx.pshape(zero) != want or _fx.dtype_of(zero) != PACKED:
            raise Reject(f"{who}: zero points {zero.name} {ctx.pshape(zero)} {_fx.dtype_of(zero)} do not fit "
                         f"{w_ph.name} (need uint8 {want})")
    others = [a for a in (arg(gemm, 0), arg(gemm, 1)) if isinstance(a, fx.Node) and dequant_of(a) is None]
    act, a_ph = _act_quant(others[0]) if len(others) == 1 else ("none", None)
    if four and act != "none":
        raise Reject(f"{who}: a 4-bit weight with quantized activations (4-bit experts are weight-only)")
    return GemmQuant(dataclasses.replace(q, activation=act), scale, int(halves), a_ph, zero)


def _block_tensor(ctx: Context, n, who: str) -> fx.Node:
    p = _fx.weight_base(n)
    if not (isinstance(p, fx.Node) and p.op == "placeholder" and p in ctx.static_ph):
        raise Reject(f"{who} are not a tensor of the block")
    return p


def one_quant(found: list, who: str):
    """The one quantization of several GEMMs (all the same, or all None)."""
    qs = {None if g is None else (g.quant, g.scale, g.halves, g.act_scale, g.zero) for g in found}
    if len(qs) != 1:
        raise Reject(f"{who}: GEMMs of one weight are quantized differently (or only some)")
    return found[0]


def experts_quant(ctx: Context, E: int, w13: fx.Node, u13, w2: fx.Node, u2, gated: bool, layouts: list,
                  shapes: tuple | None = None):
    """(QuantSpec | None, {op argument: placeholder}) of the routed experts' two stacked weights (``shapes``: their
    logical shapes, ``unpacked_shape``; default the placeholders')."""
    s13, s2 = shapes if shapes is not None else (ctx.pshape(w13), ctx.pshape(w2))
    g13 = one_quant([gemm_quant(ctx, g, src, w13, (E,), s13[1], s13[2], "w13") for g, _, src in u13], "w13")
    g2 = one_quant([gemm_quant(ctx, g, src, w2, (E,), s2[1], s2[2], "w2") for g, _, src in u2], "w2")
    if g13 is None and g2 is None:
        return None, {}
    if g13 is None or g2 is None or g13.quant != g2.quant:
        raise Reject("the two expert weights are quantized differently (or only one of them)")
    if "out_in" not in layouts:
        raise Reject("quantized experts stored [in, out] (the op reads the checkpoints' [out, in])")
    if not g13.quant.packed and (g13.halves != (2 if gated else 1) or g2.halves != 1):
        raise Reject(f"w13 dequantized with halves={g13.halves} ({'gated' if gated else 'not gated'} experts)")
    bind = {"w13_scale": g13.scale, "w2_scale": g2.scale}
    if g13.quant.zero_point:
        bind.update(w13_zero=g13.zero, w2_zero=g2.zero)
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
