"""The dense FP8 linear through torch's block-scaled GEMM (``ops/fp8_blas.py``) for prefill-sized calls: when it is
taken, what it reads (activation codes from our quantizer with column-major scales), and on the GPU that it runs,
agrees with the dequantized reference (activation quantization counted) and with our kernel on the same call."""

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.ops import fp8_blas, triton_fp8
from moecomp.core.spec import QuantSpec
from moecomp.testing import rel_err

Q = QuantSpec()  # e4m3, 128 x 128 fp32 block scales, dynamic activations


def test_col_major_scales_are_the_same_scales(poison):
    """Interpreter: quantize_act with col_major writes the same codes and scales, in strides (1, M)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-2, 2, 37)[:, None]
    a, b = triton_fp8.quantize_act(x), triton_fp8.quantize_act(x, col_major=True)
    assert b.s.shape == (37, 3) and b.s.stride() == (1, 37)
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8)) and torch.equal(a.s, b.s)


def test_taken_only_where_it_applies(monkeypatch):
    w, ws = q8.quantize(torch.randn(256, 256) * 0.02, Q)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert not fp8_blas.takes(x, w, ws, Q)  # a CPU tensor
    monkeypatch.setenv("MOECOMP_FP8_BLAS", "0")
    assert not fp8_blas.available()


def _case(M, N, K, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    w, ws = q8.quantize(torch.randn(N, K, device="cuda", generator=g) * 0.02, Q)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    return x, w, ws


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(2048, 4096, 2048), (512, 7168, 16384), (1000, 576, 7168)])
def test_gpu_blockwise_path_against_reference_and_ours(M, N, K, monkeypatch):
    """Tolerance 1e-2 against the dequantized fp32 reference with activation quantization (bf16 output rounding and
    the sums' order; the format's own error is ~6e-2 and not in this comparison); our kernel on the same call
    within 1e-2 of it. 1000 x 576 x 7168 is under MIN_MNK: our kernel, not torch's."""
    x, w, ws = _case(M, N, K)
    ref = reference.quantized_linear(x, w, ws, Q)
    before = dict(fp8_blas.stats)
    y = torch.ops.moecomp.fp8_linear(x, w, ws, None, None, Q.key)
    taken = fp8_blas.stats["calls"] > before["calls"]
    if M * N * K >= fp8_blas.MIN_MNK and not taken:
        pytest.fail(f"torch's block-scaled GEMM was not taken: {fp8_blas.last_error}")
    assert taken == (M * N * K >= fp8_blas.MIN_MNK)
    monkeypatch.setenv("MOECOMP_FP8_BLAS", "0")
    ours = torch.ops.moecomp.fp8_linear(x, w, ws, None, None, Q.key)
    assert torch.isfinite(y).all() and rel_err(y, ref) < 1e-2 and rel_err(ours, ref) < 1e-2
    assert rel_err(y, ours) < 1e-2


@pytest.mark.gpu
def test_gpu_blockwise_path_in_a_cuda_graph():
    """A proven shape class runs under capture and replays the same numbers; bias added."""
    x, w, ws = _case(2048, 4096, 2048, seed=1)
    b = torch.randn(4096, device="cuda").to(torch.bfloat16)
    eager = torch.ops.moecomp.fp8_linear(x, w, ws, b, None, Q.key)  # proves the class outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.moecomp.fp8_linear(x, w, ws, b, None, Q.key)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.moecomp.fp8_linear(x, w, ws, b, None, Q.key)
    out.fill_(float("nan"))
    g.replay()
    assert torch.equal(out, eager)
    assert rel_err(eager, reference.quantized_linear(x, w, ws, Q) + b.float()) < 1e-2


def test_call_plumbing_with_torchs_layout_rules(monkeypatch, poison):
    """Interpreter, fp32: the op's call of torch's GEMM, with ``F.scaled_mm`` replaced by a stand-in that checks the
    layouts torch's BlockWise1x128 / BlockWise128x128 checks demand (ScaledBlas.cpp: A's scales [M, K / 128] with
    strides (1, M); B = weight.T column-major, its scales' transpose [N / 128, K / 128] row-major) and computes the
    product on the dequantized operands: the op's answer is then the reference's (1e-5)."""
    import torch.nn.functional as F

    seen = {}

    def scaled_mm(a, b, sa, ra, sb, rb, output_dtype=None):
        (M, K), N = a.shape, b.shape[1]
        assert a.dtype == b.dtype == q8.FP8 and b.stride() == (1, K)  # B column-major
        assert sa.shape == (M, -(-K // 128)) and sa.stride() == (1, M) and sa.dtype == torch.float32
        assert sb.t().shape == (-(-N // 128), -(-K // 128)) and sb.t().is_contiguous()
        assert (ra, rb) == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
        seen["calls"] = seen.get("calls", 0) + 1
        a_f = a.float() * sa.repeat_interleave(128, dim=1)[:, :K]
        b_f = b.float() * sb.repeat_interleave(128, dim=0)[:K].repeat_interleave(128, dim=1)[:, :N]
        return (a_f @ b_f).to(output_dtype)

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setattr(fp8_blas, "takes", lambda *a: True)
    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(1)
    w, ws = q8.quantize(torch.randn(256, 384, generator=g) * 0.02, Q)
    x = torch.randn(80, 384, generator=g)
    b = torch.randn(256, generator=g)
    y = torch.ops.moecomp.fp8_linear(x, w, ws, b, None, Q.key)
    assert seen.get("calls") == 1
    assert rel_err(y, reference.quantized_linear(x, w, ws, Q) + b) < 1e-5
