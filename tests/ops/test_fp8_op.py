"""The quantized ops on the Triton path (MOECOMP_CPU_BACKEND=triton, the interpreter): ``moe_forward`` with
quantized routed and shared experts (FSE on and off; aligned and decode paths, launches counted) and
``moe_experts`` against ``moecomp.oracle.reference``; the mode choice (w8a8 / w8a16: MOECOMP_FP8_MODE, the config's "fp8"
key, the heuristic) and the FP8 config tables (their own "dtype=fp8" keys; bf16 lookups unchanged); the TMA kernels
refuse fp8 operands. Outputs and scratch NaN-poisoned (``poison``). GPU tests: tests/ops/test_fp8_gpu.py.

Tolerances (relative Frobenius error against the fp32 reference on the same quantized tensors): fp32 3e-5, fp16
2e-3 (see tests/kernels/test_fp8_gemm.py). A dynamic spec run weight-only (w8a16) is compared with the weight-only
reference (the op's documented freedom: its error is then smaller)."""

import dataclasses
import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe, triton_shared, tuning
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.testing import quantize_moe_args, random_moe_args

TOL = {torch.float32: 3e-5, torch.float16: 2e-3}
Q = QuantSpec()  # 128x128 blocks, fp32 scales, dynamic activations


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def weight_only_spec(spec: MoESpec) -> MoESpec:
    """The spec as the op runs it in w8a16 mode: dynamic activations of routed and shared experts not quantized."""
    wo = lambda q: q if q is None or q.activation != "dynamic" else dataclasses.replace(q, activation="none")  # noqa
    shared = spec.shared and dataclasses.replace(spec.shared, quant=wo(spec.shared.quant))
    return spec.replace(quant=wo(spec.quant), shared=shared)


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ("MOECOMP_FP8_MODE", "MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def launches(monkeypatch):
    """Calls of the routed path's launch wrappers (align, gemm2, combine, the TMA GEMMs, fp8_linear)."""
    calls = {}
    for fn in ("align", "gemm2", "combine", "_gemm1_tma", "_gemm2_tma", "fp8_linear"):
        mod = triton_shared if fn == "fp8_linear" else triton_moe  # the shared experts' linears: ops/triton_shared.py
        real = getattr(mod, fn)
        calls[fn] = 0

        def counted(*a, _real=real, _fn=fn, **kw):
            calls[_fn] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, fn, counted)
    return calls


SHARED = SharedExpertSpec(40, gate="sigmoid", quant=QuantSpec(block_n=32, block_k=64))
# name: (T, x dtype, FSE, MOECOMP_FP8_MODE, the mode that runs, launches of (align, gemm2, combine))
FORWARD = {
    "aligned-w8a8-fp32": (40, torch.float32, False, "w8a8", "w8a8", (1, 1, 1)),
    "decode-heuristic-fse-fp16": (5, torch.float16, True, None, "w8a8", (0, 1, 1)),  # the heuristic: w8a8, prequant
}


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_moe_forward_quantized(triton_backend, poison, launches, name):
    """A DeepSeek-style block (grouped sigmoid routing, correction bias) with fp8 routed experts (H=200, I=72: not
    multiples of 128, I < 128) and an fp8 shared expert (block 32x64, sigmoid gate) through the Triton path."""
    T, dtype, fse, force, mode, want = FORWARD[name]
    if force:
        triton_backend.setenv("MOECOMP_FP8_MODE", force)
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=200, intermediate_size=72, scoring="sigmoid",
                   has_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5, shared=SHARED,
                   quant=Q)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=T))
    if fse:
        spec = spec.replace(fused_shared_gate=True)
        args = (args[0], torch.cat([args[1], args[-1]], 0), *args[2:-1], None)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, weight_only_spec(spec) if mode == "w8a16" else spec, **scales)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype], f"{name}: rel err {rel_err(out, ref):.2e}"
    assert (launches["align"], launches["gemm2"], launches["combine"]) == want
    assert launches["fp8_linear"] == 3  # the shared expert's gate, up and down


