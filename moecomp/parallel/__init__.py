"""Expert and tensor parallelism of moecomp's MoE op on torch.distributed (``docs/PARALLEL.md``).

    spec.replace(parallel=ParallelSpec("ep" | "tp", world_size, rank, E, ...))   which shard this rank holds
    moecomp.parallel.forward(x, args, spec)     the block on this rank's shard (routing whole, experts sharded, one
                                                all-reduce or an all-to-all exchange); torch.ops.moecomp.moe_parallel
    moecomp.parallel.experts(x, ids, weights, args, spec)   the routed experts only, routing given
    moecomp.parallel.shard_tensors(args, spec)  this rank's shard of whole expert tensors
    moecomp.shard_experts(model, group, mode)   every MoE block optimize() binds, sharded in place

The op-level modules (comm, route, local, dispatch, capacity, ep, tp, op, slicing, emulate) sit at the ops layer
(they import ops and the spec); ``shard_experts`` (``shard.py``) sits beside ``optimize`` (it binds through it):
this package does not import it (the binder imports the op path, and ``shard.py`` the binder), ``import moecomp``
does, after ``optimize``.
``hf_distributed.py`` (``optimize`` on a model transformers' distributed loading sharded) sits there too: optimize
imports it. ``hf_ep.py`` registers ``ep_implementation="moecomp"`` with transformers (``import moecomp`` arms it).
"""

from __future__ import annotations

import importlib

from ..core.spec_parallel import ParallelSpec
from .comm import group_name
from .emulate import emulate
from .op import call, experts, forward
from .slicing import shard_tensors

__all__ = ["ParallelSpec", "group_name", "emulate", "call", "experts", "forward", "shard_tensors", "shard_experts"]


def __getattr__(name: str):
    if name == "shard_experts":
        return importlib.import_module(f"{__name__}.shard").shard_experts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
