"""The TMA GEMMs (``kernels/grouped_gemm_tma.py``) against ``moecomp.oracle.reference``, under the interpreter in fp16 (CPU;
the GPU tests run them in bf16 at real sizes). Configs force them on (``"tma": 1``; gemm1 with x's rows by pointer
loads or gathered and read by TMA, ``"tma_a"``), their launches are counted so a silent fall-back to the pointer
GEMMs fails the test, and every torch.empty is NaN-poisoned.

Shapes: H=72 and I=48 against 32-wide tiles, so tiles straddle the end of an expert's rows and of K. Tolerance:
relative Frobenius error below 5e-3 against the fp32 reference on the same fp16 tensors."""

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec
from moecomp.testing import random_moe_args

TILE = dict(BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)


def _cfg(g1_tma: str | None = None) -> dict:
    g1 = dict(TILE, **({"tma": 1, "tma_a": g1_tma == "a"} if g1_tma else {}))
    return dict(BLOCK_M=16, g1=g1, g2=dict(TILE, tma=1), decode=dict(max_t=0))


@pytest.fixture
def tma_calls(monkeypatch):
    calls = []
    for name in ("_gemm1_tma", "_gemm2_tma"):
        real = getattr(triton_moe, name)
        monkeypatch.setattr(triton_moe, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    return calls


def _run(spec, T, dtype, cfg, seed=0):
    args = random_moe_args(spec, T, dtype, "cpu", seed=seed)
    x, named = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits, _ = triton_moe.router_logits(x, named, spec)
    ids, w = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    out = triton_moe.routed(x, ids, w, named, spec, torch.empty_like(x), cfg=cfg)
    ref = reference.moe_forward(*(a.float() if a is not None and a.is_floating_point() else a for a in args), spec)
    return out, ref


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = {
    "silu-gated": dict(),
    "bias": dict(has_expert_bias=True),
    "relu2-plain": dict(gated=False, activation="relu2"),
}


@pytest.mark.parametrize("g1", [None, "ptr", "a"])
@pytest.mark.parametrize("case", list(CASES))
def test_tma_gemms_match_reference(poison, tma_calls, case, g1):
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=72, intermediate_size=48, **CASES[case])
    out, ref = _run(spec, 37, torch.float16, _cfg(g1))
    assert tma_calls == (["_gemm1_tma"] if g1 else []) + ["_gemm2_tma"]
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("why", ["fp32", "in_out", "strided", "interleaved"])
def test_tma_config_falls_back_where_tma_cannot_read(poison, tma_calls, why):
    """A TMA config on operands TMA cannot take runs the pointer GEMMs: same results, no TMA launch (interleaved
    gate/up: gemm1 only; gemm2's operands are the same as with concatenated ones)."""
    fields = dict(in_out=dict(w_layout="in_out"), interleaved=dict(gate_up="interleaved")).get(why, {})
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=72, intermediate_size=48, **fields)
    dtype = torch.float32 if why == "fp32" else torch.float16
    args = list(random_moe_args(spec, 21, dtype, "cpu", seed=3))
    if why == "strided":  # every other expert of a bigger tensor: not one 2-D matrix
        for name in ("w13", "w2"):
            i = MOE_ARGS.index(name) + 1
            args[i] = torch.cat([args[i], args[i]], 0)[::2]
    x, named = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits, _ = triton_moe.router_logits(x, named, spec)
    ids, w = triton_moe.route(logits, named["correction_bias"], spec, x.dtype)
    out = triton_moe.routed(x, ids, w, named, spec, torch.empty_like(x), cfg=_cfg("a"))
    ref = reference.moe_forward(*(a.float() if a is not None and a.is_floating_point() else a for a in args), spec)
    assert tma_calls == (["_gemm2_tma"] if why == "interleaved" else [])
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 5e-3)


def test_tma_operand_checks():
    """``_tma_ok``: contiguous 16-bit operands with 16-byte rows only (a strided h, an odd row length, fp32 or an
    [in, out] layout run the pointer GEMM)."""
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=72, intermediate_size=48)
    h, w2 = torch.zeros(32, 48, dtype=torch.float16), torch.zeros(6, 72, 48, dtype=torch.float16)
    assert triton_moe._tma_ok(spec, h, w2)
    assert not triton_moe._tma_ok(spec, torch.zeros(32, 96, dtype=torch.float16)[:, :48], w2)
    assert not triton_moe._tma_ok(spec, h.float(), w2.float())
    assert not triton_moe._tma_ok(spec.replace(w_layout="in_out"), h, w2)
    odd = MoESpec(num_experts=6, top_k=2, hidden_size=72, intermediate_size=44)
    assert not triton_moe._tma_ok(odd, torch.zeros(32, 44, dtype=torch.float16),
                                  torch.zeros(6, 72, 44, dtype=torch.float16))
    x, w13 = torch.zeros(5, 72, dtype=torch.float16), torch.zeros(6, 96, 72, dtype=torch.float16)
    assert triton_moe._tma1_ok(spec, x, w13)
    assert not triton_moe._tma1_ok(spec.replace(gate_up="interleaved"), x, w13)
    assert not triton_moe._tma1_ok(spec, x, torch.zeros(6, 96, 80, dtype=torch.float16)[..., :72])
