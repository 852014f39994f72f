"""The one-launch decode path of the routed experts (``ops/decode_fused.py``, ``kernels/decode_fused.py``) under
Triton's interpreter, against ``moecomp.reference.experts`` (+ the gated shared experts) on the same ids and weights,
outputs NaN-poisoned first (``poison``): gated concat / interleaved and ungated experts, both weight layouts, expert
biases, every activation (swiglu_oai and the clamp included), with and without a gated shared expert, T = 1 ... 4,
top-k 1 ... 4, I not a multiple of BLOCK_I and H not a multiple of BLOCK_H.

Tolerances (relative Frobenius error): fp32 2e-6 (the atomics add the slices' partial sums in another order than
the reference's one dot per expert); fp16 3e-3 (h rounded to fp16 as the two-kernel path stores it; fp16 inputs).
A mutation check: without the last program's write, ``out`` stays NaN (the poison shows it)."""

import dataclasses

import pytest
import torch

from moecomp import reference
from moecomp.ops import decode_fused
from moecomp.ops.common import MOE_ARGS
from moecomp.spec import MoESpec, SharedExpertSpec
from moecomp.testing import random_moe_args

TOL = {torch.float32: 2e-6, torch.float16: 3e-3}
BASE = MoESpec(num_experts=6, top_k=2, hidden_size=200, intermediate_size=40)
SPECS = {
    "silu-concat": BASE,
    "silu-interleaved-in_out-bias": dataclasses.replace(BASE, gate_up="interleaved", w_layout="in_out",
                                                         has_expert_bias=True),
    "gelu-ungated": dataclasses.replace(BASE, gated=False, activation="gelu"),
    "swiglu_oai-bias": dataclasses.replace(BASE, activation="swiglu_oai", has_expert_bias=True, gate_up="interleaved"),
    "silu-clamp": dataclasses.replace(BASE, activation_clamp=True, activation_limit=0.3),
    "shared-gated": dataclasses.replace(BASE, shared=SharedExpertSpec(24, gate="sigmoid")),
}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(spec: MoESpec, T: int, dtype, seed: int):
    args = random_moe_args(spec, T, dtype, seed=seed)
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(T)]).int()
    weights = torch.rand(T, spec.top_k, generator=g) + 0.1  # fp32, as the routing kernel gives them
    return x, t, ids, weights


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("T,k", [(1, 4), (3, 2)])
def test_fused_decode_matches_reference(poison, name, T, k):
    spec = dataclasses.replace(SPECS[name], top_k=k)
    for dtype in (torch.float32, torch.float16):
        x, t, ids, weights = _case(spec, T, dtype, seed=T * 10 + k)
        assert decode_fused.unsupported(spec, x, t) is None
        want = reference.experts(x, ids.long(), weights, t["w13"], t["b13"], t["w2"], t["b2"], spec)
        shared = gate = None
        if spec.shared is not None:
            ungated = dataclasses.replace(spec, shared=dataclasses.replace(spec.shared, gate="none"))
            s = reference.shared_experts(x, t["shared_w1"], t["shared_w3"], t["shared_w2"], None, ungated)
            shared = s.to(dtype)
            gate = (x.float() @ t["shared_gate_w"].float().T).reshape(-1).to(dtype)  # [T] logits
            want = want + torch.sigmoid(gate.float())[:, None] * shared.float()
        out = torch.empty_like(x)
        got = decode_fused.routed(x, ids, weights, t, spec, out, shared, gate)
        assert got is out and torch.isfinite(got).all()
        assert rel_err(got, want) < TOL[dtype], f"{name} T={T} k={k} {dtype}: {rel_err(got, want):.2e}"


def test_unsupported_and_gate(monkeypatch):
    x = torch.zeros(1, 200)
    t = dict(w13=torch.zeros(6, 80, 200), w2=torch.zeros(6, 200, 40))
    assert decode_fused.unsupported(dataclasses.replace(BASE, weight_on_input=True), x, t) == "weight_on_input"
    assert decode_fused.unsupported(BASE, x.half(), t) == "expert weights in another dtype than x"
    monkeypatch.delenv("MOECOMP_DECODE_FUSED", raising=False)
    assert not decode_fused.enabled(1)  # off by default (not measured on a GPU yet)
    monkeypatch.setenv("MOECOMP_DECODE_FUSED", "1")
    assert decode_fused.enabled(4) and not decode_fused.enabled(5) and not decode_fused.enabled(0)


def test_last_program_writes_the_output(poison, monkeypatch):
    """Mutation: a finisher that never fires (the counter's target off by one) leaves the poisoned output."""
    from moecomp.kernels import decode_fused as k

    x, t, ids, weights = _case(BASE, 1, torch.float32, seed=3)
    real = k.moe_decode_fused_kernel
    monkeypatch.setattr(k, "moe_decode_fused_kernel", _Shifted(real))
    out = decode_fused.routed(x, ids, weights, t, BASE, torch.empty_like(x))
    assert torch.isnan(out).all()


class _Shifted:
    """The kernel launched with TOP_K one larger in the counter's target only: emulated by one more slice."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*a, **kw):
            kw["SLICES"] = kw["SLICES"] + 1  # the counter then waits for programs that are never launched
            return self.fn[grid](*a, **kw)
        return launch


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3_30b_a3b", "qwen15_moe_a27b", "mixtral_8x7b"])
@pytest.mark.parametrize("T", [1, 4])
def test_fused_decode_gpu_real_sizes(preset, T):
    """bf16 at real layer sizes on the GPU, against the fp32 reference on the same ids and weights (2e-2, the bf16
    tolerance of the op's GPU tests), and twice in a row (the accumulator and counters are zeroed per call)."""
    from moecomp.testing import LAYER_PRESETS

    spec = dataclasses.replace(LAYER_PRESETS[preset], shared=None)
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T)
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g, device="cuda")[: spec.top_k]
                       for _ in range(T)]).int()
    weights = torch.rand(T, spec.top_k, generator=g, device="cuda") + 0.1
    want = reference.experts(x, ids.long(), weights, t["w13"], t["b13"], t["w2"], t["b2"], spec)
    for _ in range(2):
        got = decode_fused.routed(x, ids, weights, t, spec, torch.full_like(x, float("nan")))
        assert torch.isfinite(got).all() and rel_err(got, want) < 2e-2, rel_err(got, want)


@pytest.mark.parametrize("spec", [SPECS["shared-gated"], dataclasses.replace(BASE, zero_experts=2)],
                         ids=["shared", "zero-experts"])
def test_op_takes_the_fused_path_when_asked(poison, monkeypatch, spec):
    """torch.ops.moecomp.moe_forward on the Triton path (interpreter) with MOECOMP_DECODE_FUSED=1 at T=3: the fused
    kernel runs (counted) and the whole block equals the reference (routing included, fp32 2e-6); a spec it does not
    support (zero experts) takes the two-kernel path and is equal too."""
    from moecomp.ops import triton_moe

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv("MOECOMP_DECODE_FUSED", "1")
    calls = []
    real = decode_fused.routed
    monkeypatch.setattr(decode_fused, "routed", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    args = random_moe_args(spec, 3, torch.float32, seed=5)
    got = torch.ops.moecomp.moe_forward(*args, spec.key)
    want = reference.moe_forward(*args, spec=spec)
    assert calls == ([] if spec.zero_experts else [1]) and triton_moe.decode_fused is decode_fused
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL[torch.float32]
