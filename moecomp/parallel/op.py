"""The parallel op path: a MoE block whose routed experts are sharded over a process group (``MoESpec.parallel``).

    forward(x, args, spec)            x [..., H] -> [..., H]: the whole block, this rank's shard of the experts
        routing      over the E global experts, on every rank, as one GPU routes (``route.py``)
        xe           = x, or latent_in(x) [T, L] (``spec.latent_size``)
        routed       ``ep.py`` (all_reduce: partial; all_to_all: complete) or ``tp.py`` (partial), fp32 [T, width]
        reduce       (one all-reduce, only where the routed part is partial, at one of two points:)
          no latent:   out = all_reduce((routed + shared_partial).to(x.dtype))       routed and shared summed first
                       shared_partial: this rank's slice of the shared experts' I (``route.shared_slice``), or the
                       whole shared experts on rank 0 where they do not split
          latent:      out = latent_out(all_reduce(routed.to(x.dtype))) + shared(x)  before the output transform
        all_to_all:  out = routed (+ latent_out) + shared(x), nothing reduced
        shared experts given as this rank's slice (shared_w2 [H, Is / W], shared_w1 / w3 [Is / W, H]: a loader that
        shards them, transformers' TP plan of colwise gate / up and rowwise down): that slice is this rank's
        shared_partial (no latent, and a routed part that is partial: TP or EP all_reduce)
        replicated   (every rank holds every routed expert whole: ``tp.py`` on the whole I) routed complete on every
                     rank; out = routed (+ latent_out) + shared(x), where shared experts given as this rank's slice
                     are summed over the group on their own: shared = all_reduce(shared_slice(x).to(x.dtype))
    experts(x, ids, weights, args, spec)   the routed experts only, routing given (global ids): [T, width], reduced

The collectives run outside ``moe_forward`` / ``moe_experts``, which stay pure; for callers that trace (torch.compile
of the decoder layers in ``generate()``) the whole path is one opaque custom op, ``torch.ops.moecomp.moe_parallel(x,
tensors, spec)``, so Dynamo never traces a collective and the graph does not break; ``call`` takes the direct path from
plain eager code. Inside a CUDA graph capture the path must be ``ParallelSpec.capturable`` (no host read: all_reduce,
or all_to_all with a capacity) — NCCL collectives of fixed sizes are captured with the kernels.

Routing record and replay (issue 43, ``ops/routes.py``), as on one GPU: ``args``' ``routes_in`` (the op's last
argument ``routes_in``: int32 / int64 [T, k] global expert ids to use instead of the op's own top-k) and the
recording op ``torch.ops.moecomp.moe_parallel_routes(routes_out, route_weights_out, x, tensors, spec, routes_in)``
(int32 ids / fp32 weights [T, k] written, both declared mutated; a second op for the reason ``ops/moe_op.py`` gives).
Every rank routes its own tokens over the E global experts before any exchange, so the ids recorded and replayed are
global ids and need no translation; the routing (``route.py``) is the one-GPU op's, which reads and writes them.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ops import latent, routes
from ..ops.backend import Routed
from ..core.args import OP_ARGS
from ..ops.moe_op import check_args, plain_eager
from ..core.spec import MoESpec, SpecError
from . import ep, route, tp
from .comm import comm_for
from .local import SHARD_ARGS, check_shards


def _routed(xe, r: Routed, args: dict, spec: MoESpec, comm) -> tuple[torch.Tensor, bool]:
    """(the routed part, fp32 [T, width], whether it is partial: one all-reduce to come)."""
    if spec.parallel.mode in ("tp", "replicated"):
        return tp.routed(xe, r, args, spec), spec.parallel.mode == "tp"
    return ep.routed(xe, r, args, spec, comm)


def _parallel(spec: MoESpec):
    if spec.parallel is None:
        raise SpecError(f"the parallel path needs a spec with a parallel part (MoESpec.parallel), got "
                        f"{spec.describe()}")
    return spec.parallel


def sliced_shared(args: dict, spec: MoESpec) -> MoESpec | None:
    """The spec of this rank's slice of the shared experts (their I / W) when ``args`` hold that slice rather than
    the whole shared experts (shared_w2 with Is / W columns; module docstring), else None. SpecError where the path
    has no all-reduce to sum such slices in (EP all_to_all, latent projections; mode "replicated" reduces them on
    their own, so it takes them everywhere)."""
    sh, p = spec.shared, spec.parallel
    w2 = args.get("shared_w2")
    if sh is None or w2 is None or p.world_size == 1 or sh.quant is not None or w2.shape[-1] == sh.intermediate_size:
        return None
    n = sh.intermediate_size // p.world_size
    if w2.shape[-1] != n or sh.intermediate_size % p.world_size or (sh.gated and sh.layout == "concat"):
        return None  # (check_args names the shape the whole shared experts need)
    if p.mode != "replicated" and (spec.latent_size or (p.mode == "ep" and p.dispatch != "all_reduce")):
        raise SpecError(f"shared_w2 has shape {tuple(w2.shape)}: this rank's slice of the shared experts (I {n} of "
                        f"{sh.intermediate_size}) is summed in the routed part's all-reduce, which "
                        f"{'latent projections' if spec.latent_size else 'dispatch all_to_all'} does not have; "
                        f"expected the whole shared experts [.., {sh.intermediate_size}]")
    return spec.replace(shared=dataclasses.replace(sh, intermediate_size=n))


def check(x: torch.Tensor, args: dict, spec: MoESpec, symbolic: bool = False) -> None:
    """SpecError naming the argument: shard tensors of the wrong shape (``local.check_shards``), and every other
    argument as the one-GPU op checks it (the shards stand in at the whole block's shapes, as zero-stride views;
    shared experts given as this rank's slice: checked at the slice's shapes, ``sliced_shared``)."""
    check_shards(args, spec)
    whole = {**spec.expert_weight_shapes(), **spec.quant_shapes()}
    stand_in = {n: args[n].new_empty(()).expand(whole[n]) for n in SHARD_ARGS if args.get(n) is not None
                and n in whole}
    check_args(x, {**args, **stand_in}, sliced_shared(args, spec) or spec, symbolic)


def forward(x: torch.Tensor, args: dict, spec: MoESpec, comm=None) -> torch.Tensor:
    """The block on this rank (module docstring); ``args``: the op's tensors by name (``OP_ARGS``), the expert
    tensors this rank's shards; ``comm``: the collectives (default: the process group ``spec.parallel.group``)."""
    p = _parallel(spec)
    comm = comm_for(p) if comm is None else comm
    check(x, args, spec)
    routes.check_values(args.get("routes_in"), spec)
    shape, dt = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])  # [T, H]
    r = route.route(x2, args, spec, shape)
    xe = latent.project_in(x2, args, spec) if spec.latent_size else x2  # [T, width]
    routed, partial = _routed(xe, r, args, spec, comm)
    if spec.latent_size:
        rl = routed.to(dt)
        if partial:
            comm.all_reduce_(rl)  # the all-reduce point before the latent output transform
        out = latent.project_out(rl, args).float()
        if spec.shared is not None:
            given = sliced_shared(args, spec)  # (replicated only: the others refuse a slice here)
            out += route.shared_part(x2, args, spec, r) if given is None else _summed(x2, args, given, r, comm, dt)
        return out.to(dt).reshape(shape)
    if spec.shared is not None:
        given = sliced_shared(args, spec)
        if given is not None and p.mode == "replicated":  # the routed part complete: the slices summed alone
            routed += _summed(x2, args, given, r, comm, dt)
        elif given is not None:  # this rank's slice of the shared experts, as loaded
            routed += route.shared_part(x2, args, given, r)
        elif not partial:
            routed += route.shared_part(x2, args, spec, r)
        else:
            sl = route.shared_slice(args, spec, p.rank, p.world_size)
            if sl is not None:
                routed += route.shared_part(x2, sl[0], sl[1], r)
            elif p.rank == 0:
                routed += route.shared_part(x2, args, spec, r)
    out = routed.to(dt)
    if partial:
        comm.all_reduce_(out)  # routed and shared summed first, reduced once
    return out.reshape(shape)


