"""The routed experts as two stacked 3-D weights, whatever the dispatch spelling::

    x ──► dispatch by ids ──► GEMM(w13 [E,2I,H] "out_in" | [E,H,2I] "in_out") [+ b13[ids] ([E,2I])]   = g1
          ──► gate split: chunk / split / [:I] (concat) | [..., ::2] (interleaved)
          ──► activation (moe_activation) ──► GEMM(w2 [E,H,I] | [E,I,H]) [+ b2[ids] ([E,H])]          = g2
          ──► * weights ──► combine over k
    or (weight_on_input, Llama 4): x * weights ──► dispatch ──► g1 ──► ... ──► g2 ──► combine (unweighted)

Zero experts (LongCat-Flash): the router scores E + Z experts but the stacked weights hold fewer, E (the smaller
row count of the two; the other may have E + Z rows, its extra rows unused): ids >= E are zero-computation experts,
``zero_experts = Z``, what they compute (weight * x) left to the numeric check, and the weight with E + Z rows bound
as a view of its first E (``Experts.rows``).

The GEMM is ``grouped_mm``, ``bmm`` / ``matmul`` / ``einsum`` on gathered ``w[ids]``, or ``linear`` of ``w[e]`` (or
``select(w, 0, e)``, e read from the routing: LongCat-Flash's loop over the experts hit) in a per-expert loop. Which
weight is w13 follows from which GEMM feeds the other; the layout from the shapes (and where
every dim equals H, from how the GEMM reads the weight, else both are left to the numeric check). Latent experts
(NemotronH): the experts read a projection of x of width L (``moe_latent``); their shapes are then read against L,
not H. The routing weights
scale the expert input when they are an ancestor of the first GEMM (:func:`weights_on_input`). A block that reads
no [E, ., .] weight may keep its experts as per-expert modules of 2-D weights: ``moe_per_expert`` matches those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject
from .moe_activation import Activation, activation
from .moe_flat import FlatView, flat_view_1d
from .moe_latent import Latent, latent_in
from .moe_quant import DEQUANTS, FP8, PACKED, experts_quant, quant_inputs, unpacked_shape
from .moe_region import Region
from .moe_routing import Routing

GEMMS = ("grouped_mm", "bmm", "matmul", "linear", "mm", "einsum", "baddbmm")


@dataclass
class Experts:
    """The routed experts: their weights (stacked placeholders, or per-expert ones in ``stacked``), sizes, and the
    discrete choices the graph leaves open (``layouts`` x ``gate_ups`` x ``act.names``: the numeric check picks)."""

    I: int
    gated: bool
    layouts: list[str]
    gate_ups: list[str]
    act: Activation
    g1: set  # the first GEMM(s)
    g2_all: set  # the second GEMM(s)
    g2: fx.Node  # the last of them in graph order
    w13: fx.Node | None = None
    w2: fx.Node | None = None
    b13: fx.Node | None = None
    b2: fx.Node | None = None
    # per-expert modules: op argument -> per expert 0..E-1, the placeholders concatenated on dim 0 (moe_per_expert)
    stacked: dict[str, list[list[fx.Node]]] = field(default_factory=dict)
    linears: frozenset = frozenset()  # per-expert linears (not a shared expert's)
    baked: dict = field(default_factory=dict)  # spec field -> placeholder its value was read from
    quant: object = None  # QuantSpec of quantized w13 / w2 (moe_quant), or None
    scales: dict = field(default_factory=dict)  # w13_scale / w2_scale (/ a13_scale / a2_scale) -> placeholder
    weight_on_input: bool = False  # the routing weights scale the first GEMM's input (``weights_on_input``)
    zero_experts: int = 0  # router outputs past the stacked weights' experts (see the module docstring)
    rows: dict = field(default_factory=dict)  # op argument -> the rows of its placeholder the op reads (w[:E])
    latent: Latent | None = None  # the input projection the experts read (its output one: per MoE output)
    # op argument -> how the op's [E, ., .] tensor is a view of its placeholder (a flat 2-D weight, a weight read
    # transposed, a flat 1-D bias: ``moe_flat.FlatView``)
    views: dict = field(default_factory=dict)

    out_scales: list = field(default_factory=list)  # [E, width] tensors gathered by id that scale the expert output

    @property
    def has_b13(self) -> bool:
        return self.b13 is not None or "b13" in self.stacked

    @property
    def has_b2(self) -> bool:
        return self.b2 is not None or "b2" in self.stacked


def stacked_experts(ctx: Context, R: Routing, region: Region) -> Experts | None:
    """The routed experts as two stacked 3-D weights; None when the block uses no [E, ., .] weight at all."""
    nodes = region.all
    cands = _stacked_weights(ctx, R.E, nodes)
    if len(cands) < 2:  # zero experts: weights of fewer experts than the router scores
        fewer = _stacked_weights(ctx, R.E, nodes, fewer=True)
        if len(cands) + len(fewer) == 2:
            cands = cands + fewer
    if not cands:
        return None
    if len(cands) < 2:
        raise Reject("no pair of stacked 3-D expert weights [E, ., .] used by the block")
    if len(cands) > 2:
        raise Reject(f"{len(cands)} stacked expert weights used (separate gate / up weights are not supported; "
                     "the op needs them concatenated, which only a copy of the weights gives)")
    (w13, u13), (w2, u2) = _ordered_pair(ctx, cands, nodes)
    flat = {k: ctx.flat_view(p, R.E, nodes) for k, p in (("w13", w13), ("w2", w2)) if len(ctx.pshape(p)) == 2}
    s13, s2 = unpacked_shape(ctx, w13, nodes), unpacked_shape(ctx, w2, nodes)  # (4-bit: two codes a byte)
    s13, s2 = (flat["w13"].out_shape if "w13" in flat else s13), (flat["w2"].out_shape if "w2" in flat else s2)
    lat = latent_in(ctx, R, nodes, region.x_root, {u for u, _, _ in u13})  # the experts' input: a projection of x?
    width = R.H if lat is None else lat.L  # what the experts read and write
    # (a flat weight's GEMM may read a permuted view of it: its spelling says nothing of the layout, the shapes do)
    layouts, flip = _layouts(s13, s2, width, None if "w13" in flat else u13)
    if flip:  # w2 stored the other way round from w13: read as a transposed view
        flat["w2"] = flat.get("w2", FlatView.identity(s2)).transposed()
        s2 = flat["w2"].out_shape
    N = s13[1] if layouts[0] == "out_in" else s13[2]
    I = s2[2] if layouts[0] == "out_in" else s2[1]
    gated = gated_width(N, I)
    g1, g2 = {u for u, _, _ in u13}, {u for u, _, _ in u2}
    g2_anc = set().union(*[_fx.ancestors(x, nodes, pos=ctx.order) for x in g2])
    between = set()
    for g in g1:
        between |= _fx.descendants(g, nodes) & g2_anc
    ex = Experts(I=I, gated=gated, layouts=layouts, gate_ups=gate_ups(between, gated), act=Activation([]), g1=g1,
                 g2_all=g2, g2=max(g2, key=ctx.order.get), w13=w13, w2=w2, latent=lat, views=flat)
    ex.act = activation(ctx, between, gated, ex.baked, "expert")
    ex.b13, ex.b2, ex.out_scales = _expert_biases(ctx, R, nodes, g2_anc, N, width, ex.views)
    _zero_experts(R, ex, s13[0], s2[0])
    if ex.views and (ex.zero_experts or _fx.dtype_of(w13) in (FP8, PACKED) or _fx.dtype_of(w2) in (FP8, PACKED)):
        raise Reject("expert weights read as views (held flat, or one stored transposed) that are quantized or hold "
                     "zero experts: not read by the pass")
    ex.quant, ex.scales = experts_quant(ctx, R.E, w13, u13, w2, u2, gated, layouts, (s13, s2))
    if ex.quant is not None and ex.zero_experts:
        raise Reject("quantized experts with zero experts (fewer stacked experts than router outputs): not read by the "
                     "pass yet")
    if ex.quant is not None:
        ex.layouts = ["out_in"]
    return ex


def _zero_experts(R: Routing, ex: Experts, e13: int, e2: int) -> None:
    """Stacked weights of fewer experts than the router's outputs: E = the smaller row count, the router's ids past
    it are zero experts (``ex.zero_experts``), and a weight with more rows is read through its first E."""
    E = min(e13, e2)
    if E == R.E:
        return
    if max(e13, e2) not in (E, R.E):
        raise Reject(f"stacked expert weights of {e13} and {e2} experts under a router of {R.E} outputs")
    if ex.b13 is not None or ex.b2 is not None:
        raise Reject("expert biases with zero experts (fewer stacked experts than router outputs): not read")
    ex.zero_experts = R.E - E
    ex.rows = {k: E for k, n in (("w13", e13), ("w2", e2)) if n != E}


def weights_on_input(ctx: Context, R: Routing, ex: Experts, nodes: set) -> bool:
    """Do the routing weights reach the first expert GEMM(s), i.e. is each expert's input ``weight * x`` (Llama 4's
    ``routed_in = x * router_scores``)? Otherwise they can only scale the experts' outputs. (Where they do both, the
    spec's form does not agree with the block and the numeric check refuses it.)"""
    if R.weights is None:
        return False
    return any(R.weights in _fx.ancestors(g, nodes, pos=ctx.order) for g in ex.g1)


