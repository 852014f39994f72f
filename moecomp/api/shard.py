"""``moecomp.shard_experts(model, group, mode)``: every MoE block ``optimize()`` binds keeps only this rank's shard of
its routed experts and calls the parallel path; the router, shared experts and the rest of the model stay whole.

    model --optimize (recognise, verify, bind: on the whole weights, as on one GPU)--> bound blocks
          --for each bound block:
              spec     = the bound op spec + ParallelSpec(mode, W, rank, E, ...)    (E % W, I % W, scale blocks checked)
              whole    = the tensors the bound call reads for w13 / b13 / w2 / b2 / scales / zeros
              shards   = slicing.shard_tensors(whole, spec)                               (fresh tensors, this rank's part)
              install  a bound Parameter / buffer: replaced by its shard (a Parameter stays a Parameter, no grad);
                       a derived tensor (stacked ModuleList experts, separate gate / up): the block's buffer becomes the
                       shard, no longer rebuilt, and its sources are released: "stack" sources of this rank's experts
                       become views of the shard (EP: experts [a, b); TP: their I columns), the others empty
              st.op_spec = spec   -> the bound forward calls ``parallel.op.call`` (bind/bind.py)
    the whole tensors are no longer referenced: freed

Blocks bound another way (experts-only, router / experts pairs) stay whole (replicated) and are reported so. A
sharded block cannot run its original forward (training with gradients, hooks, ...: a RuntimeError) nor be unbound.
``generate()`` works as after ``optimize`` (every rank must run the same calls: greedy, or sampling with the same
seed); the decode steps' CUDA graphs need a capturable path (``ParallelSpec.capturable``: the default "all_reduce").

The binding a loader with sharded expert tensors needs (transformers' EP / TP plans) is the same last two steps: the
op spec with its ParallelSpec, and the shard tensors at the bound paths (``local.check_shards`` says the shapes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core.derived import get_path
from ..bind.bind import BoundState, refresh_derived as _refresh_derived, resolve as _resolve
from ..core.args import OP_ARGS
from ..core.spec import MoESpec
from ..core.spec_parallel import PARALLEL_MODES, ParallelSpec
from ..parallel.comm import group_name, resolve_group
from ..parallel.local import SHARD_ARGS
from ..parallel.slicing import shard_tensors


def shard_experts(model: nn.Module, group=None, mode: str = "ep", *, dispatch: str = "all_reduce",
                  capacity: int | None = None) -> dict:
    """Shard the routed experts of every MoE block of ``model`` over ``group`` (None: the default process group), in
    place (module docstring). ``mode``: "ep" (experts split over the ranks) or "tp" (every expert's intermediate
    columns split). ``dispatch`` / ``capacity``: EP's exchange (``ParallelSpec``; "all_to_all" when each rank runs
    its own tokens). Runs ``moecomp.optimize(model)`` first (blocks bound already stay as they are). Returns {block
    name: what this rank holds, or why the block stays whole}. ValueError for a bad mode, a group without this
    rank, or shards that cannot be cut (E or I not divisible by the world size, scale blocks)."""
    from .optimize import optimize

    if mode not in PARALLEL_MODES or mode == "replicated":  # (replicated: nothing to shard, nothing freed)
        raise ValueError(f"mode={mode!r}: expected one of {tuple(m for m in PARALLEL_MODES if m != 'replicated')}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_experts expects a torch.nn.Module, got {type(model).__name__}")
    name = group_name(group)  # (ValueError for a group without this rank)
    g = resolve_group(name)
    W, rank = dist.get_world_size(g), dist.get_rank(g)
    optimize(model)
    out = {}
    for bname, block in model.named_modules():
        st = block.__dict__.get("_moecomp")
        if st is None:
            if block.__dict__.get("_moecomp_experts") is not None:
                out[bname] = "whole: an experts-only binding (routing in the model's code) is not sharded"
            continue
        if not isinstance(st, BoundState):
            out[bname] = f"whole: a {type(st).__name__} binding is not sharded"
            continue
        spec = st.op_spec or st.spec
        p = ParallelSpec(mode, W, rank, spec.num_experts, intermediate_size=spec.intermediate_size if mode == "tp"
                         else 0, dispatch=dispatch, capacity=capacity, group=name)
        if spec.parallel is not None:
            if spec.parallel != p:
                raise ValueError(f"{bname}: already sharded as {spec.parallel.describe()}, asked for {p.describe()}")
        else:
            _shard_block(block, st, spec.replace(parallel=p))
        out[bname] = p.describe()
    return out


def _shard_block(block: nn.Module, st: BoundState, spec: MoESpec) -> None:
    """Install ``spec``'s shard of the block's expert tensors (module docstring) and the parallel op spec."""
    if st.derived:
        _refresh_derived(block, st)
    paths = {n: st.paths[OP_ARGS.index(n)] for n in SHARD_ARGS if n in OP_ARGS and st.paths[OP_ARGS.index(n)]}
    whole = {n: _resolve(block, p) for n, p in paths.items()}
    shards = shard_tensors(whole, spec)
    del whole
    derived = {d.name: d for d in st.derived}
    for n, sh in shards.items():
        path = paths[n]
        d = derived.get(path[0]) if len(path) == 1 else None
        if d is not None:  # a tensor the binder built: the shard replaces it, its sources are released
            block._buffers[d.name] = None
            _release_sources(block, d, sh, spec)
            block.register_buffer(d.name, sh, persistent=False)
            st.derived.remove(d)
            st.versions.pop(d.name, None)
            continue
        owner = _resolve(block, path[:-1]) if len(path) > 1 else block
        attr = path[-1]
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(sh, requires_grad=False)
        elif attr in owner._buffers:
            owner._buffers[attr] = sh
        else:
            setattr(owner, attr, sh)
    st.op_spec = spec
    st.spec_key = spec.key  # (computed now: compiled code reads it)


def _release_sources(block: nn.Module, d, sh: torch.Tensor, spec: MoESpec) -> None:
    """The derived tensor's sources no longer hold the whole weights: a "stack" (per-expert tensors concatenated on
    dim 0, then stacked) of this rank's experts become views of the shard, in the same proportions of dim 0; every
    other source is emptied."""
    p = spec.parallel
    mine = p.local_experts
    with torch.no_grad():
        for e, group in enumerate(d.sources):
            ts = [get_path(block, q) for q in group]
            if d.kind != "stack" or d.fp32 or e not in mine:
                for t in ts:
                    t.data = t.new_empty(0)
                continue
            row = sh[e - mine.start]  # this expert's rows of the shard
            total = sum(t.shape[0] for t in ts)
            off = 0
            for t in ts:
                n = t.shape[0] * row.shape[0] // total
                t.data = row[off:off + n]
                off += n
