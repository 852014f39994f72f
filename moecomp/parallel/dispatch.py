"""Expert-parallel exchange with uneven splits (``ParallelSpec.dispatch`` "all_to_all", ``capacity`` None): each rank
sends each of its (token, slot) pairs to the rank that owns the pair's expert, and gets the expert's output back.

    dest[p]      = owner rank of pair p's expert (ids // (E / W)); W for pairs no rank computes (zero experts' pairs,
                   an expert capacity's dropped pairs): they are not sent
    order        = pairs sorted by dest (stable: token-major within a destination)
    counts [W]   --all_to_all_single-->  recv_counts [W]              (the counts first, one int per rank pair)
    host         send_splits, recv_splits = counts, recv_counts       (the one host read: not capturable)
    x rows  [P, width] = xe[token of each sent pair]   --all_to_all_single(uneven)-->  [N, width]
    meta    [P, 2]     = (local expert id, weight) fp32 --all_to_all_single(uneven)-->  [N, 2]
    ... the owner computes y [N, width] = weight * expert(x row) ...
    y --all_to_all_single(uneven, splits swapped)-->  back [P, width]  ->  rows [T * k, width] fp32 at the sent pairs'
                   places (0 for the pairs not sent)

The caller sums ``rows`` over each token's k slots (slot order, fp32), as the one-GPU combine does. Local ids are sent
as fp32 (exact below 2^24). ``capacity.py`` is the fixed-size variant (no host read, CUDA-graph capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.spec_parallel import ParallelSpec


def destinations(ids: torch.Tensor, p: ParallelSpec, E: int) -> torch.Tensor:
    """[T * k] int64: the rank owning each pair's expert, token-major; W for pairs no rank computes."""
    flat = ids.reshape(-1).long()
    sent = (flat >= 0) & (flat < E)
    return torch.where(sent, flat // p.experts_per_rank, p.world_size)


def meta_rows(ids_flat: torch.Tensor, weights_flat: torch.Tensor, dest: torch.Tensor, p: ParallelSpec) -> torch.Tensor:
    """[n, 2] fp32: (the pair's expert id on its owner, its weight) for pairs with destination ``dest`` (< W)."""
    return torch.stack([(ids_flat - dest * p.experts_per_rank).float(), weights_flat.float()], 1)


class Plan(NamedTuple):
    sel: torch.Tensor  # [P] indices of the sent pairs (token-major index t * k + j), in send order
    send_splits: list  # pairs sent to each rank
    recv_splits: list  # pairs received from each rank


def send(comm, xe: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: ParallelSpec, E: int):
    """(plan, rows [N, width], local ids [N, 1] int64, weights [N, 1] fp32) received by this rank."""
    k = ids.shape[1]
    W = p.world_size
    dest = destinations(ids, p, E)  # [T * k]
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=W + 1)[:W]  # [W]
    recv_counts = comm.all_to_all(counts)  # [W]: one count from every rank
    send_splits, recv_splits = counts.tolist(), recv_counts.tolist()  # the host read
    sel = order[: sum(send_splits)]
    meta = meta_rows(ids.reshape(-1)[sel].long(), weights.reshape(-1)[sel], dest[sel], p)
    rows = comm.all_to_all(xe[sel // k], recv_splits, send_splits)
    got = comm.all_to_all(meta, recv_splits, send_splits)
    return Plan(sel, send_splits, recv_splits), rows, got[:, :1].long(), got[:, 1:]


def back(comm, plan: Plan, y: torch.Tensor, pairs: int) -> torch.Tensor:
    """The owners' outputs y [N, width] returned: [pairs, width] fp32, the sent pairs' rows, 0 elsewhere."""
    got = comm.all_to_all(y, plan.send_splits, plan.recv_splits)  # [P, width]
    rows = torch.zeros(pairs, y.shape[1], dtype=torch.float32, device=y.device)
    return rows.index_copy_(0, plan.sel, got.float())
