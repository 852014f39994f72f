"""The FP8 speed candidates (docs/FP8.md, "Speed candidates"), off by default, under the interpreter (CPU):

* "prequant" (config key ``fp8_prequant`` / MOECOMP_FP8_PREQUANT=1): dynamic w8a8 with activations quantized once
  (``quant_act_kernel``: x before gemm1; h before gemm2, or in gemm1's Q_OUT epilogue when its BLOCK_N covers whole
  128-column groups) and the GEMMs reading e4m3 A tiles with per-row group scales (A_QUANT 3). Same codes, same
  scales, same per-step dots and sums as the in-kernel quantization, so the outputs are BIT-IDENTICAL to the current
  w8a8 path (fp32 and fp16 here): aligned (h quantized by the kernel, padding rows skipped, and by the epilogue),
  DIRECT, the fused down-combine, BLOCK_K 64 (two K steps per group), ungated, ue8m0, the dense fp8_linear.
  ``quant_act_kernel`` equals ``quant.quantize_act`` bit for bit.
* "fold" (``fp8_fold`` / MOECOMP_FP8_FOLD=1, or 2 with the operands swapped: acc^T = (q_w s_w)^T x^T): w8a16
  with block scales, each K step's scale folded into the weight tile (q_w * s_w rounded once to x's dtype) and the
  dots accumulated in one chain. Against the weight-only
  reference (fp32 weights q_w * s_w): fp32 3e-5 (the product is exact in fp32 but for its one rounding, as in the
  reference); fp16 2e-3 (h and the outputs are stored in fp16 as before, plus the scaled weights' fp16 rounding,
  2^-11 relative each: measured ~4e-4 here).
* The switches: defaults off (the kernel arguments exactly as before), env over config key ("0" turns a key off),
  read at call time by the op.
"""

import dataclasses
import importlib

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.ops import triton_fp8, triton_moe, tuning
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.testing import quantize_moe_args, random_moe_args

from test_fp8_gemm import run_routed  # (tests/kernels is on sys.path: no package)

