"""W ranks in one process: each runs ``fn(rank, comm)`` in its own thread, ``comm`` a ``ThreadComm`` with the
collectives of ``comm.py`` exchanged through shared memory. Cheap tests of the parallel paths' split, exchange and
combine logic without spawning processes (the multi-process gloo tests run the real collectives).

    emulate(W, fn) -> [fn(0, comm_0), ..., fn(W - 1, comm_{W-1})]

Every collective is a rendezvous of all W threads (a barrier with a timeout: a rank that never arrives fails the
others with ``TimeoutError`` instead of hanging). all_reduce sums in rank order. The first exception a rank raises is
re-raised by ``emulate``. One rank computes at a time (a lock each thread holds except while it waits in a
collective): the Triton interpreter (``TRITON_INTERPRET=1``) keeps global state and is not thread-safe.
"""

from __future__ import annotations

import threading

import torch

from .comm import Pending


class _Shared:
    def __init__(self, world_size: int, timeout: float):
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list = [None] * world_size
        self.compute = threading.Lock()  # held by the rank that runs (released while waiting in a collective)


class ThreadComm:
    """``comm.py``'s interface between the threads of ``emulate``."""

    def __init__(self, rank: int, world_size: int, shared: _Shared):
        self.rank, self.world_size, self._s = rank, world_size, shared

    def _gather(self, item) -> list:
        s = self._s
        s.slots[self.rank] = item
        self._wait()
        items = list(s.slots)
        self._wait()  # nobody writes the slots again before everyone has read them
        return items

    def _wait(self) -> None:
        self._s.compute.release()
        try:
            self._s.barrier.wait()
        except threading.BrokenBarrierError:
            raise TimeoutError("emulated collective: another rank failed or never arrived") from None
        finally:
            self._s.compute.acquire()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        items = self._gather(t.clone())
        total = items[0].clone()
        for other in items[1:]:
            total += other
        return t.copy_(total)

    def all_to_all(self, rows: torch.Tensor, out_splits=None, in_splits=None) -> torch.Tensor:
        W = self.world_size
        if in_splits is None:
            if rows.shape[0] % W:
                raise ValueError(f"all_to_all of {rows.shape[0]} rows in {W} equal pieces")
            in_splits = [rows.shape[0] // W] * W
        items = self._gather((rows.clone(), list(in_splits)))
        pieces = [r.split(sp)[self.rank] for r, sp in items]
        got = [p.shape[0] for p in pieces]
        if out_splits is not None and list(out_splits) != got:
            raise ValueError(f"rank {self.rank}: out_splits {list(out_splits)} differ from the rows sent, {got}")
        return torch.cat(pieces) if pieces else rows[:0]

    def all_to_all_start(self, rows: torch.Tensor, out_splits=None, in_splits=None):
        """``all_to_all`` at once (the rendezvous is the exchange), returned as a completed ``comm.Pending``."""
        return Pending(None, self.all_to_all(rows, out_splits, in_splits))


def emulate(world_size: int, fn, timeout: float = 60.0) -> list:
    """[fn(rank, comm) for every rank], each rank in its own thread (module docstring)."""
    shared = _Shared(world_size, timeout)
    out: list = [None] * world_size
    errors: list = [None] * world_size

    def run(rank: int) -> None:
        shared.compute.acquire()
        try:
            out[rank] = fn(rank, ThreadComm(rank, world_size, shared))
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors[rank] = e
            shared.barrier.abort()
        finally:
            shared.compute.release()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    real = [e for e in errors if e is not None and not isinstance(e, TimeoutError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"emulate: a rank did not finish within {timeout} s")
    return out
