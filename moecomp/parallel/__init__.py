"""Expert and tensor parallelism of moecomp's MoE op on torch.distributed (``docs/PARALLEL.md``).

    spec.replace(parallel=ParallelSpec("ep" | "tp", world_size, rank, E, ...))   which shard this rank holds
    moecomp.parallel.forward(x, args, spec)     the block on this rank's shard (routing whole, experts sharded, one
                                                all-reduce or an all-to-all exchange); torch.ops.moecomp.moe_parallel
    moecomp.parallel.experts(x, ids, weights, args, spec)   the routed experts only, routing given
    moecomp.parallel.shard_tensors(args, spec)  this rank's shard of whole expert tensors
    moecomp.shard_experts(model, group, mode)   every MoE block optimize() binds, sharded in place

The whole package sits at the ops layer (its modules import the ops and the spec; the binder imports it). The entry
points that bind through ``optimize`` sit at the API layer: ``shard_experts`` (``api/shard.py``, public as
``moecomp.shard_experts``) and ``optimize`` on a model transformers' distributed loading sharded
(``api/hf_distributed.py``). ``hf/ep_interface.py`` registers ``ep_implementation="moecomp"`` with transformers
(``import moecomp`` arms it).
"""

from __future__ import annotations

from ..core.spec_parallel import ParallelSpec
from .comm import group_name
from .emulate import emulate
from .op import call, experts, forward
from .slicing import shard_tensors

__all__ = ["ParallelSpec", "group_name", "emulate", "call", "experts", "forward", "shard_tensors"]

