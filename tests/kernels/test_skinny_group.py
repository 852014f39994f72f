"""Sibling linears in one launch (``kernels/skinny.skinny_group_kernel``, ``ops/skinny.skinny_group``, the op
``moecomp::skinny_group``): each member's output equals what ``skinny_linear`` computes for it alone (the same tile:
bit for bit where the tiles are the same, as on the interpreter), within 1e-5 relative of the fp32 reference (the
GEMM's summation order); outputs NaN-poisoned first. On CPU under the interpreter in fp32 (its bf16 arithmetic is not
the GPU's); the GPU cases at Qwen3-30B-A3B's attention sizes in bf16 (8e-3 against fp32: the bf16 output's rounding).
"""

from __future__ import annotations

import os

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
# the CPU cases run the kernels on CPU tensors: the interpreter only (the GPU case is test_group_gpu_qwen3_attention)
needs_triton = pytest.mark.skipif(not INTERP, reason="runs the kernels under TRITON_INTERPRET=1 on CPU tensors")


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


def _nan(M, ws, dt, dev):
    return [torch.full((M, w.shape[0]), float("nan"), dtype=dt, device=dev) for w in ws]


@needs_triton
@pytest.mark.parametrize("M", [1, 2, 4])
def test_group_equals_each_member_16bit(M):
    from moecomp.ops.skinny import skinny_group, skinny_linear
    torch.manual_seed(M)
    K = 200  # no multiple of BLOCK_K: the K tail is masked
    ws = [torch.randn(n, K) * 0.05 for n in (72, 24, 16)]  # q / k / v-like, rows no multiple of BLOCK_N
    bs = [torch.randn(72), None, torch.randn(16)]  # mixed biases
    x = torch.randn(M, K)
    outs = _nan(M, ws, x.dtype, x.device)
    ys = skinny_group(x, ws, bs, outs=outs)
    assert all(y is o for y, o in zip(ys, outs))
    for w, b, y in zip(ws, bs, ys):
        assert torch.equal(y, skinny_linear(x, w, b))  # the same tile as the member alone
        ref = x @ w.T + (b if b is not None else 0)
        assert torch.isfinite(y).all() and _rel(y, ref) < 1e-5


@needs_triton
@pytest.mark.parametrize("scale", ["block", "channel", "tensor"])
def test_group_equals_each_member_fp8(scale):
    from moecomp.ops.skinny import skinny_group, skinny_linear
    torch.manual_seed(3)
    q = QuantSpec(scale=scale, activation="none", **(dict(block_n=32, block_k=32) if scale == "block" else {}))
    K = 160
    wq = [q8.quantize(torch.randn(n, K) * 0.05, q) for n in (80, 40)]  # gate / up-like
    x = torch.randn(2, K)
    outs = _nan(2, [w for w, _ in wq], x.dtype, x.device)
    ys = skinny_group(x, [w for w, _ in wq], [None, None], [s for _, s in wq], q, outs=outs)
    for (w, s), y in zip(wq, ys):
        assert torch.equal(y, skinny_linear(x, w, None, s, q))
        assert torch.isfinite(y).all() and _rel(y, x @ q8.dequantize(w, s, q).T) < 1e-5


def test_group_launcher_rejects_bad_arguments():
    from moecomp.ops.skinny import skinny_group
    x = torch.zeros(1, 16)
    with pytest.raises(ValueError, match="weights must hold 2..4"):
        skinny_group(x, [torch.zeros(8, 16)])
    with pytest.raises(ValueError, match=r"weights\[1\] must be \[N, 16\]"):
        skinny_group(x, [torch.zeros(8, 16), torch.zeros(8, 15)])
    with pytest.raises(ValueError, match="rows"):
        skinny_group(torch.zeros(5, 16), [torch.zeros(8, 16), torch.zeros(8, 16)])
    with pytest.raises(ValueError, match="outs must be 2 buffers"):
        skinny_group(x, [torch.zeros(8, 16), torch.zeros(4, 16)], outs=[torch.zeros(1, 8), torch.zeros(1, 8)])