def test_moe_experts_static_given_routing(triton_backend, poison, launches):
    """moe_experts with static activation scales (always w8a8), channel scales, ungated experts; a config asking for
    the TMA GEMMs runs the pointer kernels (TMA is 16-bit only)."""
    spec = MoESpec(num_experts=6, top_k=3, hidden_size=136, intermediate_size=40, gated=False, activation="gelu",
                   quant=QuantSpec(scale="channel", activation="static"))
    T = 21
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.float32, seed=4))
    tile = dict(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1, tma=1)
    triton_backend.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dict(max_t=0))))
    g = torch.Generator().manual_seed(0)
    ids = torch.argsort(torch.rand(T, 6, generator=g), dim=1)[:, :3]
    w = torch.rand(T, 3, generator=g)
    x, w13, w2 = args[0], args[4], args[6]
    out = torch.ops.moecomp.moe_experts(x, ids, w, w13, None, w2, None, spec.key, **scales)
    ref = reference.experts(x, ids, w, w13, None, w2, None, spec, **scales)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float32]
    assert launches["_gemm1_tma"] == launches["_gemm2_tma"] == 0 and launches["gemm2"] == 1


def test_tma_refuses_fp8_operands():
    spec = MoESpec(num_experts=2, top_k=1, hidden_size=64, intermediate_size=32, quant=Q)
    h = torch.zeros(16, 32, dtype=torch.bfloat16)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 64, 64, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(2, 64, 32, dtype=torch.float8_e4m3fn)
    assert not triton_moe._tma_ok(spec, h, w2) and not triton_moe._tma1_ok(spec, x, w13)
    bf = spec.replace(quant=None)  # the same operands in bf16 pass the dtype checks (where this Triton has TMA)
    want = triton_moe._TensorDescriptor() is not None
    assert triton_moe._tma_ok(bf, h, w2.to(torch.bfloat16)) == want
    assert triton_moe._tma1_ok(bf, x, w13.to(torch.bfloat16)) == want


# ------------------------------------------------------------------------------------------------ mode and config
def test_fp8_mode_choice(monkeypatch):
    monkeypatch.delenv("MOECOMP_FP8_MODE", raising=False)
    static, none = QuantSpec(activation="static"), QuantSpec(activation="none")
    assert [tuning.fp8_mode(Q, T) for T in (1, 16, 17, 4096)] == ["w8a16", "w8a16", "w8a8", "w8a8"]
    assert tuning.fp8_mode(Q, 1, {"fp8": "w8a8"}) == "w8a8" and tuning.fp8_mode(Q, 999, {"fp8": "w8a16"}) == "w8a16"
    assert tuning.fp8_mode(static, 1) == "w8a8" and tuning.fp8_mode(none, 999, {"fp8": "w8a8"}) == "w8a16"
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")
    assert tuning.fp8_mode(Q, 1, {"fp8": "w8a16"}) == "w8a8" and tuning.fp8_mode(none, 1) == "w8a16"
    monkeypatch.setenv("MOECOMP_FP8_MODE", "int8")
    with pytest.raises(ValueError, match="MOECOMP_FP8_MODE"):
        tuning.fp8_mode(Q, 1)


