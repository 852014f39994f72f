"""GPU tests of the opt-in "mma" 4-bit K-step form (MOECOMP_W4_FORM=mma: ``ops/w4_layout.py``,
``kernels/quant4_mma.py``; skipped without CUDA). CPU tests: tests/kernels/test_quant4_mma.py.

* The decode compiled for the GPU: every e2m1 code times every ue8m0 scale byte equals ``quant.dequantize`` bit for
  bit (the fp32 multiplies must keep subnormals: code 1 is 2^-127 before its 2^126, byte 0 is 2^-127); every int4
  code minus every zero point exactly.
* gpt-oss-120b's layer (E 128, H = I = 2880, top-4, swiglu_oai, biases, mxfp4) at T = 16 and 128 (the aligned path):
  the mma form against ``moecomp.oracle.reference`` (relative Frobenius error < 1e-2 in bf16, as
  tests/ops/test_quant4_gpu.py: h and the outputs rounded to bf16) and against the default form (< 1e-2: the two
  differ only in the summation order and bf16 roundings), CUDA-graph captured and replayed with no host sync; an int4
  layer (group 128, zero points) the same way at T = 64.
* The decode path with the form (MOECOMP_W4_DECODE=dot: the DIRECT gemm1, then the fused down-combine or gemm2
  DIRECT + combine, both decode modes forced through MOECOMP_CONFIG) at T = 1, 2, 4, 8 on one set of weights per
  layer: gpt-oss-120b (mxfp4) and Qwen3-30B-A3B (E 128, top-8, H 2048, I 768) in int4 group 128 with and without zero
  points. Every launch counted (W4_FORM 4 with W4_K32 on gemm1 and the down projection, no alignment), the op
  captured and replayed (no host sync), against the reference and the DIRECT path's default form (< 1e-2 each).
"""

import functools
import json

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.oracle import reference
from moecomp.testing import capture_moe_forward
from test_gpu import rel_err  # (tests/ops is on sys.path, no package: the bf16 GPU tests)
from test_quant4_gpu import packed_args

pytestmark = pytest.mark.gpu

GPT_OSS_120B = MoESpec(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                       activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                       has_router_bias=True, score_order="topk_then_score", quant=QuantSpec.mxfp4())
INT4 = MoESpec(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768,
               quant=QuantSpec.int4(128, zero_point=True))
QWEN3_INT4 = MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, round_weights=True,
                     quant=QuantSpec.int4(128, zero_point=True))
DECODE = {"gpt_oss_120b": GPT_OSS_120B, "qwen3_30b_a3b_int4_zp": QWEN3_INT4,
          "qwen3_30b_a3b_int4": QWEN3_INT4.replace(quant=QuantSpec.int4(128))}
TOL = 1e-2


def _kernels():
    import triton
    import triton.language as tl

    from moecomp.kernels import fp8, quant4_mma

    @triton.jit
    def mx(w_ptr, s_ptr, out_ptr, R: tl.constexpr, NW: tl.constexpr):
        rows, words = tl.arange(0, R)[:, None], tl.arange(0, NW)[None, :]
        v = quant4_mma.decode_mx(tl.load(w_ptr + rows * NW + words), fp8.ue8m0(tl.load(s_ptr + rows * NW + words)))
        tl.store(out_ptr + rows * (NW * 8) + tl.arange(0, NW * 8)[None, :], v)

    @triton.jit
    def i4(w_ptr, z_ptr, out_ptr, R: tl.constexpr, NW: tl.constexpr):
        rows = tl.arange(0, R)[:, None]
        zh = (tl.load(z_ptr + rows).to(tl.float32) + 1024.0).to(tl.float16)
        v = quant4_mma.decode_int4(tl.load(w_ptr + rows * NW + tl.arange(0, NW)[None, :]), zh).to(tl.float32)
        tl.store(out_ptr + rows * (NW * 8) + tl.arange(0, NW * 8)[None, :], v)

    return mx, i4


def test_decode_on_gpu_is_dequantize_bit_for_bit():
    from moecomp.ops import w4_layout

    mx, i4 = _kernels()
    mxq = QuantSpec.mxfp4()
    codes = torch.arange(16, dtype=torch.uint8, device="cuda").repeat(256, 2)
    scale = torch.arange(256, dtype=torch.uint8, device="cuda")[:, None]
    want = q8.dequantize(q8.pack_4bit(codes), scale.view(q8.E8M0), mxq)
    out = torch.full((256, 32), float("nan"), device="cuda")
    mx[(1,)](w4_layout.relayout(q8.pack_4bit(codes), mxq).view(torch.int32), scale.expand(256, 4).contiguous(), out,
             256, 4)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))
    zero = torch.arange(16, dtype=torch.uint8, device="cuda")[:, None]
    codes = codes[:16]
    want = q8.dequantize(q8.pack_4bit(codes), torch.ones(16, 1, device="cuda"), QuantSpec.int4(32, True), zero=zero)
    out = torch.full((16, 32), float("nan"), device="cuda")
    i4[(1,)](q8.pack_4bit(codes).view(torch.int32), zero, out, 16, 4)
    assert torch.equal(out, want)


