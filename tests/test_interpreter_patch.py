"""tests/conftest.py's ``skip_repatching_nested_calls`` (the Triton interpreter without the per-call re-patching of
triton.language in @triton.jit helpers): installed under the interpreter, and the op's Triton kernels give
bit-identical outputs with it and with the plain interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.testing import random_moe_args

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                 reason="the interpreter runs the kernels only without CUDA")

SPECS = [  # helpers of every kind: routing (groups, correction bias), gated / clamped activations, shared expert
    MoESpec(num_experts=6, top_k=2, hidden_size=12, intermediate_size=8, scoring="sigmoid", n_group=3, topk_group=2,
            has_correction_bias=True, activation_clamp=True, activation_limit=1.0,
            shared=SharedExpertSpec(6, gate="sigmoid")),
    MoESpec(num_experts=5, top_k=3, hidden_size=9, intermediate_size=7, gated=False, activation="relu2",
            w_layout="in_out", has_expert_bias=True, has_router_bias=True),
]


@interpreted
def test_installed():
    from triton.runtime import interpreter as ti

    if os.environ.get("MOECOMP_TEST_PLAIN_INTERPRETER"):
        pytest.skip("MOECOMP_TEST_PLAIN_INTERPRETER=1: the plain interpreter runs")
    assert getattr(ti.InterpretedFunction.__call__, "_moecomp_fast", False)


@interpreted
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("i", range(len(SPECS)))
def test_bit_identical_to_the_plain_interpreter(i, T, monkeypatch, poison):
    from triton.runtime import interpreter as ti

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    spec = SPECS[i]
    args = random_moe_args(spec, T, seed=3 + i)
    fast = ti.InterpretedFunction.__call__
    plain = getattr(fast, "_moecomp_plain", fast)
    outs = []
    for call in (plain, fast, plain):
        monkeypatch.setattr(ti.InterpretedFunction, "__call__", call)
        outs.append(torch.ops.moecomp.moe_forward(*args, spec.key))
    assert all(torch.isfinite(o).all() for o in outs)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
