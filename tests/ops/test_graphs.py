"""ops/graphs.py's caching policy on CPU, with a stand-in for CUDA graph capture (the real thing is in
tests/ops/test_gpu.py): when it captures, replays, re-captures for replaced / moved / updated weights, and falls
back to plain calls."""

import pytest
import torch

from moecomp.ops import graphs


class FakeGraph:
    """Captures fn over static inputs; replay recomputes into the static output, as a CUDA graph would."""

    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, inputs
        self.out = fn(*inputs)

    def replay(self):
        self.out.copy_(self.fn(*self.inputs))


@pytest.fixture
def fake_cuda(monkeypatch):
    captured = []

    def capture(fn, inputs, pool):
        g = FakeGraph(fn, inputs)
        g.pool = pool
        captured.append(g)
        return g, g.out

    monkeypatch.setattr(graphs, "_usable", lambda x, eager: graphs.max_tokens() > 0 and x.shape[0] <= graphs.max_tokens())
    monkeypatch.setattr(graphs, "_capture", capture)
    handles = iter(range(1000))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(graphs, "_pools", {})
    graphs.clear()
    yield captured
    graphs.clear()


def test_warmup_capture_replay_and_fresh_results(fake_cuda):
    w = torch.randn(8, 8)
    calls = []

    def fn(x):
        calls.append(x)
        return x @ w

    outs, xs = [], [torch.randn(3, 8) for _ in range(4)]
    for x in xs:
        outs.append(graphs.run("op", fn, (x,), (w,), "spec"))
    assert graphs.stats == {"plain": 1, "captured": 1, "replayed": 2, "capture_failed": 0}
    assert len(fake_cuda) == 1
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, x @ w)
    assert outs[2].data_ptr() != outs[3].data_ptr()  # a copy per call, not the static buffer


def test_new_graph_for_replaced_or_updated_weights_and_new_shapes(fake_cuda):
    w = torch.randn(8, 8)

    def fn_for(weight):
        return lambda x: x @ weight

    x = torch.randn(3, 8)
    for _ in range(3):
        graphs.run("op", fn_for(w), (x,), (w,), "spec")
    assert len(fake_cuda) == 1
    w.mul_(2)  # in-place update: version counter moves
    for _ in range(2):
        out = graphs.run("op", fn_for(w), (x,), (w,), "spec")
    torch.testing.assert_close(out, x @ w)
    assert len(fake_cuda) == 2
    w2 = w.clone()  # a replaced weight (another tensor object)
    for _ in range(2):
        out = graphs.run("op", fn_for(w2), (x,), (w2,), "spec")
    assert len(fake_cuda) == 3
    x5 = torch.randn(5, 8)  # another token count
    for _ in range(2):
        out = graphs.run("op", fn_for(w2), (x5,), (w2,), "spec")
    torch.testing.assert_close(out, x5 @ w2)
    assert len(fake_cuda) == 4


def test_limits_and_failed_capture_fall_back_to_plain(fake_cuda, monkeypatch):
    w = torch.randn(8, 8)
    monkeypatch.setenv("MOECOMP_OP_GRAPHS_MAX_T", "4")
    big = torch.randn(5, 8)
    for _ in range(3):
        torch.testing.assert_close(graphs.run("op", lambda x: x @ w, (big,), (w,), "s"), big @ w)
    assert graphs.stats["captured"] == 0 and graphs.stats["plain"] == 3

    def boom(fn, inputs, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", boom)
    x = torch.randn(2, 8)
    for _ in range(4):
        torch.testing.assert_close(graphs.run("op", lambda x: x @ w, (x,), (w,), "s"), x @ w)
    assert graphs.stats["capture_failed"] == 1  # tried once, then plain


def test_usable_only_for_plain_eager_calls(monkeypatch):
    """Graphs only for callers that established plain eager (parameters are fine; dispatch modes, subclasses and
    autograd recording are not), never for calls through the dispatcher (compiled code may run inside Inductor's
    CUDA-graph trees). Checked with is_cuda faked: the rest of the policy does not depend on the device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moecomp.ops.moe_op import plain_eager

    class FakeCudaTensor(torch.Tensor):
        pass

    x = torch.randn(2, 8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = torch.nn.Parameter(torch.randn(8, 8))
    assert graphs._usable(x, eager=True) and not graphs._usable(x, eager=False)
    with torch.no_grad():
        assert plain_eager((x, w))
        with TorchDispatchMode():
            assert not plain_eager((x, w))
        assert not plain_eager((x, w.detach().as_subclass(FakeCudaTensor)))
    assert not plain_eager((x, w))  # grad mode on and w requires grad
    assert plain_eager((x, w.detach()))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not graphs._usable(x, eager=True)  # inside someone's capture (moecomp's generate() step graphs)


def test_a_new_pool_once_no_graph_holds_the_old_one(fake_cuda):
    """A pool dies with its last graph; capturing into its stale handle breaks the allocator (seen on the H200 after
    graphs.clear(), and possible when the only graph is replaced)."""
    w, x, x3 = torch.randn(8, 8), torch.randn(2, 8), torch.randn(3, 8)
    for xx in (x, x, x3, x3):
        graphs.run("op", lambda x: x @ w, (xx,), (w,), "s")
    graphs.clear()
    for _ in range(2):
        graphs.run("op", lambda x: x @ w, (x,), (w,), "s")
    assert [g.pool for g in fake_cuda] == [0, 0, 1]


def test_pools_are_per_device(fake_cuda):
    """Each GPU's graphs share that GPU's pool; a device whose graphs are all gone gets a fresh pool even while
    another device's graphs keep theirs alive."""
    e0, e1 = graphs._Entry(()), graphs._Entry(())
    e0.graph = e1.graph = object()
    graphs._entries[("op", "s", 0, (), ())] = e0
    graphs._entries[("op", "s", 1, (), ())] = e1
    p0, p1 = graphs._pool_handle(0), graphs._pool_handle(1)
    assert p0 != p1 and graphs._pool_handle(0) == p0 and graphs._pool_handle(1) == p1
    del graphs._entries[("op", "s", 1, (), ())]  # device 1's last graph is gone
    assert graphs._pool_handle(1) not in (p0, p1) and graphs._pool_handle(0) == p0


def test_keys_that_never_repeat_do_not_evict_graphs(fake_cuda, monkeypatch):
    """A weight made afresh on every call (a concatenation inside a compiled graph) gives a new key each time: those
    keys cycle through the seen-once list and the captured graphs stay."""
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    monkeypatch.setattr(graphs, "MAX_SEEN", 4)
    w, x = torch.randn(8, 8), torch.randn(2, 8)
    for _ in range(3):
        graphs.run("op", lambda x: x @ w, (x,), (w,), "s")
    assert graphs.stats["captured"] == 1
    for _ in range(50):
        fresh = w.clone()  # a new tensor every call
        out = graphs.run("op", lambda x: x @ fresh, (x,), (fresh,), "s")
        torch.testing.assert_close(out, x @ fresh)
    assert graphs.stats["captured"] == 1 and len(graphs._seen) <= 4
    before = graphs.stats["replayed"]
    graphs.run("op", lambda x: x @ w, (x,), (w,), "s")
    assert graphs.stats["replayed"] == before + 1  # the first graph is still there
