"""The collectives the parallel paths use, behind one small interface, and the process group a spec names.

    comm.rank, comm.world_size
    comm.all_reduce_(t)                         t summed over the ranks, in place (every rank gets the same sum)
    comm.all_to_all(rows, out_splits, in_splits)  rows [n, ...] split along dim 0: piece j to rank j; returns the
                                                pieces received, in rank order (splits None: equal pieces)
    comm.all_to_all_start(rows, out_splits, in_splits).wait()   the same exchange started asynchronously (``async_op``
                                                on the group: NCCL's stream on CUDA, gloo's threads on CPU); ``wait()``
                                                returns the pieces (on CUDA: the current stream waits for them)

``DistComm`` runs them on a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU: both capturable in a CUDA
graph when the sizes are fixed, NCCL only). ``comm_for(parallel_spec)`` finds the group the spec names
(``ParallelSpec.group``: "" for the default group, else a group's name, ``group_name(group)``) and checks it holds
this rank at the spec's rank and world size: a ValueError naming what was expected otherwise.
``ThreadComm`` (``emulate.py``) runs the same interface between threads of one process (tests without processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.spec_parallel import ParallelSpec

_GROUPS: dict = {}  # name -> process group (groups named by group_name(); others resolved through c10d)
_COMMS: dict = {}  # (name, id(group), world_size, rank) -> DistComm, checked once


class Pending:
    """An exchange in flight: ``wait()`` -> the received tensor (``work`` None: already complete)."""

    def __init__(self, work, out: torch.Tensor, keep: torch.Tensor | None = None):
        self.work, self.out, self.keep = work, out, keep  # keep: the input, alive until the exchange is done

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = self.keep = None
        return self.out


class DistComm:
    """The collectives on one process group (module docstring)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_to_all(self, rows: torch.Tensor, out_splits=None, in_splits=None) -> torch.Tensor:
        n = rows.shape[0] if out_splits is None else sum(out_splits)
        out = rows.new_empty((n, *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def all_to_all_start(self, rows: torch.Tensor, out_splits=None, in_splits=None) -> Pending:
        n = rows.shape[0] if out_splits is None else sum(out_splits)
        out = rows.new_empty((n, *rows.shape[1:]))
        rows = rows.contiguous()
        work = dist.all_to_all_single(out, rows, out_splits, in_splits, group=self.group, async_op=True)
        return Pending(work, out, rows)


def group_name(group=None) -> str:
    """The name a ParallelSpec gives ``group`` by (``ParallelSpec.group``): "" for the default group (None or
    ``dist.group.WORLD``), else the group's own name (remembered, so ``comm_for`` finds the group again)."""
    if group is None or group is dist.group.WORLD:
        return ""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"the process group does not hold this process (global rank {dist.get_rank()}): "
                         f"torch.distributed.new_group gave this rank no group; expected a group holding it")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup (or None: the default group), got "
                         f"{type(group).__name__}")
    if dist.is_initialized() and group is dist.distributed_c10d._get_default_group():
        return ""
    name = group.group_name
    _GROUPS[name] = group
    return name


def resolve_group(name: str):
    """The process group named ``name`` ("" = the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("parallel experts need torch.distributed initialised (torch.distributed.init_process_group, "
                         "or torchrun); it is not")
    if name == "":
        return dist.distributed_c10d._get_default_group()
    group = _GROUPS.get(name)
    if group is None:
        try:
            group = dist.distributed_c10d._resolve_process_group(name)
        except Exception as e:
            raise ValueError(f"parallel.group={name!r} names no process group of this process "
                             f"(moecomp.parallel.group_name(group) gives a group's name)") from e
    return group


def check_group(group, p: ParallelSpec) -> None:
    """ValueError unless ``group`` holds this rank, at ``p.rank`` of ``p.world_size``."""
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError(f"the process group {p.group or 'default'!r} does not hold this process (global rank "
                         f"{dist.get_rank()}): expected a group with this rank at rank {p.rank} of {p.world_size}")
    W = dist.get_world_size(group)
    if W != p.world_size:
        raise ValueError(f"world size mismatch: the spec's parallel part says world_size={p.world_size}, the process "
                         f"group {p.group or 'default'!r} has {W} ranks")
    if r != p.rank:
        raise ValueError(f"rank mismatch: the spec's parallel part says rank={p.rank}, this process is rank {r} of the "
                         f"process group {p.group or 'default'!r}")


def comm_for(p: ParallelSpec) -> DistComm:
    """The collectives on the group ``p`` names, checked against ``p`` (once per group object)."""
    group = resolve_group(p.group)
    key = (p.group, id(group), p.world_size, p.rank)
    comm = _COMMS.get(key)
    if comm is None or comm.group is not group:
        check_group(group, p)
        if len(_COMMS) > 64:
            _COMMS.clear()
        comm = _COMMS[key] = DistComm(group)
    return comm