def _stacked_weights(ctx: Context, E: int, nodes: set, fewer: bool = False) -> list:
    """[(placeholder, its GEMM uses)] for every static [E, ., .] placeholder some GEMM of the block reads (``fewer``:
    [e, ., .] with 1 < e < E instead), and every 2-D one the block reads as E experts' matrices (``moe_flat``)."""
    cands = []
    for p in sorted(ctx.static_ph, key=ctx.order.get):
        s = ctx.pshape(p)
        flat = s is not None and len(s) == 2 and not fewer and ctx.flat_view(p, E, nodes) is not None
        if not flat and (s is None or len(s) != 3 or (not 1 < s[0] < E if fewer else s[0] != E)):
            continue
        uses = _weight_uses(p, nodes)
        if uses:
            cands.append((p, uses))
    return cands


def _weight_uses(p: fx.Node, nodes: set):
    """GEMM nodes fed by placeholder ``p`` through views / casts / indexing: (gemm, transposed on the way, the node
    the GEMM reads)."""
    out = []
    stack = [(p, False)]
    seen = set()
    while stack:
        n, tr = stack.pop()
        for u in n.users:
            if u not in nodes or (u, tr) in seen:
                continue
            seen.add((u, tr))
            name = op_name(u)
            if name in GEMMS:
                out.append((u, tr, n))
            elif name in ("transpose", "t", "permute", "mT", "swapaxes"):
                stack.append((u, not tr))
            elif name in DEQUANTS:  # a quantized weight (moe_quant): the fp8 / packed tensor is its first input
                if arg(u, 0) is n:
                    stack.append((u, tr))
            elif name in _fx.CAST_OPS or name in ("getitem", "index_select", "select", "contiguous", "view",
                                                  "reshape", "unsqueeze", "squeeze", "expand", "clone", "detach",
                                                  "narrow", "unflatten", "_unsafe_view", "flatten", "chunk", "split"):
                if name in ("getitem", "select") and arg(u, 0) is not n:
                    continue  # p used as the index, not indexed
                stack.append((u, tr))
    return out


