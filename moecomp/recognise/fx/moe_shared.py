"""The shared (always-on) expert: the dense linears of the block other than the router and the routed experts::

    x ─┬─► gate_proj ─► act ─┐                                        layout "separate", gated
       ├─► up_proj ──────────┴─(*)─► down_proj ─┐
       │   or gate_up_proj ─► chunk ─► act(g) * u | swiglu_oai      layout "concat" ([2Is, H], gate rows first)
       │   or up_proj ─► act ─────────────────► down_proj            not gated
       └─► [shared_gate [1, H] ─► sigmoid] ──────(*)──────────────────┴─► (+ routed output)

The activation is read like the routed experts' (``moe_activation``). The shared output must reach the block output.
FP8 shared-expert linears are read through their ``dequant_fp8`` nodes (``moe_quant``). 4-bit dense linears
(``moecomp.linear_4bit``: a ``Packed4Linear`` of an int4 GPTQ / AWQ checkpoint) are refused with ``SPEC_INVALID``:
4-bit shared experts are not in the spec (``api/pair.py`` may then rewrite the block's router and experts alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ...core.reject import RejectCode
from ...core.spec import SharedExpertSpec
from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject
from .moe_activation import Activation, activation, strip_gate_clamp
from .moe_experts import has_step2
from .moe_gammas import stacked_shared
from .moe_quant import shared_quant, strip_act_quant
from .moe_routing import Routing

LINEAR4 = "linear_4bit"  # torch.ops.moecomp.linear_4bit (ops/linear4.py)


@dataclass
class Shared:
    spec: SharedExpertSpec
    bind: dict  # shared_w1 / shared_w3 / shared_w2 / shared_gate_w -> placeholder node | None
    down: fx.Node  # the down projection
    baked: dict  # "shared.<field>" -> placeholder name


def shared(ctx: Context, R: Routing, region: set, x_root: fx.Node, out: fx.Node,
           exclude: frozenset = frozenset()) -> Shared | None:
    """Dense linears of ``region`` other than the router (and the routed experts' ``exclude``): a shared-expert MLP
    and its optional sigmoid gate; None when there are none."""
    q4 = sorted((n for n in region if op_name(n) == LINEAR4), key=ctx.order.get)
    if q4:
        raise Reject(f"the block's dense linears {[n.name for n in q4]} are 4-bit (moecomp.linear_4bit: a "
                     f"Packed4Linear shared expert of an int4 checkpoint); 4-bit shared experts are not supported by "
                     f"the op (SharedExpertSpec.quant): no whole-block rewrite (the pair rewrite may still take the "
                     f"router and experts, leaving the shared expert to the block)", RejectCode.SPEC_INVALID)
    lins = []
    for n in region:
        lf = ctx.as_linear(n) if n is not R.logits_linear and n not in exclude else None
        if lf is not None:
            lins.append((n, *lf))
    st = stacked_shared(ctx, R, region, exclude)  # S experts stacked [S, ., .], read by bmm (Inkling)
    if st is not None:
        if lins:
            raise Reject(f"stacked shared experts and dense linears {[n.name for n, *_ in lins]} in one block")
        spec, bind, down = st
        if out not in _fx.descendants(down, region) and out is not down:
            raise Reject("the stacked shared experts do not reach the block output")
        return Shared(spec=spec, bind=bind, down=down, baked={})
    if not lins:
        return None
    H = R.H
    x_like = (x_root, _fx.strip_views_casts(R.x_router))
    first = [(n, w) for n, a, w, b in lins if strip_act_quant(a) in x_like]  # (x, or x quantized: moe_quant)
    rest = [(n, w) for n, a, w, b in lins if strip_act_quant(a) not in x_like]
    if any(b is not None for *_, b in lins):
        raise Reject("shared expert with biases is not supported")
    gate_lin = [(n, w) for n, w in first if ctx.pshape(w) == (1, H)]
    mlp_in = [(n, w) for n, w in first if ctx.pshape(w) != (1, H)]
    if len(rest) != 1 or not mlp_in:
        raise Reject(f"unrecognised dense linears in the block: {[n.name for n, *_ in lins]}")
    down, wd = rest[0]
    Is = ctx.pshape(wd)[1]
    if ctx.pshape(wd)[0] != H:
        raise Reject(f"shared down projection {ctx.pshape(wd)} does not produce hidden size {H}")
    down_anc = _fx.ancestors(down, region, pos=ctx.order)
    between = set()
    for n, _ in mlp_in:
        between |= _fx.descendants(n, region) & down_anc
    baked = {}  # spec fields read from scalar attributes: reported as "shared.<field>"
    bind = dict(shared_w1=None, shared_w3=None, shared_w2=wd, shared_gate_w=None)
    fields, act = _projections(ctx, mlp_in, between, Is, H, bind, baked)
    fields.update(_act_fields(act))
    fields["gate"], bind["shared_gate_w"] = _shared_gate(gate_lin)
    if out not in _fx.descendants(down, region) and out is not down:
        raise Reject("the shared expert does not reach the block output")
    by_weight = {w: n for n, _, w, _ in lins}
    fields["quant"], scales = shared_quant(ctx, {k: (by_weight[w], w) for k, w in bind.items()
                                                 if w is not None and k != "shared_gate_w"})
    bind.update(scales)
    return Shared(spec=SharedExpertSpec(**fields), bind=bind, down=down,
                  baked={f"shared.{k}": v for k, v in baked.items()})


def _projections(ctx: Context, mlp_in: list, between: set, Is: int, H: int, bind: dict, baked: dict):
    """The input projections: (spec fields, Activation); fills ``bind``'s shared_w1 / shared_w3."""
    act_of = {}  # which input projection feeds an activation (through views / casts and a gate clamp(max=L); a
    # sigmoid: x * sigmoid(x), or a softcapped silu whose sigmoid reads the raw gate)
    for n, _ in mlp_in:
        for u in between:
            if op_name(u) in ("silu", "sigmoid", "relu", "gelu") and strip_gate_clamp(arg(u, 0)) is n:
                act_of[n] = op_name(u)
    if len(mlp_in) == 2:
        gated_ones = [(n, w) for n, w in mlp_in if n in act_of]
        if len(gated_ones) != 1:
            raise Reject("shared expert: cannot tell gate_proj from up_proj")
        (g, wg), (_, wu) = gated_ones[0], [(n, w) for n, w in mlp_in if n is not gated_ones[0][0]][0]
        if ctx.pshape(wg) != (Is, H) or ctx.pshape(wu) != (Is, H):
            raise Reject("shared gate / up projections do not match the down projection")
        bind.update(shared_w1=wg, shared_w3=wu)
        return dict(intermediate_size=Is, gated=True, layout="separate"), activation(
            ctx, between, True, baked, "shared expert")
    if len(mlp_in) != 1:
        raise Reject("more than two shared input projections")
    n, w = mlp_in[0]
    s = ctx.pshape(w)
    if s == (2 * Is, H) and any(op_name(u) in ("chunk", "split", "getitem") for u in n.users):
        if any(op_name(u) == "getitem" and has_step2(arg(u, 1)) for u in between):
            raise Reject("shared expert with interleaved gate/up rows is not supported")
        try:
            act = activation(ctx, between, True, baked, "shared expert (concatenated gate/up)")
        except Reject as e:
            raise Reject(f"shared expert (concatenated gate/up): activation not recognised ({e})") from None
        bind.update(shared_w1=w)
        return dict(intermediate_size=Is, gated=True, layout="concat"), act
    if s == (Is, H) and n in act_of:
        bind.update(shared_w3=w)
        return dict(intermediate_size=Is, gated=False, layout="separate"), activation(
            ctx, between, False, baked, "shared expert")
    raise Reject("shared expert projection not recognised")


def _act_fields(act: Activation) -> dict:
    if len(act.names) != 1:
        raise Reject(f"shared expert activation is ambiguous: {act.names}")
    fields = dict(activation=act.names[0], activation_clamp=act.clamp)
    if act.alpha is not None:
        fields["activation_alpha"] = act.alpha
    if act.limit is not None:
        fields["activation_limit"] = act.limit
    fields.update(act.fields())
    return fields


def _shared_gate(gate_lin: list):
    """(spec gate, gate weight placeholder | None) from the [1, H] linears of x."""
    if not gate_lin:
        return "none", None
    if len(gate_lin) != 1:
        raise Reject("several [1, H] shared-expert gates")
    gl, gw = gate_lin[0]
    if not any(op_name(u) == "sigmoid" for u in gl.users):
        raise Reject("shared-expert gate is not a sigmoid")
    return "sigmoid", gw
