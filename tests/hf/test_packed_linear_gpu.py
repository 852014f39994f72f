"""GPU checks of the 4-bit dense linear (``torch.ops.moecomp.linear_4bit``, ``kernels/linear4.py``), bf16. CPU tests:
tests/hf/test_packed_linear.py (the hand-written oracle ``make`` / ``oracle`` is imported from there).

* The op on CUDA against the fp32 oracle, x bf16: int4 symmetric (group 128, fp16 scales), int4 with zero points
  (group 32, bf16 scales), mxfp4; M in {1, 4} (the skinny kernel: launches counted), {64, 512} (the MMA kernel);
  a ragged shape (N 200, K 320: a short last group) at M 3. Tolerance ``TOL_BF16`` 5e-3 relative Frobenius: the
  weights are exact in bf16 (int4's code - zero, e2m1 times a power of two) or multiply fp32 sums (int4's scale),
  so the error is the output's rounding to bf16 (2^-9 relative) and the bf16 dot order.
* The op captured in a CUDA graph at M 1 and replayed on new x equals the eager call (no host sync in the launch).
* A loaded int4 Qwen2-MoE (attention and shared experts Packed4Linear) on CUDA, optimized: its logits within
  ``test_gptq.TOL_BF16`` of the fp32 CPU load.
"""

from __future__ import annotations

import pytest
import torch

from moecomp.kernels import linear4 as lin4_k
from moecomp.core.spec import QuantSpec

from .test_packed_linear import make, oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL_BF16 = 5e-3
QUANTS = {"int4_g128": QuantSpec.int4(128), "int4_g32_zp_bf16": QuantSpec.int4(32, True, "bf16"),
          "mxfp4": QuantSpec.mxfp4()}


def frob(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class _Count:
    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


@pytest.fixture
def counted(monkeypatch):
    monkeypatch.delenv("MOECOMP_SKINNY", raising=False)
    c = {"skinny": _Count(lin4_k.skinny4_kernel), "mma": _Count(lin4_k.linear4_kernel)}
    monkeypatch.setattr(lin4_k, "skinny4_kernel", c["skinny"])
    monkeypatch.setattr(lin4_k, "linear4_kernel", c["mma"])
    return c


@pytest.mark.parametrize("name", list(QUANTS))
@pytest.mark.parametrize("M,N,K", [(1, 1536, 1024), (4, 1536, 1024), (64, 1536, 1024), (512, 1536, 1024),
                                   (3, 200, 320)])
def test_linear_4bit_cuda(counted, name, M, N, K):
    quant = QUANTS[name]
    if quant.weight == "mxfp4" and K % 32:
        pytest.skip("mxfp4 groups of 32")
    q, s, z, w = make(quant, N, K, seed=M)
    b = torch.randn(N).bfloat16()
    x = torch.randn(M, K).bfloat16()
    dev = [t.cuda() if t is not None else None for t in (x, q, s, z, b)]
    got = torch.ops.moecomp.linear_4bit(*dev, quant.key)
    torch.cuda.synchronize()
    assert counted["skinny" if M <= 4 else "mma"].n == 1
    want = oracle(x, w, b)
    err = frob(got.cpu(), want)
    print(f"{name} M={M} N={N} K={K}: rel err {err:.2e}")
    assert torch.isfinite(got).all() and err <= TOL_BF16


def test_linear_4bit_cuda_graph():
    quant = QUANTS["int4_g32_zp_bf16"]
    q, s, z, w = (t.cuda() for t in make(quant, 512, 1024))
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    torch.ops.moecomp.linear_4bit(x, q, s, z, None, quant.key)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.ops.moecomp.linear_4bit(x, q, s, z, None, quant.key)
    x.copy_(torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16))
    g.replay()
    assert torch.equal(y, torch.ops.moecomp.linear_4bit(x, q, s, z, None, quant.key))


def test_loaded_int4_model_cuda(tmp_path):
    import moecomp
    from moecomp.api import load_gptq as L
    from moecomp.testing import int4_writer as W
    from moecomp.formats.packed_linear import Packed4Linear

    from .conftest import rel_err
    from .test_gptq import TOL_BF16 as TOL_MODEL, build, logits

    model = build("qwen2_moe")
    path = W.write_int4_checkpoint(model, str(tmp_path), "awq", 64, False, attention=True, dense=True)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    want = logits(L.load_int4(path, dtype=torch.float32), ids)
    got = L.load_int4(path, device="cuda")
    assert any(isinstance(m, Packed4Linear) and m.qweight.is_cuda for m in got.modules())
    got = moecomp.optimize(got, fast_generate=False)
    err = rel_err(logits(got, ids.cuda()).cpu(), want)
    print(f"qwen2_moe int4 on CUDA, bf16: rel err {err:.2e}")
    assert err <= TOL_MODEL
