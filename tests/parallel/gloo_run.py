"""Run checks on W real processes (gloo over 127.0.0.1): ``run_world(W, jobs)`` starts W processes, which join one
process group and run every job of ``scenarios.JOBS`` named in ``jobs``; each returns its rows (name, rank, error,
tolerance) per job or the traceback. The processes come from torch.multiprocessing's "forkserver" (a fresh server
process, started once, never a fork of pytest itself, that has imported torch, Dynamo, moecomp and transformers:
each worker is a fork of it, so W workers do not pay those imports W times over, which was most of the time), or
"spawn" where there is no fork server.

Safety: the rendezvous is a TCPStore on 127.0.0.1 at a port the OS picked free (a socket bound to 127.0.0.1:0,
closed just before the store binds it: retried once on a clash), gloo talks over the loopback interface
(GLOO_SOCKET_IFNAME=lo where there is one), and everything is bounded: collectives time out after ``timeout`` seconds,
the parent waits at most ``timeout`` for the results, then terminates what is left and fails with a message. The
first rank that raises ends the run at once (its traceback reported, the other ranks terminated: they may be waiting in
a collective the failed rank never joins), not after the collective timeout.
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
            except Exception:  # noqa: BLE001  (reported; the later jobs are not run: the other ranks may be
                out.put((rank, job, None, traceback.format_exc()))  # waiting in this job's collectives)
                return
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
        if err is not None:  # the first failure ends the run: the other ranks may wait in a collective for it
            errors.append(f"rank {rank}, job {job}:\n{err}")
            return
        else:
            got.setdefault(job, []).extend(rows)


# what the fork server imports once for every worker (a module that fails to import is skipped): torch with Dynamo
# (moecomp's verify calls the op through the dispatcher, which imports it), moecomp, the checks, transformers and the
# tiny models' modelling code
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "moecomp", "moecomp.parallel", "scenarios", "transformers",
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers.models.deepseek_v3.modeling_deepseek_v3")


def _context():
    """"forkserver" where there is one: a fresh server process (not a fork of pytest) that imports torch, moecomp and
    the checks once, then forks each worker from that state, so W workers do not import torch W times over (most of
    a spawned worker's start-up); "spawn" elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def run_world(W: int, jobs: tuple, timeout: float = 120.0, worker=None) -> dict:
    """{job: rows of every rank} from W gloo processes; AssertionError with the ranks' tracebacks on a failure, a
    hang (past ``timeout``) or a process that died. ``worker``: a test module's own worker (a module-level function
    with ``_worker``'s signature) in place of this module's."""
    ctx = _context()
    for attempt in range(2):
        port = free_port()
        out = ctx.Queue()
        procs = [ctx.Process(target=worker or _worker, args=(r, W, port, jobs, out, timeout), daemon=True) for r in range(W)]
        for p in procs:
            p.start()
        got, errors = {}, []
        try:
            _collect(procs, out, W * len(jobs), timeout, got, errors)
        finally:
            for p in procs:
                if not errors:  # a failed run: the others are likely blocked in a collective, stop them now
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
