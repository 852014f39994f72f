"""The 4-bit (w4a16) Triton path under the interpreter (CPU): ``kernels/quant4.py`` in the grouped GEMMs and the
decode down-combine, launched by ``ops/triton_quant4.py`` through the op. GPU tests: tests/ops/test_quant4_gpu.py.

* Dequantization in the kernels is exact: every e2m1 code times every ue8m0 scale byte decodes as
  ``quant.dequantize``; a one-expert GEMM on identity activations (y = w^T) returns ``quant.dequantize``'s weights bit
  for bit (fp32; fp16 where the weight rounds once, as ``dequantize(...).half()``): mxfp4 with one and with several
  groups a K step, int4 symmetric and with zero points, the three K-step forms (split A, interleaved nibbles,
  ``tl.dot_scaled``), gemm1 and gemm2. A mutation (the e2m1 sign bit ignored) fails it.
* ``moe_forward`` / ``moe_experts`` on the Triton path against ``moecomp.oracle.reference`` on the same packed tensors:
  mxfp4, int4 symmetric, int4 with zero points (groups 64 and 128, a partial last group), gate / up concatenated and
  interleaved (gpt-oss: swiglu_oai with its clamp, expert biases), the decode path (T = 1..4: fused down-combine and
  "pairs") and the aligned one (T = 40); the int4 fold option and the split / dot_scaled forms (dot_scaled on fp32 x
  runs the interleave form). Launches counted, outputs and scratch
  NaN-poisoned (``poison``).
* ``torch.library.opcheck`` of moe_forward with 4-bit arguments; the tile rule and configs; 4-bit never reaches the
  TMA GEMMs.

Tolerances (relative Frobenius error against the fp32 reference on the same packed tensors, which dequantizes
exactly): fp32 3e-5 (the sums in another order; measured <= 4.4e-7), fp16 2e-3 (h and the per-pair outputs stored
in fp16: measured <= 3.6e-4 aligned, 0 on the fused decode path); the int4 fold option rounds each scaled weight to
fp16 once more (2^-11 relative; measured 5.7e-4): same bound. For scale: the quantization itself puts these outputs
17% (mxfp4) / 13% (int4, group 64, zero points) from the unquantized weights' output
(``test_quantization_error_is_much_larger`` asserts 2-30%), two to five orders of magnitude above the bounds.
"""

import json

import pytest
import torch
import triton
import triton.language as tl

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.kernels import fp8, quant4
from moecomp.ops import triton_fp8_tma, triton_moe, triton_quant4, tuning
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.testing import quantize_moe_args, random_moe_args

TOL = {torch.float32: 3e-5, torch.float16: 2e-3}
MX = QuantSpec.mxfp4()


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# ------------------------------------------------------------------------------------------------ exact decode
@triton.jit
def _e2m1_kernel(c_ptr, e_ptr, out_ptr):
    c = tl.load(c_ptr + tl.arange(0, 16)).to(tl.int32)  # [16] codes
    s = fp8.ue8m0(tl.load(e_ptr + tl.arange(0, 256)))  # [256] scales
    v = quant4.e2m1(c)[:, None] * s[None, :]  # [16, 256]
    tl.store(out_ptr + tl.arange(0, 16)[:, None] * 256 + tl.arange(0, 256)[None, :], v)


def test_e2m1_times_every_scale_byte_is_dequantize():
    codes, e = torch.arange(16, dtype=torch.uint8), torch.arange(256, dtype=torch.uint8)
    out = torch.empty(16, 256)
    _e2m1_kernel[(1,)](codes, e, out)
    want = torch.tensor(q8.E2M1)[:, None] * e.view(q8.E8M0).float()[None, :]
    nan = want.isnan()  # scale byte 255
    assert torch.equal(out.isnan(), nan) and nan.sum() == 16
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bits: -0 (code 8), inf, subnormals


def _one_expert(quant, K, N, seed):
    """A random [N, K] weight quantized (wider scale bytes for mxfp4: 2^-20 .. 2^4), as one expert."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1, N, K, generator=g) * torch.exp2(torch.randint(-8, 3, (1, N, 1), generator=g).float())
    packed, scale, zero = q8.quantize_4bit(w, quant)
    if quant.weight == "mxfp4":  # spread the exponents further than quantize_4bit's would be
        scale = (scale.view(torch.uint8).int() + torch.randint(-12, 3, scale.shape, generator=g)).to(torch.uint8)
        scale = scale.view(q8.E8M0)
    return packed, scale, zero


EXACT = {  # name: (quant, K, N, dtype, BLOCK_K, the K step's form)
    "mxfp4-bk32-fp32": (MX, 96, 40, torch.float32, 32, "split"),
    "mxfp4-bk128-fp32-interleave": (MX, 200, 40, torch.float32, 128, "interleave"),
    "mxfp4-bk64-fp16": (MX, 96, 40, torch.float16, 64, "split"),
    "mxfp4-bk64-fp16-dot_scaled": (MX, 200, 40, torch.float16, 64, "dot_scaled"),
    "int4-g64-fp32": (QuantSpec.int4(64), 200, 24, torch.float32, 64, "split"),
    "int4zp-g128-fp32-interleave": (QuantSpec.int4(128, True), 200, 24, torch.float32, 64, "interleave"),
    "int4zp-g64-bf16scales-fp16": (QuantSpec.int4(64, True, "bf16"), 96, 24, torch.float16, 32, "split"),
}


def _kw(quant, scale, zero, form):
    return triton_quant4.quant4_kwargs(quant, scale, zero, {"w4_form": form})


@pytest.mark.parametrize("case", sorted(EXACT))
def test_gemm2_on_identity_reproduces_dequantize(poison, case):
    """gemm2 (aligned), one expert, h = I [K, K] (in sorted order), routing weight 1: y[p] = h[p] . w^T = column p of
    w^T, exactly."""
    quant, K, N, dtype, bk, form = EXACT[case]
    packed, scale, zero = _one_expert(quant, K, N, len(case))
    want = q8.dequantize(packed[0], scale[0], quant, zero=None if zero is None else zero[0]).T  # [K, N] fp32
    spec = MoESpec(num_experts=1, top_k=1, hidden_size=N, intermediate_size=K, quant=quant)
    ids = torch.zeros(K, 1, dtype=torch.int32)
    aligned = triton_moe.align(ids, 1, 16)
    eye = torch.cat([torch.eye(K, dtype=dtype), torch.zeros(1, K, dtype=dtype)])  # row K: padding (sentinel K)
    h = eye[aligned[0].long().clamp(0, K)]  # [S, K]: sorted row s is pair sorted[s]'s row of I (unread past num_padded)
    c2 = dict(BLOCK_N=16, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=1)
    y = triton_moe.gemm2(h, packed, None, torch.ones(K), spec, aligned, K, 16, c2, _kw(quant, scale, zero, form))
    assert y.dtype == dtype and torch.equal(y, want.to(dtype)), f"{case}: {(y.float() - want).abs().max()}"


@pytest.mark.parametrize("case", ["mxfp4-bk64-fp16", "int4zp-g128-fp32-interleave", "mxfp4-bk64-fp16-dot_scaled"])
def test_gemm1_on_identity_reproduces_dequantize(poison, case):
    """gemm1 aligned, ungated relu, one expert: x = I gives relu(w)^T, x = -I relu(-w)^T; w = their difference."""
    quant, K, N, dtype, bk, form = EXACT[case]
    packed, scale, zero = _one_expert(quant, K, N, 7)
    want = q8.dequantize(packed[0], scale[0], quant, zero=None if zero is None else zero[0]).T.to(dtype)
    spec = MoESpec(num_experts=1, top_k=1, hidden_size=K, intermediate_size=N, gated=False, activation="relu",
                   quant=quant)
    ids = torch.zeros(K, 1, dtype=torch.int32)
    c1 = dict(BLOCK_N=16, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=1)
    kw = _kw(quant, scale, zero, form)
    aligned = triton_moe.align(ids, 1, 16)
    rows = aligned[0][:K].long()  # sorted row s holds pair (token) rows[s]

    def run(x):
        h = triton_moe.gemm1(x, packed, None, spec, aligned, 1, 16, c1, kw)  # [S, N] in sorted order
        return torch.empty_like(h[:K]).index_copy_(0, rows, h[:K])

    pos, neg = run(torch.eye(K, dtype=dtype)), run(-torch.eye(K, dtype=dtype))
    assert torch.equal(pos, want.clamp(min=0)) and torch.equal(neg, (-want).clamp(min=0))


_E2M1 = quant4.e2m1


@triton.jit
def _unsigned_e2m1(c):
    return _E2M1(c & 7)


def test_ignoring_the_sign_bit_fails(monkeypatch, poison):
    """Mutation: with the e2m1 sign bit dropped the identity check above fails."""
    monkeypatch.setattr(quant4, "e2m1", _unsigned_e2m1)
    with pytest.raises(AssertionError):
        test_gemm2_on_identity_reproduces_dequantize(None, "mxfp4-bk32-fp32")


# ------------------------------------------------------------------------------------------------ the op
def _spec(quant, gate_up="concat", E=4, k=2, H=96, I=64):
    oai = gate_up == "interleaved"
    return MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, gated=True, gate_up=gate_up,
                   activation="swiglu_oai" if oai else "silu", has_expert_bias=oai, quant=quant)


OP = {  # name: (spec, dtype, T, path, options)   path: "fused" / "pairs" (decode), "aligned"
    "mxfp4-oai-fp32-T3": (_spec(MX, "interleaved"), torch.float32, 3, "fused", {}),
    "mxfp4-oai-fp16-T40": (_spec(MX, "interleaved", H=200), torch.float16, 40, "aligned", {}),
    "mxfp4-concat-fp16-T1-pairs": (_spec(MX), torch.float16, 1, "pairs", {}),
    "int4-g64-fp32-T40": (_spec(QuantSpec.int4(64)), torch.float32, 40, "aligned", {}),
    "int4-g128-fp16-T2": (_spec(QuantSpec.int4(128), H=160), torch.float16, 2, "fused", {}),
    "int4zp-g128-fp16-T4": (_spec(QuantSpec.int4(128, True), H=160), torch.float16, 4, "fused", {}),
    "int4zp-g64-oai-fp16-T40": (_spec(QuantSpec.int4(64, True), "interleaved"), torch.float16, 40, "aligned", {}),
    "int4zp-g128-fp32-T40-bk128": (_spec(QuantSpec.int4(128, True, "fp32"), H=160), torch.float32, 40, "aligned",
                                   {"bk": 128}),
    "int4zp-g64-fp16-T40-fold": (_spec(QuantSpec.int4(64, True)), torch.float16, 40, "aligned",
                                 {"MOECOMP_W4_FOLD": "1"}),
    "mxfp4-oai-fp32-T2-split": (_spec(MX, "interleaved"), torch.float32, 2, "fused", {"MOECOMP_W4_FORM": "split"}),
    "int4-g64-fp16-T40-split-fold": (_spec(QuantSpec.int4(64)), torch.float16, 40, "aligned",
                                     {"MOECOMP_W4_FORM": "split", "MOECOMP_W4_FOLD": "1"}),
    "mxfp4-oai-fp16-T40-dot_scaled": (_spec(MX, "interleaved", H=200), torch.float16, 40, "aligned",
                                      {"MOECOMP_W4_FORM": "dot_scaled"}),
    "mxfp4-fp32-T2-dot_scaled": (_spec(MX), torch.float32, 2, "fused", {"MOECOMP_W4_FORM": "dot_scaled"}),
}


def _count(monkeypatch, names=("align", "gemm1", "gemm2", "decode_down")):
    calls = dict.fromkeys(names, 0)
    for fn in names:
        real = getattr(triton_moe, fn)

        def counted(*a, _real=real, _fn=fn, **kw):
            calls[_fn] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, counted)
    return calls


def _config(spec, dtype, T, path, opts):
    cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, spec.top_k, dtype,
                            torch.device("cpu"), spec.quant)
    if path == "pairs":
        cfg = dict(cfg, decode=dict(cfg["decode"], g2=dict(cfg["decode"]["g2"], mode="pairs")))
    if "bk" in opts:
        cfg = dict(cfg, g1=dict(cfg["g1"], BLOCK_K=opts["bk"]), g2=dict(cfg["g2"], BLOCK_K=opts["bk"]))
    return cfg


@pytest.mark.parametrize("case", sorted(OP))
def test_moe_forward_matches_reference(triton_backend, poison, case):
    spec, dtype, T, path, opts = OP[case]
    for name, v in opts.items():
        if name.startswith("MOECOMP_"):
            triton_backend.setenv(name, v)
    cfg = _config(spec, dtype, T, path, opts)
    if path == "pairs" or "bk" in opts:
        triton_backend.setenv("MOECOMP_CONFIG", json.dumps(cfg))
    calls = _count(triton_backend)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=len(case)))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{case}: rel err {err:.2e}"
    decode = path != "aligned"
    assert calls["align"] == (0 if decode else 1) and calls["gemm1"] == 1
    assert calls["decode_down"] == decode and calls["gemm2"] == (path != "fused")


def test_moe_experts_matches_reference(triton_backend, poison):
    """moe_experts (the HF experts interface's op) with int4 zero points, interleaved gate / up and biases."""
    spec = _spec(QuantSpec.int4(64, True), "interleaved")
    T, dtype = 5, torch.float32
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=3))
    named = dict(zip(MOE_ARGS, args[1:]))
    g = torch.Generator().manual_seed(3)
    ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), 1)[:, :spec.top_k]
    w = torch.rand(T, spec.top_k, generator=g)
    out = torch.ops.moecomp.moe_experts(args[0], ids, w, named["w13"], named["b13"], named["w2"], named["b2"],
                                        spec.key, **scales)
    ref = reference.experts(args[0], ids, w, named["w13"], named["b13"], named["w2"], named["b2"], spec, **scales)
    assert rel_err(out, ref) < TOL[dtype]


def test_quantization_error_is_much_larger(triton_backend):
    """The bounds above are far below what 4-bit quantization itself changes: the op's output against the output
    of the unquantized float weights it was quantized from."""
    for quant in (MX, QuantSpec.int4(64, True)):
        spec = _spec(quant, "interleaved")
        raw = random_moe_args(spec, 3, torch.float32, seed=5)
        args, scales = quantize_moe_args(spec, raw)
        out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
        unquantized = reference.moe_forward(*raw, spec.replace(quant=None))
        assert 0.02 < rel_err(out, unquantized) < 0.3


@pytest.mark.parametrize("T", [2])
def test_opcheck_moe_forward_4bit(cpu_backend, T):
    spec = _spec(QuantSpec.int4(64, True), "interleaved", E=3, H=64, I=32)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.float32, seed=T))
    before = {n: t.clone() for n, t in scales.items()}
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key), scales)
    assert all(torch.equal(before[n], t) for n, t in scales.items())


# ------------------------------------------------------------------------------------------------ rules
def test_tile_rule_and_heuristic_configs(monkeypatch):
    mx, g64 = _kw(MX, torch.zeros(1, 1, 1), None, "split"), _kw(QuantSpec.int4(64), torch.zeros(1, 1, 1), None, "interleave")
    folded = triton_quant4.quant4_kwargs(QuantSpec.int4(96), torch.zeros(1, 1, 1), None, {"w4_fold": 1})
    c = dict(BLOCK_N=32, BLOCK_K=128)
    assert triton_quant4.tile(c, mx)["BLOCK_K"] == 128  # whole groups of 32 a step (folded)
    assert triton_quant4.tile(c, g64)["BLOCK_K"] == 64  # the scale after the dot: BLOCK_K divides the group
    assert triton_quant4.tile(dict(c, BLOCK_K=16), mx)["BLOCK_K"] == 32
    assert triton_quant4.tile(c, folded)["BLOCK_K"] == 32  # 96: neither 128 nor 64 divides or is a multiple
    for quant in (MX, QuantSpec.int4(64, True), QuantSpec.int4(128)):
        for T in (1, 16, 17, 512):
            cfg = tuning.get_config(32, 2880, 2880, T, 4, torch.bfloat16, torch.device("cpu"), quant)
            for c in (cfg["g1"], cfg["g2"], cfg["decode"]["g1"], cfg["decode"]["g2"]):
                assert c["BLOCK_K"] >= 32 and (quant.weight == "mxfp4" or quant.block_k % c["BLOCK_K"] == 0)
    assert tuning.quant4_key(QuantSpec.int4(128, True)) == "int4_g128_zp" and tuning.quant4_key(MX) == "mxfp4"
    monkeypatch.setattr(tuning, "device_key", lambda device: "no-table")  # the CUDA heuristic, on this machine
    monkeypatch.setattr(tuning, "_nearest", lambda *a: None)  # (no shipped table's entry near either: the heuristic)
    for quant in (MX, QuantSpec.int4(64)):
        for T in (1, 17, 64, 4096):  # every row class; T = 1: the decode path's tiles too
            cfg = tuning.quant4_config(32, 2880, 2880, T, 4, torch.device("cuda"), quant)
            assert cfg["decode"]["max_t"] == tuning.QUANT4_DECODE_MAX_T
            for c in (cfg["g1"], cfg["g2"], cfg["decode"]["g1"], cfg["decode"]["g2"]):
                assert triton_quant4.tile(c, _kw(quant, torch.zeros(1, 1, 1), None, "interleave")) == c


def test_4bit_never_takes_the_tma_gemms():
    spec = _spec(MX)
    w = torch.zeros(4, 128, 48, dtype=torch.uint8)
    q = _kw(MX, torch.zeros(4, 128, 3, dtype=torch.uint8).view(q8.E8M0), None, "split")
    c = dict(BLOCK_N=64, BLOCK_K=128, tma=1)
    assert not triton_fp8_tma.gemm1_ok(spec, torch.zeros(2, 96), w, q, c)
    assert not triton_fp8_tma.gemm2_ok(spec, torch.zeros(2, 64), w, q, c)
    assert q["A_QUANT"] == 0 and q["W_SCALE"] == 0 and q["W4"] == 1  # the 16-bit TMA GEMMs need q None


def test_zero_points_are_required():
    with pytest.raises(ValueError, match="w13_zero"):
        triton_quant4.quant4_kwargs(QuantSpec.int4(64, True), torch.zeros(1, 2, 2), None, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_diag_quant4_helpers_and_refusal(capsys):
    """benchmarks/diag_quant4.py refuses to run without CUDA; its byte count and packing are right on a tiny layer."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "diag_quant4.py"
    mod_spec = importlib.util.spec_from_file_location("diag_quant4", path)
    diag = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(diag)
    assert diag.main([]) == 1 and "needs CUDA" in capsys.readouterr().out
    spec = _spec(QuantSpec.int4(64, True), "interleaved", E=4, H=64, I=32)
    raw = dict(zip(MOE_ARGS, random_moe_args(spec, 2, torch.float32, seed=0)[1:]))
    t, extra = diag.pack(spec, raw)
    assert t["w13"].shape == (4, 64, 32) and extra["w13_zero"].shape == (4, 64, 1)
    # one expert: w13 64 x 32 bytes + w2 64 x 16, fp16 scales and uint8 zeros per row and group, fp32 biases
    assert diag.expert_bytes(t, extra) == 64 * 32 + 64 * 16 + (64 + 64) * 3 + (64 + 64) * 4
    assert 1 <= diag.touched(spec, torch.randn(3, 64), raw) <= 4