def _summed(x2: torch.Tensor, args: dict, given: MoESpec, r: Routed, comm, dt) -> torch.Tensor:
    """The shared experts' output summed over the group from this rank's slice (``given``: its spec), fp32 [T, H];
    reduced in x's dtype, as a row-parallel down projection is."""
    s = route.shared_part(x2, args, given, r).to(dt)
    comm.all_reduce_(s)
    return s.float()


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, args: dict, spec: MoESpec,
            comm=None) -> torch.Tensor:
    """The routed experts only (module docstring): x [T, width] (the experts' input), ids / weights [T, k] over
    the E global experts -> [T, width] in x's dtype, summed over the ranks. ``args``: this rank's shard tensors."""
    p = _parallel(spec)
    comm = comm_for(p) if comm is None else comm
    check_shards(args, spec)
    routed, partial = _routed(x, Routed(ids, weights.float(), None, None), args, spec, comm)
    out = routed.to(x.dtype)
    return comm.all_reduce_(out) if partial else out


def _op_args(tensors, rt=()) -> dict:
    """The op's tensors by name (``OP_ARGS`` order), the routing arguments (``routes.ROUTE_ARGS``) where given."""
    args = dict(zip(OP_ARGS, tensors))
    args.update({n: t for n, t in zip(routes.ROUTE_ARGS, rt) if t is not None})
    return args


