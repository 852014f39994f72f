"""The activation between an expert's first GEMM(s) and its down GEMM (routed or shared experts), read from the ops
in between::

    gated:     act(gate) * up                       act ∈ silu (or x * sigmoid(x)) | gelu | gelu_tanh | relu | relu2
    clamped:   act(gate.clamp(max=L)) * up.clamp(-L, L)                         (DeepSeek-V4: activation_clamp)
    clamped after the activation:  act(gate).clamp(max=L) * up.clamp(-L, L)      (Step-3.7: activation_clamp_after)
    oai:       (up.clamp(-L, L) + 1) * g * sigmoid(alpha * g),  g = gate.clamp(max=L)        (gpt-oss: swiglu_oai)
    plain:     act(up)                                      relu2: relu(up) ** 2 | square(relu(up)) | r * r
    softcaps:  cap(gate, cg) * sigmoid(gate) * cap(up, cu),  cap(v, c) = tanh(v / c) * c   (Inkling2: gate_softcap,
               up_softcap; either cap may be absent; the sigmoid (or silu) must see the raw gate)

Any other clamp is refused. Bounds, alpha and limit are read as constants or from scalar attributes (the
placeholder a value came from is recorded in ``baked``, spec field -> placeholder name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject

CLAMPS = ("clamp", "clamp_min", "clamp_max")


@dataclass
class Activation:
    names: list[str]  # candidate spec activations (one, except where only the numeric check can tell)
    clamp: bool = False  # activation_clamp (clamped SwiGLU)
    clamp_after: bool = False  # activation_clamp_after (the activation's output clamped, Step-3.7)
    alpha: float | None = None  # swiglu_oai's alpha
    limit: float | None = None  # swiglu_oai's or the clamped SwiGLU's limit
    gate_softcap: float = 0.0  # softcapped silu: the cap on the linear gate factor (0: none)
    up_softcap: float = 0.0  # softcapped silu: the cap on up (0: none)

    def fields(self) -> dict:
        """The spec fields besides ``activation`` that this activation sets (the softcaps, the clamp after the
        activation, where it has them)."""
        out = dict(gate_softcap=self.gate_softcap, up_softcap=self.up_softcap) if (
            self.gate_softcap or self.up_softcap) else {}
        return {**out, "activation_clamp_after": True} if self.clamp_after else out


# Ops that belong to no activation the spec knows (as the recogniser reads them: ``silu`` / ``sigmoid``, ``gelu``,
# ``relu``, clamps, products): found between the GEMMs they refuse the block, whatever else is there. A softcap
# ``tanh(x / c) * c`` (Inkling2's gate and up) beside a sigmoid once passed for silu: only the numeric check stood
# between it and a wrong match, and a cap large enough to stay out of reach of the check's values would have passed.
FOREIGN = frozenset({"tanh", "div", "exp", "log", "softplus", "erf", "sqrt", "rsqrt", "abs", "sign", "where",
                     "maximum", "minimum", "sin", "cos", "mean", "var", "norm", "softmax", "log_softmax"})


def activation(ctx: Context, between: set, gated: bool, baked: dict, who: str) -> Activation:
    """The activation computed by the nodes ``between`` the first GEMM(s) and the down GEMM."""
    caps = softcaps(ctx, between, baked, who)
    if caps is not None:
        between = between - caps[2]
    names = {op_name(n) for n in between}
    foreign = sorted(names & FOREIGN)
    if foreign:
        raise Reject(f"{who} activation not recognised: {foreign} between the GEMMs belong to no activation the spec "
                     f"knows (e.g. a softcap tanh(x / c) * c; ops there: {sorted(names)})")
    clamps = [n for n in between if op_name(n) in CLAMPS]
    if clamps and "sigmoid" in names and gated and _scaled_sigmoid(ctx, between):  # sigmoid(alpha * g): gpt-oss
        alpha, limit = _swiglu_consts(ctx, between, baked)
        return Activation(["swiglu_oai"], alpha=alpha, limit=limit)
    acts = sorted({a for n in between if (a := _elementwise_act(n, between)) is not None})
    if len(acts) != 1:
        raise Reject(f"{who} activation not recognised (ops between the GEMMs: {sorted(names)})")
    res = Activation(acts)
    if caps is not None:
        if not gated or clamps or acts != ["silu"]:
            raise Reject(f"{who}: softcaps tanh(v / c) * c around a {'clamped ' if clamps else ''}{acts} "
                         f"{'gated' if gated else 'ungated'} activation (only a gated silu's gate / up are capped)")
        res.gate_softcap, res.up_softcap = caps[0], caps[1]
        return res
    if clamps:
        if not gated:
            raise Reject(f"{who}: clamp in an ungated activation (not a clamped SwiGLU)")
        res.limit = _clamp_limit(ctx, clamps, between, baked, who)
        res.clamp_after = _clamp_is_after(clamps, between)
        res.clamp = not res.clamp_after
    return res


def _elementwise_act(n: fx.Node, between: set) -> str | None:
    nm = op_name(n)
    if nm == "gelu":
        return "gelu_tanh" if arg(n, 1, "approximate", "none") == "tanh" else "gelu"
    if nm == "relu":
        sq = [u for u in n.users if u in between and (
            op_name(u) == "square" or (op_name(u) == "pow" and arg(u, 1, "exponent") in (2, 2.0))
            or (op_name(u) == "mul" and arg(u, 0) is n and arg(u, 1) is n))]
        return "relu2" if sq else "relu"
    if nm in ("silu", "sigmoid"):
        return "silu"  # sigmoid: x * sigmoid(x); the numeric check confirms
    return None


def clamp_bounds(ctx: Context, n: fx.Node, baked: dict | None = None, field: str | None = None):
    """(min, max) of a clamp node as floats, None where open; rejects bounds whose value cannot be read."""
    nm = op_name(n)
    if nm == "clamp":
        lo, hi = arg(n, 1, "min"), arg(n, 2, "max")
    elif nm == "clamp_min":
        lo, hi = arg(n, 1, "min"), None
    else:
        lo, hi = None, arg(n, 1, "max")
    out = []
    for b in (lo, hi):
        if b is None:
            out.append(None)
            continue
        v = _fx.scalar_value(b, ctx.values)
        if v is None:
            raise Reject(f"clamp bound of {n.name} is not readable (a tensor, or no example inputs)")
        if baked is not None and field and isinstance(b, fx.Node):
            src = b
            while isinstance(src, fx.Node) and op_name(src) in ("neg", "item"):
                src = arg(src, 0)
            if isinstance(src, fx.Node) and src.op == "placeholder":
                baked[field] = src.name
        out.append(v)
    return out[0], out[1]


def strip_gate_clamp(n):
    """``n`` through views / casts and an upper-only clamp (the gate side of a clamped SwiGLU)."""
    n = _fx.strip_views_casts(n)
    if isinstance(n, fx.Node) and op_name(n) in ("clamp", "clamp_max") and (
            op_name(n) == "clamp_max" or arg(n, 1, "min") is None):
        n = _fx.strip_views_casts(arg(n, 0))
    return n


def _clamp_limit(ctx: Context, clamps, between: set, baked: dict, who: str) -> float:
    """L of a clamped SwiGLU: act(gate.clamp(max=L)) * up.clamp(-L, L) (DeepSeek-V4) or act(gate).clamp(max=L) *
    up.clamp(-L, L) (Step-3.7's limit_after_act; which one: ``_clamp_is_after``). ``between`` may hold an unrolled
    loop's experts: one gate clamp and one up clamp per expert, all at one L and of one form. Rejects anything
    else."""
    upper, sym = [], []
    for c in clamps:
        lo, hi = clamp_bounds(ctx, c, baked, "activation_limit")
        if lo is None and hi is not None:
            upper.append((c, hi))
        elif lo is not None and hi is not None and math.isclose(lo, -hi) and hi > 0:
            sym.append((c, hi))
        else:
            raise Reject(f"{who}: clamp({lo}, {hi}) in the activation is not a clamped SwiGLU's")
    limits = [v for _, v in upper + sym]
    if not upper or len(upper) != len(sym) or not all(math.isclose(v, limits[0]) for v in limits):
        raise Reject(f"{who}: clamps {sorted((c.name, v) for c, v in upper + sym)} are not one gate clamp(max=L) and "
                     "one up clamp(-L, L) (per expert)")
    if _clamp_forms(clamps, between) not in ({"before"}, {"after"}):
        raise Reject(f"{who}: clamped gate / up do not feed act(gate) * up (nor act(gate).clamp(max={limits[0]:g}) * "
                     "up)")
    return limits[0]


def _clamp_is_after(clamps, between: set) -> bool:
    """Do the clamps (``_clamp_limit``'s, checked) clamp the activation's output rather than the gate before it?"""
    return _clamp_forms(clamps, between) == {"after"}


def _clamp_forms(clamps, between: set) -> set:
    """The form (``_clamp_form``) of each gate clamp(max=L) among ``clamps``."""
    syms = {c for c in clamps if op_name(c) == "clamp" and arg(c, 1, "min") is not None}
    return {_clamp_form(c, syms, between) for c in clamps if c not in syms}


def _clamp_form(cu: fx.Node, syms: set, between: set) -> str | None:
    """"before" when an activation (or x * sigmoid(x)'s sigmoid) reads the gate clamp ``cu`` and a product reads an
    up clamp (one of ``syms``); "after" when ``cu`` clamps an activation's output and one product reads ``cu`` and an
    up clamp; else None."""
    up_in = [n for n in between if op_name(n) == "mul" and any(
        _fx.strip_views_casts(a) in syms for a in (arg(n, 0), arg(n, 1)))]
    if up_in and any(op_name(n) in _ACT_OPS + ("sigmoid",) and _fx.strip_views_casts(arg(n, 0)) is cu
                     for n in between):
        return "before"
    if _is_act_output(_fx.strip_views_casts(arg(cu, 0)), between) and any(
            cu in {_fx.strip_views_casts(arg(n, 0)), _fx.strip_views_casts(arg(n, 1))} for n in up_in):
        return "after"
    return None


def _scaled_sigmoid(ctx: Context, between: set) -> bool:
    """Does a sigmoid between the GEMMs read a value times a readable constant (swiglu_oai's sigmoid(alpha * g),
    not silu's x * sigmoid(x))?"""
    for n in between:
        m = arg(n, 0) if op_name(n) == "sigmoid" else None
        if isinstance(m, fx.Node) and op_name(m) == "mul" and any(
                _fx.scalar_value(o, ctx.values) is not None for o in (arg(m, 0), arg(m, 1))):
            return True
    return False


_ACT_OPS = ("silu", "gelu", "relu")


def _is_act_output(n, between: set) -> bool:
    """``n`` is an activation of the gate computed between the GEMMs: silu / gelu / relu, or x * sigmoid(x)."""
    if not isinstance(n, fx.Node) or n not in between:
        return False
    if op_name(n) in _ACT_OPS:
        return True
    if op_name(n) != "mul":
        return False
    a, b = _fx.strip_views_casts(arg(n, 0)), _fx.strip_views_casts(arg(n, 1))
    return any(isinstance(s, fx.Node) and op_name(s) == "sigmoid" and _fx.strip_views_casts(arg(s, 0)) is o
               for s, o in ((a, b), (b, a)))


def _swiglu_consts(ctx: Context, between: set, baked: dict):
    """swiglu_oai's (alpha, limit): the clamps' max and the constant multiplying the gate inside the sigmoid."""
    limit = alpha = None
    for n in between:
        nm = op_name(n)
        if nm == "clamp":
            mx = arg(n, 2, "max")
            v = _fx.scalar_value(mx, ctx.values)
            if v is None:
                raise Reject("swiglu limit is not readable (no example inputs?)")
            if limit is not None and not math.isclose(v, limit):
                raise Reject("swiglu clamps with different limits")
            limit = v
            if isinstance(mx, fx.Node) and op_name(mx) == "item":
                baked["activation_limit"] = arg(mx, 0).name
        if nm == "sigmoid" and op_name(m := arg(n, 0)) == "mul":
            for o in (arg(m, 0), arg(m, 1)):
                v = _fx.scalar_value(o, ctx.values)
                if v is not None:
                    alpha = v
                    if isinstance(o, fx.Node) and op_name(o) == "item":
                        baked["activation_alpha"] = arg(o, 0).name
    if alpha is None or limit is None:
        raise Reject("clamp + sigmoid gate without a readable alpha / limit")
    return alpha, limit


def softcaps(ctx: Context, between: set, baked: dict, who: str) -> tuple[float, float, set] | None:
    """(gate cap, up cap, the nodes computing them) of a softcapped silu, or None without a ``tanh`` between the
    GEMMs. A softcap is ``tanh(v / c) * c`` (or ``tanh(v * (1 / c)) * c``, either order, casts between), c a readable
    positive scalar; it caps the gate when v is what the sigmoid / silu reads (the raw gate), else up (``between``
    may hold an unrolled loop's experts: one cap per expert and side, all equal). Rejects a tanh that is no softcap,
    different caps on one side, and a sigmoid of a capped value (the sigmoid must see the raw gate): the numeric
    check then confirms which projection is the gate and that each side is capped once."""
    tanhs = [n for n in between if op_name(n) == "tanh"]
    if not tanhs:
        return None
    sig_src = {_fx.strip_views_casts(arg(n, 0), views=False) for n in between if op_name(n) in ("sigmoid", "silu")}
    found, used = {}, set()
    for t in tanhs:
        src, c, inner = _cap_input(ctx, arg(t, 0), between)
        outer = [u for u in _users_through_casts(t, between) if op_name(u) == "mul" and _times(ctx, u, t) is not None]
        if src is None or len(outer) != 1 or not math.isclose(_times(ctx, outer[0], t), c, rel_tol=1e-6):
            raise Reject(f"{who}: {t.name} (tanh) between the GEMMs is not a softcap tanh(v / c) * c")
        if outer[0] in sig_src:
            raise Reject(f"{who}: a sigmoid of a softcapped value (the spec's softcapped silu applies the sigmoid to "
                         "the raw gate)")
        side = "gate_softcap" if src in sig_src else "up_softcap"
        if side in found and not math.isclose(found[side], c, rel_tol=1e-6):  # (an unrolled loop: one per expert)
            lo, hi = sorted((found[side], c))  # (the tanhs come in no set order)
            raise Reject(f"{who}: softcaps {lo:g} and {hi:g} on the {side[:-8]} side")
        found[side] = c
        used |= {inner, t, outer[0]}
        for k in (inner, outer[0]):  # a cap read from a scalar placeholder: record where it came from
            for a in (arg(k, 0), arg(k, 1)):
                if isinstance(a, fx.Node) and op_name(a) == "item" and arg(a, 0).op == "placeholder":
                    baked[side] = arg(a, 0).name
    return found.get("gate_softcap", 0.0), found.get("up_softcap", 0.0), used


def _times(ctx: Context, m: fx.Node, t: fx.Node) -> float | None:
    """The scalar multiplying ``t`` (through casts) in the product ``m``, or None."""
    a, b = arg(m, 0), arg(m, 1)
    for x, y in ((a, b), (b, a)):
        if _fx.strip_views_casts(x, views=False) is t:
            v = _fx.scalar_value(y, ctx.values)
            if v is not None:
                return v
    return None


def _cap_input(ctx: Context, n, between: set):
    """(v, c, the division node) when ``n`` (through casts) is ``v / c`` or ``v * (1 / c)``, c > 0; else Nones."""
    n = _fx.strip_views_casts(n, views=False)
    if not isinstance(n, fx.Node) or n not in between or op_name(n) not in ("div", "mul"):
        return None, None, None
    a, b = arg(n, 0), arg(n, 1)
    v = _fx.scalar_value(b, ctx.values)
    if op_name(n) == "mul" and v is None:
        a, b = b, a
        v = _fx.scalar_value(b, ctx.values)
    if v is None or not isinstance(a, fx.Node) or not v > 0:
        return None, None, None
    c = v if op_name(n) == "div" else 1.0 / v
    return _fx.strip_views_casts(a, views=False), c, n


def _users_through_casts(n: fx.Node, between: set) -> list:
    """The users of ``n`` in ``between``, looking through cast nodes."""
    out, todo = [], [n]
    while todo:
        for u in todo.pop().users:
            if u not in between:
                continue
            if op_name(u) in _fx.CAST_OPS:
                todo.append(u)
            else:
                out.append(u)
    return out
