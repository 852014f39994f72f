"""The parallel paths on real process groups: W = 2 and W = 4 gloo processes on 127.0.0.1 (``gloo_run.py``), each
running every check of ``scenarios.py`` once (one spawn per world size: process start-up is most of the time), and
bad groups (world size or rank not the spec's, a group without this rank) refused with a ValueError. Every rank's
output equals the one-GPU oracle within fp32 tolerance."""

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


@pytest.mark.parametrize("W", [2, 4])
def test_gloo_world(W):
    got = gloo_run.run_world(W, ("all", "bad_groups"), timeout=120)
    rows = got["all"]
    assert {r[1] for r in rows} == set(range(W)) and not sc.failures(rows), sc.failures(rows)
    names = {r[0] for r in rows}
    for must in ("deepseek_v3/ep_a2a", "qwen3/tp", "mixtral/ep_a2a_fixed", "mixtral/capacity 2 drops",
                 "deepseek_v3/own tokens T=0", "mixtral/ep all to one rank", "fp8_block/tp", "int4/ep"):
        assert any(n.startswith(must) for n in names), must
    assert len(got["bad_groups"]) == W
