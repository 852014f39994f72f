"""GPU tests of the dot-free 4-bit decode path (``kernels/quant4_gemv.py``, ``ops/triton_quant4_gemv.py``; H200
class, skipped without CUDA): the op at gpt-oss-20b's layer size (E=32, k=4, H=I=2880, mxfp4, gate / up interleaved,
swiglu_oai with its clamp, expert and router biases) and a Qwen3-30B-A3B-like int4 layer (E=128, k=8, H=2048, I=768,
group 128, zero points), bf16, T in {1, 2, 4}: the GEMV path (MOECOMP_W4_DECODE=gemv) against ``moecomp.oracle.reference``
on the same packed tensors and against the DIRECT dot path (MOECOMP_W4_DECODE=dot); the tile options (REDUCE_END 0,
PREFETCH 0, the inline-PTX conversions) against the default; CUDA-graph capture and replay with no host sync.

Bounds (relative Frobenius error): against the reference 1e-2 (h and the output rounded to bf16; expected ~3e-3, as
tests/ops/test_quant4_gpu.py); GEMV against dot 1e-2 (both at ~3e-3 from the reference, in different directions);
an option against the default 1e-2 (the same products; REDUCE_END / PREFETCH change only the fp32 summation order,
the inline PTX nothing: expected 0 for ASM). ``pytest tests/ops/test_quant4_gemv_gpu.py -q`` (a few seconds).
"""

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_quant4_gemv, tuning
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.testing import capture_moe_forward
from test_gpu import poison_cache, rel_err  # (tests/ops is on sys.path, no package)
from test_quant4_gpu import packed_args

pytestmark = pytest.mark.gpu

BOUND = 1e-2
GPT_OSS_20B = MoESpec(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                      activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                      has_router_bias=True, score_order="topk_then_score", quant=QuantSpec.mxfp4())
QWEN3_INT4 = MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                     quant=QuantSpec.int4(128, zero_point=True))
SPECS = {"gpt_oss_20b_mxfp4": GPT_OSS_20B, "qwen3_int4_g128_zp": QWEN3_INT4}
ENV = ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM", "MOECOMP_W4_DECODE",
       "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM")


@pytest.fixture(scope="module")
def layers():
    return {name: packed_args(spec, 4, torch.bfloat16, seed=11) for name, spec in SPECS.items()}


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _run(spec, args, extra, T, monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = {"gemv": 0}
    real = triton_quant4_gemv.routed

    def counted(*a, **kw):
        calls["gemv"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(triton_quant4_gemv, "routed", counted)
    a = (args[0][:T],) + args[1:]
    poison_cache()
    out = torch.ops.moecomp.moe_forward(*a, spec.key, **extra)
    torch.cuda.synchronize()
    monkeypatch.setattr(triton_quant4_gemv, "routed", real)
    for k in env:
        monkeypatch.delenv(k)
    assert torch.isfinite(out).all(), f"non-finite (unwritten) output with {env}"
    return out, calls["gemv"], reference.moe_forward(*a, spec, **extra)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_gemv_against_reference_and_dot(name, layers, clean_env):
    spec = SPECS[name]
    args, extra = layers[name]
    errs = {}
    for T in (1, 2, 4):
        g, n_gemv, ref = _run(spec, args, extra, T, clean_env, MOECOMP_W4_DECODE="gemv")
        d, n_dot, _ = _run(spec, args, extra, T, clean_env, MOECOMP_W4_DECODE="dot")
        h, n_heur, _ = _run(spec, args, extra, T, clean_env)  # the config (heuristic: gemv up to QUANT4_GEMV_MAX_T)
        cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, spec.top_k,
                                torch.bfloat16, args[0].device, spec.quant)
        dec = tuning.decode_config(cfg, T, args[0].device)
        want_gemv = int(dec is not None and dec.get("mode") == "gemv")
        assert (n_gemv, n_dot, n_heur) == (1, 0, want_gemv)
        errs[T] = (rel_err(g, ref), rel_err(d, ref), rel_err(g, d))
        assert torch.equal(h, g if want_gemv else d)
    assert max(max(e) for e in errs.values()) < BOUND, f"{name}: (gemv-ref, dot-ref, gemv-dot) by T {errs}"


OPTIONS = {  # name: environment (against the default GEMV tiles)
    "reduce every step": {"MOECOMP_W4_GEMV": '{"gemv1": {"REDUCE_END": 0}, "gemv2": {"REDUCE_END": 0}}'},
    "no prefetch": {"MOECOMP_W4_GEMV": '{"gemv1": {"PREFETCH": 0}, "gemv2": {"PREFETCH": 0}}'},
    "wide tiles": {"MOECOMP_W4_GEMV": '{"gemv1": {"BLOCK_N": 64, "BLOCK_K": 64}, "gemv2": {"BLOCK_N": 32, '
                                      '"BLOCK_K": 256}}'},
    "inline ptx": {"MOECOMP_W4_ASM": "1"},
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_gemv_options(name, option, layers, clean_env):
    spec = SPECS[name]
    args, extra = layers[name]
    for T in (1, 4):
        base, _, ref = _run(spec, args, extra, T, clean_env, MOECOMP_W4_DECODE="gemv")
        got, n, _ = _run(spec, args, extra, T, clean_env, MOECOMP_W4_DECODE="gemv", **OPTIONS[option])
        assert n == 1 and rel_err(got, base) < BOUND and rel_err(got, ref) < BOUND, (T, rel_err(got, base))
        if option == "inline ptx":  # the same values in the same order
            assert torch.equal(got, base), f"T={T}: inline PTX differs by {rel_err(got, base):.2e}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_gemv_cuda_graph_capture_and_replay(name, layers, clean_env):
    """Captured at T = 1 on the GEMV path (a host sync during capture raises), replayed on new inputs, each replay's
    output (NaN-filled first) against the reference."""
    clean_env.setenv("MOECOMP_W4_DECODE", "gemv")
    spec = SPECS[name]
    args, extra = layers[name]
    static_x = args[0][:1].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, sync_check=True, extra=extra)
    for seed in range(3):
        x = torch.randn(1, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x.to(torch.bfloat16))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(static_out).all()
        assert rel_err(static_out, reference.moe_forward(static_x, *args[1:], spec, **extra)) < BOUND
