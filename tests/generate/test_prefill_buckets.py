"""The prefill padded to a prompt-length bucket (``moecomp/generate/prefill.py``), on CPU (fp32, tiny models).

There are no CUDA graphs on CPU, so the bucketed body runs eagerly (``engine.prefill.cpu = True``): its greedy tokens
must be transformers' exactly (several families, sliding layers, left padding in the batch, prompts on and just past
a bucket edge), and ``return_routed_experts`` must still equal ``record_routing``'s. The capture logic runs with a
stand-in for ``torch.cuda.CUDAGraph`` (``FakeGraph``): like a real capture it runs nothing while capturing and on
replay runs the captured body with the arguments it was captured with, so a replay only sees what the host copied
into the static tensors (a Python value of the capturing call baked into the body would give wrong tokens on the
next call of the bucket). The real captures are in test_prefill_graph_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moecomp
from moecomp.generate import engine as engine_mod, prefill

from .models import FAMILIES, build, prompts

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet(quiet_single_thread):
    pass


def _pair(family, builder=build, **kw):
    ref = builder(family, **kw)
    opt = moecomp.optimize(copy.deepcopy(ref))
    assert len(opt._moecomp_report.rewritten) == ref.config.num_hidden_layers
    opt.generate.cpu = True  # the engine on CPU
    opt.generate._engine().prefill.cpu = True  # and its bucketed prefill (eager: no graphs on CPU)
    return ref, opt


def _gen(m, ids, mask, n=12, **kw):
    return m.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)


class FakeGraph:
    """Captures nothing; ``replay`` runs the body captured, with the arguments of the capturing call, and no tensor
    read on the host while it runs (``.item()``, ``int()``, ``bool()``, ``.tolist()`` raise: on CUDA each would be a
    device-to-host sync, which ends a capture)."""

    READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, body):
        self.body, self.replays = body, 0

    def replay(self):
        self.replays += 1
        saved = {n: getattr(torch.Tensor, n) for n in self.READS}

        def refuse(*a, **k):
            raise AssertionError("a tensor read on the host inside the captured prefill")

        try:
            for n in self.READS:
                setattr(torch.Tensor, n, refuse)
            self.body()
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)


@pytest.fixture()
def fake_graphs(monkeypatch):
    """Captures on CPU: ``prefill.graphs_on`` true, ``capture_graph`` a FakeGraph (``fail`` set: raises it)."""
    state = {"fail": None, "graphs": []}

    def capture(body, pool, device):
        if state["fail"] is not None:
            raise state["fail"]
        state["graphs"].append(FakeGraph(body))
        return state["graphs"][-1]

    monkeypatch.setattr(prefill, "graphs_on", lambda device: True)
    monkeypatch.setattr(prefill, "new_pool", lambda device: None)
    monkeypatch.setattr(prefill, "capture_graph", capture)
    return state


def test_buckets():
    """Powers of two from 16 to 256, then multiples of 256 up to 4096 (20 buckets); a bucket holds its prompt and
    never passes the cache of a call of that prompt (the engine's cache-length grid is the same 256)."""
    assert prefill.POW2_UNTIL == engine_mod.LENGTH_ROUND
    assert [prefill.bucket(n) for n in (1, 16, 17, 32, 33, 255, 256, 257, 512, 513, 4096)] == \
        [16, 16, 32, 32, 64, 256, 256, 512, 512, 768, 4096]
    grid = prefill.buckets(prefill.MAX_LENGTH)
    assert grid[:6] == [16, 32, 64, 128, 256, 512] and grid[-1] == 4096 and len(grid) == 20
    for n in range(1, prefill.MAX_LENGTH + 1):
        b = prefill.bucket(n)
        assert n <= b <= engine_mod.length_bucket(n + 1) and b in grid, n


def test_masks():
    """Key j of query i (cache indices): the row's mask, causal, the query's own key always, the window on the
    sliding mapping; additive masks hold 0 / the dtype's minimum."""
    pad = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    ar = torch.arange(6)
    m = prefill.masks(pad, ar, 4, 2, None)
    full, sl = m["full_attention"], m["sliding_attention"]
    assert full.shape == (2, 1, 4, 6) and full.dtype == torch.bool
    for b in range(2):
        for i in range(4):
            for j in range(6):
                want = bool(pad[b, j]) and j <= i or j == i
                assert bool(full[b, 0, i, j]) == want and bool(sl[b, 0, i, j]) == (want and j > i - 2), (b, i, j)
    add = prefill.masks(pad, ar, 4, None, torch.float32)
    assert torch.equal(add == 0, full) and bool((add[~full] == torch.finfo(torch.float32).min).all())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bucketed_prefill_tokens_equal_transformers(family):
    """Batch 3 with left padding (batch bucket 4), prompts of 16 (on a bucket edge), 17 (one past it: bucket 32), one
    token alone, and 257 (past the last power of two: bucket 512, as long as the call's cache): transformers' greedy
    tokens."""
    ref, opt = _pair(family)
    cases = [(16, 3, (0, 3, 5)), (17, 3, (0, 3, 5)), (1, 1, ()), (257, 2, (0, 100))]
    for S, B, pad in cases if family != "deepseek_v3" else cases[:3]:  # (MLA at 257 tokens: 7 s on CPU)
        ids, mask = prompts(ref.config.vocab_size, B, S, seed=S, left_pad=pad)
        want = _gen(ref, ids, mask)
        got = _gen(opt, ids, mask)
        last = opt.generate.last
        assert last["path"] == "moecomp" and last["prefill_bucket"] == prefill.bucket(S), last
        assert last["prefill"] == f"bucket {prefill.bucket(S)}, not captured (cpu: no graphs)", last
        assert torch.equal(got, want), (family, S)
    assert last["cache_length"] == (512 if family != "deepseek_v3" else 256)  # (257: its bucket fills the cache)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe"])
def test_bucketed_prefill_sliding_layers(family):
    """Sliding layers (window 8: shorter than the prompts, so the prefill's sliding mask matters; gpt-oss with eager
    attention and sinks: additive masks): transformers' tokens."""
    from .test_sliding_window import build as build_sliding

    ref, opt = _pair(family, builder=build_sliding)
    for S in (11, 16, 17):
        ids, mask = prompts(ref.config.vocab_size, 2, S, seed=S, left_pad=(0, 4))
        want = _gen(ref, ids, mask, 16)
        assert torch.equal(_gen(opt, ids, mask, 16), want), S
        assert opt.generate.last["prefill_bucket"] == prefill.bucket(S), opt.generate.last
    assert opt.generate.engine.window == 8


def test_off_switches_take_todays_prefill(monkeypatch):
    """The environment switch, a prompt past the largest bucket, batch x bucket past the token cap, and an unknown
    layers mode (a ValueError naming the variable): today's prefill, said in last["prefill"], same tokens."""
    ref, opt = _pair("qwen3_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 17, seed=3, left_pad=(0, 2))
    want = _gen(ref, ids, mask)
    monkeypatch.setenv(prefill.ENV_OFF, "0")
    assert torch.equal(_gen(opt, ids, mask), want)
    assert opt.generate.last["prefill"] == f"off: {prefill.ENV_OFF}=0" and opt.generate.last["prefill_bucket"] is None
    monkeypatch.delenv(prefill.ENV_OFF)
    monkeypatch.setattr(prefill, "MAX_LENGTH", 16)
    assert torch.equal(_gen(opt, ids, mask), want)
    assert opt.generate.last["prefill"] == "off: prompt of 17 tokens, past the largest bucket (16)"
    monkeypatch.setattr(prefill, "MAX_LENGTH", 4096)
    monkeypatch.setattr(prefill, "MAX_TOKENS", 32)
    assert torch.equal(_gen(opt, ids, mask), want)
    assert opt.generate.last["prefill"] == "off: batch bucket 2 x prompt bucket 32 past 32 tokens"
    monkeypatch.setattr(prefill, "MAX_TOKENS", 8192)
    monkeypatch.setenv(prefill.ENV_LAYERS, "fast")
    with pytest.raises(ValueError, match=prefill.ENV_LAYERS):
        _gen(opt, ids, mask)
    monkeypatch.delenv(prefill.ENV_LAYERS)
    assert torch.equal(_gen(opt, ids, mask), want) and opt.generate.last["prefill_bucket"] == 32


def test_a_model_that_keeps_every_logit_is_refused(monkeypatch):
    """A forward that ignores a tensor logits_to_keep (here: made to keep every position) is found on its first
    bucketed run: that call and every later one take today's prefill, say why, and warn once; same tokens."""
    import functools

    monkeypatch.setattr(prefill, "_warned", set())
    ref, opt = _pair("qwen3_moe")
    forward = opt.forward

    @functools.wraps(forward)
    def keep_all(*args, **kwargs):
        kwargs["logits_to_keep"] = 0
        return forward(*args, **kwargs)

    opt.forward = keep_all
    why = "off: the bucketed prefill failed (the model's forward returned logits of shape (2, 16, 96)"
    for S in (9, 12):
        ids, mask = prompts(ref.config.vocab_size, 2, S, seed=S, left_pad=(0, 2))
        if S == 9:
            with pytest.warns(UserWarning, match="the bucketed prefill failed for this model"):
                got = _gen(opt, ids, mask)
        else:
            got = _gen(opt, ids, mask)
        assert torch.equal(got, _gen(ref, ids, mask)) and opt.generate.last["prefill"].startswith(why), S


@pytest.mark.parametrize("mode", ["dynamic", "static", "eager"])
def test_layer_modes(monkeypatch, mode):
    """MOECOMP_GENERATE_PREFILL_LAYERS with the layers compiled (Dynamo, "eager" backend on CPU): dynamic shapes
    (today's prefill compile), static shapes per bucket, or eager layers: transformers' tokens, and the mode said in
    last["prefill_layers"] (the first call of a fresh slot runs eager layers, as today's prefill does)."""
    monkeypatch.setenv(prefill.ENV_LAYERS, mode)
    ref, opt = _pair("qwen3_moe")
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "eager"
    labels = []
    for S in (7, 9, 20):
        ids, mask = prompts(ref.config.vocab_size, 2, S, seed=S, left_pad=(0, 2))
        want = _gen(ref, ids, mask, 6)
        assert torch.equal(_gen(opt, ids, mask, 6), want), S
        labels.append(opt.generate.last["prefill_layers"])
    later = {"dynamic": "compiled", "static": "compiled (static shapes per bucket)",
             "eager": f"eager ({prefill.ENV_LAYERS}=eager)"}[mode]
    assert labels == ["eager", later, later] and eng.compile_error is None, labels


def test_captured_prefill_replays_other_lengths_of_the_bucket(fake_graphs):
    """With captures (FakeGraph): the first call of a fresh slot allocates the cache (not captured), the next call of
    the bucket captures, then other prompt lengths and batches of it replay the captured body without capturing;
    another bucket captures its own; changed weights capture again. Tokens: transformers' every time."""
    ref, opt = _pair("qwen2_moe")
    eng = opt.generate._engine()
    seen = []
    for S, seed in ((9, 1), (12, 2), (16, 3), (5, 4), (20, 5)):
        ids, mask = prompts(ref.config.vocab_size, 3, S, seed=seed, left_pad=(0, 2, 1))
        assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask)), S
        seen.append(opt.generate.last["prefill"])
    assert seen[0].startswith("bucket 16, not captured: this call allocated the slot's cache"), seen
    assert seen[1:] == ["captured", "replayed", "replayed", "captured"], seen
    assert eng.stats["prefill_captures"] == 2 and eng.stats["prefill_replays"] == 2
    assert [g.replays for g in fake_graphs["graphs"]] == [2, 0]
    ids, mask = prompts(ref.config.vocab_size, 1, 14, seed=6)  # batch bucket 1: another slot
    assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask))
    with torch.no_grad():
        for m in (ref, opt):
            m.model.layers[0].mlp.gate.weight.mul_(-1.0)
    ids, mask = prompts(ref.config.vocab_size, 3, 11, seed=7, left_pad=(1, 0, 0))
    assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask))
    assert opt.generate.last["prefill"] == "captured"  # a new fingerprint: the old graphs are stale
    assert torch.equal(_gen(opt, ids[:, 1:], mask[:, 1:]), _gen(ref, ids[:, 1:], mask[:, 1:]))
    assert opt.generate.last["prefill"] == "replayed"


