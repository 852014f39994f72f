"""Launches per decoder layer in the generate benchmarks' ``--profile`` (``benchmarks/gen_profile.py``, issue 41): the
layer count read from the model, the two per-layer figures from a profile's kernels per step, and the table rows."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _gen_profile():
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module("gen_profile")


def test_per_layer_figures():
    """12 layers: 19 kernels each (one name 2x a layer), 5 of the step's own (3 names, one run twice a step)."""
    gp = _gen_profile()
    counts = {"skinny_kernel": 48.0, "route_topk_kernel": 12.0, "triton_poi_fused_add_0": 12.0,
              "moe_gemv1_kernel": 12.0, **{f"triton_red_{i}": 12.0 for i in range(12)},
              "embedding": 1.0, "lm_head_gemv": 2.0, "sample": 2.0}
    step = sum(counts.values())
    assert step == 12 * 19 + 5
    got = gp.per_layer(step, counts, 12)
    assert got == dict(decoder_layers=12, kernels_per_layer=step / 12, kernels_per_layer_repeated=19.0)
    assert gp.per_layer(step, counts, None) == dict(decoder_layers=None, kernels_per_layer=None,
                                                   kernels_per_layer_repeated=None)


def test_decoder_layers_and_table():
    pytest.importorskip("transformers")
    from generate.models import build

    gp = _gen_profile()
    model = build("qwen3_moe", layers=3)
    assert gp.decoder_layers(model) == 3
    rows = gp.profile_table([dict(model="qwen3", batch=1, path="one_liner", kernels_per_step=233.0,
                                  decoder_layers=12, kernels_per_layer=233 / 12, kernels_per_layer_repeated=19.0,
                                  gpu_busy_ms_per_step=0.5, wall_ms_per_step=0.9),
                             dict(model="gpt-oss", dtype="mxfp4", batch=8, kernels_per_step=10.0, decoder_layers=None,
                                  kernels_per_layer=None, kernels_per_layer_repeated=None, gpu_busy_ms_per_step=1.0,
                                  wall_ms_per_step=2.0)])
    assert rows[1].startswith("| model | weights | B | path | kernels / step | decoder layers | kernels / layer |")
    assert rows[3] == "| qwen3 | - | 1 | one_liner | 233.0 | 12 | 19.42 | 19.00 | 0.500 | 0.900 |"
    assert rows[4] == "| gpt-oss | mxfp4 | 8 | - | 10.0 | - | - | - | 1.000 | 2.000 |"
    assert gp.profile_table([]) == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without CUDA")
def test_diag_fused_decode_refuses_without_cuda_and_renders(capsys):
    """benchmarks/diag_fused_decode.py imports, refuses to run without a GPU, and its table renders every part."""
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    diag = importlib.import_module("diag_fused_decode")
    assert diag.main(["--parts", "norm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    rows = [dict(part="qkv", model="qwen3", weights="fp8", rows=2, unfused_us=9.0, fused_us=4.5, ratio=0.5,
                 rel_diff=1e-3),
            dict(part="attention", model="qwen3 n=576", weights="bf16 S=10", rows=1, unfused_us=8.0, fused_us=6.0,
                 ratio=0.75, rel_diff=0.0)]
    text = diag.table(rows).splitlines()
    assert text[2] == "| qkv | qwen3 | fp8 | 2 | 9.00 | 4.50 | 0.50 | rel diff 1.0e-03 |"
    assert text[3] == "| attention | qwen3 n=576 | bf16 S=10 | 1 | 8.00 | 6.00 | 0.75 | rel diff 0.0e+00 |"
