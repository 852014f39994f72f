"""The one-launch decode attention (``MOECOMP_ATTN_ONE_LAUNCH=1``: ``kernels/decode_attention.decode_attn_one_kernel``,
launched by ``ops/triton_attention._one_launch``) under the Triton interpreter, against the two-launch op (split +
combine, same op with the variable off) and an independent plain-torch attention written here (float64, one query
head at a time: softmax(scale q k^T) v over the positions taking part, the sink one more logit). fp32 and fp16
inputs (the interpreter's bf16 dot is wrong), outputs NaN-poisoned, every input fresh random. Tolerances: against
the plain attention 1e-5 (fp32) / 3e-3 (fp16) of the largest |out|; against the two launches 1e-6 (fp32) / 1e-3
(fp16, one rounding of the output), in practice equal. Every case asserts the one launch ran (the two-launch path
raises if called) and the counters are back at zero after each call."""

import pytest
import torch

from moecomp.ops import attention  # noqa: F401  (registers torch.ops.moecomp.decode_attention)
from moecomp.ops import triton_attention as ta

TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (3e-3, 1e-3)}  # (against the plain attention, against 2 launches)


def plain_attention(q, k, v, keep, n, scale, sinks=None, window=0):
    """float64, head by head: query head i reads kv head i // (Hq / Hkv); positions j with keep[b, j], j < n and,
    with a window, j >= n - window; the sink is one more logit with no value; nothing taking part -> zeros."""
    B, Hq, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    out = torch.zeros(B, Hq, v.shape[3], dtype=torch.float64)
    for b in range(B):
        pos = [j for j in range(min(n, L)) if keep[b, j] and (not window or j >= n - window)]
        for i in range(Hq):
            h = i // (Hq // Hkv)
            logits = scale * (k[b, h, pos].double() @ q[b, i].double())  # [len(pos)]
            if sinks is not None:
                logits = torch.cat([logits, sinks[i:i + 1].double()])
            if len(logits) == 0:
                continue
            p = torch.softmax(logits, 0)[:len(pos)]
            out[b, i] = p @ v[b, h, pos].double()
    return out


def _inputs(B, Hq, Hkv, L, Dk, Dv, n, dtype, seed, empty_row=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Dk, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, Dk, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, Dv, generator=g).to(dtype)
    keep = torch.rand(B, L, generator=g) > 0.3  # padded positions
    keep[:, n - 1] = True
    if empty_row is not None:
        keep[empty_row] = False  # a row with no valid position
    return q, k, v, keep, torch.tensor(n)