TOL = {torch.float32: 3e-5, torch.float16: 2e-3}
G1 = dict(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=1)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("MOECOMP_FP8_MODE", "MOECOMP_FP8_PREQUANT", "MOECOMP_FP8_FOLD", "MOECOMP_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32)
    return ids, torch.rand(T, k, generator=g)


def run(spec, T, dtype, path, cfg, seed=0):
    """``test_fp8_gemm.run_routed``: (output [T, H], gemm1's and gemm2's q kwargs, the tensors, h)."""
    return run_routed(spec, T, dtype, path, cfg, seed)


def _spec(H, I, gated=True, **quant):
    return MoESpec(num_experts=5, top_k=2, hidden_size=H, intermediate_size=I, gated=gated,
                   activation="silu" if gated else "relu", quant=QuantSpec(**quant))


# ------------------------------------------------------------------------------------------------ the quant kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_act_equals_quant_quantize_act(poison, dtype):
    g = torch.Generator().manual_seed(1)
    M, K = 37, 300  # 3 groups, the last one partial; more rows than one program
    x = (torch.randn(M, K, generator=g) * torch.logspace(-4, 3, M)[:, None]).to(dtype)
    x[2] = 0  # an all-zero row: the scale is 1e-10 / 448
    qa = triton_fp8.quantize_act(x)
    want_q, want_s = q8.quantize_act(x, QuantSpec())
    assert qa.dtype == dtype and torch.equal(qa.s, want_s)
    assert torch.equal(qa.q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_act_skips_padding_rows(poison):
    """h in sorted order: rows past num_padded and rows of the sentinel are neither read nor written."""
    S, K, P = 48, 200, 7
    h = torch.randn(S, K)
    sorted_ids = torch.full((S,), P, dtype=torch.int32)
    sorted_ids[[0, 1, 2, 16, 17, 33]] = torch.tensor([3, 0, 6, 1, 2, 5], dtype=torch.int32)
    num_padded = torch.tensor([32], dtype=torch.int32)  # row 33 lies past it
    h[3] = float("nan")  # a padding row (unwritten h): never read
    qa = triton_fp8.quantize_act(h, (sorted_ids, torch.zeros(3, dtype=torch.int32), num_padded, 3), P)
    live = torch.tensor([0, 1, 2, 16, 17])
    want_q, want_s = q8.quantize_act(h[live], QuantSpec())
    assert torch.equal(qa.s[live], want_s) and torch.equal(qa.q[live].view(torch.uint8), want_q.view(torch.uint8))
    dead = torch.tensor([r for r in range(S) if r not in live.tolist()])
    assert qa.s[dead].isnan().all() and qa.q[dead].float().isnan().all()  # poisoned, left alone


# ------------------------------------------------------------------------------------------------ prequant
# name: (H, I, gated, QuantSpec fields, dtype, path, gemm1 BLOCK_N, whether gemm1 writes h quantized (Q_OUT))
PREQUANT = {
    "aligned-fp32-hkernel": (200, 72, True, {}, torch.float32, "aligned", 32, False),
    "aligned-fp32-qout-I200": (72, 200, True, {}, torch.float32, "aligned", 128, True),
    "aligned-fp16-bk64-qout": (200, 200, True, dict(block_n=32, block_k=64), torch.float16, "aligned", 128, True),
    "aligned-fp32-qout-bn256": (72, 300, True, {}, torch.float32, "aligned", 256, True),  # 2 groups a program
    "direct-fp16-ue8m0-qout": (200, 72, True, dict(scale_dtype="ue8m0"), torch.float16, "direct", 128, True),
    "direct-fp32-ungated-qout": (200, 72, False, {}, torch.float32, "direct", 128, True),
    "fused-fp32-hkernel": (200, 72, True, dict(block_n=64), torch.float32, "fused", 32, False),
}


@pytest.mark.parametrize("case", sorted(PREQUANT))
def test_prequant_bit_identical_to_w8a8(poison, case):
    H, I, gated, fields, dtype, path, bn, q_out = PREQUANT[case]
    spec = _spec(H, I, gated, **fields)
    T = 13 if path == "aligned" else 4
    base = dict(BLOCK_M=16, g1=dict(G1, BLOCK_N=bn), g2=dict(G1, BLOCK_N=64), fp8="w8a8")
    want, (q1, _), t, _ = run(spec, T, dtype, path, base, seed=len(case))
    got, (p1, p2), _, h = run(spec, T, dtype, path, dict(base, fp8_prequant=1), seed=len(case))
    assert (q1["A_QUANT"], p1["A_QUANT"], p2["A_QUANT"]) == (1, 3, 3) and p1["_h_quant"]
    assert isinstance(h, triton_fp8.QAct) == q_out  # gemm1 wrote h quantized (else gemm2 quantized it)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), f"{case}: {(got != want).sum().item()} elements differ"
    x, ids, w, named, scales = t
    ref = reference.experts(x, ids.long(), w, named["w13"], None, named["w2"], None, spec,
                            **{n: scales.get(n) for n in ("w13_scale", "w2_scale")})
    assert rel_err(got, ref) < TOL[dtype]


def test_prequant_fp8_linear_bit_identical(monkeypatch):
    """The dense fp8_linear (shared experts, other FP8Linear) with MOECOMP_FP8_PREQUANT=1: x quantized once, same
    bits as the in-kernel quantization; and MOECOMP_FP8_FOLD=1 within the weight-only tolerance."""
    op_mod = importlib.import_module("moecomp.ops.fp8_linear")
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")
    calls = []
    real = triton_fp8.quantize_act
    monkeypatch.setattr(triton_fp8, "quantize_act", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    g = torch.Generator().manual_seed(5)
    q = QuantSpec(block_n=32, block_k=64)
    wq, ws = q8.quantize(torch.randn(72, 300, generator=g) * 0.1, q)
    x = torch.randn(19, 300, generator=g)
    want = torch.ops.moecomp.fp8_linear(x, wq, ws, None, None, q.key)
    monkeypatch.setenv("MOECOMP_FP8_PREQUANT", "1")
    got = torch.ops.moecomp.fp8_linear(x, wq, ws, None, None, q.key)
    assert calls and torch.equal(got, want)
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a16")
    monkeypatch.setenv("MOECOMP_FP8_FOLD", "1")
    y = torch.ops.moecomp.fp8_linear(x.half(), wq, ws, None, None, q.key)
    ref = op_mod.torch_fp8_linear(x.half().float(), wq, ws, None, None, dataclasses.replace(q, activation="none"))
    assert rel_err(y, ref) < TOL[torch.float16]


# ------------------------------------------------------------------------------------------------ fold
# name: (H, I, QuantSpec fields, dtype, path, FOLD: 1 folded, 2 folded with the operands swapped)
FOLD = {
    "aligned-fp32-block32": (200, 72, dict(block_n=32), torch.float32, "aligned", 1),
    "aligned-fp32-block32-swap": (200, 72, dict(block_n=32), torch.float32, "aligned", 2),
    "aligned-fp16-block32x64-swap": (200, 300, dict(block_n=32, block_k=64), torch.float16, "aligned", 2),
    "direct-fp16-ue8m0": (200, 72, dict(scale_dtype="ue8m0"), torch.float16, "direct", 1),
    "direct-fp16-swap": (72, 200, {}, torch.float16, "direct", 2),
    "fused-fp32-swap": (72, 200, {}, torch.float32, "fused", 2),
}


@pytest.mark.parametrize("case", sorted(FOLD))
def test_fold_matches_weight_only_reference(poison, case):
    H, I, fields, dtype, path, fold = FOLD[case]
    spec = _spec(H, I, **fields)
    T = 13 if path == "aligned" else 4
    cfg = dict(BLOCK_M=16, g1=G1, g2=dict(G1, BLOCK_N=64), fp8="w8a16", fp8_fold=fold)
    out, (q1, q2), (x, ids, w, named, scales), _ = run(spec, T, dtype, path, cfg, seed=len(case))
    assert q1.get("FOLD") == q2.get("FOLD") == fold and q1["A_QUANT"] == 0
    wo = spec.replace(quant=QuantSpec(**fields, activation="none"))
    ref = reference.experts(x, ids.long(), w, named["w13"], None, named["w2"], None, wo,
                            **{n: scales.get(n) for n in ("w13_scale", "w2_scale")})
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype], f"{case}: rel err {rel_err(out, ref):.2e}"


# ------------------------------------------------------------------------------------------------ the switches
def test_candidates_off_by_default_and_env_over_config(monkeypatch):
    qs, s = QuantSpec(), torch.ones(5, 2, 2)
    before = triton_fp8.quant_kwargs(qs, s, None, "w8a8")
    assert tuning.fp8_candidates({}) == {"prequant": 0, "fold": 0}
    assert triton_fp8.quant_kwargs(qs, s, None, "w8a8", cand=tuning.fp8_candidates({})) == before
    assert set(triton_fp8.quant_kwargs(qs, s, None, "w8a16", cand=tuning.fp8_candidates(None))) == set(before)
    assert tuning.fp8_candidates({"fp8_prequant": 1, "fp8_fold": 2}) == {"prequant": 1, "fold": 2}
    monkeypatch.setenv("MOECOMP_FP8_PREQUANT", "0")
    monkeypatch.setenv("MOECOMP_FP8_FOLD", "1")
    assert tuning.fp8_candidates({"fp8_prequant": 1, "fp8_fold": 2}) == {"prequant": 0, "fold": 1}
    # fold touches only w8a16 over block scales; prequant only dynamic w8a8
    assert "FOLD" not in triton_fp8.quant_kwargs(QuantSpec(scale="channel"), s, None, "w8a16",
                                                 cand={"fold": True})
    st = triton_fp8.quant_kwargs(QuantSpec(activation="static"), s, torch.ones(5), "w8a8", cand={"prequant": True})
    assert st["A_QUANT"] == 2
    monkeypatch.setenv("MOECOMP_FP8_FOLD", "yes")
    with pytest.raises(ValueError, match="MOECOMP_FP8_FOLD"):
        tuning.fp8_candidates()
    monkeypatch.setenv("MOECOMP_FP8_FOLD", "2")
    monkeypatch.setenv("MOECOMP_FP8_PREQUANT", "2")
    with pytest.raises(ValueError, match="MOECOMP_FP8_PREQUANT"):
        tuning.fp8_candidates()


def test_op_reads_the_env_var_per_call(poison, monkeypatch):
    """torch.ops.moecomp.moe_forward (Triton CPU backend, w8a8 forced, aligned path): MOECOMP_FP8_PREQUANT set
    between two calls takes effect on the second (quantize_act launched: x, and h at gemm1's BLOCK_N 32), same
    bits. "0" turns off the heuristic's prequant."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")
    monkeypatch.setenv("MOECOMP_DECODE_MAX_T", "0")
    calls = []
    real = triton_fp8.quantize_act
    monkeypatch.setattr(triton_fp8, "quantize_act", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=200, intermediate_size=72, quant=QuantSpec())
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 9, torch.float32, seed=3))
    monkeypatch.setenv("MOECOMP_FP8_PREQUANT", "0")
    want = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert not calls
    monkeypatch.setenv("MOECOMP_FP8_PREQUANT", "1")
    got = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert len(calls) == 2 and torch.equal(got, want)
