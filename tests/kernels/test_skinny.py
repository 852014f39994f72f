"""The skinny linear (``kernels/skinny.py``, M <= 4 rows) against torch on fresh random inputs: 16-bit weights, and
e4m3 weights with block / channel / tensor scales (fp32 and UE8M0) against the dequantized weight (weight-only, so
the only error is the GEMM's fp32 summation order: 1e-5 relative in fp32). On CPU under the interpreter in fp32
(its bf16 arithmetic is not the GPU's); on CUDA in bf16 against an fp32 reference (bf16 output rounding: 8e-3)."""

from __future__ import annotations

import os

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (CUDA or INTERP), reason="needs CUDA or TRITON_INTERPRET=1")


def _dev():
    return torch.device("cuda" if CUDA else "cpu")


def _check(y, ref, tol):
    err = float((y.float() - ref).norm() / ref.norm())
    assert torch.isfinite(y).all() and err < tol, err


@pytest.mark.parametrize("M", [1, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_16bit(M, bias):
    from moecomp.ops.skinny import skinny_linear
    torch.manual_seed(M + 10 * bias)
    dt = torch.bfloat16 if CUDA else torch.float32
    N, K = 72, 200  # neither a multiple of the tiles: masked rows and K tail
    x = torch.randn(M, K, device=_dev(), dtype=dt)
    w = torch.randn(N, K, device=_dev(), dtype=dt) * 0.05
    b = torch.randn(N, device=_dev(), dtype=dt) if bias else None
    out = torch.full((M, N), float("nan"), device=_dev(), dtype=dt)
    y = skinny_linear(x, w, b, out=out)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    _check(y, ref, 8e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("scale,sdt", [("block", "fp32"), ("block", "ue8m0"), ("channel", "fp32"), ("tensor", "fp32")])
@pytest.mark.parametrize("M", [1, 4])
def test_skinny_fp8_weight_only(scale, sdt, M):
    from moecomp.ops.skinny import skinny_linear
    torch.manual_seed(M)
    dt = torch.bfloat16 if CUDA else torch.float32
    q = QuantSpec(scale=scale, scale_dtype=sdt, activation="none", block_n=32, block_k=32) if scale == "block" \
        else QuantSpec(scale=scale, scale_dtype=sdt, activation="none")
    N, K = 80, 160
    wq, ws = q8.quantize(torch.randn(N, K, device=_dev()) * 0.05, q)
    x = torch.randn(M, K, device=_dev(), dtype=dt)
    out = torch.full((M, N), float("nan"), device=_dev(), dtype=dt)
    cfgs = [None] if CUDA else [dict(BLOCK_N=8, BLOCK_K=64, REDUCE_END=1, num_warps=4, num_stages=1),
                                dict(BLOCK_N=16, BLOCK_K=16, REDUCE_END=0, num_warps=4, num_stages=1)]
    ref = x.float() @ q8.dequantize(wq, ws, q).T
    for cfg in cfgs:  # BLOCK_K above the scale block (groups in a step), and below it (one scale a step)
        y = skinny_linear(x, wq, None, ws, q, out=out.clone(), cfg=cfg)
        _check(y, ref, 8e-3 if CUDA else 1e-5)


def test_skinny_rejects_bad_rows():
    from moecomp.ops.skinny import skinny_linear
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(5, 16), torch.zeros(8, 16))


def test_skinny_linear_op_checks_and_falls_back():
    """``moecomp::skinny_linear``: bad shapes / dtypes are ValueErrors naming the argument; off CUDA (and at rows the
    kernel does not take) it is ``F.linear`` exactly; opcheck passes."""
    import moecomp.ops  # noqa: F401  (registers the op)

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)
    with pytest.raises(ValueError, match="weight"):
        torch.ops.moecomp.skinny_linear(x, torch.randn(8, 15), None)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.moecomp.skinny_linear(x, w.double(), None)
    with pytest.raises(ValueError, match="bias"):
        torch.ops.moecomp.skinny_linear(x, w, torch.randn(7))
    y = torch.ops.moecomp.skinny_linear(x, w, b)
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    torch.library.opcheck(torch.ops.moecomp.skinny_linear.default, (x, w, b))
    # with parameters that require grad (an nn.Linear's): the gradients are the linear's
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    torch.library.opcheck(torch.ops.moecomp.skinny_linear.default, (xg, wg, bg))
    torch.ops.moecomp.skinny_linear(xg, wg, bg).square().sum().backward()
    x2, w2, b2 = (t.clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x2, w2, b2).square().sum().backward()
    for a, r in ((xg, x2), (wg, w2), (bg, b2)):
        torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_skinny_linear_op_gpu(rows):
    """On CUDA at one or two rows the op runs the kernel (bf16 within 8e-3 of fp32), at three cuBLAS; a plain
    nn.Linear swapped by the engine's ``method_forwards(skinny=True)`` gives the same, and is put back."""
    import moecomp.ops  # noqa: F401
    from moecomp.generate.shared_layers import method_forwards
    from moecomp.ops import linear16 as sl

    torch.manual_seed(rows)
    lin = torch.nn.Linear(2048, 4096, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 1, 2048, device="cuda", dtype=torch.bfloat16)
    assert sl.takes(x, lin.weight) == (rows <= 2)
    ref = x.float() @ lin.weight.float().T + lin.bias.float()
    y = torch.ops.moecomp.skinny_linear(x, lin.weight, lin.bias)
    _check(y, ref, 8e-3)
    with method_forwards([torch.nn.Sequential(lin)], skinny=True):
        assert "forward" in lin.__dict__
        _check(lin(x), ref, 8e-3)
    assert "forward" not in lin.__dict__
    torch.library.opcheck(torch.ops.moecomp.skinny_linear.default, (x, lin.weight, lin.bias))
