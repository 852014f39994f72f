"""The prefill captured per prompt-length bucket on CUDA (``moecomp/generate/prefill.py``), fp32 tiny models.

Tokens equal transformers' and the uncaptured prefill's (``MOECOMP_GENERATE_PREFILL_GRAPH=0``) exactly (fp32: a flip
would need two logits within ~1e-5); ``model.generate.last["prefill"]`` says what ran: the first call of a fresh slot
allocates its cache (eager, not captured), the next call of a bucket captures, later calls of any prompt length in
that bucket replay without capturing, with little host time; a capture that fails (a host read forced into it) falls
back with the reason; ``return_routed_experts`` through the replayed prefill equals ``record_routing``'s; warm-up
captures the buckets it is asked for.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moecomp
from moecomp.generate import prefill

from .models import build, prompts

pytestmark = pytest.mark.gpu
AGREE = 0.995  # routes: share of (layer, token) entries whose ids equal the eager reference's (near-ties apart)
HOST_S = 5e-3  # host time of a replayed prefill call at 2 layers (generous: about a dozen launches and the replay)


def _pair(family, builder=build, **kw):
    ref = builder(family, "cuda", torch.float32, **kw)
    opt = moecomp.optimize(copy.deepcopy(ref))
    assert len(opt._moecomp_report.rewritten) == ref.config.num_hidden_layers
    return ref, opt


def _gen(m, ids, mask, n=12, **kw):
    return m.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)


def _sliding(family, device, dtype):
    from .test_sliding_window import build as build_sliding

    return build_sliding(family, device, dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss"])
def test_prefill_graph_replays_and_equals_uncaptured(family, monkeypatch):
    """Batch 3 with left padding: prompts of 12 (fresh slot, then captured), 9 and 16 (replayed: the same bucket),
    17 (bucket 32: captured), 20 (replayed). gpt-oss: sliding layers (window 8) and eager attention with sinks
    (additive masks, a mapping per layer type)."""
    ref, opt = _pair(family, _sliding if family == "gpt_oss" else build)
    eng = opt.generate._engine()
    seen = []
    for S, seed in ((12, 1), (12, 2), (9, 3), (16, 4), (17, 5), (20, 6)):
        ids, mask = prompts(ref.config.vocab_size, 3, S, seed=seed, left_pad=(0, 3, 5))
        ids, mask = ids.cuda(), mask.cuda()
        want = _gen(ref, ids, mask)
        got = _gen(opt, ids, mask)
        last = dict(opt.generate.last)
        assert last["path"] == "moecomp" and torch.equal(got, want), (S, last)
        seen.append(last["prefill"])
        if last["prefill"] == "replayed":
            assert last["prefill_layers"] == "compiled" and last["graphs"] == "replayed", last
            assert 0 < last["prefill_gpu_s"] <= last["prefill_s"] + 1e-4, last
            assert last["prefill_host_s"] < HOST_S, last
        monkeypatch.setenv(prefill.ENV_OFF, "0")
        assert torch.equal(_gen(opt, ids, mask), got), S  # the uncaptured prefill: the same tokens
        assert opt.generate.last["prefill"] == f"off: {prefill.ENV_OFF}=0"
        monkeypatch.delenv(prefill.ENV_OFF)
    assert seen[0].startswith("bucket 16, not captured: this call allocated the slot's cache"), seen
    assert seen[1:] == ["captured", "replayed", "replayed", "captured", "replayed"], seen
    assert eng.stats["prefill_captures"] == 2 and eng.stats["prefill_replays"] == 3, eng.stats
    assert eng.stats.get("prefill_capture_failures", 0) == 0


@pytest.mark.parametrize("mode", ["static", "eager"])
def test_prefill_layer_modes(mode, monkeypatch):
    """MOECOMP_GENERATE_PREFILL_LAYERS=static (Inductor per bucket) and eager (layers eager inside the graph):
    transformers' tokens, captured and replayed, the mode said in last["prefill_layers"]."""
    monkeypatch.setenv(prefill.ENV_LAYERS, mode)
    ref, opt = _pair("qwen3_moe")
    seen = []
    for S in (12, 10, 14, 30):
        ids, mask = prompts(ref.config.vocab_size, 2, S, seed=S, left_pad=(0, 2))
        ids, mask = ids.cuda(), mask.cuda()
        assert torch.equal(_gen(opt, ids, mask), _gen(ref, ids, mask)), S
        seen.append((opt.generate.last["prefill"], opt.generate.last["prefill_layers"]))
    label = "compiled (static shapes per bucket)" if mode == "static" else f"eager ({prefill.ENV_LAYERS}=eager)"
    assert [p for p, _ in seen[1:]] == ["captured", "replayed", "captured"] and all(
        lab == label for _, lab in seen[1:]), seen


