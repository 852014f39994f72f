"""Run checks on W real processes (gloo over 127.0.0.1): ``run_world(W, jobs)`` spawns W processes (the "spawn"
start method: a fresh interpreter each, nothing inherited but sys.path), which join one process group and run every
job of ``JOBS`` named in ``jobs``; each returns its rows (name, rank, error, tolerance) per job or the traceback.

Safety: the rendezvous is a TCPStore on 127.0.0.1 at a port the OS picked free (a socket bound to 127.0.0.1:0,
closed just before the store binds it: retried once on a clash), gloo talks over the loopback interface
(GLOO_SOCKET_IFNAME=lo where there is one), and everything is bounded: collectives time out after ``timeout`` seconds,
the parent waits at most ``timeout`` for the results, then terminates what is left and fails with a message.
"""

from __future__ import annotations

import datetime
import os
import queue as _queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, W: int, port: int, jobs: tuple, out, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001  (the parent reports it)
        out.put((rank, "init", None, traceback.format_exc()))
        return
    try:
        import scenarios

        for job in jobs:
            try:
                out.put((rank, job, scenarios.JOBS[job](rank, W), None))
            except Exception:  # noqa: BLE001
                out.put((rank, job, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _collect(procs, out, n: int, timeout: float, got: dict, errors: list) -> None:
    """Read n results (or a join failure) from the queue; stop early when a process died without reporting."""
    deadline = time.monotonic() + timeout
    while n:
        try:
            rank, job, rows, err = out.get(timeout=0.5)
        except _queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                errors.append(f"missing results: {'processes died (rank, exit code) ' + str(dead) if dead else ''}"
                              f"{'' if dead else f'none within {timeout} s (a hung collective?)'}; exit codes "
                              f"{[p.exitcode for p in procs]}")
                return
            continue
        n -= 1
        if job == "init":
            errors.append(f"rank {rank} could not join the group:\n{err}")
            return
        if err is not None:
            errors.append(f"rank {rank}, job {job}:\n{err}")
        else:
            got.setdefault(job, []).extend(rows)


def run_world(W: int, jobs: tuple, timeout: float = 120.0) -> dict:
    """{job: rows of every rank} from W gloo processes; AssertionError with the ranks' tracebacks on a failure, a
    hang (past ``timeout``) or a process that died."""
    ctx = mp.get_context("spawn")
    for attempt in range(2):
        port = free_port()
        out = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, W, port, jobs, out, timeout), daemon=True) for r in range(W)]
        for p in procs:
            p.start()
        got, errors = {}, []
        try:
            _collect(procs, out, W * len(jobs), timeout, got, errors)
        finally:
            for p in procs:
                p.join(5)
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        if errors and attempt == 0 and any("address already in use" in e.lower() for e in errors):
            continue  # the free port was taken between the probe and the store: once more, on another
        assert not errors, "\n".join(errors)
        return got
    raise AssertionError("unreachable")
