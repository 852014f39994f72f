"""The fallback for shapes / GPUs without a tuned entry (``moecomp/ops/tuning_nearest.py``): the nearest entry of any
shipped table by rows per expert, N and K; ``MOECOMP_TABLE=off / loo`` hide this GPU's table / the queried shape."""

import json

import pytest
import torch

from moecomp.ops import tuning, tuning_nearest


def _cfg(bm: int, k: int, tma: bool = False) -> dict:
    g = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=bm, top_k=k, g1=dict(g, **({"tma": True} if tma else {})), g2=dict(g))


@pytest.fixture
def tables(tmp_path, monkeypatch):
    monkeypatch.delenv("MOECOMP_TABLE", raising=False)
    tuning_nearest.all_tables.cache_clear()
    # GPU A: a Qwen3-like shape (E=128, k=8) at two buckets and a Mixtral-like one (E=8, k=2)
    a = {"E=128,N=768,K=2048,dtype=bfloat16": {"1": _cfg(16, 8), "8192": _cfg(128, 8, tma=True)},
         "E=8,N=14336,K=4096,dtype=bfloat16": {"16": _cfg(32, 2), "1024": _cfg(64, 2)},
         "E=8,N=14336,K=4096,dtype=fp8": {"16": dict(_cfg(16, 2), fp8="w8a16")}}
    b = {"E=128,N=768,K=2048,dtype=bfloat16": {"1": _cfg(48, 8)}}  # GPU B: the same shape, another answer
    (tmp_path / "GPU_A.json").write_text(json.dumps(a))
    (tmp_path / "GPU_B.json").write_text(json.dumps(b))
    (tmp_path / "GPU_A.meta.json").write_text(json.dumps({"not": "a table"}))  # sidecars are skipped
    yield str(tmp_path)
    tuning_nearest.all_tables.cache_clear()


def near(d, own, E, N, K, T, k, dt="bfloat16"):
    return tuning_nearest.nearest(d, own, E, N, K, T, k, dt, torch.device("cpu"))


def test_rows_per_expert_pick_the_bucket(tables):
    # E=160, k=6 at T=4096: 24576 pairs over 160 experts = 154 rows per expert -> the 8192 bucket of E=128, k=8
    # (65536 / 128 = 512 rows) is nearer than its T=1 bucket (1 row)
    assert near(tables, "GPU_A", 160, 768, 2048, 4096, 6)["BLOCK_M"] == 128
    assert near(tables, "GPU_A", 160, 768, 2048, 1, 6)["BLOCK_M"] == 16
    # a Mixtral-like query: N and K pick the E=8 shape, rows its bucket (T=700, k=2: 175 rows -> bucket 1024's 256)
    assert near(tables, "GPU_A", 8, 16384, 4096, 700, 2)["BLOCK_M"] == 64


def test_own_gpu_preferred_then_modes(tables, monkeypatch):
    assert near(tables, "GPU_A", 128, 768, 2048, 1, 8)["BLOCK_M"] == 16  # own entry (distance 0)
    assert near(tables, "GPU_B", 128, 768, 2048, 1, 8)["BLOCK_M"] == 48  # B's own
    monkeypatch.setenv("MOECOMP_TABLE", "off")  # A's table hidden: B's entry of the same shape
    assert near(tables, "GPU_A", 128, 768, 2048, 1, 8)["BLOCK_M"] == 48
    monkeypatch.setenv("MOECOMP_TABLE", "loo")  # A's table and the shape hidden everywhere: nothing is left
    assert near(tables, "GPU_A", 128, 768, 2048, 1, 8) is None
    assert near(tables, "GPU_B", 128, 768, 2048, 1, 8)["top_k"] == 2  # from B: A's other shape (E=8) is left
    monkeypatch.setenv("MOECOMP_TABLE", "bogus")
    with pytest.raises(ValueError, match="MOECOMP_TABLE"):
        near(tables, "GPU_A", 128, 768, 2048, 1, 8)


def test_dtype_must_match(tables):
    assert near(tables, "GPU_A", 8, 14336, 4096, 16, 2, "fp8")["fp8"] == "w8a16"
    assert near(tables, "GPU_A", 8, 14336, 4096, 16, 2, "mxfp4") is None  # no table of that dtype: the heuristic


def test_tma_dropped_below_sm90(tables, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    cfg = tuning_nearest._fit_device(_cfg(128, 8, tma=True), torch.device("cuda", 0))
    assert "tma" not in cfg["g1"] and cfg["g1"]["BLOCK_N"] == 64
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert tuning_nearest._fit_device(_cfg(128, 8, tma=True), torch.device("cuda", 0))["g1"]["tma"] is True


def test_shipped_tables_carry_top_k():
    """Every entry of the shipped tables says its top-k (the rows per expert above need it)."""
    tuning_nearest.all_tables.cache_clear()
    tabs = tuning_nearest.all_tables(str(tuning.CONFIG_DIR))
    assert tabs, "no shipped table"
    for gpu, table in tabs.items():
        for key, buckets in table.items():
            for b, cfg in buckets.items():
                assert isinstance(cfg.get("top_k"), int) and cfg["top_k"] >= 1, (gpu, key, b)
