"""Norms around the routed experts (``MoESpec.latent_norm`` / ``expert_norm``; MuseSpark, Ergo) and after the shared
expert (``SharedExpertSpec.norm``; Ergo)::

    x ──► linear(x, Wi [L, H]) ──► [rms norm, weight g [L], eps] ──► the experts' input     (latent_norm)
    GEMM(w2 [E, width, I]) ──► [rms norm, weight g [width], eps] ──► * routing weights ──► combine   (expert_norm)
    GEMM(w2 [E, width, I]) ──► rms norm ──► * g[ids] (g [E, width]) ──► * routing weights ──► combine
                                                                          (expert_norm "rms_per_expert")
    shared down projection ──► [rms norm, weight g [H], eps] ──► (+ routed output)          (shared.norm)

Read by meaning, not by names: a norm is a 1-D static weight of the experts' width read by the nodes between the input
projection and every first expert GEMM (latent), or between the second expert GEMMs and the MoE output (expert
output), or between the shared down projection and the MoE output off the routed path (shared), with one RMS
normalisation among those nodes: an ``add(mean(·), eps)`` (its eps: the constant added to a mean) or a
``rms_norm(·, shape, weight, eps)`` call. A per-expert weight is an [E, width] tensor gathered by expert id that only
multiplies the expert output (``moe_experts._expert_biases`` sets it apart from a bias). Which form it is
(``rms_1p``: rms(v) * (1 + g); ``rms``: rms(v) * g; ``scaled_rms_1p``: rms(round(v * (1 + g)))) is left to the
numeric check, which runs the candidates with the weight drawn at random when it is constant (``numeric``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ...core.reject import RejectCode
from ...core.spec_checks import EXPERT_NORMS, LATENT_NORMS, PER_EXPERT_NORMS, SHARED_NORMS, SpecError
from . import graph as _fx
from .context import Context
from .graph import arg, op_name
from .refuse import Reject


@dataclass
class Norm:
    w: fx.Node  # the [width] weight placeholder ([E, width]: per expert)
    eps: float
    forms: tuple  # the forms the numeric check tries
    eps_src: str | None = None  # the scalar attribute's placeholder eps was read from


def _between(ctx: Context, nodes: set, srcs: set, dsts: set) -> set:
    """Nodes (within ``nodes``) that descend from some node of ``srcs`` and are ancestors of every node of ``dsts``."""
    down = set().union(*[_fx.descendants(s, nodes) for s in srcs])
    for d in dsts:
        down &= _fx.ancestors(d, nodes, pos=ctx.order) | {d}
    return down - dsts


def _find(ctx: Context, between: set, width: int, what: str, forms: tuple) -> Norm | None:
    """The norm among ``between``: its [width] weight (None when no such weight is read there) and eps."""
    ws = sorted({p for n in between for p in _weights_read(ctx, n, between) if ctx.pshape(p) == (width,)},
                key=lambda p: p.name)
    if not ws:
        return None
    if len(ws) > 1:
        raise Reject(f"{len(ws)} weights of width {width} read {what}: {[p.name for p in ws]}")
    eps, src = _one_eps(ctx, between, f"a weight of width {width} ({ws[0].name}) read {what}")
    return Norm(w=ws[0], eps=eps, forms=forms, eps_src=src)


def _one_eps(ctx: Context, between: set, what: str) -> tuple[float, str | None]:
    """(eps, its placeholder's name or None) of the one RMS normalisation among ``between``: an add(mean(·), eps) or a
    rms_norm call (eps None: torch's default, its input dtype's machine epsilon)."""
    found = []
    for n in sorted(between, key=ctx.order.get):
        if op_name(n) == "add":
            e = _eps(ctx, n)
            if e is not None:
                found.append(e)
        elif op_name(n) == "rms_norm":
            c = arg(n, 3, "eps", None)
            if c is None:
                found.append((torch.finfo(_fx.dtype_of(arg(n, 0)) or torch.float32).eps, None))
            elif _fx.scalar_value(c, ctx.values) is not None:
                found.append((float(_fx.scalar_value(c, ctx.values)), _src(c)))
    if len(found) != 1:
        raise Reject(f"{what}, but {len(found)} add(mean(·), eps) / rms_norm there: not one RMS norm")
    return found[0]


def _src(c) -> str | None:
    """The placeholder a scalar ``c`` = ``p.item()`` was read from (None for a literal)."""
    if isinstance(c, fx.Node) and op_name(c) == "item" and isinstance(arg(c, 0), fx.Node):
        return arg(c, 0).name
    return None


def _weights_read(ctx: Context, n: fx.Node, between: set, depth: int = 4) -> set:
    """The 1-D static placeholders ``n`` reads from outside ``between``: directly, or through a few nodes computed
    from static placeholders alone (``(1.0 + w).float()``)."""
    found = set()
    for a in n.all_input_nodes:
        if a in between:
            continue
        anc = _fx.ancestors(a, pos=ctx.order) | {a}
        phs = [p for p in anc if p.op == "placeholder"]
        if len(anc) - len(phs) > depth or not all(p in ctx.static_ph for p in phs):
            continue
        found |= {p for p in phs if ctx.weight_ph(p, 1) is not None}
    return found


def _eps(ctx: Context, n: fx.Node) -> tuple[float, str | None] | None:
    """``n`` = add(mean(·), c) (either order, casts allowed around the mean) -> (c, its placeholder), else None."""
    a, b = arg(n, 0), arg(n, 1)
    for m, c in ((a, b), (b, a)):
        if isinstance(m, fx.Node) and op_name(_fx.strip_views_casts(m)) == "mean":
            v = _fx.scalar_value(c, ctx.values)
            if v is not None:
                return float(v), _src(c)
    return None


def latent_norm(ctx: Context, nodes: set, lin_in: fx.Node, g1s: set, L: int) -> Norm | None:
    """The norm between the latent input projection ``lin_in`` and the first expert GEMMs ``g1s``, or None."""
    return _find(ctx, _between(ctx, nodes, {lin_in}, g1s), L, "between the latent projection and the experts",
                 tuple(f for f in LATENT_NORMS if f != "none"))


def expert_norm(ctx: Context, core: set, g2s: set, out: fx.Node, width: int, skip) -> Norm | None:
    """The norm between the second expert GEMMs ``g2s`` and the MoE output ``out`` (the nodes ``skip``, e.g. the
    latent output projection, and what follows them left out), or None."""
    between = set().union(*[_fx.descendants(g, core) for g in g2s]) & (_fx.ancestors(out, core, pos=ctx.order)
                                                                       | {out})
    for s in skip:
        between -= _fx.descendants(s, core) | {s}
    return _find(ctx, between, width, "between the expert GEMMs and the MoE output",
                 tuple(f for f in EXPERT_NORMS if f != "none" and f not in PER_EXPERT_NORMS))


def per_expert_norm(ctx: Context, core: set, g2s: set, out: fx.Node, scales: list, skip) -> Norm | None:
    """The per-expert norm of the expert outputs: an [E, width] tensor ``scales`` (gathered by expert id, only
    multiplying: ``Experts.out_scales``) times an RMS normalisation between the second expert GEMMs and ``out``;
    None without such a tensor, a Reject when it is not that."""
    if not scales:
        return None
    names = [p.name for p in scales]
    if len(scales) > 1:
        raise Reject(f"{len(scales)} per-expert tensors {names} multiply the expert outputs")
    between = set().union(*[_fx.descendants(g, core) for g in g2s]) & (_fx.ancestors(out, core, pos=ctx.order)
                                                                       | {out})
    for s in skip:
        between -= _fx.descendants(s, core) | {s}
    eps, src = _one_eps(ctx, between, f"the per-expert tensor {names[0]} multiplies the expert outputs")
    return Norm(w=scales[0], eps=eps, forms=PER_EXPERT_NORMS, eps_src=src)


def shared_norm(ctx: Context, core: set, down: fx.Node, g2s: set, out: fx.Node, H: int) -> Norm | None:
    """The norm between the shared expert's down projection ``down`` and the MoE output ``out``, off the routed
    experts' path (``g2s``'s descendants), or None."""
    between = _fx.descendants(down, core) & (_fx.ancestors(out, core, pos=ctx.order) | {out})
    between -= set().union(*[_fx.descendants(g, core) for g in g2s])
    return _find(ctx, between, H, "between the shared expert and the MoE output",
                 tuple(f for f in SHARED_NORMS if f != "none"))


def with_norms(candidates: list, lnorm: Norm | None, enorm: Norm | None) -> list:
    """Each candidate spec once per combination of the norms' forms (eps read from the graph); unchanged without
    norms."""
    if lnorm is None and enorm is None:
        return candidates
    out, err = [], None
    for spec in candidates:
        for lf in (lnorm.forms if lnorm else ("none",)):
            for ef in (enorm.forms if enorm else ("none",)):
                try:
                    out.append(spec.replace(latent_norm=lf, latent_norm_eps=lnorm.eps if lnorm else 1e-6,
                                            expert_norm=ef, expert_norm_eps=enorm.eps if enorm else 1e-6))
                except SpecError as e:
                    err = e
    if not out:
        raise Reject(f"no valid spec with the norms: {err}", RejectCode.SPEC_INVALID)
    return out
