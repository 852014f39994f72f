"""GPU tests of the 4-bit (w4a16) Triton path (H200 class; skipped without CUDA): the op at real layer sizes against
``moecomp.oracle.reference`` on the same packed tensors, CUDA-graph capture and replay, no host syncs.

The decode sizes (T <= ``tuning.QUANT4_GEMV_MAX_T``) run the dot-free GEMV kernels here (the heuristic's choice;
tests/ops/test_quant4_gemv_gpu.py compares them with the dot path), except in the options test.

Shapes: gpt-oss-20b's layer (E=32, k=4, H=I=2880, gate / up interleaved, swiglu_oai with its clamp, expert and router
biases, top-k then softmax; mxfp4: e2m1 codes, ue8m0 scales per 32 columns) and a Qwen3-30B-A3B-like int4 layer
(E=128, k=8, H=2048, I=768; group 128, fp16 scales, zero points), T in {1, 4, 16, 64, 512} (decode path up to 16
tokens, aligned above), bf16 and fp16.

The reference dequantizes exactly (fp32) and runs in fp32; the kernels use the same weights exactly (mxfp4 codes
times their power-of-two scale are exact in bf16 / fp16; int4's (code - zero) is exact and its scale multiplies the
fp32 partial sum), so what is left is the 16-bit roundings of h, of the per-pair outputs (aligned path) and of the
output: relative Frobenius error bound 1e-2 for bf16 (expected ~2-4e-3), 5e-3 for fp16 (expected ~1e-3). The
quantization itself is one to two orders of magnitude larger (13-17% on the CPU tests' small random layers).
"""

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.testing import capture_moe_forward, random_moe_args
from test_gpu import poison_cache, rel_err  # (tests/ops is on sys.path, no package: the bf16 GPU tests)

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
GPT_OSS_20B = MoESpec(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                      activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                      has_router_bias=True, score_order="topk_then_score", quant=QuantSpec.mxfp4())
QWEN3_INT4 = MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                     quant=QuantSpec.int4(128, zero_point=True))
SPECS = {"gpt_oss_20b_mxfp4": GPT_OSS_20B, "qwen3_int4_g128_zp": QWEN3_INT4}


def packed_args(spec: MoESpec, T: int, dtype: torch.dtype, seed: int):
    """``random_moe_args`` (std 0.02, on the GPU) with w13 / w2 quantized to the spec's 4-bit format a few experts
    at a time (``quant.quantize_4bit``'s mxfp4 search holds 8 fp32 copies of what it quantizes). Returns
    (positional args, {w13_scale, w2_scale (, w13_zero, w2_zero)})."""
    args = random_moe_args(spec, T, dtype, "cuda", std=0.02, seed=seed)
    t = dict(zip(MOE_ARGS, args[1:]))
    extra = {}
    for name in ("w13", "w2"):
        parts = [q8.quantize_4bit(t[name][e:e + 4], spec.quant) for e in range(0, spec.num_experts, 4)]
        t[name] = torch.cat([p[0] for p in parts])
        extra[f"{name}_scale"] = torch.cat([p[1] for p in parts])
        if spec.quant.zero_point:
            extra[f"{name}_zero"] = torch.cat([p[2] for p in parts])
    torch.cuda.empty_cache()
    return (args[0],) + tuple(t[n] for n in MOE_ARGS), extra


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_quant4_real_layer_sizes(name, dtype, monkeypatch):
    """Every T on one set of weights (the inputs drawn per T): the op against the reference."""
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM", "MOECOMP_W4_DECODE",
                "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM"):
        monkeypatch.delenv(var, raising=False)
    spec = SPECS[name]
    args, extra = packed_args(spec, 512, dtype, seed=1)
    errs = {}
    for T in (1, 4, 16, 64, 512):
        x = torch.randn(T, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(T))
        a = (x.to(dtype),) + args[1:]
        poison_cache()
        out = torch.ops.moecomp.moe_forward(*a, spec.key, **extra)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{name} T={T}: non-finite (unwritten) output"
        errs[T] = rel_err(out, reference.moe_forward(*a, spec, **extra))
    assert max(errs.values()) < TOL[dtype], f"{name} {dtype}: rel err by T {errs}"


