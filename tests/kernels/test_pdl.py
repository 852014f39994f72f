"""Launch options of programmatic dependent launch (``triton_moe._pdl``): which kernels signal where, and the
MOECOMP_PDL switch. The kernels' results under PDL are covered by the GPU tests (every kernel launches with it on
Hopper)."""

import pytest
import torch

from moecomp.ops import triton_moe
from moecomp.core.spec import MoESpec


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(triton_moe, "_interpret", lambda: False)
    monkeypatch.setattr(triton_moe, "_pdl_devices", {0: True})
    monkeypatch.delenv("MOECOMP_PDL", raising=False)
    return torch.device("cuda", 0)


def test_gemms_signal_after_their_main_loop(hopper):
    assert triton_moe._pdl(hopper, gemm=True) == dict(USE_PDL=2, launch_pdl=True)
    assert triton_moe._pdl(hopper) == dict(USE_PDL=1, launch_pdl=True)


@pytest.mark.parametrize("mode,gemm,want", [("early", True, 1), ("early", False, 1), ("0", True, None),
                                            ("0", False, None)])
def test_pdl_switch(hopper, monkeypatch, mode, gemm, want):
    monkeypatch.setenv("MOECOMP_PDL", mode)
    assert triton_moe._pdl(hopper, gemm=gemm) == ({} if want is None else dict(USE_PDL=want, launch_pdl=True))


def test_no_pdl_off_hopper(monkeypatch):
    monkeypatch.setattr(triton_moe, "_pdl_devices", {0: False})
    monkeypatch.setattr(triton_moe, "_interpret", lambda: False)
    assert triton_moe._pdl(torch.device("cuda", 0), gemm=True) == {}
    assert triton_moe._pdl(torch.device("cpu"), gemm=True) == {}


@pytest.mark.parametrize("join,mode,want_pdl", [(True, None, False), (False, None, True), (True, "side", True)])
def test_aligned_path_beside_the_side_stream_launches_without_pdl(hopper, monkeypatch, join, mode, want_pdl):
    """``routed``'s aligned path launches without PDL while the shared experts run on the side stream (a join is
    given), unless MOECOMP_PDL=side; without a side stream it keeps PDL. The hold ends with the call."""
    if mode:
        monkeypatch.setenv("MOECOMP_PDL", mode)
    seen = []

    def experts(x, *a, **k):
        seen.append(triton_moe._pdl(hopper, gemm=True))
        return torch.zeros(x.shape[0] * 2, x.shape[1])

    monkeypatch.setattr(triton_moe, "experts", experts)
    monkeypatch.setattr(triton_moe, "combine", lambda y, T, k, out, *a: out)
    monkeypatch.setattr(triton_moe.tuning, "decode_config", lambda cfg, T, dev: None)
    x = torch.zeros(3, 4)
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=4, intermediate_size=4)
    triton_moe.routed(x, ids, w, {}, spec, torch.empty(3, 4), cfg={}, join=(lambda: None) if join else None)
    assert seen == [dict(USE_PDL=2, launch_pdl=True) if want_pdl else {}]
    assert triton_moe._pdl(hopper, gemm=True) == dict(USE_PDL=2, launch_pdl=True)  # the hold is over
