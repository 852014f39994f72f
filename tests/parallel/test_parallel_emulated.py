"""The parallel paths with W ranks as threads of this process (``moecomp.parallel.emulate``): every check of
``scenarios.py`` (Mixtral, Qwen3-MoE, DeepSeek-V3 routing with groups + bias + shared experts, gated shared experts,
latent projections, zero experts, gpt-oss, an expert capacity, Llama 4's weight on input, FP8 block and int4
experts; EP with all-reduce, all-to-all uneven and fixed, TP) equal to the one-GPU oracle on every rank; then the same
on the Triton kernels (interpreter) for a few. Seconds, no processes: the multi-process gloo tests run the real
collectives on the same checks."""

from __future__ import annotations

import os
import sys

import pytest

from moecomp import parallel as par

sys.path.insert(0, os.path.dirname(__file__))
import scenarios as sc  # noqa: E402


def _run(W: int, fn) -> list:
    rows = [row for per_rank in par.emulate(W, fn) for row in per_rank]
    assert rows and not sc.failures(rows), sc.failures(rows)
    return rows


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("check", sc.ALL_CHECKS, ids=lambda c: c.__name__)
def test_parallel_equals_one_gpu(check, W):
    rows = _run(W, lambda rank, comm: check(rank, W, comm))
    assert {r[1] for r in rows} == set(range(W))


def test_triton_kernels(monkeypatch):
    """The Triton path (routing kernel, the experts' kernels with the skipped ids past the local experts) under the
    interpreter: DeepSeek-V3 routing, EP all-reduce / fixed all-to-all and TP, and zero experts on EP."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1 (set by conftest without CUDA)")
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    _run(2, lambda rank, comm: sc.check_every_spec(rank, 2, comm, specs=["deepseek_v3"],
                                                   modes=["ep", "ep_a2a_fixed", "tp"]))
    _run(2, lambda rank, comm: sc.check_every_spec(rank, 2, comm, specs=["zero_experts"], modes=["ep"]))


def test_emulate_reports_a_failing_rank():
    def fn(rank, comm):
        if rank == 1:
            raise RuntimeError("rank 1 broke")
        import torch

        return comm.all_reduce_(torch.ones(2))

    with pytest.raises(RuntimeError, match="rank 1 broke"):
        par.emulate(2, fn, timeout=10)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_routes_record_replay(monkeypatch, backend):
    """Routing record / replay on the parallel path (``scenarios_routes.check_routes_op``: EP all-reduce, EP
    all-to-all, TP at W = 2): the record equals the one-GPU op's, replay gives the recorded output and the oracle's
    replay of other global ids. "triton": the routing kernel writing / reading the ids (interpreter)."""
    import scenarios_routes as sr

    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1 (set by conftest without CUDA)")
        monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    rows = _run(2, lambda rank, comm: sr.check_routes_op(rank, 2, comm))
    assert len(rows) == 2 * 3 * 3 * 6  # ranks x specs x modes x rows
