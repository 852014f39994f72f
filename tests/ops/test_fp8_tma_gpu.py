"""GPU tests of the FP8 TMA GEMMs (``kernels/grouped_gemm_tma_fp8.py``; H200 class, skipped without CUDA) at real
layer sizes: configs that ask for them (``"tma": 1``, w8a8 + prequant), the launchers counted (a silent fall-back to
the pointer kernels fails), against ``moecomp.oracle.reference`` with the quantized spec (activation quantization counted;
tolerance 2e-2 as every bf16 FP8 test: h and y are bf16) and against the pointer kernels on the same call (5e-3:
the same codes and scales, the tensor cores' order of sums differs); CUDA-graph capture and replay with new inputs;
no host sync in a call. CPU tests: tests/kernels/test_grouped_gemm_tma_fp8.py."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_fp8_tma
from moecomp.testing import capture_moe_forward, check_replays, count_calls
from test_fp8_gpu import TOL, Q, quantized_args, quantized_spec  # (tests/ops is on sys.path: the FP8 GPU tests)
from test_gpu import poison_cache, rel_err

pytestmark = pytest.mark.gpu


def tma_config(bm: int, g1_bn: int, tma_a: bool, nw: int = 8) -> dict:
    g1 = dict(BLOCK_N=g1_bn, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=3 if g1_bn == 128 else 4, tma=1,
              tma_a=int(tma_a))
    g2 = dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=4, tma=1)
    return dict(BLOCK_M=bm, fp8="w8a8", fp8_prequant=1, g1=g1, g2=g2, decode=dict(max_t=0))


POINTER = dict(BLOCK_M=64, fp8="w8a8", fp8_prequant=1, decode=dict(max_t=0),
               g1=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
               g2=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3))


@pytest.fixture
def fp8_tma_calls(monkeypatch):
    return count_calls(monkeypatch, triton_fp8_tma, ("gemm1", "gemm2"))


def _run(args, scales, spec, monkeypatch, cfg):
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(cfg))
    poison_cache()
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{spec.describe()}: non-finite (unwritten) output"
    return out


CASES = {  # name: (preset, T, BLOCK_M, gemm1 BLOCK_N (128: h quantized in its epilogue), A by TMA, warps)
    "qwen3-1024-a_tma": ("qwen3_30b_a3b", 1024, 128, 64, True, 8),
    "qwen3-8192-q_out": ("qwen3_30b_a3b", 8192, 128, 128, True, 8),
    "qwen3-300-bm64-a_ptr": ("qwen3_30b_a3b", 300, 64, 64, False, 4),
    "mixtral-1024-a_tma": ("mixtral_8x7b", 1024, 128, 64, True, 8),
    "qwen15-600-shared": ("qwen15_moe_a27b", 600, 64, 64, True, 4),
    "deepseek-1024-q_out": ("deepseek_v3", 1024, 128, 128, True, 8),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.bigmem] if c.startswith("deepseek") else [])
                                  for c in sorted(CASES)])
def test_fp8_tma_real_layer_sizes(case, monkeypatch, fp8_tma_calls):
    name, T, bm, bn, a_tma, nw = CASES[case]
    for var in ("MOECOMP_FP8_MODE", "MOECOMP_FP8_PREQUANT", "MOECOMP_DECODE_MAX_T"):
        monkeypatch.delenv(var, raising=False)
    spec = quantized_spec(name)
    args, scales = quantized_args(spec, T, seed=T + 7)
    out = _run(args, scales, spec, monkeypatch, tma_config(bm, bn, a_tma, nw))
    assert fp8_tma_calls == ["gemm1", "gemm2"]
    ref = reference.moe_forward(*args, spec, **scales)
    ptr = _run(args, scales, spec, monkeypatch, POINTER)
    assert fp8_tma_calls == ["gemm1", "gemm2"]  # the pointer config ran no TMA launch
    errs = dict(ref=rel_err(out, ref), pointer=rel_err(out, ptr), pointer_ref=rel_err(ptr, ref))
    print(f"{case}: {errs}")
    assert errs["ref"] < TOL and errs["pointer"] < 5e-3, f"{case}: {errs}"


@pytest.mark.parametrize("quant", ["ue8m0", "channel", "tensor"])
def test_fp8_tma_scale_layouts(quant, monkeypatch, fp8_tma_calls):
    """ue8m0 block scales (DeepSeek-V3.1 / V3.2 checkpoints), per-channel and per-tensor weight scales at Qwen3's
    size, T=1024."""
    import dataclasses

    monkeypatch.delenv("MOECOMP_FP8_MODE", raising=False)
    q = dataclasses.replace(Q, scale_dtype="ue8m0") if quant == "ue8m0" else dataclasses.replace(Q, scale=quant)
    spec = quantized_spec("qwen3_30b_a3b", q)
    args, scales = quantized_args(spec, 1024, seed=11)
    out = _run(args, scales, spec, monkeypatch, tma_config(128, 64, True))
    assert fp8_tma_calls == ["gemm1", "gemm2"]
    err = rel_err(out, reference.moe_forward(*args, spec, **scales))
    assert err < TOL, f"{quant}: {err:.2e}"


def test_fp8_tma_cuda_graph_and_no_host_sync(monkeypatch, fp8_tma_calls):
    """Captured in the caller's CUDA graph with a host sync on the captured path raising (Qwen1.5-MoE: its fp8 shared
    expert on the side stream) and replayed with new inputs (``testing.capture_moe_forward`` / ``check_replays``)."""
    monkeypatch.delenv("MOECOMP_FP8_MODE", raising=False)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(tma_config(64, 128, True, 4)))
    spec = quantized_spec("qwen15_moe_a27b")
    T = 700
    args, scales = quantized_args(spec, T, seed=5)
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, sync_check=True, extra=scales)
    inputs = [torch.randn(T, spec.hidden_size, generator=torch.Generator("cuda").manual_seed(seed), device="cuda")
              * 0.5 for seed in (1, 2)]
    check_replays(graph, static_x, static_out, inputs, lambda x: reference.moe_forward(x, *args[1:], spec, **scales),
                  TOL)
    assert set(fp8_tma_calls) == {"gemm1", "gemm2"}
