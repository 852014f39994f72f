"""Property tests for a bias on one expert GEMM only (``MoESpec.expert_bias`` "gemm1": b13 alone, "gemm2": b2 alone;
"both" drawn too, as the control): ``moe_forward`` and ``moe_experts`` against ``moecomp.oracle.reference`` on random specs
and inputs, CPU, fp32.

hypothesis draws E, k, odd H / I, every activation gated or not (swiglu_oai gated, with its clamp), both weight
layouts and gate / up orders, softmax / sigmoid routing with or without a correction bias and renormalisation, a
shared expert or none, and T = 0..24 (T <= 8 takes the Triton decode path on CPU, more the aligned grouped GEMMs).
Derandomized (the same examples every run). The side of the bias is a test parameter (not drawn: every side is
reached whatever hypothesis draws); per side the torch path takes 27 moe_forward + 14 moe_experts cases, the Triton
kernels under the interpreter 6 + 3 (tiny shapes). Each run asserts its cases ran.
Outputs NaN-poisoned (``poison``); every output finite; per token max |out - ref| <= 1e-5 x max|ref| of the case,
except moe_forward tokens near a routing tie (``reference.near_tie_tokens``, relative logit window 1e-5), which two
correct routers may route apart; moe_experts has no routing to tie.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moecomp.oracle import reference
from moecomp.core.spec import ACTIVATIONS, EXPERT_BIASES, MoESpec, SharedExpertSpec
from moecomp.testing import random_moe_args

TOL = 1e-5
SIZES = {"torch": dict(E=9, H=40, I=24), "triton": dict(E=5, H=12, I=8)}
EXAMPLES = {"torch": (27, 14), "triton": (6, 3)}  # (moe_forward, moe_experts) cases per side


@st.composite
def bias_specs(draw, sizes: dict, side: str):
    E = draw(st.integers(2, sizes["E"]))
    activation = draw(st.sampled_from(ACTIVATIONS))
    gated = activation == "swiglu_oai" or draw(st.booleans())
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    shared = SharedExpertSpec(draw(st.integers(2, sizes["I"]))) if draw(st.booleans()) else None
    return MoESpec(
        num_experts=E, top_k=draw(st.integers(1, E)), hidden_size=draw(st.integers(3, sizes["H"])),
        intermediate_size=draw(st.integers(2, sizes["I"])), scoring=scoring,
        has_correction_bias=scoring == "sigmoid" and draw(st.booleans()), renormalize=draw(st.booleans()),
        activation=activation, gated=gated, activation_limit=draw(st.sampled_from([0.5, 7.0])),
        w_layout=draw(st.sampled_from(["out_in", "in_out"])),
        gate_up=draw(st.sampled_from(["concat", "interleaved"])) if gated else "concat",
        has_expert_bias=True, expert_bias=side, shared=shared)


def _off(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T] bool: tokens off by more than TOL x max|ref|."""
    return (out.double() - ref.double()).abs().amax(-1) > TOL * ref.abs().max().double().clamp_min(1e-30)


def _forward(spec: MoESpec, T: int, seed: int) -> None:
    args = random_moe_args(spec, T, torch.float32, seed=seed, std=0.4)
    assert (args[5] is None, args[7] is None) == (not spec.has_b13, not spec.has_b2)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == ref.shape and torch.isfinite(out).all(), f"{spec.describe()} T={T}: non-finite output"
    off = _off(out, ref) if T else torch.zeros(0, dtype=torch.bool)
    if off.any():
        near = reference.near_tie_tokens(args[0], args[1], args[2], args[3], spec, 1e-5)
        assert not (off & ~near).any(), f"{spec.describe()} {spec.expert_bias} T={T}: tokens off"


def _experts(spec: MoESpec, T: int, seed: int) -> None:
    args = random_moe_args(spec, T, torch.float32, seed=seed, std=0.4)
    x, w13, b13, w2, b2 = args[0], args[4], args[5], args[6], args[7]
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k] for _ in range(T)]) if T else \
        torch.zeros(0, spec.top_k, dtype=torch.long)
    w = torch.rand(T, spec.top_k, generator=g)
    out = torch.ops.moecomp.moe_experts(x, ids, w, w13, b13, w2, b2, spec.key)
    ref = reference.experts(x, ids, w, w13, b13, w2, b2, spec)
    assert torch.isfinite(out).all() and not (T and _off(out, ref).any()), f"{spec.describe()} {spec.expert_bias}"


@pytest.mark.parametrize("side", EXPERT_BIASES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_sided_bias_matches_reference(monkeypatch, poison, backend, side):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    seen: dict = {}
    n_fwd, n_exp = EXAMPLES[backend]

    def settings_for(n):
        return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                        suppress_health_check=list(HealthCheck))

    @settings_for(n_fwd)
    @given(spec=bias_specs(SIZES[backend], side), T=st.integers(0, 24), seed=st.integers(0, 2**16))
    def forward(spec, T, seed):
        seen[("moe_forward", spec.expert_bias)] = seen.get(("moe_forward", spec.expert_bias), 0) + 1
        _forward(spec, T, seed)

    @settings_for(n_exp)
    @given(spec=bias_specs(SIZES[backend], side), T=st.integers(0, 24), seed=st.integers(0, 2**16))
    def experts(spec, T, seed):
        seen[("moe_experts", spec.expert_bias)] = seen.get(("moe_experts", spec.expert_bias), 0) + 1
        _experts(spec, T, seed)

    forward()
    experts()
    for op in ("moe_forward", "moe_experts"):
        assert seen.get((op, side), 0) >= 2, seen