@pytest.fixture
def lookup_dir(tmp_path, monkeypatch):
    """The run-time lookup reads its tables from tmp_path while the test runs."""
    for var in ("MOECOMP_CONFIG", "MOECOMP_FP8_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning._table.cache_clear()
    yield tmp_path
    tuning._table.cache_clear()


def test_fp8_configs(lookup_dir, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for dev in (cpu, cuda):  # the heuristic (no table): BLOCK_K = 128 everywhere, "pairs" decode, the mode by T
        for T in (1, 16, 200, 8192):
            c = tuning._fp8_heuristic(128, 768, 2048, T, 8, dev)
            assert {c["g1"]["BLOCK_K"], c["g2"]["BLOCK_K"], c["decode"]["g1"]["BLOCK_K"]} == {128}
            assert c["decode"]["g2"]["mode"] == "pairs" and c["fp8"] == "w8a8" and c["fp8_prequant"] == 1
    plain = tuning.get_config(8, 72, 200, 40, 2, torch.bfloat16, cpu)
    assert plain == tuning._heuristic(8, 72, 200, 40, 2, cpu) and "fp8" not in plain
    tile = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    entry = lambda bm, mode: dict(BLOCK_M=bm, g1=tile, g2=tile, fp8=mode)  # noqa: E731
    table = {tuning.shape_key(8, 72, 200, torch.bfloat16): {"1": entry(16, None)},
             tuning.shape_key(8, 72, 200, "fp8"): {"1": entry(16, "w8a16"), "64": entry(32, "w8a8")},
             tuning.shape_key(8, 72, 200, "fp8_w8a8"): {"1": entry(64, "w8a8")}}
    (lookup_dir / "cpu.json").write_text(json.dumps(table))
    tuning._table.cache_clear()
    assert tuning.shape_key(8, 72, 200, "fp8") == "E=8,N=72,K=200,dtype=fp8"
    assert tuning.get_config(8, 72, 200, 40, 2, torch.bfloat16, cpu) == entry(16, None)  # bf16: its own entry
    assert tuning.get_config(8, 72, 200, 40, 2, torch.bfloat16, cpu, Q) == entry(16, "w8a16")
    assert tuning.get_config(8, 72, 200, 100, 2, torch.float16, cpu, Q) == entry(32, "w8a8")
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a8")  # the forced mode's own table
    assert tuning.get_config(8, 72, 200, 40, 2, torch.bfloat16, cpu, Q) == entry(64, "w8a8")
    monkeypatch.setenv("MOECOMP_FP8_MODE", "w8a16")  # no table of its own: the "fp8" one
    assert tuning.get_config(8, 72, 200, 40, 2, torch.bfloat16, cpu, Q) == entry(16, "w8a16")
    assert tuning.get_config(9, 72, 200, 40, 2, torch.bfloat16, cpu, Q)["g1"]["BLOCK_K"] == 128  # untuned


def test_fp8_tile_rule():
    kw = lambda w, a, bk: dict(W_SCALE=w, A_QUANT=a, Q_BLOCK_K=bk)  # noqa: E731
    c = dict(BLOCK_K=256, BLOCK_N=32)
    assert triton_moe.fp8_tile(c, None) is c
    assert triton_moe.fp8_tile(c, kw(1, 0, 256)) is c  # weight-only, 256-wide blocks: 256 divides
    assert triton_moe.fp8_tile(c, kw(1, 1, 256))["BLOCK_K"] == 128  # dynamic: the 128-column group
    assert triton_moe.fp8_tile(c, kw(1, 0, 64))["BLOCK_K"] == 64
    assert triton_moe.fp8_tile(c, kw(2, 2, 1))["BLOCK_K"] == 256  # channel scales, static activations
    assert triton_moe.fp8_tile(dict(BLOCK_K=128), kw(1, 1, 384))["BLOCK_K"] == 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="--interpret runs where the kernels are interpreted (no CUDA)")
def test_tune_fp8_both_modes(lookup_dir, monkeypatch):
    """``python -m moecomp tune --interpret --fp8 both``: each bucket measured in both modes and each mode's speed
    candidates (fake timer, falling: the last variant measured, w8a16+fold2, is the fastest; every candidate still
    runs once, checked against the first), the table written under "dtype=fp8" with the winner's mode and candidate
    keys, which the run-time lookup returns for a quantized spec; the meta records every variant's time."""
    from moecomp.cli import tune, tune_io

    times = iter(range(10 ** 6, 0, -1))
    monkeypatch.setattr(tune_io, "bench", lambda fn, rep_ms, device: 1.0 + 1e-6 * next(times))
    E, I, H, K = tune.INTERPRET_SHAPE
    out = lookup_dir / "cpu.json"
    assert tune.main(["--interpret", "--fp8", "both", "--shape", f"{E},{I},{H},{K}", "--tokens", "1",
                      "--out", str(out)]) == 0
    key = tuning.shape_key(E, I, H, "fp8")
    table = json.loads(out.read_text())
    assert set(table) == {key}
    assert table[key]["1"]["fp8"] == "w8a16" and table[key]["1"]["fp8_fold"] == 2, table[key]["1"]
    assert "fp8_prequant" not in table[key]["1"]
    assert table[key]["1"]["decode"]["g2"]["mode"] in ("fused", "pairs")
    meta = json.loads((lookup_dir / "cpu.meta.json").read_text())[key]["1"]
    assert set(meta["fp8_ms"]) == set(tune.FP8_CHOICES["both"]) and meta["ms"] == min(meta["fp8_ms"].values())
    assert min(meta["fp8_ms"], key=meta["fp8_ms"].get) == "w8a16+fold2"
    tuning._table.cache_clear()
    cfg = tuning.get_config(E, I, H, 1, K, torch.float32, torch.device("cpu"), Q)
    assert cfg == table[key]["1"] and tuning.fp8_candidates(cfg) == {"prequant": 0, "fold": 2}


def test_tune_mode_keys():
    """The tuner's FP8 variant names -> config keys, as ``tuning.fp8_candidates`` reads them."""
    from moecomp.cli import tune

    assert tune.mode_keys(None) == {}
    assert tune.mode_keys("w8a8") == {"fp8": "w8a8"}
    assert tune.mode_keys("w8a8+prequant") == {"fp8": "w8a8", "fp8_prequant": 1}
    assert tune.mode_keys("w8a16+fold1") == {"fp8": "w8a16", "fp8_fold": 1}
    for mode in tune.FP8_CHOICES["both"]:
        keys = tune.mode_keys(mode)
        assert keys["fp8"] in tuning.FP8_MODES
        assert tuning.fp8_candidates(keys) == {"prequant": keys.get("fp8_prequant", 0), "fold": keys.get("fp8_fold", 0)}


def test_tune_checks_a_quantized_h():
    """A gemm1 candidate whose epilogue writes h quantized (prequant's QAct) is checked on its dequantized values:
    equal codes pass, other codes are rejected (the tuner crashed on it on the GPU before)."""
    from moecomp.cli import tune
    from moecomp.ops.triton_fp8 import QAct

    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 200, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(6, 2, generator=g) + 0.5
    ref = QAct(q, s, torch.float32).dequantize()
    assert torch.equal(ref[:, 130], q[:, 130].float() * s[:, 1])
    rows = torch.tensor([True, False, True, True, False, True])
    notes = []
    verdict, out = tune._run_checked(lambda: QAct(q, s, torch.float32), ref[rows], "h", notes.append,
                                     torch.device("cpu"), rows)
    assert verdict == "ok" and torch.equal(out, ref[rows])
    neg = (-q.float()).to(torch.float8_e4m3fn)
    verdict, _ = tune._run_checked(lambda: QAct(neg, s, torch.float32), ref[rows], "h", notes.append,
                                   torch.device("cpu"), rows)
    assert verdict == "rejected" and "REJECT" in notes[-1]


def test_tune_compares_gemm1_candidates_as_gemm2_reads_them(triton_backend):
    """Under prequant the tuner compares gemm1 candidates on h as gemm2 reads it: a 16-bit h is quantized the way
    gemm1's epilogue would write it, so an epilogue-quantized candidate (a QAct of the same h) is equal to it, not
    2e-2 away (the quantization itself, which the tuner rejected on the GPU)."""
    from moecomp.cli import tune
    from moecomp.ops.triton_fp8 import quantize_act

    h = torch.randn(24, 200, generator=torch.Generator().manual_seed(2))
    as_epilogue = quantize_act(h)  # what a Q_OUT gemm1 returns for this h
    assert torch.equal(tune._as_quantized(h), tune._as_quantized(as_epilogue))
    assert tune._rel(as_epilogue.dequantize(), h) > tune.REL_TOL  # what the plain comparison saw
    verdict, _ = tune._run_checked(lambda: as_epilogue, tune._as_quantized(h), "g1", lambda m: None,
                                   torch.device("cpu"), None, tune._as_quantized)
    assert verdict == "ok"
