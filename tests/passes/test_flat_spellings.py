"""Experts in other storage layouts (``flat_spellings``, issue 38) through ``moecomp.optimize`` on a model holding the
block as ``mlp``, and through structural discovery (``recognise/discover.py``).

Each block: optimize rewrites exactly that one block, whole, by the FX pass; the bound block calls the op once per
forward and gives the block's own output on fresh [3, 7, H] fp32 tokens within max |diff| / max |block| <= 1e-5;
the op reads the block's weights in place (a view of the same storage: its tensor's storage is the Parameter's, and
a ``.data`` write, which bumps no version counter, reaches the op: a copy would go stale); discover finds the block
with its E router outputs. A flat weight that only a copy could read as [E, ., .] is refused with that reason.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import flat_spellings as fs
import moecomp
from moecomp.core.derived import get_path
from moecomp.recognise import discover
from moecomp.coverage import families as fam
from moecomp.bind.bind import resolve as _resolve
from moecomp.recognise.structure import iter_blocks
from moecomp.core.args import OP_ARGS

TOL = 1e-5  # fp32: the op against the block's own forward, relative to the output's largest entry


class Model(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.mlp = block

    def forward(self, x):
        return self.mlp(x)


def _rel_err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _op_tensor(block, k: str) -> torch.Tensor:
    """The tensor the bound block hands the op as argument ``k``."""
    return _resolve(block, block._moecomp.paths[OP_ARGS.index(k)])


def _run(model, x):
    with torch.no_grad():
        got, _, calls = fam.count_calls_per_block(model, lambda: model(x))
    return got, calls


@pytest.mark.parametrize("name", sorted(fs.SPELLINGS))
def test_flat_spelling_rewritten_whole(name):
    block = fs.build(name)
    model = Model(copy.deepcopy(block)).eval()
    _, rep = moecomp.optimize(model, report=True)
    [b] = rep.blocks
    assert b.status == "rewritten" and b.method == "fx", str(rep)
    assert [r.name for r in rep.rewritten] == ["mlp"], str(rep)
    x = torch.randn(3, 7, fs.H, generator=torch.Generator().manual_seed(1))
    got, calls = _run(model, x)
    with torch.no_grad():
        want = block(x)
    assert calls == 1 and torch.isfinite(got).all()
    assert _rel_err(got, want) <= TOL
    # the op reads the block's own storage: same storage, and a .data write (no version bump) reaches it
    for path, k in fs.FLAT[name].items():
        p, t = get_path(model.mlp, path), _op_tensor(model.mlp, k)
        assert t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr(), (path, k)
        assert t.numel() in (p.numel(), fs.E * p.numel()), (path, k)  # the whole tensor, or one expert's
    if fs.FLAT[name]:
        first = next(iter(fs.FLAT[name]))
        with torch.no_grad():
            for m in (model.mlp, block):
                get_path(m, first).data.mul_(-1.5)
            want2 = block(x)
        got2, calls2 = _run(model, x)
        assert calls2 == 1 and _rel_err(got2, want2) <= TOL and _rel_err(want2, want) > 1e-2


@pytest.mark.parametrize("name", sorted(fs.SPELLINGS))
def test_flat_spelling_discovered(name):
    """Structural discovery finds the block (shapes and ownership only), and optimize's block finder offers it."""
    model = Model(fs.build(name))
    assert discover.routed_blocks(model, fs.H) == {"mlp": fs.E}
    [(n, _, parts, why)] = iter_blocks(model)
    assert n == "mlp" and parts is not None and parts.num_experts == fs.E and parts.hidden_size == fs.H, why


class _SplitGateUp(fs.RowsViewGather):
    """Gate and up in two flat matrices ``w_g`` / ``w_u`` [E * I, H]: the op reads them concatenated per expert
    ([E, 2I, H]), which no view of two storages gives."""

    def __init__(self):
        super().__init__()
        del self.w_in
        self.w_g = fs._param(fs.E * fs.I, fs.H)
        self.w_u = fs._param(fs.E * fs.I, fs.H)

    def forward(self, x):
        t = x.reshape(-1, fs.H)
        w, ids = fs._softmax_topk(self.scorer(t))
        g = torch.einsum("th,tkih->tki", t, self.w_g.view(fs.E, fs.I, fs.H)[ids])
        u = torch.einsum("th,tkih->tki", t, self.w_u.view(fs.E, fs.I, fs.H)[ids])
        y = torch.einsum("tki,tkhi->tkh", torch.nn.functional.silu(g) * u, self.w_out.view(fs.E, fs.H, fs.I)[ids])
        return (y * w[..., None]).sum(1).reshape(x.shape)


def test_flat_layout_needing_a_copy_is_refused():
    """Flat experts whose op tensor only a copy could give (gate and up in two matrices: the op reads them
    concatenated) are refused, the reason naming the copy; the block is left as it was. (A 2-D matrix split along
    one dim is always a view, whatever its strides: such layouts are bound.)"""
    split = _SplitGateUp().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in split.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    model = Model(copy.deepcopy(split)).eval()
    _, rep = moecomp.optimize(model, report=True)
    [b] = rep.blocks
    assert b.status == "skipped" and "only a copy" in b.reason and "concatenated" in b.reason, str(rep)
    x = torch.randn(2, 5, fs.H)
    got, calls = _run(model, x)
    with torch.no_grad():
        assert calls == 0 and torch.equal(got, split(x))


