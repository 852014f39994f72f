"""The RMSNorm prologue on CUDA at Qwen3-30B-A3B's pre-attention sizes (H 2048 -> q / k / v 4096 / 512 / 512):
``moecomp::norm_group`` against the unfused path it replaces (transformers' RMSNorm in bf16, then
``moecomp::skinny_group``), 1, 2 and 4 rows, bf16 and e4m3 128x128 blocks weight-only, with and without the
residual add. Each output within the bound ``ops/norm_group.py`` states (2.5u * sum_k |a_k W_nk| + 2u |y|, u = 2^-8;
the GPU rounds to nearest, so that is one u of slack), h equal to x + r bit for bit, one
``skinny_norm_group_kernel`` launch where the members take the skinny kernel (and none of Inductor's norm), and a
CUDA-graph replay equal to the eager call."""

from __future__ import annotations

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
H, NS, EPS, U = 2048, (4096, 512, 512), 1e-6, 2.0 ** -8


def _weights(fmt):
    dense = [torch.randn(n, H, device="cuda") * 0.02 for n in NS]
    if fmt == "bf16":
        return [w.bfloat16() for w in dense], [None] * 3, "", [w.bfloat16().double() for w in dense]
    q = QuantSpec(activation="none")
    pairs = [q8.quantize(w, q) for w in dense]
    return [p[0] for p in pairs], [p[1] for p in pairs], q.key, [q8.dequantize(w, s, q).double() for w, s in pairs]


@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_group_against_unfused_qwen3(M, fmt, residual):
    import moecomp.ops  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    from moecomp.ops import linear_group

    torch.manual_seed(M)
    x = torch.randn(M, 1, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x) if residual else None
    g = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    ws, ss, key, W64 = _weights(fmt)
    args = (x, r, g, EPS, False, ws, [None] * 3, ss, key)
    out = torch.ops.moecomp.norm_group(*args)
    h = x + r if residual else x
    hf = h.float()
    n = g * (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + EPS)).to(h.dtype)  # transformers' form
    unfused = torch.ops.moecomp.skinny_group(n, ws, [None] * 3, ss, key)
    hd = h.double()
    a = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + EPS) * g.double()
    for y, yu, W in zip(out, unfused, W64):
        exact = a @ W.T
        bound = 2.5 * U * (a.abs() @ W.abs().T) + 2 * U * exact.abs()
        assert torch.isfinite(y).all() and ((y.double() - yu.double()).abs() <= bound).all()
    assert len(out) == 3 + residual
    if residual:
        assert torch.equal(out[3], h)
    one = linear_group.one_launch(x, ws, linear_group.group_quant(key))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.moecomp.norm_group(*args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("skinny_norm_group_kernel" in k for k in names) == int(one), names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og = torch.ops.moecomp.norm_group(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(og, out))