@pytest.mark.parametrize("name,spec,T", [("gpt_oss_120b", GPT_OSS_120B, 16), ("gpt_oss_120b", GPT_OSS_120B, 128),
                                         ("int4_g128_zp", INT4, 64)])
def test_mma_form_real_layer(name, spec, T, monkeypatch):
    for var in ("MOECOMP_CONFIG", "MOECOMP_W4_FOLD", "MOECOMP_W4_DECODE", "MOECOMP_DECODE_MAX_T"):
        monkeypatch.delenv(var, raising=False)
    args, extra = packed_args(spec, T, torch.bfloat16, seed=T)
    monkeypatch.delenv("MOECOMP_W4_FORM", raising=False)
    default = torch.ops.moecomp.moe_forward(*args, spec.key, **extra)
    monkeypatch.setenv("MOECOMP_W4_FORM", "mma")
    x = args[0]
    graph, out = capture_moe_forward(x.clone(), args[1:], spec, sync_check=True, extra=extra)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.moe_forward(*args, spec, **extra)
    assert torch.isfinite(out).all()
    err, err_default = rel_err(out, ref), rel_err(out, default)
    assert err < TOL and err_default < TOL, f"{name} T={T}: vs reference {err:.2e}, vs default form {err_default:.2e}"


@functools.lru_cache(maxsize=1)  # one layer's weights at a time (gpt-oss-120b: 1.1 GB packed)
def _decode_layer(name: str):
    return packed_args(DECODE[name], 8, torch.bfloat16, seed=8)


def _spy_forms(monkeypatch):
    from moecomp.ops import triton_moe

    seen = []
    for fn, qi in (("gemm1", 8), ("gemm2", 9), ("decode_down", 11), ("align", None)):
        real = getattr(triton_moe, fn)

        def spy(*a, _real=real, _fn=fn, _qi=qi, **kw):
            q = {} if _qi is None else (kw.get("q") or (a[_qi] if len(a) > _qi else None) or {})
            seen.append((_fn, q.get("W4_FORM", 0), q.get("W4_K32", 0)))
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, spy)
    return seen


@pytest.mark.parametrize("mode", ["fused", "pairs"])
@pytest.mark.parametrize("name", sorted(DECODE))
def test_mma_form_decode_path(name, mode, monkeypatch):
    from moecomp.ops import tuning

    for var in ("MOECOMP_CONFIG", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM", "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOECOMP_W4_DECODE", "dot")
    monkeypatch.setenv("MOECOMP_DECODE_MAX_T", "8")  # the decode path at every T here, whatever the table's limit
    spec = DECODE[name]
    args, extra = _decode_layer(name)
    dev = torch.device("cuda")
    seen = _spy_forms(monkeypatch)
    want = [("gemm1", 4, 1), ("decode_down", 4, 1)] + ([("gemm2", 4, 1)] if mode == "pairs" else [])
    for T in (1, 2, 4, 8):
        monkeypatch.delenv("MOECOMP_CONFIG", raising=False)  # not the previous T's (get_config would return it)
        cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, spec.top_k,
                                torch.bfloat16, dev, spec.quant)
        dec = tuning.decode_config(cfg, T, dev)
        assert dec is not None, f"{name} T={T}: not on the decode path"
        monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(cfg, decode=dict(dec, g2=dict(dec["g2"], mode=mode)))))
        x = args[0][:T].contiguous()
        monkeypatch.delenv("MOECOMP_W4_FORM", raising=False)
        default = torch.ops.moecomp.moe_forward(x, *args[1:], spec.key, **extra)  # DIRECT, the default form
        monkeypatch.setenv("MOECOMP_W4_FORM", "mma")
        seen.clear()
        graph, out = capture_moe_forward(x.clone(), args[1:], spec, sync_check=True, extra=extra)
        assert seen == want * 3, f"{name} T={T} {mode}: launches {seen}"  # two warm-up calls and the capture
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.moe_forward(x, *args[1:], spec, **extra)
        assert torch.isfinite(out).all(), f"{name} T={T} {mode}: non-finite output"
        err, err_default = rel_err(out, ref), rel_err(out, default)
        assert err < TOL and err_default < TOL, (f"{name} T={T} {mode}: vs reference {err:.2e}, vs the DIRECT "
                                                 f"default form {err_default:.2e}")