def _ordered_pair(ctx: Context, cands: list, nodes: set):
    """The two stacked weights as ((w13, uses), (w2, uses)): w13's GEMM feeds w2's."""
    (pa, ua), (pb, ub) = cands
    ga = {u for u, _, _ in ua}
    gb = {u for u, _, _ in ub}
    anc_b = set().union(*[_fx.ancestors(x, nodes, pos=ctx.order) for x in gb])
    anc_a = set().union(*[_fx.ancestors(x, nodes, pos=ctx.order) for x in ga])
    a_feeds_b = any(g in anc_b for g in ga)
    b_feeds_a = any(g in anc_a for g in gb)
    if a_feeds_b == b_feeds_a:
        raise Reject("cannot order the two expert GEMMs")
    return ((pa, ua), (pb, ub)) if a_feeds_b else ((pb, ub), (pa, ua))


def _layouts(s13: tuple, s2: tuple, H: int, u13) -> tuple[list[str], bool]:
    """(candidate weight layouts, is w2 read transposed): from the shapes; where every dim equals H, the structural
    reading (``u13``: w13's uses; None: not read) first. Where w13 fits only one layout and w2 only the other (one
    stored [out, in], the other [in, out]), w13's layout, w2 read as a transposed view."""
    try:
        return _joint_layouts(s13, s2, H, u13), False
    except Reject:
        o13 = {o for o, ok in (("out_in", s13[2] == H), ("in_out", s13[1] == H)) if ok}
        o2 = {o for o, ok in (("out_in", s2[1] == H), ("in_out", s2[2] == H)) if ok}
        if len(o13) != 1 or len(o2) != 1 or o13 == o2:
            raise
    structural = _layout_from_use(u13) if u13 is not None else None
    if structural is not None and structural not in o13:
        raise Reject(f"expert weight shapes say {next(iter(o13))} but the GEMM reads them as {structural}")
    return [next(iter(o13))], True


