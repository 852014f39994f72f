"""The chunked, overlapped all-to-all (``ParallelSpec.chunks``, ``moecomp/parallel/overlap.py``): equal to the unchunked
exchange on 2 real gloo processes (127.0.0.1, ``gloo_run.py``) and on W = 2 / 4 emulated ranks (threads), with
Mixtral-like and DeepSeek-V3-like routing (groups, bias, shared experts; also zero experts and an expert capacity,
whose pairs are not sent), C = 2 and 3 chunks, T not divisible by C,
T < C, T = 0 on one rank and on all. Plus the spec field's validation and key round trip.

Tolerances: through ``moe_experts`` the chunked result is held to ``CHUNK_TOL`` of the unchunked one (relative,
fp32: the experts' grouped GEMMs see other batches of rows, whose blocking changes the last bits; nothing else
differs) and to ``scenarios.TOL`` of the one-GPU oracle. With a row-independent stand-in for the experts
(``_row_independent``) the chunked result is bitwise the unchunked one (same pairs, same fp32 combine order)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

from moecomp import parallel as par
from moecomp.parallel import local, overlap
from moecomp.parallel.comm import comm_for
from moecomp.core.spec import MoESpec, SpecError
from moecomp.core.spec_parallel import ParallelSpec
from moecomp.testing import random_moe_args, rel_err

sys.path.insert(0, os.path.dirname(__file__))
import gloo_run  # noqa: E402
import scenarios as sc  # noqa: E402

CHUNK_TOL = 2e-6
NAMES = ("mixtral", "deepseek_v3")
UNSENT = ("zero_experts", "capacity")  # pairs no rank computes (zero experts; an expert capacity's drops): not sent
# tokens per rank: T % C != 0 for C = 2, 3; T = 0 on one rank; T = 2 < C = 3 (an empty chunk); T = 0 everywhere
SIZES = {2: ((7, 0), (5, 2), (0, 0)), 4: ((7, 0, 5, 2),)}
JOBS = ("overlap_chunked", "overlap_bitwise")


def _x(name: str, T: int, rank: int) -> torch.Tensor:
    return random_moe_args(sc.SPECS[name], T, seed=100 + rank)[0]  # [T, H], this rank's own tokens


def overlap_chunked(rank: int, W: int, comm=None, names=NAMES + UNSENT, sizes_=None, chunks=(2, 3)) -> list:
    """parallel.forward with chunks C in {2, 3} against chunks = 1 (CHUNK_TOL) and the oracle (scenarios.TOL)."""
    rows = []
    for name in names:
        _, t = sc.block(name, 8)
        for sizes in sizes_ or SIZES[W]:
            T = sizes[rank]
            x = _x(name, T, rank)
            one = sc.on_rank(x, t, sc.parallel_spec(name, "ep_a2a", W, rank), comm)
            ref = sc.oracle(x, t, sc.SPECS[name])
            for C in chunks:
                out = sc.on_rank(x, t, sc.parallel_spec(name, "ep_a2a", W, rank, chunks=C), comm)
                assert out.shape == x.shape and bool(torch.isfinite(out).all())
                what = f"{name} T={T} of {sizes} chunks={C}"
                rows.append((f"{what} vs chunks=1", rank, rel_err(out, one) if T else 0.0, CHUNK_TOL))
                rows.append((f"{what} vs oracle", rank, rel_err(out, ref) if T else 0.0, sc.TOL))
    return rows


def _row_independent(rows, ids, weights, args, ks):
    """A stand-in for ``local.run`` whose every row depends on that row alone: weight * (local id + 1) * tanh(x)."""
    return (torch.tanh(rows.float()) * (ids.float() + 1) * weights).to(rows.dtype)


def overlap_bitwise(rank: int, W: int, comm=None, patch: bool = True) -> list:
    """parallel.experts (routing given: random top-k over E) with ``_row_independent`` experts: chunked bitwise equal
    to unchunked, and both equal to the stand-in computed directly. ``patch``: install the stand-in here (a process
    of its own; the emulated test installs it around all its threads). On a real group, also: the exchange started by
    ``DistComm.all_to_all_start`` is asynchronous (a work handle) and gives what the blocking one gives."""
    rows = []
    orig = local.run
    if patch:
        local.run = _row_independent
    try:
        for name in NAMES:
            spec0 = sc.SPECS[name]
            E, k, n = spec0.num_experts, spec0.top_k, spec0.num_experts // W
            for sizes in SIZES[W]:
                T = sizes[rank]
                g = torch.Generator().manual_seed(200 + rank)
                x = torch.randn(T, spec0.hidden_size, generator=g)
                ids = torch.rand(T, E, generator=g).argsort(1)[:, :k]  # [T, k] distinct experts
                w = torch.rand(T, k, generator=g)
                shards = par.shard_tensors(sc.block(name, 1)[1], sc.parallel_spec(name, "ep_a2a", W, rank))
                outs = [par.experts(x, ids, w, shards, sc.parallel_spec(name, "ep_a2a", W, rank, chunks=C), comm)
                        for C in (1, 2, 3)]
                want = (torch.tanh(x)[:, None] * ((ids % n).float() + 1)[..., None] * w[..., None]).sum(1)
                what = f"{name} T={T} of {sizes}"
                rows.append((f"{what} row-independent chunks=1 vs direct", rank, rel_err(outs[0], want) if T else 0.0,
                             1e-6))
                for C, out in zip((2, 3), outs[1:]):
                    rows.append((f"{what} row-independent chunks={C} bitwise", rank,
                                 0.0 if torch.equal(out, outs[0]) else 1.0, 0.5))
    finally:
        local.run = orig
    if comm is None and dist.is_initialized():
        c = comm_for(sc.parallel_spec("mixtral", "ep_a2a", W, rank).parallel)
        send = torch.arange(6 * W, dtype=torch.float32).view(3 * W, 2) + 100 * rank  # 3 rows to each rank
        pending = c.all_to_all_start(send)
        rows.append(("all_to_all_start is async", rank, 0.0 if pending.work is not None else 1.0, 0.5))
        rows.append(("all_to_all_start == all_to_all", rank, rel_err(pending.wait(), c.all_to_all(send)), 1e-12))
    return rows


def _worker(rank, W, port, jobs, out, timeout):
    """gloo_run's worker, with this module's jobs added to ``scenarios.JOBS`` in the worker."""
    import scenarios

    scenarios.JOBS.update({j: globals()[j] for j in JOBS})
    gloo_run._worker(rank, W, port, jobs, out, timeout)


def _ok(rows, W):
    assert rows and {r[1] for r in rows} == set(range(W)), rows
    assert not sc.failures(rows), sc.failures(rows)


@pytest.fixture(scope="module")
def gloo_world():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return gloo_run.run_world(2, JOBS, timeout=120, worker=_worker)


def test_gloo_chunked_equals_unchunked(gloo_world):
    rows = gloo_world["overlap_chunked"]
    _ok(rows, 2)
    assert len(rows) == 2 * len(NAMES + UNSENT) * len(SIZES[2]) * 2 * 2


def test_gloo_row_independent_bitwise(gloo_world):
    rows = gloo_world["overlap_bitwise"]
    _ok(rows, 2)
    assert sum("bitwise" in r[0] for r in rows) == 2 * len(NAMES) * len(SIZES[2]) * 2
    assert sum(r[0].startswith("all_to_all_start") for r in rows) == 2 * 2


@pytest.mark.parametrize("W", [2, 4])
def test_emulated_chunked_equals_unchunked(W):
    _ok([row for rank_rows in par.emulate(W, lambda r, c: overlap_chunked(r, W, c)) for row in rank_rows], W)


def test_emulated_triton_kernels(monkeypatch):
    """The Triton path (routing kernel, the experts' kernels) under the interpreter: DeepSeek-V3, 3 chunks."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1 (set by conftest without CUDA)")
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    rows = par.emulate(2, lambda r, c: overlap_chunked(r, 2, c, names=("deepseek_v3",), sizes_=((7, 0),), chunks=(3,)))
    _ok([row for rank_rows in rows for row in rank_rows], 2)


@pytest.mark.parametrize("W", [2, 4])
def test_emulated_row_independent_bitwise(W, monkeypatch):
    monkeypatch.setattr(local, "run", _row_independent)
    rows = [row for rank_rows in par.emulate(W, lambda r, c: overlap_bitwise(r, W, c, patch=False))
            for row in rank_rows]
    _ok(rows, W)


def test_chunk_sizes():
    assert overlap.chunk_sizes(7, 3) == [3, 2, 2] and overlap.chunk_sizes(2, 3) == [1, 1, 0]
    assert overlap.chunk_sizes(0, 2) == [0, 0] and overlap.chunk_sizes(8, 4) == [2] * 4


@pytest.mark.parametrize("kw, match", [
    (dict(chunks=0), r"parallel.chunks must be an int >= 1 \(1: no chunked overlap\), got 0"),
    (dict(chunks=True), "parallel.chunks must be an int >= 1"),
    (dict(chunks=2.0), "parallel.chunks must be an int >= 1"),
    (dict(chunks=2, dispatch="all_reduce"), "parallel.chunks=2 is for dispatch 'all_to_all' without a capacity"),
    (dict(chunks=3, capacity=0), r"parallel.chunks=3 .* with capacity=0 \(fixed buffers are not chunked"),
    (dict(chunks=2, capacity=4), "with capacity=4"),
    (dict(chunks=2, mode="tp", intermediate_size=16, dispatch="all_reduce"), "got dispatch 'all_reduce'"),
])
def test_bad_chunks(kw, match):
    base = dict(mode="ep", world_size=2, rank=1, num_global_experts=8, dispatch="all_to_all")
    with pytest.raises(SpecError, match=match):
        ParallelSpec(**{**base, **kw})


def test_chunks_key_round_trip():
    p = ParallelSpec("ep", 2, 1, 16, dispatch="all_to_all", chunks=3)
    spec = sc.SPECS["deepseek_v3"].replace(parallel=p)
    back = MoESpec.from_key(spec.key)
    assert back == spec and back.parallel.chunks == 3 and back.key == spec.key
    assert "chunks 3" in p.describe() and not p.capturable
    assert "chunks" not in ParallelSpec("ep", 2, 1, 16, dispatch="all_to_all").describe()
    d = json.loads(spec.key)
    assert d["parallel"]["chunks"] == 3
    del d["parallel"]["chunks"]  # a key written before the field existed: one chunk
    assert MoESpec.from_key(json.dumps(d)).parallel == ParallelSpec("ep", 2, 1, 16, dispatch="all_to_all")
    d["parallel"]["chunks"] = "2"
    with pytest.raises(SpecError, match="ParallelSpec field chunks='2' should be int"):
        MoESpec.from_key(json.dumps(d))
