"""GPU: the dot-free (GEMV) 4-bit decode kernels on weights held in the "mma" layout (``QuantSpec.layout``; issue 42
item 1; skipped without CUDA). CPU tests: tests/kernels/test_quant4_gemv_mma.py; the packed GEMV's GPU tests:
tests/ops/test_quant4_gemv_gpu.py.

gpt-oss-120b's layer (E 128, H = I = 2880, top-4, swiglu_oai with its clamp, expert and router biases, mxfp4) and
a Qwen3-30B-A3B-size int4 layer (group 128, zero points), bf16, T in {1, 2, 4}, MOECOMP_W4_DECODE=gemv:

* the op with the spec's layout "mma" on ``w4_layout.relayout``'s tensors (what ``optimize`` holds with
  MOECOMP_W4_FORM=mma) runs the GEMV (counted) and equals the op on the packed tensors bit for bit (the same fp16
  weight bits from the mma words, the same sums: ``torch.equal``), also with the inline-PTX conversions
  (MOECOMP_W4_ASM=1); against the oracle on the mma bytes: relative Frobenius error < 1e-2 (h and the output
  rounded to bf16, as tests/ops/test_quant4_gemv_gpu.py); outputs checked finite after a NaN-poisoned allocator;
* captured in a CUDA graph at T = 1 (a host sync raises) and replayed on new inputs (output NaN-filled first),
  each replay against the oracle.

``pytest tests/ops/test_quant4_gemv_mma_gpu.py -q`` (under a minute: the gpt-oss layer's quantization dominates).
"""

import dataclasses

import pytest
import torch

from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.oracle import reference
from moecomp.ops import triton_quant4_gemv, w4_layout
from moecomp.testing import capture_moe_forward
from test_gpu import poison_cache, rel_err  # (tests/ops is on sys.path, no package)
from test_quant4_gpu import packed_args

pytestmark = pytest.mark.gpu

BOUND = 1e-2
GPT_OSS_120B = MoESpec(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                       activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                       has_router_bias=True, score_order="topk_then_score", quant=QuantSpec.mxfp4())
QWEN3_INT4 = MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                     quant=QuantSpec.int4(128, zero_point=True))
SPECS = {"gpt_oss_120b": GPT_OSS_120B, "qwen3_int4_g128_zp": QWEN3_INT4}
ENV = ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM", "MOECOMP_W4_DECODE",
       "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM")


@pytest.fixture(scope="module")
def layers():
    """name -> (packed args, extra, mma spec, held args: w13 / w2 re-laid)."""
    out = {}
    for name, spec in SPECS.items():
        args, extra = packed_args(spec, 4, torch.bfloat16, seed=17)
        held = list(args)
        for n in ("w13", "w2"):
            i = 1 + MOE_ARGS.index(n)
            held[i] = w4_layout.relayout(args[i], spec.quant)
        mspec = spec.replace(quant=dataclasses.replace(spec.quant, layout="mma"))
        out[name] = (args, extra, mspec, tuple(held))
    return out


@pytest.fixture
def gemv_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOECOMP_W4_DECODE", "gemv")
    return monkeypatch


def _run(spec, args, T, extra, monkeypatch):
    calls = []
    real = triton_quant4_gemv.routed

    def counted(x, ids_flat, weights, a, *rest, **kw):
        calls.append(a["w13"].data_ptr())
        return real(x, ids_flat, weights, a, *rest, **kw)

    monkeypatch.setattr(triton_quant4_gemv, "routed", counted)
    poison_cache()
    out = torch.ops.moecomp.moe_forward(args[0][:T], *args[1:], spec.key, **extra)
    torch.cuda.synchronize()
    monkeypatch.setattr(triton_quant4_gemv, "routed", real)
    assert torch.isfinite(out).all(), f"non-finite (unwritten) output at T={T}"
    assert calls == [args[1 + MOE_ARGS.index("w13")].data_ptr()], calls  # the GEMV, once, on these tensors
    return out


@pytest.mark.parametrize("asm", [0, 1], ids=["plain", "inline_ptx"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_gemv_on_mma_layout_equals_packed(name, asm, layers, gemv_env):
    args, extra, mspec, held = layers[name]
    if asm:
        gemv_env.setenv("MOECOMP_W4_ASM", "1")
    errs = {}
    for T in (1, 2, 4):
        on_packed = _run(SPECS[name], args, T, extra, gemv_env)
        on_mma = _run(mspec, held, T, extra, gemv_env)
        ref = reference.moe_forward(held[0][:T], *held[1:], mspec, **extra)  # the oracle's decode of the mma bytes
        errs[T] = rel_err(on_mma, ref)
        assert torch.equal(on_mma, on_packed), f"{name} T={T}: mma vs packed {rel_err(on_mma, on_packed):.2e}"
    assert max(errs.values()) < BOUND, f"{name}: rel err by T {errs}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_gemv_on_mma_layout_cuda_graph(name, layers, gemv_env):
    args, extra, mspec, held = layers[name]
    static_x = held[0][:1].clone()
    graph, static_out = capture_moe_forward(static_x, held[1:], mspec, sync_check=True, extra=extra)
    for seed in range(3):
        x = torch.randn(1, mspec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x.to(torch.bfloat16))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(static_out).all()
        assert rel_err(static_out, reference.moe_forward(static_x, *held[1:], mspec, **extra)) < BOUND