def test_prefill_capture_failure_falls_back(monkeypatch):
    """A host read inside the prefill (forced: the embedding's output read while a capture runs, prefill-sized
    inputs only) makes its capture fail: that call's tokens stand, the reason is in last["prefill"] and warned of,
    the next call of the bucket takes today's prefill and says so, the decode graphs are untouched, and another
    bucket captures once the read is gone."""
    monkeypatch.setattr(prefill, "_warned", set())
    ref, opt = _pair("qwen3_moe")

    def host_read(mod, args, out):
        if torch.cuda.is_current_stream_capturing() and args[0].shape[1] > 1:
            out.sum().item()

    hook = opt.get_input_embeddings().register_forward_hook(host_read)
    ids, mask = prompts(ref.config.vocab_size, 2, 10, seed=1, left_pad=(0, 3))
    ids, mask = ids.cuda(), mask.cuda()
    want = _gen(ref, ids, mask)
    assert torch.equal(_gen(opt, ids, mask), want)  # allocates the slot's cache: nothing captured
    with pytest.warns(UserWarning, match="the prefill could not be captured"):
        assert torch.equal(_gen(opt, ids, mask), want)
    last = opt.generate.last
    assert last["prefill"].startswith("capture failed: ") and "Error" in last["prefill"], last
    assert opt.generate.engine.stats["prefill_capture_failures"] == 1
    ids2, mask2 = prompts(ref.config.vocab_size, 2, 14, seed=2)
    ids2, mask2 = ids2.cuda(), mask2.cuda()
    assert torch.equal(_gen(opt, ids2, mask2), _gen(ref, ids2, mask2))
    last = opt.generate.last
    assert last["prefill"].startswith("off: capture failed before (") and last["graphs"] == "replayed", last
    hook.remove()
    ids3, mask3 = prompts(ref.config.vocab_size, 2, 30, seed=3)
    ids3, mask3 = ids3.cuda(), mask3.cuda()
    assert torch.equal(_gen(opt, ids3, mask3), _gen(ref, ids3, mask3))
    assert opt.generate.last["prefill"] == "captured", opt.generate.last


def test_prefill_graph_routes():
    """return_routed_experts=True with the prefill run (fresh slot), captured, then replayed for another prompt length
    of the bucket: -1 exactly on left padding and the last column, ids everywhere else, and those ids the ones
    record_routing finds in one forward of the generated sequence (the op's eager path: sorted ids compared, at
    least AGREE of the entries; the compiled, captured prefill and decode agree with it but at near-ties)."""
    from moecomp.api.routing import moe_blocks

    m = moecomp.optimize(build("qwen3_moe", "cuda", torch.float32, layers=3, seed=0))
    L, k = len(moe_blocks(m)), moe_blocks(m)[0][1]._moecomp.spec.top_k
    seen = []
    for S, seed in ((6, 0), (9, 1), (16, 2)):
        ids, mask = prompts(m.config.vocab_size, 3, S, seed=seed, left_pad=(0, 3, 1))
        ids, mask = ids.cuda(), mask.cuda()
        out = _gen(m, ids, mask, 8, min_new_tokens=8, return_dict_in_generate=True, return_routed_experts=True)
        last = m.generate.last
        seen.append(last["prefill"])
        assert last["routes"] == "recorded in the engine's steps" and last["routes_missing"] == 0, last
        seq, routes = out.sequences, out.routed_experts
        assert routes.shape == (L, 3, seq.shape[1], k)
        full = torch.cat([mask, torch.ones(3, seq.shape[1] - S, dtype=mask.dtype, device="cuda")], 1)
        with torch.no_grad(), moecomp.record_routing(m) as rec:
            m(input_ids=seq, attention_mask=full)
        live = full.bool().clone()
        live[:, -1] = False
        assert bool((routes[:, ~live] == -1).all()) and bool((routes[:, live] >= 0).all()), S
        same = (routes[:, live].sort(-1).values == rec.routes[:, live].sort(-1).values).all(-1).float().mean()
        assert float(same) >= AGREE, (S, float(same))
    assert seen[1:] == ["captured", "replayed"], seen


def test_warmup_captures_prefill_buckets():
    """moecomp.warmup captures every bucket that fits max_length (64: 16, 32, 64); a later call of a warmed bucket
    replays at once (no prefill capture) with transformers' tokens."""
    ref, opt = _pair("qwen3_moe")
    got = moecomp.warmup(opt, batch_sizes=[1], max_length=64)
    assert got[1]["prefill"] == {16: "replayed", 32: "captured", 64: "captured"}, got
    eng = opt.generate.engine
    caps = eng.stats["prefill_captures"]
    ids, mask = prompts(ref.config.vocab_size, 1, 40, seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    assert torch.equal(_gen(opt, ids, mask, 10), _gen(ref, ids, mask, 10))
    assert opt.generate.last["prefill"] == "replayed" and eng.stats["prefill_captures"] == caps, opt.generate.last
