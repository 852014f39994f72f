"""benchmarks/bench_ep.py run dry (tiny shapes, 2 iterations, a gloo group of one in this process, no JSON): every
mode times its phases and the total."""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch.distributed as dist

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def test_bench_ep_dry(capsys):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    sys.path.insert(0, BENCH)
    bench = importlib.import_module("bench_ep")
    rows = bench.run(["--dry", "--tokens", "2"])
    assert not dist.is_initialized()  # (its own group, destroyed)
    assert [r["mode"] for r in rows] == list(bench.MODES)
    for r in rows:
        need = ("route", "experts", "shared", "total", "op") + (
            ("dispatch", "combine") if "a2a" in r["mode"] else ("all_reduce",))
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in need), r
    assert "ep_a2a_fixed" in capsys.readouterr().out
