"""Latent projections around the routed experts (``MoESpec.latent_size``; NemotronH's ``moe_latent_size``)::

    x ──► linear(x, Wi [L, H], [bi]) = xl ──► dispatch ──► GEMM(w13 [E, N, L]) ──► ... ──► GEMM(w2 [E, L, I])
          ──► * weights ──► combine over k ──► linear(·, Wo [H, L], [bo]) ──► [+ shared(x)] ──► out
    x ──► router (on x, not xl)                x ──► shared expert (on x, not xl)

Read by meaning, not by names: the input projection is the one linear of the block input that every first expert
GEMM descends from and the routing does not (so neither the router nor a router MLP's first layer), and the experts'
weights have its output width L; the output
projection is a linear of an [H, L] weight that descends from the second expert GEMMs and through which every path
from them to the MoE output passes (nothing routed reaches the output around it). The shared-expert reader is given
both projections to leave out. What they compute, with the routed scaling before the output projection and its
bias, is left to the numeric check (the reference runs them: ``moecomp.oracle.reference.latent_in`` / ``latent_out``).
A scalar applied after a biased output projection would scale its bias too, which the spec does not express: such a
block is refused (:func:`check_scales`). Without biases the projection is linear and such a scalar is routed scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from . import graph as _fx
from .context import Context
from .refuse import Reject
from .moe_output import bypasses as _bypasses, output_paths as _paths, scalar_factor as _scalar_factor
from .moe_routing import Routing


@dataclass
class Latent:
    L: int
    lin_in: fx.Node  # the input projection's linear
    w_in: fx.Node  # [L, H] placeholder
    b_in: fx.Node | None
    lin_out: fx.Node | None = None  # the output projection's linear (found per MoE output: :func:`latent_out`)
    w_out: fx.Node | None = None  # [H, L]
    b_out: fx.Node | None = None

    @property
    def linears(self) -> frozenset:
        return frozenset(n for n in (self.lin_in, self.lin_out) if n is not None)

    @property
    def bindings(self) -> dict:
        return dict(latent_in_w=self.w_in, latent_in_b=self.b_in, latent_out_w=self.w_out, latent_out_b=self.b_out)


def latent_in(ctx: Context, R: Routing, nodes: set, x_root: fx.Node, g1: set) -> Latent | None:
    """The input projection of the routed experts: the one linear of the block input that every first expert GEMM in
    ``g1`` descends from and the routing (router logits, routing weights) does not; None when there is none (the
    experts read x itself)."""
    x_like = {x_root, _fx.strip_views_casts(R.x_router)}
    g1_anc = [_fx.ancestors(g, nodes, pos=ctx.order) for g in g1]
    routing = {R.logits_linear} | _fx.ancestors(R.logits_linear, nodes, pos=ctx.order)
    if R.weights is not None:
        routing |= _fx.ancestors(R.weights, nodes, pos=ctx.order)
    found = []
    for n in nodes:
        lf = ctx.as_linear(n) if n not in routing else None
        if lf is None or _fx.strip_views_casts(lf[0]) not in x_like:
            continue
        s = ctx.pshape(lf[1])
        if s is not None and s[1] == R.H and all(n in anc for anc in g1_anc):
            found.append((n, *lf))
    if not found:
        return None
    if len(found) > 1:
        raise Reject(f"{len(found)} linears of the block input feed the expert GEMMs: {[f[0].name for f in found]}")
    n, _, w, b = found[0]
    return Latent(L=ctx.pshape(w)[0], lin_in=n, w_in=w, b_in=b)


def latent_out(ctx: Context, R: Routing, lat: Latent, region: set, g2s: set, out: fx.Node) -> Latent:
    """``lat`` with its output projection: the linear of an [H, L] weight after the second expert GEMMs that every
    path from them to ``out`` passes through. Reject when there is none or more than one."""
    path = _paths(ctx, region, g2s, out)
    found = []
    for n in sorted(path - g2s, key=ctx.order.get):
        lf = ctx.as_linear(n)
        if lf is None or ctx.pshape(lf[1]) != (R.H, lat.L) or _bypasses(g2s, path, out, n):
            continue
        found.append((n, lf[1], lf[2]))
    if len(found) != 1:
        raise Reject(f"experts of width {lat.L} after an input projection, but {len(found)} output projections "
                     f"[{R.H}, {lat.L}] that all their results pass through")
    n, w, b = found[0]
    if (b is None) != (lat.b_in is None):
        raise Reject("latent projections with a bias on only one of them")
    return Latent(lat.L, lat.lin_in, lat.w_in, lat.b_in, n, w, b)


def check_scales(ctx: Context, lat: Latent, region: set, out: fx.Node, shared_down: fx.Node | None) -> None:
    """A biased output projection: no scalar may scale what it returns (routed scaling would scale its bias too,
    which the spec does not express). Without biases the projection is linear and scales pass through it."""
    if lat.b_out is None:
        return
    src = {lat.lin_out}
    path = _paths(ctx, region, src, out) | src
    for n in sorted(path - src, key=ctx.order.get):
        sc = _scalar_factor(ctx, n, path)
        if sc is not None and sc[0] != 1.0 and not _bypasses(src, path, out, n):
            raise Reject(f"the latent output projection's result (bias included) is scaled by {sc[0]:g} ({n.name}): "
                         "not a form MoESpec expresses (its routed scaling applies before the projection's bias)")
