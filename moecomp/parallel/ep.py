"""Expert parallelism: this rank holds experts [r * E / W, (r + 1) * E / W) and computes the pairs routed to them.

    dispatch "all_reduce" (the group shares one batch; every rank routed every token the same way):
        lid = id - start where the pair's expert is local, else E / W (skipped: ``local.kernel_spec(sentinel)``)
        lw  = weight where local, else 0       (zero experts' pairs, ids >= E: on rank 0 only, weight * x)
        partial [T, width] = moe_experts(xe, lid, lw)    -> the caller sums partials over the ranks (one all-reduce)
    dispatch "all_to_all" (each rank its own tokens):
        pairs -> owners (``dispatch.py``: uneven, counts first; ``capacity.py``: fixed buffers, capturable;
                         ``overlap.py``: uneven, in ``chunks`` pipelined token chunks, the exchange overlapping
                         the experts)
        y = moe_experts(rows, local id, weight) on the owner, k = 1 a row   -> back to the token's rank
        out [T, width] = sum over each token's k slots of the returned rows (fp32, slot order, as the one-GPU
                         combine) + the zero experts' weight * x; complete: nothing to reduce
"""

from __future__ import annotations

import torch

from ..ops.backend import Routed
from ..ops.zero_experts import zero_term
from ..core.spec import MoESpec
from . import capacity, dispatch, local, overlap


def routed(xe: torch.Tensor, r: Routed, args: dict, spec: MoESpec, comm) -> tuple[torch.Tensor, bool]:
    """(routed output fp32 [T, width], partial: whether it still has to be summed over the ranks)."""
    if spec.parallel.dispatch == "all_reduce":
        return _partial(xe, r, args, spec), True
    return _exchanged(xe, r, args, spec, comm), False


def _partial(xe, r: Routed, args: dict, spec: MoESpec) -> torch.Tensor:
    p = spec.parallel
    n, start = p.experts_per_rank, p.local_experts.start
    ids = r.ids.long()
    mine = (ids >= start) & (ids < start + n)
    lid = torch.where(mine, ids - start, n)  # [T, k]: not local -> past the local experts (skipped)
    lw = torch.where(mine, r.weights, 0.0)
    if spec.zero_experts and p.rank == 0:  # the zero experts' weight * x, added once
        lw = torch.where(ids >= spec.num_experts, r.weights, lw)
    ks = local.kernel_spec(spec, ids.shape[1], True)
    return local.run(xe, lid, lw, args, ks).float()


def _exchanged(xe, r: Routed, args: dict, spec: MoESpec, comm) -> torch.Tensor:
    p = spec.parallel
    T, k = r.ids.shape
    E, width = spec.num_experts, xe.shape[1]
    fixed = p.capacity is not None
    if not fixed and xe.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("moecomp parallel: dispatch 'all_to_all' without a capacity reads the exchange's counts on "
                           "the host, which a CUDA graph capture cannot do; use capacity=0 (fixed buffers of T * k "
                           "rows, no drop) or capacity=C, or dispatch 'all_reduce'")
    if p.chunks > 1:  # the exchange in chunks, overlapping the experts (overlap.py)
        pair_rows = overlap.exchange(comm, xe, r.ids, r.weights, args, spec)  # [T * k, width]
    else:
        via = capacity if fixed else dispatch
        plan, rows, lid, lw = via.send(comm, xe, r.ids, r.weights, p, E)
        y = local.run(rows, lid, lw, args, local.kernel_spec(spec, 1, fixed))  # [N, width]
        pair_rows = capacity.back(comm, plan, y) if fixed else dispatch.back(comm, plan, y, T * k)  # [T * k, width]
    out = pair_rows.view(T, k, width).sum(1)
    if spec.zero_experts:
        out += zero_term(xe, r.ids, r.weights, spec)
    return out
