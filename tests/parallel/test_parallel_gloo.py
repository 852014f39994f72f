"""The parallel paths on real process groups: W = 2 and W = 4 gloo processes on 127.0.0.1 (``gloo_run.py``). One
spawn per world size runs every job (process start-up is most of the time): every check of ``scenarios.py`` (each
rank's output equal to the one-GPU oracle within fp32 tolerance), and at W = 2 also bad groups (world size or rank
not the spec's, a group without this rank: ValueErrors), ``shard_experts`` on a plain PyTorch model and on tiny HF
models whose ``generate()`` gives the unsharded tokens on every rank, and routing record / replay on the parallel op and
on sharded tiny HF models (``scenarios_routes.py``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import gloo_run  # noqa: E402
import scenarios as sc  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
JOBS = {2: ("all", "bad_groups", "plain_model", "hf_generate", "routes_op", "routes_model"), 4: ("all",)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda W: f"W{W}")
def world(request):
    W = request.param
    return W, gloo_run.run_world(W, JOBS[W], timeout=240)


def _ok(rows, W):
    assert {r[1] for r in rows} == set(range(W)) and not sc.failures(rows), sc.failures(rows)


def test_op_paths(world):
    W, got = world
    rows = got["all"]
    _ok(rows, W)
    names = {r[0] for r in rows}
    for must in ("deepseek_v3/ep_a2a", "qwen3/tp", "mixtral/ep_a2a_fixed", "mixtral/capacity 2 drops",
                 "deepseek_v3/own tokens T=0", "mixtral/ep all to one rank", "fp8_block/tp", "int4/ep", "latent/tp"):
        assert any(n.startswith(must) for n in names), must


def test_bad_groups(world):
    W, got = world
    if W != 2:
        pytest.skip("run at W = 2")
    assert len(got["bad_groups"]) == W


def test_shard_experts(world):
    W, got = world
    if W != 2:
        pytest.skip("run at W = 2")
    for job in ("plain_model", "hf_generate"):
        _ok(got[job], W)
    assert {r[0] for r in got["hf_generate"]} == {f"hf {m} generate{e}" for m in ("qwen3_moe/ep", "deepseek_v3/tp")
                                                  for e in ("", " engine")}


def test_routes_record_replay(world):
    """Record / replay on the parallel op (EP all-reduce, EP all-to-all, TP; also through the custom ops) and on tiny
    HF models sharded by shard_experts (Qwen3-MoE EP, DeepSeek-V3 TP): record equals the unsharded record, replay of
    the recorded routes gives the unsharded logits, replay of other routes the unsharded replay of them."""
    W, got = world
    if W != 2:
        pytest.skip("run at W = 2")
    _ok(got["routes_op"], W)
    assert len(got["routes_op"]) == W * 3 * 3 * 9  # ranks x specs x modes x rows (6 + 3 through the ops)
    _ok(got["routes_model"], W)
    assert {r[0] for r in got["routes_model"]} == {f"routes hf {m} {c}" for m in ("qwen3_moe/ep", "deepseek_v3/tp")
                                                   for c in ("record ids", "record logits", "replay recorded",
                                                             "replay other", "generate routes", "generate tokens",
                                                             "generate in engine")}


def test_one_rank_raising_ends_the_run_fast():
    """Rank 1 raises (a wrong input) while rank 0 waits in the op's all-reduce: the run fails with rank 1's
    ValueError well before the collective timeout (240 s), the waiting rank terminated."""
    import time

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1, job one_rank_raises:(.|\n)*must be hidden_size"):
        gloo_run.run_world(2, ("one_rank_raises",), timeout=240)
    assert time.monotonic() - t0 < 60
