"""Property tests for the softcapped gated silu (``MoESpec.gate_softcap`` / ``up_softcap``, shared experts' too):
``moe_forward`` against ``moecomp.oracle.reference`` on random specs and inputs, CPU, fp32.

hypothesis draws E, k, odd H / I, each cap 0 (uncapped) or in [0.2, 6] (of the order of the pre-activations, so
tanh bends), both gate/up orders and weight layouts, expert biases, softmax / sigmoid routing with or without a
correction bias and renormalisation, a shared expert (separate or concat, its own caps) or none, and T = 0..24.
Derandomized (the same examples every run). The torch path takes 60 cases,
the Triton kernels under the interpreter 8 (tiny shapes; tests/ops/test_softcap.py runs fixed Triton cases).
Outputs NaN-poisoned (``poison``); every output finite; per token max |out - ref| <= 1e-5 x max|ref| of the case,
except tokens near a routing tie (``reference.near_tie_tokens``, relative logit window 1e-5), which two correct
routers may route apart."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moecomp.oracle import reference
from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.testing import random_moe_args

TOL = 1e-5
caps = st.one_of(st.just(0.0), st.floats(0.2, 6.0, allow_nan=False).map(lambda c: round(c, 3)))


@st.composite
def softcap_specs(draw, tiny: bool):
    E = draw(st.integers(2, 6 if tiny else 9))
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    shared = None
    if draw(st.booleans()):
        shared = SharedExpertSpec(draw(st.integers(3, 12 if tiny else 20)), layout=draw(st.sampled_from(
            ["separate", "concat"])), gate_softcap=draw(caps), up_softcap=draw(caps))
    return MoESpec(
        num_experts=E, top_k=draw(st.integers(1, E)), hidden_size=draw(st.integers(3, 16 if tiny else 40)),
        intermediate_size=draw(st.integers(2, 12 if tiny else 24)), scoring=scoring,
        has_correction_bias=scoring == "sigmoid" and draw(st.booleans()), renormalize=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), gate_up=draw(st.sampled_from(
            ["concat", "interleaved"])), w_layout=draw(st.sampled_from(["out_in", "in_out"])),
        has_expert_bias=draw(st.booleans()), gate_softcap=draw(caps), up_softcap=draw(caps), shared=shared)


def _check(spec: MoESpec, T: int, seed: int) -> None:
    args = random_moe_args(spec, T, torch.float32, seed=seed, std=0.4)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == ref.shape and torch.isfinite(out).all(), f"{spec.describe()} T={T}: non-finite output"
    if not T:
        return
    tok_err = (out.double() - ref.double()).abs().amax(-1) / ref.abs().max().double().clamp_min(1e-30)
    off = tok_err > TOL
    if off.any():
        near = reference.near_tie_tokens(args[0], args[1], args[2], args[3], spec, 1e-5)
        assert not (off & ~near).any(), f"{spec.describe()} T={T}: tokens off by {tok_err[off & ~near].tolist()}"


@pytest.mark.parametrize("backend, examples, tiny", [("torch", 60, False), ("triton", 8, True)])
def test_softcap_op_matches_reference(monkeypatch, poison, backend, examples, tiny):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(spec=softcap_specs(tiny), T=st.integers(0, 24), seed=st.integers(0, 2**16))
    def prop(spec, T, seed):
        _check(spec, T, seed)

    prop()
