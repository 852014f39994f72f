"""router_gemv_kernel (``triton_moe.router_gemv``) against ``torch.nn.functional.linear`` on the operands converted
the way ``router_logits``'s linear path converts them, under the interpreter (fp32 / fp16; FACTS.md: no bf16 dots
on CPU, though this kernel has no dot). Outputs are poisoned with NaN first. Tolerances: fp32 rtol 1e-5 / atol 1e-5
(sum order), fp16 one half-precision ulp (rtol 1e-3, atol 1e-3), since both round an fp32 sum once."""

import pytest
import torch

from moecomp.ops import triton_moe
from moecomp.core.spec import MoESpec, SharedExpertSpec

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _linear(x, rw, rb, gw, want):
    """The linear path of router_logits, written out."""
    if gw is not None:
        rw = torch.cat([rw, gw.to(rw.dtype)], 0)
        rb = None if rb is None else torch.cat([rb, rb.new_zeros(1)])
    return torch.nn.functional.linear(x.to(want).float(), rw.to(want).float(),
                                      None if rb is None else rb.to(want).float()).to(want)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "gate", "gate+bias", "fp32 router", "fp32 gate"])
def test_router_gemv_matches_linear(T, dtype, form):
    g = torch.Generator().manual_seed(T)
    E, H = 12, 1100  # H over one 1024 chunk and not a multiple of it; E not a power of two
    x = torch.randn(T, H, generator=g).to(dtype)
    rw = (torch.randn(E, H, generator=g) * 0.1).to(dtype)
    rb = (torch.randn(E, generator=g) * 0.1).to(dtype) if "bias" in form else None
    gw = (torch.randn(1, H, generator=g) * 0.1) if "gate" in form else None
    gw = gw if gw is None or form == "fp32 gate" else gw.to(dtype)
    want = torch.float32 if form == "fp32 router" else dtype
    R = E + (gw is not None)
    out = torch.full((T, R), float("nan"), dtype=want)
    got = triton_moe.router_gemv(x, rw, rb, gw, want, out=out)
    assert got is out and got.dtype == want and not got.isnan().any()
    torch.testing.assert_close(got.float(), _linear(x, rw, rb, gw, want).float(), **TOL[want])


def test_router_logits_same_on_both_sides_of_the_switch(monkeypatch):
    """router_logits gives the same (logits, gate) from the GEMV (T <= the limit) and from linear (limit 0), for a
    separate gate, a fused gate row (FSE) and an fp32 router over fp16 weights; x may be a strided view."""
    g = torch.Generator().manual_seed(0)
    E, H, T = 8, 64, 2
    base = dict(num_experts=E, top_k=2, hidden_size=H, intermediate_size=16)
    gated = SharedExpertSpec(intermediate_size=16, gate="sigmoid")
    x = torch.randn(T, 2 * H, generator=g).to(torch.float16)[:, ::2]  # row stride 2H, element stride 2
    rw = (torch.randn(E + 1, H, generator=g) * 0.1).to(torch.float16)
    cases = [
        (MoESpec(**base, shared=gated), dict(router_w=rw[:E], router_b=None, shared_gate_w=rw[E:])),
        (MoESpec(**base, shared=gated, fused_shared_gate=True), dict(router_w=rw, router_b=None, shared_gate_w=None)),
        (MoESpec(**base, router_fp32=True), dict(router_w=rw[:E], router_b=None, shared_gate_w=None)),
    ]
    for spec, args in cases:
        monkeypatch.setenv("MOECOMP_ROUTER_GEMV_MAX_T", "16")
        gemv = triton_moe.router_logits(x, args, spec)
        monkeypatch.setenv("MOECOMP_ROUTER_GEMV_MAX_T", "0")
        lin = triton_moe.router_logits(x, args, spec)
        assert gemv[0].shape == (T, E) and gemv[0].dtype == lin[0].dtype
        torch.testing.assert_close(gemv[0].float(), lin[0].float(), rtol=1e-3, atol=1e-3)
        assert (gemv[1] is None) == (lin[1] is None)
        if lin[1] is not None:
            torch.testing.assert_close(gemv[1].float(), lin[1].float(), rtol=1e-3, atol=1e-3)


def test_router_gemv_reads_the_gate_row_not_past_the_router():
    """The gate row comes from gw: a router whose row E would be garbage (a view into a larger buffer) still gives
    the gate's logit."""
    big = torch.randn(9, 32)
    big[8] = float("nan")  # what a read past the 8 router rows would see
    gw = torch.randn(1, 32)
    x = torch.randn(1, 32)
    got = triton_moe.router_gemv(x, big[:8], None, gw, torch.float32)
    torch.testing.assert_close(got[:, 8], (x @ gw.T)[:, 0], rtol=1e-5, atol=1e-5)
    assert not got.isnan().any()
