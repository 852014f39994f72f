"""GPU tests of the Gluon FP8 gemm2 (``kernels/gluon_fp8.py``, opt-in ``MOECOMP_FP8_GLUON=1``; H100/H200 class,
skipped without CUDA): the op with the TMA fp8 config (``test_fp8_tma_gpu.tma_config``) and the env on, the Gluon
launcher counted (a fall-back fails the test, its reason shown), outputs poisoned first (``poison_cache``) and
checked finite, against ``moecomp.oracle.reference`` with the quantized spec (tolerance 2e-2 as every bf16 FP8 test:
the format adds e4m3's 2^-4 relative rounding of h's codes per element, averaged over I; h and y are bf16) and
against the TMA Triton gemm2 on the same call (5e-3: the same codes and scales; the tensor cores' order of sums and
the promotion order differ). Sizes: Qwen3-30B-A3B (E 128, H 2048, I 768) at T = 1024 / 8192, DeepSeek-V3 (I 2048,
ue8m0-free fp32 blocks) at T = 1024, Qwen1.5-MoE (I 1408: 11 K steps, the odd tail), and ragged expert loads (a
few experts take most tokens, many none). CPU checks of the compiled kernel: tests/kernels/test_gluon_fp8_compile.py."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_fp8_gluon, triton_fp8_tma
from moecomp.testing import MOE_ARGS, count_calls
from test_fp8_gpu import TOL, quantized_args, quantized_spec  # (tests/ops is on sys.path)
from test_fp8_tma_gpu import tma_config
from test_gpu import poison_cache, rel_err

pytestmark = pytest.mark.gpu


def _run(args, scales, spec, monkeypatch, cfg, gluon: bool):
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(cfg))
    monkeypatch.setenv("MOECOMP_FP8_GLUON", "1" if gluon else "0")
    poison_cache()
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{spec.describe()}: non-finite (unwritten) output"
    return out


CASES = {  # name: (preset, T, BLOCK_M, gemm1 BLOCK_N (128: h quantized in gemm1's epilogue), ragged)
    "qwen3-1024": ("qwen3_30b_a3b", 1024, 128, 64, False),
    "qwen3-8192-q_out": ("qwen3_30b_a3b", 8192, 128, 128, False),
    "qwen3-1024-bm64-ragged": ("qwen3_30b_a3b", 1024, 64, 64, True),
    "qwen15-600-bm64": ("qwen15_moe_a27b", 600, 64, 64, False),
    "deepseek-1024": ("deepseek_v3", 1024, 128, 128, False),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.bigmem] if c.startswith("deepseek") else [])
                                  for c in sorted(CASES)])
def test_fp8_gluon_gemm2(case, monkeypatch):
    name, T, bm, bn, ragged = CASES[case]
    for var in ("MOECOMP_FP8_MODE", "MOECOMP_FP8_PREQUANT", "MOECOMP_DECODE_MAX_T"):
        monkeypatch.delenv(var, raising=False)
    spec = quantized_spec(name)
    args, scales = quantized_args(spec, T, seed=T + 3)
    if ragged:  # router rows of the first eighth of the experts scaled up: they take most tokens, many get none
        args = list(args)
        i = 1 + MOE_ARGS.index("router_w")  # (x first)
        w = args[i].clone()
        w[: spec.num_experts // 8] *= 4.0
        args[i] = w
        args = tuple(args)
    cfg = tma_config(bm, bn, True, 4 * (bm // 64))
    triton_fp8_gluon.FALLBACKS.clear()
    calls = count_calls(monkeypatch, triton_fp8_gluon, ("gemm2",))
    tma_calls = count_calls(monkeypatch, triton_fp8_tma, ("gemm2",))
    out = _run(args, scales, spec, monkeypatch, cfg, gluon=True)
    assert calls == ["gemm2"] and tma_calls == ["gemm2"], (calls, triton_fp8_gluon.fallbacks())
    assert not triton_fp8_gluon.fallbacks()
    tma = _run(args, scales, spec, monkeypatch, cfg, gluon=False)
    assert calls == ["gemm2"] and tma_calls == ["gemm2", "gemm2"]  # the second call ran the Triton TMA gemm2
    ref = reference.moe_forward(*args, spec, **scales)
    errs = dict(ref=rel_err(out, ref), tma=rel_err(out, tma), tma_ref=rel_err(tma, ref))
    print(f"{case}: {errs}")
    assert errs["ref"] < TOL and errs["tma"] < 5e-3, f"{case}: {errs}"


def test_fp8_gluon_fallback_counted(monkeypatch):
    """A call the Gluon gemm2 does not take (per-channel weight scales) runs the TMA kernel, the reason counted."""
    import dataclasses

    from test_fp8_gpu import Q

    monkeypatch.delenv("MOECOMP_FP8_MODE", raising=False)
    spec = quantized_spec("qwen3_30b_a3b", dataclasses.replace(Q, scale="channel"))
    args, scales = quantized_args(spec, 512, seed=4)
    triton_fp8_gluon.FALLBACKS.clear()
    calls = count_calls(monkeypatch, triton_fp8_gluon, ("gemm2",))
    out = _run(args, scales, spec, monkeypatch, tma_config(128, 64, True), gluon=True)
    assert calls == [] and sum(triton_fp8_gluon.fallbacks().values()) == 1, triton_fp8_gluon.fallbacks()
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL
