"""The opt-in "mma" 4-bit K-step form (MOECOMP_W4_FORM=mma; ``kernels/quant4_mma.py`` on ``ops/w4_layout.py``'s
re-laid weights) on the decode path, under the interpreter (CPU): the DIRECT gemm1 (gated with its activation
epilogue and biases, or not), then either the fused down-combine (``moe_down_combine_kernel``, decode mode "fused")
or gemm2 DIRECT + combine ("pairs"). GPU: tests/ops/test_quant4_mma_gpu.py; the sm_90 compile of these branches:
tests/kernels/test_sm90_compile_w4mma.py; the aligned path's mma form: tests/kernels/test_quant4_mma.py.

* The op (``moe_forward``) against ``oracle/reference.py`` on fresh random inputs (NaN-poisoned outputs): mxfp4 and
  int4 (symmetric, with zero points), gpt-oss's interleaved swiglu_oai with expert biases, concat silu, ungated gelu,
  weight_on_input, zero experts, H / I multiples of 8 but not of 32 (the word mask word by word: no W4_K32); T = 1..3
  (the CPU decode path), both decode modes. Each launch is counted and must have run the mma form (W4_FORM 4) on the
  re-laid weights (mxfp4: ``w4_layout.relayout``'s bytes; int4: the packed bytes themselves), with W4_K32 exactly
  where its K is a multiple of 32; no alignment launch.
* The same launches with the mma form but the packed (not re-laid) mxfp4 bytes fail the tolerance (the check can
  fail); the GEMV mode reads packed weights as held, no re-laid copy (``direct_kwargs``: counted).
* A decode tile narrower than 16 weight rows is widened for the mma form (``triton_quant4.tile``).
* benchmarks/diag_w4_mma.py's path environments run the launches their labels name.

Tolerances (relative Frobenius error against the fp32 reference on the same packed tensors): fp32 3e-5 (the same
exact weights, sums in another order), fp16 2e-3 (h and the outputs stored in fp16), as tests/kernels/
test_quant4_mma.py. The interpreter's bf16 dot is wrong, so the cases run fp32 / fp16 x (the launchers' UPCAST
covers bf16 there; bf16 runs on the GPU test).
"""

import json

import pytest
import torch

from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.ops import triton_moe, triton_quant4, tuning, w4_layout
from moecomp.oracle import reference
from moecomp.testing import quantize_moe_args, random_moe_args

MX = QuantSpec.mxfp4()
TOL = {torch.float32: 3e-5, torch.float16: 2e-3}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _spec(quant, gate_up="concat", gated=True, H=64, I=32, top_k=2, **kw):
    oai = gate_up == "interleaved"
    return MoESpec(num_experts=4, top_k=top_k, hidden_size=H, intermediate_size=I, gated=gated, gate_up=gate_up,
                   activation="swiglu_oai" if oai else ("silu" if gated else "gelu"), has_expert_bias=oai,
                   quant=quant, **kw)


CASES = {  # name: (spec, dtype, T, decode mode)
    "mxfp4-oai-fp32-T1-fused": (_spec(MX, "interleaved"), torch.float32, 1, "fused"),
    "mxfp4-oai-fp32-T3-pairs": (_spec(MX, "interleaved"), torch.float32, 3, "pairs"),
    "mxfp4-concat-fp16-T2-fused": (_spec(MX, H=96), torch.float16, 2, "fused"),
    "mxfp4-ungated-fp32-T2-pairs": (_spec(MX, gated=False), torch.float32, 2, "pairs"),
    "mxfp4-woi-fp32-T2-fused": (_spec(MX, top_k=1, weight_on_input=True), torch.float32, 2, "fused"),
    "int4-g64-fp32-T1-fused": (_spec(QuantSpec.int4(64)), torch.float32, 1, "fused"),
    "int4-g32-fp16-T2-pairs": (_spec(QuantSpec.int4(32), H=96), torch.float16, 2, "pairs"),
    "int4zp-g32-oai-fp16-T1-fused": (_spec(QuantSpec.int4(32, True), "interleaved"), torch.float16, 1, "fused"),
    "int4zp-g64-ungated-fp32-T3-fused": (_spec(QuantSpec.int4(64, True), gated=False), torch.float32, 3, "fused"),
    "int4zp-g32-fp32-T2-pairs": (_spec(QuantSpec.int4(32, True)), torch.float32, 2, "pairs"),
    "mxfp4-zero-fp32-T3-fused": (_spec(MX, zero_experts=2), torch.float32, 3, "fused"),
    "mxfp4-H80-I40-fp32-T2-fused": (_spec(MX, H=80, I=40), torch.float32, 2, "fused"),  # K % 32 != 0: no W4_K32
    "int4zp-g32-H80-I40-fp32-T1-pairs": (_spec(QuantSpec.int4(32, True), H=80, I=40), torch.float32, 1, "pairs"),
}


@pytest.fixture
def mma_decode(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_DECODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOECOMP_W4_FORM", "mma")
    return monkeypatch


def _launches(monkeypatch):
    """(launch name, its W4_FORM, its weight tensor) of every gemm1 / gemm2 / decode_down / align call."""
    seen = []
    pos = {"gemm1": (1, 8), "gemm2": (1, 9), "decode_down": (1, 11)}  # (weight, q) positions
    for fn in ("gemm1", "gemm2", "decode_down", "align"):
        real = getattr(triton_moe, fn)

        def spy(*a, _real=real, _fn=fn, **kw):
            if _fn == "align":
                seen.append(("align", None, None, None))
            else:
                w, qi = pos[_fn]
                q = kw["q"] if "q" in kw else (a[qi] if len(a) > qi else None)
                seen.append((_fn, (q or {}).get("W4_FORM", 0), a[w], (q or {}).get("W4_K32", 0)))
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, spy)
    return seen