def _joint_layouts(s13: tuple, s2: tuple, H: int, u13) -> list[str]:
    """Candidate layouts of w13 and w2 stored alike (see ``_layouts``)."""
    structural = _layout_from_use(u13) if u13 is not None else None
    if s2[1] == H and s13[2] == H and not (s2[2] == H and s13[1] == H):
        layouts = ["out_in"]
    elif s2[2] == H and s13[1] == H and not (s2[1] == H and s13[2] == H):
        layouts = ["in_out"]
    elif s2[1] == H and s13[2] == H and s2[2] == H and s13[1] == H:
        layouts = [structural] + [x for x in ("out_in", "in_out") if x != structural] if structural else [
            "out_in", "in_out"]
    else:
        raise Reject(f"expert weights {tuple(s13)} / {tuple(s2)} do not fit the width {H} they read (the hidden size, "
                     "or a latent projection's)")
    if structural is not None and len(layouts) == 1 and structural != layouts[0]:
        raise Reject(f"expert weight shapes say {layouts[0]} but the GEMM reads them as {structural}")
    return layouts


def gated_width(N: int, I: int) -> bool:
    """Is a first GEMM of N outputs, read by a second GEMM of I inputs, gated (N = 2I) or plain (N = I)?"""
    if N == 2 * I:
        return True
    if N == I:
        return False
    raise Reject(f"first expert GEMM has {N} outputs, second reads {I}: neither gated (2I) nor plain (I)")


def gate_ups(between: set, gated: bool) -> list[str]:
    """Candidate gate/up splits of the first GEMM's output, from the ops ``between`` the GEMMs."""
    if not gated:
        return ["concat"]
    if any(op_name(n) == "getitem" and has_step2(arg(n, 1)) for n in between):
        return ["interleaved"]
    if {op_name(n) for n in between} & {"chunk", "split", "getitem"}:
        return ["concat"]
    return ["concat", "interleaved"]


_GATHERS = frozenset({"getitem", "index_select", "gather", "index", "take"})


