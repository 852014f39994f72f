"""Expert-parallel exchange in buffers of fixed size (``ParallelSpec.dispatch`` "all_to_all" with ``capacity`` not
None): nothing is read on the host and every size follows from T, k, W and C, so the exchange is capturable in a CUDA
graph (NCCL) — the decode steps of ``generate()``.

    C            = capacity, or T * k when capacity is 0 (no pair can ever be dropped: every rank must then call with
                   the same T, as the decode steps of a shared batch do)
    dest[p]      = owner rank of pair p (W: not sent; ``dispatch.destinations``)
    pos[p]       = rank of pair p among the pairs to the same destination, slot-major: every token's first choice
                   (tokens in order) before any token's second choice, ... (cumulative sum over a one-hot [P, W + 1])
    kept         = dest < W and pos < C     (DROP POLICY: a pair past its destination's C rows adds nothing; its
                   token keeps the other pairs' outputs, not renormalised)
    send [W * C + 1, width]: pair p's x row at dest * C + pos; the last row takes every pair not kept (discarded)
    meta [W * C + 1, 2]: (local id, weight); empty rows hold (E / W, 0): an id past the local experts, skipped by the
                   experts (``local.kernel_spec(sentinel=True)``)
    --all_to_all_single (equal splits of C rows)--> recv [W * C, width], meta
    ... the owner computes y [W * C, width] over every row (empty ones skipped, 0) ...
    y --all_to_all_single--> back [W * C, width];  rows[p] = back[slot[p]] (0 for pairs not kept)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.spec_parallel import ParallelSpec
from .dispatch import destinations, meta_rows


class FixedPlan(NamedTuple):
    slot: torch.Tensor  # [T * k] each pair's row in the send buffer (W * C: not sent)
    kept: torch.Tensor  # [T * k] bool: sent and within capacity


def capacity_of(p: ParallelSpec, T: int, k: int) -> int:
    """Rows per destination rank: ``p.capacity``, or T * k (no drop) for capacity 0."""
    return p.capacity or T * k


def positions(dest: torch.Tensor, T: int, k: int, W: int) -> torch.Tensor:
    """[T * k] int64: each pair's rank among the pairs to its destination, slot-major (module docstring)."""
    if dest.numel() == 0:
        return dest.clone()
    sm = dest.view(T, k).t().reshape(-1)  # slot-major order
    hot = (sm[:, None] == torch.arange(W + 1, device=sm.device)).long()  # [P, W + 1] one-hot (no range check)
    rank = ((hot.cumsum(0) - hot) * hot).sum(1)  # [P]
    return rank.view(k, T).t().reshape(-1)  # token-major again


def send(comm, xe: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: ParallelSpec, E: int):
    """(plan, rows [W * C, width], local ids [W * C, 1] int64, weights [W * C, 1] fp32) received by this rank."""
    T, k = ids.shape
    W, width = p.world_size, xe.shape[1]
    C = capacity_of(p, T, k)
    dest = destinations(ids, p, E)  # [T * k]
    pos = positions(dest, T, k, W)
    kept = (dest < W) & (pos < C)
    slot = torch.where(kept, dest * C + pos, W * C)
    tok = torch.arange(T * k, device=xe.device) // k
    buf = xe.new_zeros(W * C + 1, width)
    buf[slot] = xe[tok]
    meta = torch.zeros(W * C + 1, 2, dtype=torch.float32, device=xe.device)
    meta[:, 0] = p.experts_per_rank  # empty rows: an id past the local experts (skipped), weight 0
    meta[slot] = meta_rows(ids.reshape(-1).long(), weights.reshape(-1), dest, p)  # (pairs not kept: the last row)
    rows = comm.all_to_all(buf[: W * C])
    got = comm.all_to_all(meta[: W * C])
    return FixedPlan(slot, kept), rows, got[:, :1].long(), got[:, 1:]


def back(comm, plan: FixedPlan, y: torch.Tensor) -> torch.Tensor:
    """The owners' outputs y [W * C, width] returned: [T * k, width] fp32 (0 for the pairs not kept)."""
    got = comm.all_to_all(y).float()  # [W * C, width]
    padded = torch.cat([got, got.new_zeros(1, got.shape[1])])
    return padded[plan.slot]