def test_group_op_checks_cpu_path_and_opcheck():
    """``moecomp::skinny_group``: bad arguments are ValueErrors naming them; on CPU each member is ``F.linear``
    exactly (16-bit) or the FP8 linear's torch path; opcheck passes (with gradients for 16-bit members)."""
    import moecomp.ops  # noqa: F401
    from moecomp.ops import linear_group as lg

    torch.manual_seed(0)
    op = torch.ops.moecomp.skinny_group
    x = torch.randn(2, 1, 16)
    ws = [torch.randn(8, 16), torch.randn(4, 16), torch.randn(4, 16)]
    bs = [torch.randn(8), None, torch.randn(4)]
    ys = op(x, ws, bs, [None] * 3, "")
    assert [tuple(y.shape) for y in ys] == [(2, 1, 8), (2, 1, 4), (2, 1, 4)]
    assert all(torch.equal(y, torch.nn.functional.linear(x, w, b)) for y, w, b in zip(ys, ws, bs))
    with pytest.raises(ValueError, match="member 1: .*weight must be"):
        op(x, [ws[0], torch.randn(4, 15)], [None, None], [None, None], "")
    with pytest.raises(ValueError, match="member 0: .*dtype"):
        op(x, [ws[0].double(), ws[1]], [None, None], [None, None], "")
    with pytest.raises(ValueError, match=r"scales\[0\] must be None"):
        op(x, ws[:2], [None, None], [torch.ones(8), None], "")
    with pytest.raises(ValueError, match="biases and scales must have one entry per weight"):
        op(x, ws[:2], [None], [None, None], "")
    with pytest.raises(ValueError, match="weights must hold 2..4"):
        op(x, ws * 2, [None] * 6, [None] * 6, "")
    q_static = QuantSpec(activation="static")
    with pytest.raises(ValueError, match="without a static activation scale"):
        op(x, ws[:2], [None, None], [None, None], q_static.key)
    torch.library.opcheck(op.default, (x, ws, bs, [None] * 3, ""))
    xg, wg = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    torch.library.opcheck(op.default, (xg, wg, [b.clone() for b in (bs[0], bs[2], bs[2])], [None] * 3, ""))
    # the gradients are the linears'
    bg = [torch.randn(n).requires_grad_() for n in (8, 4, 4)]
    sum(y.square().sum() for y in op(xg, wg, bg, [None] * 3, "")).backward()
    x2, w2, b2 = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws], [b.detach().clone()
                                                                                         .requires_grad_() for b in bg]
    sum(torch.nn.functional.linear(x2, w, b).square().sum() for w, b in zip(w2, b2)).backward()
    torch.testing.assert_close(xg.grad, x2.grad)
    for a, r in zip(wg + bg, w2 + b2):
        torch.testing.assert_close(a.grad, r.grad)
    # e4m3 weight-only members: the FP8 linear's torch path (its schema test compares fp8 inputs with allclose,
    # which CPU lacks: the other utilities run, as for moecomp::fp8_linear)
    q = QuantSpec(scale="block", activation="none", block_n=32, block_k=32)
    wq = [q8.quantize(torch.randn(n, 64) * 0.05, q) for n in (64, 32)]
    xq = torch.randn(1, 64)
    args = (xq, [w for w, _ in wq], [None, None], [s for _, s in wq], q.key)
    for y, r in zip(op(*args), lg.reference(*args)):
        assert _rel(y, r.float()) < 1e-6
    with pytest.raises(ValueError, match=r"scales\[1\] is None"):
        op(xq, args[1], [None, None], [args[3][0], None], q.key)
    torch.library.opcheck(op.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_group_gpu_qwen3_attention(M, fmt):
    """Qwen3-30B-A3B's q / k / v (H 2048 -> 32 x 128, 4 x 128, 4 x 128) in one launch, bf16 or e4m3 128x128 blocks
    weight-only: each within 8e-3 of fp32, and the op takes one launch where the members take the skinny kernel
    (the profiler counts the kernels); in a CUDA graph the replay gives the same outputs."""
    import moecomp.ops  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(M)
    H, dev = 2048, "cuda"
    x = torch.randn(M, 1, H, device=dev, dtype=torch.bfloat16)
    dense = [torch.randn(n, H, device=dev) * 0.02 for n in (4096, 512, 512)]
    if fmt == "bf16":
        ws, ss, quant, W = [w.bfloat16() for w in dense], [None] * 3, "", [w.bfloat16().float() for w in dense]
    else:
        q = QuantSpec(activation="none")
        pairs = [q8.quantize(w, q) for w in dense]
        ws, ss, quant = [p[0] for p in pairs], [p[1] for p in pairs], q.key
        W = [q8.dequantize(w, s, q) for w, s in pairs]
    args = (x, ws, [None] * 3, ss, quant)
    ys = torch.ops.moecomp.skinny_group(*args)
    for y, w in zip(ys, W):
        assert _rel(y, x.float() @ w.T) < 8e-3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.moecomp.skinny_group(*args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("skinny_group_kernel" in n for n in names) == 1 and not any(n == "skinny_kernel" for n in names), names
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = torch.ops.moecomp.skinny_group(*args)
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(yg, ys))


@needs_triton
@pytest.mark.parametrize("activation,M,one", [("none", 4, True), ("dynamic", 2, True), ("dynamic", 4, True),
                                              ("dynamic", 33, False)])
def test_group_op_fp8_as_each_members_op(monkeypatch, poison, activation, M, one):
    """e4m3 members through the op on the Triton path: one group launch where each member's FP8 linear runs the
    skinny kernel (weight-only, or dynamic activations at decode rows: ``tuning.fp8_mode`` w8a16), each member's op
    otherwise (dynamic at 33 rows: w8a8); either way each output equals ``moecomp::fp8_linear``'s bit for bit."""
    import moecomp.ops  # noqa: F401
    from moecomp.ops import skinny
    from moecomp.testing import count_calls

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setattr(skinny, "use_skinny", lambda M, N, K, quantized: quantized and M <= 4)  # the GPU's rule
    torch.manual_seed(M)
    q = QuantSpec(scale="block", activation=activation, block_n=32, block_k=32)
    wq = [q8.quantize(torch.randn(n, 64) * 0.05, q) for n in (64, 32)]
    x = torch.randn(M, 64)
    calls = count_calls(monkeypatch, skinny, ["skinny_group"])
    ys = torch.ops.moecomp.skinny_group(x, [w for w, _ in wq], [None, None], [s for _, s in wq], q.key)
    assert calls == (["skinny_group"] if one else [])
    for (w, s), y in zip(wq, ys):
        assert torch.equal(y, torch.ops.moecomp.fp8_linear(x, w, s, None, None, q.key))


def test_skinny_launches_take_the_ops_pdl_options(monkeypatch):
    """The skinny linears (one matrix and the group) launch with the op's PDL options in the GEMM form (wait at the
    start, release after the K loop; ``triton_moe._pdl``), plain with MOECOMP_PDL=0 or off Hopper; the fused router
    with the non-GEMM form, as router_gemv / route_topk."""
    from moecomp.ops import skinny, triton_moe, triton_router

    monkeypatch.setattr(triton_moe, "_interpret", lambda: False)
    monkeypatch.setattr(triton_moe, "_pdl_devices", {0: True})
    monkeypatch.delenv("MOECOMP_PDL", raising=False)
    hopper = torch.device("cuda", 0)
    monkeypatch.delenv("MOECOMP_SKINNY_PDL", raising=False)
    assert skinny.launch_options(hopper) == {}  # opt-in until measured on a GPU
    monkeypatch.setenv("MOECOMP_SKINNY_PDL", "1")
    assert skinny.launch_options(hopper) == dict(USE_PDL=2, launch_pdl=True)
    assert triton_router.launch_options(hopper) == dict(USE_PDL=1, launch_pdl=True)
    monkeypatch.setenv("MOECOMP_PDL", "0")
    assert skinny.launch_options(hopper) == {} == triton_router.launch_options(hopper)
    monkeypatch.delenv("MOECOMP_PDL")
    monkeypatch.setattr(triton_moe, "_pdl_devices", {0: False})
    assert skinny.launch_options(hopper) == {}