def test_strided_flat_weight_is_a_view():
    """A flat weight that is itself a transposed (non-contiguous) tensor: splitting its rows is still a view, so the
    op reads it in place (strided) and agrees with the block."""
    block = fs.build("rows_view_gather")
    with torch.no_grad():
        w = block.w_in.detach().clone()
        block.w_in = torch.nn.Parameter(torch.empty(w.shape[1], w.shape[0]).t())
        block.w_in.copy_(w)
    assert not block.w_in.is_contiguous()
    model = Model(copy.deepcopy(block)).eval()
    _, rep = moecomp.optimize(model, report=True)
    assert [r.name for r in rep.rewritten] == ["mlp"], str(rep)
    t = _op_tensor(model.mlp, "w13")
    assert t.untyped_storage().data_ptr() == model.mlp.w_in.untyped_storage().data_ptr() and not t.is_contiguous()
    x = torch.randn(3, 7, fs.H)
    got, calls = _run(model, x)
    with torch.no_grad():
        assert calls == 1 and _rel_err(got, block(x)) <= TOL


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter on CPU tensors (the GPU "
                    "test below runs the compiled kernels)")
@pytest.mark.parametrize("name, arg", [("columns_in_out_loop", "w13"), ("ungated_mixed_layout", "w2"),
                                       ("chunked_split", "w2")])
def test_flat_spelling_triton_reads_strided_views(name, arg, monkeypatch):
    """The op's Triton path (on CPU: the interpreter) reads the flat weights as the strided views the binder hands
    it (no contiguous copy on the way: the GEMM launcher gets the non-contiguous view of the Parameter's storage),
    and the bound block agrees with its own forward within 1e-5 (fp32)."""
    from moecomp.ops import triton_moe

    block = fs.build(name)
    model = Model(copy.deepcopy(block)).eval()
    moecomp.optimize(model)
    seen = []
    for fn, pos in (("gemm1", 1), ("gemm2", 1), ("decode_down", 1)):
        orig = getattr(triton_moe, fn)

        def spy(*a, _orig=orig, _pos=pos, **kw):
            seen.append(a[_pos])
            return _orig(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, spy)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    x = torch.randn(3, 7, fs.H, generator=torch.Generator().manual_seed(3))
    got, calls = _run(model, x)
    with torch.no_grad():
        want = block(x)
    t = _op_tensor(model.mlp, arg)
    assert calls == 1 and not t.is_contiguous()
    assert any(w.data_ptr() == t.data_ptr() and w.stride() == t.stride() for w in seen), [w.stride() for w in seen]
    assert _rel_err(got, want) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(fs.SPELLINGS))
def test_flat_spelling_gpu_bf16(name):
    """On the GPU (Triton path, the op reading strided views: permuted flat columns, transposed w2), bf16, output
    poisoned first (NaNs left in the caching allocator's free blocks). Tolerance: per-token max error within 2e-2
    of the token's largest entry on at least 90% of tokens (bf16 routing near-ties may send a token elsewhere)."""
    block = fs.build(name).to("cuda", torch.bfloat16)
    model = Model(copy.deepcopy(block)).eval()
    _, rep = moecomp.optimize(model, report=True)
    assert [r.name for r in rep.rewritten] == ["mlp"], str(rep)
    for path, k in fs.FLAT[name].items():
        assert _op_tensor(model.mlp, k).untyped_storage().data_ptr() == \
            get_path(model.mlp, path).untyped_storage().data_ptr()
    x = torch.randn(4, 33, fs.H, device="cuda", dtype=torch.bfloat16)
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk
    got, calls = _run(model, x)
    torch.cuda.synchronize()
    with torch.no_grad():
        want = block(x).float()
    assert calls == 1 and torch.isfinite(got).all()
    tok = (got.float() - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-3)
    assert (tok <= 2e-2).float().mean().item() >= 0.9


@pytest.mark.parametrize("name", ["rows_view_gather", "ungated_mixed_layout", "flat_biased"])
def test_flat_spelling_compile_backend(name):
    """``torch.compile(backend="moecomp")``: the block's graph gets one ``moe_forward`` reading a view of the flat /
    transposed weight (view + permute nodes, no copy), equal to the block within 1e-5. (Blocks that loop over the
    experts with ``where(ids == e)`` break Dynamo's graph at the data-dependent shapes there: the backend sees no
    whole block; ``optimize`` binds them.)"""
    import moecomp.api.backend  # noqa: F401 (registers the backend name)
    from moecomp.core import counters

    block = fs.build(name)
    compiled = torch.compile(block, backend="moecomp", dynamic=True)
    x = torch.randn(3, 7, fs.H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = compiled(x), block(x)
    assert counters.snapshot()["rewrite_moe"]["replaced"] == 1
    assert _rel_err(got, want) <= TOL