@pytest.fixture
def one_launch(monkeypatch):
    """The variable on, the triton backend on CPU, fresh counters; the two-launch path fails if it runs."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setattr(ta, "_counters", {})
    two = ta._two_launches

    def refuse(*a, **kw):
        if ta.one_launch_wanted():
            raise AssertionError("the two launches ran with MOECOMP_ATTN_ONE_LAUNCH=1")
        return two(*a, **kw)

    monkeypatch.setattr(ta, "_two_launches", refuse)

    def call(*args, on=True):
        monkeypatch.setenv(ta.ONE_LAUNCH_ENV, "1" if on else "0")
        return torch.ops.moecomp.decode_attention(*args)

    return call


def _counters_zero() -> bool:
    bufs = ta._counters.get(("cpu", None), [])
    return all(int(c.abs().sum()) == 0 for c in bufs)


def _off(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,L,Dk,Dv,n,window,sinks,empty_row,splits", [
    (3, 8, 2, 200, 16, 16, 170, 0, None, 2, 4),  # GQA 4, 4 splits (the last empty: 192 > n), row 2 attends nothing
    (2, 8, 2, 150, 16, 16, 131, 0, "fp32", 1, 3),  # sinks; row 1 attends nothing (the sink takes all: zeros)
    (1, 4, 4, 200, 16, 16, 170, 70, "model", None, 2),  # MHA, window 70 across a block border, sinks in the dtype
    (2, 6, 1, 260, 24, 16, 259, 0, None, None, 5),  # MQA (G 6, not a power of 2), Dk 24 != Dv 16
    (2, 8, 2, 40, 16, 16, 33, 0, "fp32", 0, 1),  # one split: no partials, no counter; row 0 attends nothing
    (2, 8, 2, 300, 16, 16, 280, 48, None, None, 1),  # one split by the window (48 < one block)
])
def test_one_launch_matches_two_launches_and_plain_attention(one_launch, dtype, B, Hq, Hkv, L, Dk, Dv, n, window,
                                                             sinks, empty_row, splits, poison):
    q, k, v, keep, nn = _inputs(B, Hq, Hkv, L, Dk, Dv, n, dtype, seed=L + n + window, empty_row=empty_row)
    s = None if sinks is None else (torch.randn(Hq, generator=torch.Generator().manual_seed(n)) * 3).to(
        torch.float32 if sinks == "fp32" else dtype)
    assert ta._plan(q, k, v, window)["S"] == splits  # the case runs the path it names
    scale = Dk ** -0.5
    one = one_launch(q, k, v, keep, nn, scale, s, window)
    assert _counters_zero()
    two = one_launch(q, k, v, keep, nn, scale, s, window, on=False)
    ref = plain_attention(q, k, v, keep, n, scale, s, window)
    assert one.shape == (B, Hq, Dv) and one.dtype == dtype and torch.isfinite(one).all()
    tol_ref, tol_two = TOL[dtype]
    assert _off(one, ref) <= tol_ref
    assert float((one.double() - two.double()).abs().max() / two.double().abs().max()) <= tol_two
    if empty_row is not None:
        assert torch.equal(one[empty_row], torch.zeros_like(one[empty_row]))
    if splits > 1:  # the counters were made, one slot per (row, kv head) at least
        assert ta._counters[("cpu", None)][-1].numel() >= B * Hkv
    else:
        assert ("cpu", None) not in ta._counters


@pytest.mark.parametrize("merge_tile", [64, 128])
def test_last_program_merges_heads_in_steps(one_launch, merge_tile, monkeypatch, poison):
    """A smaller merge tile: the last program merges 1 (64) or 2 (128 = S_PAD 4 x 2 x BLOCK_DV 16) query heads at
    a time (G 4), looping over the group; sinks and a window on."""
    monkeypatch.setattr(ta, "MERGE_TILE", merge_tile)
    q, k, v, keep, nn = _inputs(2, 8, 2, 220, 16, 16, 200, torch.float32, seed=merge_tile)
    p = ta._plan(q, k, v, 150)
    assert p["S"] == 3 and ta._merge_step(p, 4) == merge_tile // 64
    s = torch.randn(8) * 2
    one = one_launch(q, k, v, keep, nn, 0.25, s, 150)
    assert _counters_zero()
    assert _off(one, plain_attention(q, k, v, keep, 200, 0.25, s, 150)) <= 1e-5


def test_repeated_calls_leave_the_counters_at_zero(one_launch, poison):
    """Several calls on one counter buffer, the valid length and the query changing (as a replayed decode step):
    each right, the counters zero after each."""
    q, k, v, keep, nn = _inputs(2, 8, 2, 256, 16, 16, 256, torch.float32, seed=7)
    s = torch.randn(8)
    g = torch.Generator().manual_seed(8)
    for n in (256, 100, 65, 230):
        nn.fill_(n)
        q = torch.randn(q.shape, generator=g)
        assert ta._plan(q, k, v, 0)["S"] == 4
        out = one_launch(q, k, v, keep, nn, 0.3, s)
        assert _counters_zero()
        assert _off(out, plain_attention(q, k, v, keep, n, 0.3, s)) <= 1e-5
    assert len(ta._counters[("cpu", None)]) == 1  # one buffer, made once


def test_counter_buffers_grow_and_keep_the_old(monkeypatch):
    """More (row, kv head) pairs than the buffer holds: a larger zeroed buffer is added, the old one kept (a graph
    captured on it still holds its address), and the larger is used from then on."""
    monkeypatch.setattr(ta, "_counters", {})
    cpu = torch.device("cpu")
    small = ta.counter(cpu, 8)
    assert small.numel() == ta.COUNTER_SLOTS and ta.counter(cpu, ta.COUNTER_SLOTS) is small
    big = ta.counter(cpu, ta.COUNTER_SLOTS + 1)
    assert big.numel() == 2 * ta.COUNTER_SLOTS and int(big.abs().sum()) == 0
    assert ta._counters[("cpu", None)] == [small, big] and ta.counter(cpu, 8) is big


def test_opcheck_with_one_launch(one_launch, monkeypatch):
    monkeypatch.setenv(ta.ONE_LAUNCH_ENV, "1")
    q, k, v, keep, n = _inputs(2, 4, 2, 150, 8, 8, 140, torch.float32, seed=2)
    assert ta._plan(q, k, v, 0)["S"] == 3
    torch.library.opcheck(torch.ops.moecomp.decode_attention.default, (q, k, v, keep, n, 0.5))
    torch.library.opcheck(torch.ops.moecomp.decode_attention.default, (q, k, v, keep, n, 0.5, torch.randn(4), 90))
    assert _counters_zero()
