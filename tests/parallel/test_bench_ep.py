"""benchmarks/bench_ep.py run dry (tiny shapes, 2 iterations, a gloo group of one in this process, no JSON): every
mode times its phases and the total; the uneven all-to-all also with chunked overlap (chunks 2 and 3 of T = 5: uneven
chunks); every all-to-all row has its floor from the all_to_all_single fit of the same run."""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

from moecomp.parallel.comm import comm_for
from moecomp.core.spec_parallel import ParallelSpec

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def _positive(r, keys):
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in keys), (keys, r)


def test_bench_ep_dry(capsys):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    sys.path.insert(0, BENCH)
    bench = importlib.import_module("bench_ep")
    rows = bench.run(["--dry", "--tokens", "5", "--chunks", "1,2,3"])
    assert not dist.is_initialized()  # (its own group, destroyed)
    want = [(m, c) for m in bench.MODES for c in ((1, 2, 3) if m == "ep_a2a" else (1,))]
    assert [(r["mode"], r["chunks"]) for r in rows] == want
    for r in rows:
        a2a = "a2a" in r["mode"]
        need = ("route", "shared", "total", "op") + (("routed",) if a2a else ("experts", "all_reduce"))
        if a2a and r["chunks"] == 1:
            need += ("experts", "dispatch", "combine", "comm", "vs_floor")
        _positive(r, need)
        if a2a:  # the floor: bytes and collectives of the row, at the fitted latency and bandwidth
            _positive(r, ("a2a_bytes", "collectives", "floor"))
            assert r["collectives"] == (3 if "fixed" in r["mode"] else 1 + 3 * r["chunks"] if r["chunks"] > 1 else 4)
            assert math.isfinite(r["comm"]) and r["vs_floor"] == pytest.approx(r["comm"] / r["floor"])
        else:
            assert "floor" not in r
        if r["chunks"] > 1:
            assert "dispatch" not in r and "combine" not in r  # (pipelined: not timed apart)
    out = capsys.readouterr().out
    assert "ep_a2a_fixed" in out and "all_to_all_single fit" in out and "vs_floor" in out


def test_a2a_fit():
    """The all_to_all_single fit on a gloo group of one: a positive latency and bandwidth, the sizes it timed."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    sys.path.insert(0, BENCH)
    bench = importlib.import_module("bench_ep")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = comm_for(ParallelSpec("ep", 1, 0, 1))
        f = bench.a2a_fit(comm, torch.device("cpu"), torch.float32, [1024, 65536], bench._timer(torch.device("cpu"), 2))
    finally:
        dist.destroy_process_group()
    _positive(f, ("latency_us", "bandwidth_gbps"))
    assert [b for b, _ in f["points"]] == [1024, 65536] and all(t > 0 for _, t in f["points"])
