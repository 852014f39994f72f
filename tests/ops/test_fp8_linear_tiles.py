"""MOECOMP_FP8_LINEAR_TILES (``tuning.fp8_linear_config``; benchmarks/diag_fp8_linear.py's sweep) sets the dense FP8
linear's tiles for every call, and the op still computes its format with them (interpreter, fp32, against the
dequantized reference with activation quantization counted: 1e-5, as test_fp8_op.py's fp32 bound)."""

import torch

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.ops import tuning
from moecomp.core.spec import QuantSpec
from moecomp.testing import rel_err


def test_override_and_result(monkeypatch, poison):
    cpu = torch.device("cpu")
    assert tuning.fp8_linear_config(512, 256, 256, cpu, 1)["BLOCK_M"] == 16  # the interpreter's default
    monkeypatch.setenv("MOECOMP_FP8_LINEAR_TILES", "32,64,1,4,1")
    assert tuning.fp8_linear_config(512, 256, 256, cpu, 1) == dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1,
                                                                   num_warps=4, num_stages=1)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    q = QuantSpec()
    g = torch.Generator().manual_seed(0)
    w, ws = q8.quantize(torch.randn(192, 256, generator=g) * 0.02, q)
    x = torch.randn(40, 256, generator=g)
    y = torch.ops.moecomp.fp8_linear(x, w, ws, None, None, q.key)
    assert torch.isfinite(y).all() and rel_err(y, reference.quantized_linear(x, w, ws, q)) < 1e-5
