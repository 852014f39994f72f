"""GPU tests of the Gluon FP8 GEMMs (``kernels/gluon_fp8.py`` gemm2, ``kernels/gluon_fp8_gemm1.py`` gemm1; opt-in
``MOECOMP_FP8_GLUON=1``; H100/H200 class, skipped without CUDA).

The op (``test_fp8_gluon_op``): the TMA fp8 config (``test_fp8_tma_gpu.tma_config``) and the env on, both Gluon
launchers counted (a fall-back fails the test, its reason shown), outputs poisoned first (``poison_cache``) and
checked finite, against ``moecomp.oracle.reference`` with the quantized spec (tolerance 2e-2 as every bf16 FP8 test:
the format adds e4m3's 2^-4 relative rounding of h's codes per element, averaged over I; h and y are bf16) and
against the Triton TMA GEMMs on the same call (5e-3: the same codes and scales; the tensor cores' order of sums and
the promotion order differ). Sizes: Qwen3-30B-A3B (E 128, H 2048, I 768) at T = 1024 / 8192, DeepSeek-V3 (I 2048,
fp32 blocks) at T = 1024, Qwen1.5-MoE (I 1408: 11 K steps of gemm2, the odd tail), and ragged expert loads (a few
experts take most tokens, many none).

gemm1 alone (``test_fp8_gluon_gemm1``, ``testing.gluon_gemm1_case``): h of the Gluon gemm1 against the dequantized
reference (h in bf16: 1e-2, bf16's 2^-9 rounding plus x's e4m3 codes, which the reference rounds the same way up to
one code where x * (1 / s) and x / s differ; h quantized (Q_OUT): 4e-2, e4m3's 2^-4 relative rounding) and against
the Triton TMA fp8 gemm1 on the same call (5e-3 bf16, 1e-2 quantized: a code flips where accumulation orders put h
on the other side of a rounding boundary), only the rows that hold a pair compared, every one of them finite.
CPU checks of the compiled kernels: tests/kernels/test_gluon_fp8_compile.py, test_gluon_fp8_gemm1_compile.py."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_fp8_gluon, triton_fp8_tma
from moecomp.testing import MOE_ARGS, count_calls
from moecomp.testing import gluon_gemm1_case as g1
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
def test_fp8_gluon_op(case, monkeypatch):
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
    calls = count_calls(monkeypatch, triton_fp8_gluon, ("gemm1", "gemm2"))
    tma_calls = count_calls(monkeypatch, triton_fp8_tma, ("gemm1", "gemm2"))
    out = _run(args, scales, spec, monkeypatch, cfg, gluon=True)
    assert calls == ["gemm1", "gemm2"] and tma_calls == ["gemm1", "gemm2"], (calls, triton_fp8_gluon.fallbacks())
    assert not triton_fp8_gluon.fallbacks()
    tma = _run(args, scales, spec, monkeypatch, cfg, gluon=False)
    assert calls == ["gemm1", "gemm2"] and tma_calls == ["gemm1", "gemm2"] * 2  # the second ran the Triton GEMMs
    ref = reference.moe_forward(*args, spec, **scales)
    errs = dict(ref=rel_err(out, ref), tma=rel_err(out, tma), tma_ref=rel_err(tma, ref))
    print(f"{case}: {errs}")
    assert errs["ref"] < TOL and errs["tma"] < 5e-3, f"{case}: {errs}"


def test_fp8_gluon_fallback_counted(monkeypatch):
    """A call the Gluon GEMMs do not take (per-channel weight scales) runs the TMA kernels, each reason counted."""
    import dataclasses

    from test_fp8_gpu import Q

    monkeypatch.delenv("MOECOMP_FP8_MODE", raising=False)
    spec = quantized_spec("qwen3_30b_a3b", dataclasses.replace(Q, scale="channel"))
    args, scales = quantized_args(spec, 512, seed=4)
    triton_fp8_gluon.FALLBACKS.clear()
    calls = count_calls(monkeypatch, triton_fp8_gluon, ("gemm1", "gemm2"))
    out = _run(args, scales, spec, monkeypatch, tma_config(128, 64, True), gluon=True)
    fb = triton_fp8_gluon.fallbacks()
    assert calls == [] and sorted(k.split(":")[0] for k in fb) == ["gemm1", "gemm2"], fb
    assert sum(fb.values()) == 2, fb
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL


def _counts(E: int, P: int, seed: int, ragged: bool) -> list[int]:
    """P pairs over E experts: uniform, or ragged (an eighth of the experts four times as likely, then every expert
    past the first half left empty)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(E)
    if ragged:
        p[: max(1, E // 8)] = 4.0
        p[E // 2:] = 0.0
    return torch.bincount(torch.multinomial(p, P, replacement=True, generator=g), minlength=E).tolist()


GEMM1_CASES = {  # name: (E, H, I, pairs, BLOCK_M, ragged, dict(act, bias, w_on_input, h_quant))
    "qwen3-bm64-q_out": (32, 2048, 768, 4096, 64, False, dict(h_quant=True)),
    "qwen3-bm64": (32, 2048, 768, 4096, 64, False, {}),
    "qwen3-bm128-ragged": (32, 2048, 768, 4096, 128, True, {}),
    "qwen15-bm64-q_out-ragged": (60, 2048, 1408, 2400, 64, True, dict(h_quant=True)),
    "deepseek-bm128": (16, 7168, 2048, 2048, 128, False, {}),
    "deepseek-bm64-q_out": (16, 7168, 2048, 2048, 64, False, dict(h_quant=True)),
    "gelu-bias-bm64": (4, 256, 256, 300, 64, False, dict(act="gelu", bias=True)),
    "gelu_tanh-w_on_input-bm128": (4, 384, 256, 300, 128, False, dict(act="gelu_tanh", w_on_input=True)),
    "relu2-bias-bm64-q_out": (4, 256, 384, 300, 64, True, dict(act="relu2", bias=True, h_quant=True)),
    "relu-bm128": (4, 256, 128, 5, 128, False, dict(act="relu")),
}


@pytest.mark.parametrize("case", sorted(GEMM1_CASES))
def test_fp8_gluon_gemm1(case, monkeypatch):
    E, H, I, P, bm, ragged, kw = GEMM1_CASES[case]
    c = g1.make_case1(E, H, I, _counts(E, P, P + E, ragged), bm, seed=P, **kw)
    rows = g1.valid_rows(c)
    triton_fp8_gluon.FALLBACKS.clear()
    calls = count_calls(monkeypatch, triton_fp8_gluon, ("gemm1",))
    poison_cache()
    out = g1.run1(c, gluon=True)
    torch.cuda.synchronize()
    assert calls == ["gemm1"] and not triton_fp8_gluon.fallbacks(), triton_fp8_gluon.fallbacks()
    quant = kw.get("h_quant", False) and bm == 64
    assert hasattr(out, "s") == quant, f"{case}: Q_OUT expected {quant}"
    h = g1.dense_h(out)[rows]
    assert torch.isfinite(h).all(), f"{case}: non-finite (unwritten) rows of h"
    poison_cache()
    tma = g1.dense_h(g1.run1(c, gluon=False, bn=128 if quant else 64))[rows]
    ref = g1.reference1(c)[rows]
    errs = dict(ref=rel_err(h, ref), tma=rel_err(h, tma), tma_ref=rel_err(tma, ref))
    print(f"{case}: rows {rows.numel()}, {errs}")
    assert errs["ref"] < (4e-2 if quant else 1e-2) and errs["tma"] < (1e-2 if quant else 5e-3), f"{case}: {errs}"
    if quant:  # the group scales: the same h up to accumulation order
        s_t = g1.run1(c, gluon=False, bn=128).s[rows]
        assert rel_err(out.s[rows], s_t) < 1e-3, f"{case}: group scales differ"