def _gathered(p: fx.Node, nodes: set) -> bool:
    """Is ``p`` (through views / casts) indexed inside the block, the way a per-expert bias is (``b[ids]``,
    ``b[e]``)? A 2-D weight a GEMM reads whole (a shared expert's [E, H] projection when its width equals E) is not."""
    todo, seen = [p], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in nodes or u in seen:
                continue
            seen.add(u)
            name = op_name(u)
            if name in _GATHERS and arg(u, 0) is n:
                return True
            if name in _fx.VIEW_OPS or name in _fx.CAST_OPS:
                todo.append(u)
    return False


def _multiplied_only(p: fx.Node, nodes: set) -> bool:
    """Does ``p`` (through views, casts and its gather) reach the block only as a factor of products? A per-expert
    scale of the expert output (a per-expert norm's weight, ``moe_norms``) is; a bias (added) is not."""
    todo, seen, uses = [p], set(), 0
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in nodes or u in seen:
                continue
            seen.add(u)
            name = op_name(u)
            if name in _GATHERS or name in _fx.VIEW_OPS or name in _fx.CAST_OPS:
                todo.append(u)
            elif name in ("mul", "mul_"):
                uses += 1
            else:
                return False
    return uses > 0


def _expert_biases(ctx: Context, R: Routing, nodes: set, g2_anc: set, N: int, width: int, views: dict):
    """(b13, b2, out_scales): 2-D [E, N] / [E, width] placeholders the block gathers by expert id (width: H, or L
    between latent projections), or 1-D [E * N] / [E * width] ones it views as such (their views added to
    ``views``), each None when absent (either may be alone: ``MoESpec.expert_bias``); out_scales: 2-D [E, width] ones
    after the second GEMM that only multiply (left to ``moe_norms.per_expert_norm``)."""
    b13 = b2 = None
    out_scales = []
    scales = quant_inputs(nodes)  # per-expert scales of quantized weights are not biases
    for p in sorted(ctx.static_ph, key=ctx.order.get):
        s = ctx.pshape(p)
        fv = flat_view_1d(s, p, R.E, nodes) if s is not None and len(s) == 1 else None
        s = fv.out_shape if fv is not None else s
        if s is None or len(s) != 2 or s[0] != R.E or p is R.router_w or p in scales or not _gathered(p, nodes):
            continue
        feeds_g2 = any(a in g2_anc for a in _fx.descendants(p, nodes))
        if feeds_g2 and s[1] == N and b13 is None:
            b13 = p
            if fv is not None:
                views["b13"] = fv
        elif not feeds_g2 and s[1] == width and _multiplied_only(p, nodes):
            if fv is not None:
                raise Reject(f"per-expert tensor {p.name} held flat multiplies the expert outputs: not read")
            out_scales.append(p)
        elif not feeds_g2 and s[1] == width and b2 is None:
            b2 = p
            if fv is not None:
                views["b2"] = fv
        else:
            raise Reject(f"unexplained per-expert 2-D tensor {p.name} {tuple(s)}")
    return b13, b2, out_scales


def has_step2(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(s, slice) and s.step == 2 for s in items)


def _layout_from_use(uses) -> str | None:
    """out_in / in_out from how the first GEMM reads the weight (None when it cannot tell)."""
    votes = set()
    for g, transposed, src in uses:
        name = op_name(g)
        if name == "grouped_mm":
            votes.add("out_in" if transposed else "in_out")
        elif name == "linear":
            votes.add("in_out" if transposed else "out_in")
        elif name in ("bmm", "matmul", "mm"):
            pos = 0 if arg(g, 0) is src else 1
            # weight on the left (W @ x) computes out = W x: [out, in] unless transposed
            left = "out_in" if not transposed else "in_out"
            right = "in_out" if not transposed else "out_in"
            votes.add(left if pos == 0 else right)
    return votes.pop() if len(votes) == 1 else None