def _config(spec, dtype, T, mode):
    cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, spec.top_k, dtype,
                            torch.device("cpu"), spec.quant)
    assert T <= cfg["decode"]["max_t"]  # the CPU decode path
    return dict(cfg, decode=dict(cfg["decode"], g2=dict(cfg["decode"]["g2"], mode=mode)))


def _run(monkeypatch, case):
    spec, dtype, T, mode = CASES[case]
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(_config(spec, dtype, T, mode)))
    seen = _launches(monkeypatch)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=len(case)))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    return spec, dtype, mode, args, out, ref, seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_path_mma_form_matches_reference(mma_decode, poison, case):
    spec, dtype, mode, args, out, ref, seen = _run(mma_decode, case)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{case}: rel err {err:.2e}"
    named = dict(zip(MOE_ARGS, args[1:]))
    w13, w2 = named["w13"], named["w2"]  # the packed tensors
    want = [("gemm1", w13), ("decode_down", w2)] + ([("gemm2", w2)] if mode == "pairs" else [])
    assert [(n, f) for n, f, _, _ in seen] == [(n, 4) for n, _ in want]  # no align: DIRECT
    for (name, _, w, k32), (_, packed) in zip(seen, want):
        assert k32 == (packed.shape[-1] % 16 == 0), name  # K % 32 == 0: the 16-byte word loads' promise
        relaid = w4_layout.relayout(packed, spec.quant)
        assert torch.equal(w, relaid), name
        if spec.quant.weight == "int4":
            assert w.data_ptr() == packed.data_ptr(), name  # int4: the packed bytes themselves
        else:
            assert not torch.equal(w, packed), name


def test_packed_bytes_under_the_mma_form_fail(mma_decode, poison):
    """Mutation: the DIRECT launches given the mma form but the packed mxfp4 bytes are far off the reference."""
    mma_decode.setattr(triton_quant4, "gemm_weights", lambda quant, args, q1, q2: (args["w13"], args["w2"]))
    _, _, _, _, out, ref, seen = _run(mma_decode, "mxfp4-oai-fp32-T1-fused")
    assert [(n, f) for n, f, _, _ in seen] == [("gemm1", 4), ("decode_down", 4)]
    assert rel_err(out, ref) > 1e-2


def test_gemv_mode_keeps_the_packed_weights(mma_decode):
    """Mode "gemv" (MOECOMP_W4_DECODE=gemv) on packed weights with the mma form asked: the dot-free kernels read the
    weights as held (packed here); ``direct_kwargs`` gives them the device's default form and ``gemm_weights`` is
    not asked for the re-laid tensors."""
    mma_decode.setenv("MOECOMP_W4_DECODE", "gemv")
    from moecomp.ops import triton_quant4_gemv

    forms = []
    real = triton_quant4_gemv.routed

    def spy(x, ids_flat, weights, args, spec, out, shared, gate, dec, q1, q2, *a, **kw):
        forms.append((q1.get("W4_FORM", 0), q2.get("W4_FORM", 0)))
        return real(x, ids_flat, weights, args, spec, out, shared, gate, dec, q1, q2, *a, **kw)

    mma_decode.setattr(triton_quant4_gemv, "routed", spy)
    spec = _spec(MX, "interleaved")
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 1, torch.float32, seed=5))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert forms == [(0, 0)]  # interleave, the CPU default
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL[torch.float32]


@pytest.mark.parametrize("quant", [MX, QuantSpec.int4(64, True)], ids=["mxfp4", "int4zp"])
def test_mma_tile_is_at_least_16_rows(quant):
    kw = triton_quant4.quant4_kwargs(quant, torch.zeros(1, 2, 2, dtype=torch.uint8), torch.zeros(1, 2, 2,
                                     dtype=torch.uint8), {"w4_form": "mma"})
    c = dict(BLOCK_N=4, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3)
    t = triton_quant4.tile(c, kw)
    assert t["BLOCK_N"] == triton_quant4.MIN_MMA_ROWS == 16
    assert t["BLOCK_K"] == (256 if quant.weight == "mxfp4" else 64)
    kw.pop("W4_FORM")
    assert triton_quant4.tile(c, kw)["BLOCK_N"] == 4  # the other forms keep the tile


@pytest.mark.parametrize("label,T", [("w4 direct", 1), ("w4 direct mma", 1), ("w4 direct mma", 12), ("w4 mma", 2)])
def test_diag_paths_run_what_they_are_named(mma_decode, label, T):
    """benchmarks/diag_w4_mma.py's environments: "direct" paths on the DIRECT launches (past the CPU decode limit of 8
    tokens too), "mma" ones with W4_FORM 4, "w4 mma" on the aligned path."""
    import os

    mma_decode.syspath_prepend(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from diag_w4_mma import PATHS

    mma_decode.delenv("MOECOMP_W4_FORM")
    for name, v in PATHS[label].items():
        mma_decode.setenv(name, v)
    seen = _launches(mma_decode)
    spec = _spec(MX, "interleaved")
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.float32, seed=T))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL[torch.float32]
    form = 4 if "mma" in label else 0  # (0: interleave, the CPU default)
    direct = "direct" in label
    want = [("gemm1", form), ("decode_down", form)] if direct else [("align", None), ("gemm1", 4), ("gemm2", 4)]
    assert [(n, f) for n, f, _, _ in seen] == want
