"""The uneven expert-parallel exchange (``dispatch.py``) in N token chunks, pipelined so that the communication
overlaps the experts (``ParallelSpec.chunks`` = N > 1; dispatch "all_to_all", capacity None).

    chunks       each rank's T tokens split in N ranges of T // N or T // N + 1 tokens (the first T % N ones longer;
                 T < N or T = 0: some empty). Chunk c of every rank is exchanged together: every rank takes part in
                 every chunk's collectives, with zero rows where it has none
    plan         dest[p] (``dispatch.destinations``) for all pairs; one stable sort on (chunk, dest): each chunk's
                 pairs grouped by destination, token-major inside; counts [N, W]
    counts       [W, N] --all_to_all_single (N a rank)-->  recv [W, N]; one host read for every chunk
    pipeline     (the collectives async on the comm's group: ``comm.all_to_all_start``; same order on every rank)
                   start dispatch 0 (rows, meta)
                   for c in 0 .. N - 1:
                       start dispatch c + 1              <- in flight while chunk c's experts run
                       wait dispatch c; y_c = experts(rows_c)
                       start combine c (y_c back)
                       wait combine c - 1 -> its pairs' rows  <- came back while chunk c's experts ran
                   wait combine N - 1
    result       rows [T * k, width] fp32 at every sent pair's place (0 for pairs not sent), summed by the caller
                 over each token's k slots in slot order: the same combine as the unchunked path

On CUDA the NCCL collectives run on NCCL's stream and the experts on the current stream, so they overlap on the GPU
(``work.wait()`` makes the current stream wait, the host does not block); on gloo the async ops run on gloo's
threads while this thread runs the experts. The experts see each chunk's rows apart (k = 1 a row): each row's output
is bitwise the unchunked call's where the expert kernels compute a row independently of its batch, else within
their batch-size rounding (the CPU grouped GEMM in fp32: about 1e-7 relative).

It pays where the exchange of a chunk takes about as long as its experts (large T, prefill); each chunk adds three
collectives' latency and one experts call's launch, so at small T (decode) N = 1 is faster.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.spec import MoESpec
from ..core.spec_parallel import ParallelSpec
from . import local
from .comm import Pending
from .dispatch import destinations, meta_rows


class ChunkPlan(NamedTuple):
    sel: list  # per chunk: [P_c] int64 the sent pairs' token-major indices (t * k + j), in send order
    send: list  # per chunk: [W] pairs this rank sends to each rank
    recv: list  # per chunk: [W] pairs this rank receives from each rank


def chunk_sizes(T: int, n: int) -> list:
    """Tokens of each of the n chunks: T // n, the first T % n of them one more."""
    return [T // n + (1 if c < T % n else 0) for c in range(n)]


def _start(comm, rows: torch.Tensor, out_splits, in_splits) -> Pending:
    start = getattr(comm, "all_to_all_start", None)
    if start is None:  # a comm without async exchanges: complete at once
        return Pending(None, comm.all_to_all(rows, out_splits, in_splits))
    return start(rows, out_splits, in_splits)


def plan(comm, ids: torch.Tensor, p: ParallelSpec, E: int) -> tuple[ChunkPlan, torch.Tensor]:
    """(the chunks' plan, dest [T * k]) from ids [T, k]: one counts exchange and one host read for every chunk."""
    T, k = ids.shape
    n, W = p.chunks, p.world_size
    dev = ids.device
    dest = destinations(ids, p, E)  # [T * k], W: not sent
    sizes = chunk_sizes(T, n)
    chunk = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(sizes, device=dev) * k)  # [T * k]
    key = chunk * (W + 1) + dest
    order = torch.sort(key, stable=True).indices  # by chunk, then destination; token-major inside
    counts = torch.bincount(key, minlength=n * (W + 1)).view(n, W + 1)  # [n, W + 1]
    recv = comm.all_to_all(counts[:, :W].t().contiguous().view(-1)).view(W, n)  # [W, n]: from each rank, per chunk
    counts_h, recv_h = counts.tolist(), recv.t().tolist()  # the host read (both)
    sel, start = [], 0
    for c in range(n):
        sent = sum(counts_h[c][:W])
        sel.append(order[start:start + sent])
        start += sum(counts_h[c])
    return ChunkPlan(sel, [row[:W] for row in counts_h], recv_h), dest


def exchange(comm, xe: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, args: dict, spec: MoESpec
             ) -> torch.Tensor:
    """The pipelined exchange and this rank's experts (module docstring): xe [T, width], ids / weights [T, k] over
    the E global experts -> rows [T * k, width] fp32, the owners' weight * expert(x) of each pair (0: not sent)."""
    p = spec.parallel
    T, k = ids.shape
    width, n = xe.shape[1], p.chunks
    cp, dest = plan(comm, ids, p, spec.num_experts)
    ids_flat, w_flat = ids.reshape(-1).long(), weights.reshape(-1)
    ks = local.kernel_spec(spec, 1, False)
    out = torch.zeros(T * k, width, dtype=torch.float32, device=xe.device)

    def dispatch(c: int) -> tuple:
        s = cp.sel[c]
        meta = meta_rows(ids_flat[s], w_flat[s], dest[s], p)  # [P_c, 2]
        return (_start(comm, xe[s // k], cp.recv[c], cp.send[c]), _start(comm, meta, cp.recv[c], cp.send[c]))

    def finish(c: int, pending: Pending) -> None:
        out.index_copy_(0, cp.sel[c], pending.wait().float())

    sent = [dispatch(0)]
    back = None  # (chunk, pending) of the combine in flight
    for c in range(n):
        if c + 1 < n:
            sent.append(dispatch(c + 1))
        rows_p, meta_p = sent[c]
        rows, got = rows_p.wait(), meta_p.wait()
        sent[c] = None  # (the received chunk is freed after its experts)
        y = local.run(rows, got[:, :1].long(), got[:, 1:], args, ks)  # [N_c, width]
        pending = _start(comm, y, cp.send[c], cp.recv[c])
        if back is not None:
            finish(*back)
        back = (c, pending)
    finish(*back)
    return out
