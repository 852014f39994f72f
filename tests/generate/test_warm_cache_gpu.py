"""Warm starts on the GPU (generate/warm_cache.py, warm_triton.py): a fresh process with EMPTY Inductor and Triton
caches loads what another process saved, and compiles nothing: every Inductor graph is a cache hit (its Triton kernels
come bundled in the artifacts), every moecomp kernel it runs was restored into its Triton cache before ``optimize``
ran it, the step is captured and replays, the tokens are the first process's, and its warm-up takes less time than
the cold one's (a relative check: no figure)."""

from __future__ import annotations

import pytest

from .test_warm_cache import _child

pytestmark = pytest.mark.gpu


def test_warm_start_from_artifacts_alone(tmp_path):
    warm = str(tmp_path / "warm")
    env = dict(MOECOMP_WARM_CACHE="1", MOECOMP_CACHE_DIR=warm)  # (optimize restores moecomp's Triton kernels first)
    a = _child("warmup", str(tmp_path / "inductor-a"), warm, device="cuda", **env)
    ca = a["warmup"]["2"]["cache"]
    assert ca["load"] == "miss" and ca["save"] == "saved" and a["graphs"] == "replayed", (ca, a["graphs"])
    assert a["kernels"] and ca["triton_save"]["packed"] == len(a["kernels"]), (a["kernels"], ca)
    b = _child("warmup", str(tmp_path / "inductor-b"), warm, device="cuda", **env)
    # every moecomp kernel the second process ran was restored into its (empty) Triton cache before optimize ran it
    assert b["kernels"] and set(b["kernels"]) <= set(b["restored"][warm]["restored_dirs"]), (b["kernels"],
                                                                                          b["restored"])
    cb = b["warmup"]["2"]["cache"]
    assert cb["load"] == "hit" and cb["loaded_bytes"] == ca["saved_bytes"] and b["graphs"] == "replayed", cb
    ind_a, ind_b = a["counters"]["inductor"], b["counters"]["inductor"]
    assert ind_a.get("fxgraph_cache_miss", 0) > 0 and ind_b.get("fxgraph_cache_hit") == ind_a["fxgraph_cache_miss"] \
        and not ind_b.get("fxgraph_cache_miss"), (ind_a, ind_b)
    assert b["tokens"] == a["tokens"] and b["warnings"] == []
    assert b["warmup"]["2"]["seconds"] < a["warmup"]["2"]["seconds"], (a["warmup"], b["warmup"], ind_a, ind_b)