@torch.library.custom_op("moecomp::moe_parallel", mutates_args=())
def moe_parallel(x: torch.Tensor, tensors: list[torch.Tensor | None], spec: str,
                 routes_in: torch.Tensor | None = None) -> torch.Tensor:
    """``forward`` as one op: ``tensors`` in ``OP_ARGS`` order (this rank's shards for the expert tensors; a shorter
    list leaves the rest None), ``spec`` a MoESpec key with a parallel part; ``routes_in``: replayed global ids."""
    return forward(x, _op_args(tensors, (None, None, routes_in)), MoESpec.from_key(spec))


def _fake(x, tensors, spec, rt) -> torch.Tensor:
    s = MoESpec.from_key(spec)
    _parallel(s)
    check(x, _op_args(tensors, rt), s, symbolic=True)
    return torch.empty_like(x)


@moe_parallel.register_fake
def _(x, tensors, spec, routes_in=None):
    return _fake(x, tensors, spec, (None, None, routes_in))


@torch.library.custom_op("moecomp::moe_parallel_routes", mutates_args=routes.OUTS)
def moe_parallel_routes(routes_out: torch.Tensor, route_weights_out: torch.Tensor | None, x: torch.Tensor,
                        tensors: list[torch.Tensor | None], spec: str,
                        routes_in: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_parallel`` recording its routing: int32 global ids [T, k] into ``routes_out``, fp32 weights [T, k] into
    ``route_weights_out`` where given (module docstring)."""
    return forward(x, _op_args(tensors, (routes_out, route_weights_out, routes_in)), MoESpec.from_key(spec))


@moe_parallel_routes.register_fake
def _(routes_out, route_weights_out, x, tensors, spec, routes_in=None):
    return _fake(x, tensors, spec, (routes_out, route_weights_out, routes_in))


def call(x: torch.Tensor, tensors, spec: MoESpec, routes_out: torch.Tensor | None = None,
         route_weights_out: torch.Tensor | None = None, routes_in: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_parallel`` for a bound block (``tensors`` in ``OP_ARGS`` order): direct from plain eager code, through
    the op where something traces or dispatches (as ``moe_op.call_moe_forward``); ``routes_out`` /
    ``route_weights_out`` / ``routes_in``: routing record and replay (module docstring), recording through
    ``moe_parallel_routes``."""
    tensors = tuple(tensors)
    rt = (routes_out, route_weights_out, routes_in)
    if plain_eager((x,) + tensors + rt):
        return forward(x, _op_args(tensors, rt), spec)
    if routes_out is None and route_weights_out is not None:  # weights alone: the ids into a scratch buffer
        routes_out = torch.empty(x.numel() // x.shape[-1], spec.top_k, dtype=torch.int32, device=x.device)
    if routes_out is not None:
        return torch.ops.moecomp.moe_parallel_routes(routes_out, route_weights_out, x, list(tensors), spec.key,
                                                     routes_in)
    return torch.ops.moecomp.moe_parallel(x, list(tensors), spec.key, routes_in)