OPTIONS = {  # name: (spec, environment, bound)
    "int4 split": (QWEN3_INT4, {"MOECOMP_W4_FORM": "split"}, TOL[torch.bfloat16]),
    "int4 fold": (QWEN3_INT4, {"MOECOMP_W4_FOLD": "1"}, 1.5e-2),  # one more bf16 rounding of each scaled weight
    "mxfp4 split": (GPT_OSS_20B, {"MOECOMP_W4_FORM": "split"}, TOL[torch.bfloat16]),
    "mxfp4 dot_scaled": (GPT_OSS_20B, {"MOECOMP_W4_FORM": "dot_scaled"}, TOL[torch.bfloat16]),
    "mxfp4 interleave": (GPT_OSS_20B, {"MOECOMP_W4_FORM": "interleave"}, TOL[torch.bfloat16]),
    "mxfp4 asm": (GPT_OSS_20B, {"MOECOMP_W4_FORM": "asm"}, TOL[torch.bfloat16]),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_quant4_options(option, monkeypatch):
    """The speed candidates (the K step's forms, int4's folded scale) at a decode and an aligned size, bf16 (the
    decode size on the dot kernels: MOECOMP_W4_DECODE=dot, not the GEMV ones the heuristic takes at T = 4)."""
    spec, env, bound = OPTIONS[option]
    monkeypatch.setenv("MOECOMP_W4_DECODE", "dot")
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    args, extra = packed_args(spec, 64, torch.bfloat16, seed=2)
    for T in (4, 64):
        a = (args[0][:T],) + args[1:]
        out = torch.ops.moecomp.moe_forward(*a, spec.key, **extra)
        assert torch.isfinite(out).all()
        assert rel_err(out, reference.moe_forward(*a, spec, **extra)) < bound


@pytest.mark.parametrize("name", sorted(SPECS))
def test_quant4_cuda_graph_capture_and_replay(name):
    """The op captured in a CUDA graph at T=1 (the decode path; a host sync during capture raises) and replayed on
    new inputs, each replay's output (NaN-filled first) against the reference."""
    spec = SPECS[name]
    args, extra = packed_args(spec, 1, torch.bfloat16, seed=3)
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, sync_check=True, extra=extra)
    for seed in range(3):
        x = torch.randn(1, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x.to(torch.bfloat16))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(static_out).all()
        assert rel_err(static_out, reference.moe_forward(static_x, *args[1:], spec, **extra)) < TOL[torch.bfloat16]


def test_quant4_eager_graphs_and_no_host_sync():
    """call_moe_forward (how bound blocks call the op) with 4-bit args: plain, captured (ops/graphs.py), replayed,
    each equal to plain launches; then no host sync on the hot path."""
    from moecomp.ops import graphs, triton_moe
    from moecomp.core.args import OP_ARGS
    from moecomp.ops.moe_op import call_moe_forward

    spec = GPT_OSS_20B
    T = 4
    args, extra = packed_args(spec, T, torch.bfloat16, seed=4)
    named = {**dict(zip(MOE_ARGS, args[1:])), **extra}
    tensors = tuple(named.get(n) for n in OP_ARGS)
    graphs.clear()
    for _ in range(3):
        x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        out = call_moe_forward(x, tensors, spec)
        torch.testing.assert_close(out, triton_moe.moe_forward(x, named, spec), rtol=0, atol=0)
    assert graphs.stats["capture_failed"] == 0, graphs.last_error
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ops.moecomp.moe_forward(*args, spec.key, **extra)
        call_moe_forward(args[0], tensors, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