def test_failed_capture_falls_back_with_the_reason(fake_graphs, monkeypatch):
    """A capture that raises: this call's tokens stand (the body ran before the capture), the reason is in
    last["prefill"] and warned of once; later calls of the bucket take today's prefill and say why."""
    monkeypatch.setattr(prefill, "_warned", set())
    ref, opt = _pair("qwen3_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 10, seed=1, left_pad=(0, 3))
    want = _gen(ref, ids, mask)
    assert torch.equal(_gen(opt, ids, mask), want)  # allocates the slot's cache
    fake_graphs["fail"] = RuntimeError("operation not permitted when stream is capturing\nmore")
    with pytest.warns(UserWarning, match=r"prefill could not be captured as a CUDA graph \(RuntimeError: operation"):
        assert torch.equal(_gen(opt, ids, mask), want)
    why = "RuntimeError: operation not permitted when stream is capturing"
    assert opt.generate.last["prefill"].startswith(f"capture failed: {why} (this call ran bucket 16"), opt.generate.last
    assert opt.generate.engine.stats["prefill_capture_failures"] == 1
    fake_graphs["fail"] = None
    ids2, mask2 = prompts(ref.config.vocab_size, 2, 13, seed=2)
    assert torch.equal(_gen(opt, ids2, mask2), _gen(ref, ids2, mask2))
    assert opt.generate.last["prefill"] == f"off: capture failed before ({why})"
    ids3, mask3 = prompts(ref.config.vocab_size, 2, 30, seed=3)  # another bucket captures
    assert torch.equal(_gen(opt, ids3, mask3), _gen(ref, ids3, mask3))
    assert opt.generate.last["prefill"] == "captured"


def test_routes_with_the_bucketed_prefill(fake_graphs, poison):
    """return_routed_experts=True through the bucketed prefill, run, captured and replayed: the routes equal
    record_routing's over transformers' loop (exactly: the same op routes both), -1 on left padding and the last
    column; the bucket's padding columns never show."""
    from moecomp.api.routing import moe_blocks

    m = moecomp.optimize(build("qwen3_moe", layers=3, seed=0), use_capture=False)
    m.generate.cpu = True
    m.generate._engine().prefill.cpu = True
    k = moe_blocks(m)[0][1]._moecomp.spec.top_k
    seen = []
    for S, seed in ((6, 0), (9, 1), (16, 2)):
        ids = torch.randint(3, 90, (3, S), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[2, :3] = 0
        out = _gen(m, ids, mask, 4, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                   return_routed_experts=True)
        last = m.generate.last
        seen.append(last["prefill"])
        assert last["routes"] == "recorded in the engine's steps" and last["routes_missing"] == 0, last
        seq, routes = out.sequences, out.routed_experts
        assert routes.shape == (3, 3, seq.shape[1], k)
        assert bool((routes[:, 2, :3] == -1).all()) and bool((routes[:, :, -1] == -1).all())
        live = routes[:, :, :-1] >= 0
        assert int(live.sum()) == 3 * k * (3 * (seq.shape[1] - 1) - 3)
        with torch.no_grad(), moecomp.record_routing(m) as rec:
            again = _gen(m, ids, mask, 4, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                         moecomp_fast=False)
        assert torch.equal(again.sequences, seq)
        ref = rec.calls[-1] if rec.calls[-1].shape[2] == seq.shape[1] - 1 else rec.routes
        assert torch.equal(routes[:, :, :-1][live], ref[live]), S
    assert seen[0].startswith("bucket 16, not captured") and seen[1:] == ["captured", "replayed"], seen
    m.generate.release()


def test_warmup_captures_prompt_buckets(fake_graphs):
    """moecomp.warmup(prompt_lengths=...) captures each bucket's prefill (default: every bucket that fits
    max_length); a later call of a warmed bucket replays; bad lengths are a ValueError naming the argument."""
    ref, opt = _pair("qwen3_moe")
    got = moecomp.warmup(opt, batch_sizes=[2], max_length=64, prompt_length=5, prompt_lengths=[9, 20])
    assert got[2]["prefill"] == {16: "replayed", 32: "captured"}, got  # 16: warmup's own calls captured it
    ids, mask = prompts(ref.config.vocab_size, 2, 25, seed=1, left_pad=(0, 4))
    assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask))
    assert opt.generate.last["prefill"] == "replayed" and opt.generate.last["prefill_bucket"] == 32
    got = moecomp.warmup(opt, batch_sizes=[1], max_length=64, prompt_length=5)
    assert got[1]["prefill"] == {16: "replayed", 32: "captured", 64: "captured"}, got
    for bad in ([0], [64], "16", [1.5]):
        with pytest.raises(ValueError, match="prompt_lengths"):
            moecomp.warmup(opt, batch_sizes=[1], max_length=64, prompt_lengths=bad)
