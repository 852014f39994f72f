"""moecomp's generate() on CPU (fp32): the one-liner gives transformers' tokens exactly, falls back to transformers'
loop for what it does not do, and optimize() composes with torch.compile without per-step recompiles.

On CPU the engine runs the same static-cache step as on the GPU, eagerly (no graphs): these tests cover the loop's
logic (static cache, masks, left padding, batch buckets, eos and pad handling, min lengths, processors, sampling).
The CUDA-graph side is in test_generate_gpu.py.
"""

import copy
import inspect
import pickle

import pytest
import torch

import moecomp
from moecomp.generate import sampling
from moecomp.api.optimize import rewritten_blocks

from .models import FAMILIES, build, prompts

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet(quiet_single_thread):
    pass


def _pair(family, **kw):
    ref = build(family, **kw)
    opt = moecomp.optimize(copy.deepcopy(ref))
    assert len(opt._moecomp_report.rewritten) == ref.config.num_hidden_layers
    opt.generate.cpu = True  # the engine on CPU (by default CPU models keep transformers' loop)
    return ref, opt


def test_cpu_models_keep_transformers_loop_by_default():
    ref = build("qwen3_moe")
    opt = moecomp.optimize(copy.deepcopy(ref))
    ids, _ = prompts(ref.config.vocab_size, 1, 5, seed=11)
    assert torch.equal(opt.generate(ids, max_new_tokens=4, do_sample=False),
                       ref.generate(ids, max_new_tokens=4, do_sample=False))
    assert opt.generate.last["path"] == "transformers" and "CPU" in opt.generate.last["reason"]


def _both(ref, opt, ids, mask=None, **kw):
    want = ref.generate(ids, attention_mask=mask, **kw)
    got = opt.generate(ids, attention_mask=mask, **kw)
    return got, want


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_transformers(family):
    """Batch of 3 with left padding (bucket 4: one repeated row), 16 new tokens."""
    ref, opt = _pair(family)
    ids, mask = prompts(ref.config.vocab_size, 3, 9, seed=1, left_pad=(0, 3, 5))
    got, want = _both(ref, opt, ids, mask, max_new_tokens=16, do_sample=False)
    last = opt.generate.last
    assert last["path"] == "moecomp" and last["batch_bucket"] == 4 and last["graphs"] == "off (CPU)", last
    assert torch.equal(got, want)
    # the time-to-first-token breakdown: transformers' setup before the engine, the engine's prefill and decode
    # on the host, the whole call; each part positive and within the call
    parts = [last[k] for k in ("host_setup_s", "prefill_host_s", "decode_host_s")]
    assert all(p > 0 for p in parts) and sum(parts) <= last["call_s"], last
    got, want = _both(ref, opt, ids[:1], None, max_new_tokens=5, do_sample=False)  # no mask, batch 1
    assert torch.equal(got, want) and opt.generate.last["batch_bucket"] == 1


def test_eos_pad_and_lengths():
    """Rows stop at eos and get pad tokens afterwards; the result is as long as transformers' (it stops when every row
    has stopped); max_length and min_new_tokens / min_length are honoured."""
    ref, opt = _pair("qwen3_moe")
    ids, mask = prompts(ref.config.vocab_size, 4, 8, seed=2, left_pad=(0, 0, 4, 1))
    free = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[:, 8:]
    eos = [int(free[0, 3]), int(free[2, 6])]
    checked = 0
    for kw in (dict(max_new_tokens=24), dict(max_length=20), dict(max_new_tokens=24, min_new_tokens=10),
               dict(max_new_tokens=24, min_length=14)):
        got, want = _both(ref, opt, ids, mask, do_sample=False, eos_token_id=eos, pad_token_id=0, **kw)
        assert opt.generate.last["path"] == "moecomp", opt.generate.last
        assert torch.equal(got, want), kw
        checked += int(got.shape[1] < 8 + 24)
    assert checked >= 1  # at least one setting stopped early on eos


def test_sampling_paths():
    ref, opt = _pair("qwen2_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 6, seed=3)
    greedy = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    got = opt.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=1)
    assert opt.generate.last["path"] == "moecomp" and torch.equal(got, greedy)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(opt.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=True,
                                 temperature=2.0, top_p=0.95, top_k=0))
        assert opt.generate.last["path"] == "moecomp"
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_sampler_draws_from_the_softmax():
    """select() with do_sample: frequencies over 40,000 draws match softmax(logits / T) within 5 standard errors."""
    V, n = 6, 40_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, V).contiguous()
    from transformers.generation.logits_process import TemperatureLogitsWarper

    s = sampling.Sampler(True, [TemperatureLogitsWarper(0.7)], (), -1).prepare("cpu", V)
    st = sampling.StepState(n, 4, "cpu")
    st.start(n, 0)
    torch.manual_seed(0)
    freq = torch.bincount(sampling.select(logits, st, s), minlength=V).float() / n
    p = torch.softmax(logits[0] / 0.7, -1)
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-4).all(), (freq, p)


@pytest.mark.parametrize("kw,reason", [
    (dict(num_beams=2), "decoding mode"),
    (dict(repetition_penalty=1.3), "logits processor RepetitionPenaltyLogitsProcessor"),
    (dict(return_dict_in_generate=True, output_scores=True), "=True"),
    (dict(moecomp_fast=False), "moecomp_fast=False"),
    (dict(cache_implementation="static"), "cache_implementation given"),
])
def test_falls_back_to_transformers_with_the_same_result(kw, reason):
    ref, opt = _pair("qwen3_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=4)
    got = opt.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kw)
    last = opt.generate.last
    assert last["path"] == "transformers" and reason in last["reason"], last
    kw.pop("moecomp_fast", None)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kw)
    if isinstance(got, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert torch.equal(got.sequences, want.sequences)


def test_remembered_decoding_mode_follows_config_changes(monkeypatch):
    """``_plain_reason`` remembers transformers' resolution of the decoding mode (it deep-copies the configs: ~0.4 ms
    a call on this CPU); a change of the model's generation config, of its config or of the call's arguments must
    change the answer, never reuse a stale one. Counts the resolutions to show the memo is used at all."""
    from moecomp.generate import hf_generate

    _, opt = _pair("qwen3_moe")
    ids, mask = prompts(opt.config.vocab_size, 1, 5, seed=2)
    calls = []
    real = hf_generate._mode_reason
    monkeypatch.setattr(hf_generate, "_mode_reason", lambda m, kw: calls.append(1) or real(m, kw))
    fg = opt.generate
    for _ in range(3):
        assert fg._plain_reason((ids,), dict(attention_mask=mask, max_new_tokens=2)) is None
    assert len(calls) == 1
    opt.generation_config.num_beams = 2  # the model's config changed in place: a new key, a new answer
    assert "decoding mode" in fg._plain_reason((ids,), dict(attention_mask=mask, max_new_tokens=2))
    opt.generation_config.num_beams = 1
    assert fg._plain_reason((ids,), dict(attention_mask=mask, max_new_tokens=2)) is None
    assert "decoding mode" in fg._plain_reason((ids,), dict(attention_mask=mask, max_new_tokens=2, num_beams=3))
    gc = copy.deepcopy(opt.generation_config)
    assert fg._plain_reason((ids,), dict(generation_config=gc, max_new_tokens=2)) is None
    gc.num_beams = 2  # a config object passed in, changed between calls
    assert "decoding mode" in fg._plain_reason((ids,), dict(generation_config=gc, max_new_tokens=2))
    n = len(calls)
    assert "decoding mode" in fg._plain_reason((ids,), dict(generation_config=gc, max_new_tokens=2))
    assert len(calls) == n  # the same call again: remembered
    got = opt.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert opt.generate.last["path"] == "transformers" or got.shape == (1, 8)


def test_streamer_and_user_cache_go_to_transformers():
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    class Keep(BaseStreamer):
        def __init__(self):
            self.seen = []

        def put(self, v):
            self.seen.append(v)

        def end(self):
            pass

    ref, opt = _pair("qwen3_moe")
    ids, _ = prompts(ref.config.vocab_size, 1, 5, seed=5)
    st = Keep()
    got = opt.generate(ids, max_new_tokens=4, do_sample=False, streamer=st)
    assert opt.generate.last["reason"] == "streamer given" and len(st.seen) == 1 + got.shape[1] - 5
    assert torch.equal(got, ref.generate(ids, max_new_tokens=4, do_sample=False))
    opt.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(config=opt.config))
    assert opt.generate.last["path"] == "transformers"


def test_opt_outs_unoptimize_copy_and_pickle():
    ref, opt = _pair("qwen3_moe")
    ids, _ = prompts(ref.config.vocab_size, 1, 5, seed=6)
    want = ref.generate(ids, max_new_tokens=5, do_sample=False)
    plain = moecomp.optimize(copy.deepcopy(ref), fast_generate=False)  # (opt.generate.cpu carries over below)
    assert "generate" not in plain.__dict__ and torch.equal(plain.generate(ids, max_new_tokens=5, do_sample=False),
                                                           want)
    assert "moecomp" in opt._moecomp_report.generate and "generate()" in str(opt._moecomp_report)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert torch.equal(clone.generate(ids, max_new_tokens=5, do_sample=False), want)
        assert clone.generate.last["path"] == "moecomp" and clone.generate.model is clone
    opt.generate.enabled = False
    opt.generate(ids, max_new_tokens=5, do_sample=False)
    assert opt.generate.last["path"] == "transformers"
    moecomp.unoptimize(opt)
    assert "generate" not in opt.__dict__ and torch.equal(opt.generate(ids, max_new_tokens=5, do_sample=False), want)


def test_dense_model_keeps_transformers_generate():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)).eval()
    moecomp.optimize(m)
    assert "generate" not in m.__dict__ and m._moecomp_report.generate == ""


def test_weight_updates_between_calls_are_followed():
    ref, opt = _pair("qwen2_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 6, seed=7)
    kw = dict(max_new_tokens=8, do_sample=False)
    got, want = _both(ref, opt, ids, mask, **kw)
    assert torch.equal(got, want)
    with torch.no_grad():
        for m in (ref, opt):
            m.model.layers[0].mlp.gate.weight.mul_(-1.0)
            m.model.layers[0].mlp.shared_expert_gate.weight.mul_(4.0)
    got, want = _both(ref, opt, ids, mask, **kw)
    assert torch.equal(got, want)


def test_torch_compile_of_an_optimized_model_does_not_recompile_per_step():
    """The bound block counted its calls in a Python attribute; under torch.compile Dynamo guarded on the count and
    recompiled every step (then fell back to eager at the cache limit)."""
    from transformers import StaticCache

    ref, opt = _pair("qwen3_moe")
    compiled = torch.compile(opt, backend="eager")
    ids, _ = prompts(ref.config.vocab_size, 2, 7, seed=8)
    cache = StaticCache(config=opt.config, max_cache_len=32)
    kw = {"cache" if "cache" in inspect.signature(opt.forward).parameters else "past_key_values": cache}
    calls0 = [b._moecomp.calls for b in rewritten_blocks(opt).values()]
    with torch.no_grad():
        tok = opt(input_ids=ids, use_cache=True, **kw).logits[:, -1:].argmax(-1)
        try:
            for t in range(8):
                if t == 2:
                    torch.compiler.set_stance("fail_on_recompile")
                tok = compiled(input_ids=tok, position_ids=torch.full((2, 1), 7 + t), use_cache=True,
                               **kw).logits[:, -1:].argmax(-1)
        finally:
            torch.compiler.set_stance("default")
    calls1 = [b._moecomp.calls for b in rewritten_blocks(opt).values()]
    assert [c1 - c0 for c0, c1 in zip(calls0, calls1)] == [1, 1]  # only the eager prefill counted


def test_compiled_decoder_layers_and_a_failed_compile(monkeypatch):
    """The decode step with the decoder layers under torch.compile (what the GPU does with Inductor; here the "eager"
    backend), the decode attention included: same tokens. A compile that fails in the warm-up step is undone (the
    cache lengths the layers that ran had advanced are put back) and the engine goes on with eager layers."""
    ref, opt = _pair("qwen3_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=9, left_pad=(0, 2))
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    opt.generate._engine().cpu_compile = True
    opt.generate._engine().compile_backend = "eager"
    assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), want)
    assert opt.generate.last["layers"] == "compiled" and opt.generate.last["prefill_layers"] == "eager"
    for S in (7, 5):  # the cache exists now: the prefill runs compiled too (dynamic shapes: any prompt length)
        ids2, mask2 = prompts(ref.config.vocab_size, 2, S, seed=S, left_pad=(1, 0))
        want2 = ref.generate(ids2, attention_mask=mask2, max_new_tokens=8, do_sample=False)
        assert torch.equal(opt.generate(ids2, attention_mask=mask2, max_new_tokens=8, do_sample=False), want2)
        assert opt.generate.last["prefill_layers"] == "compiled", opt.generate.last

    calls = []

    def broken(gm, example_inputs):  # the compiled layer fails when the second layer runs it, after the first ran
        def run(*args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("backend failed")
            return gm(*args)

        return run

    _, opt2 = _pair("qwen3_moe")
    eng = opt2.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, broken
    assert torch.equal(opt2.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), want)
    assert "compile failed" in opt2.generate.last["layers"] and len(calls) >= 2


def test_a_failed_prefill_compile_leaves_the_decode_step_compiled(monkeypatch):
    """Compiling the prefill's layers fails (what Dynamo did on torch 2.11 with gpt-oss's sink attention): the prefill
    runs eagerly from then on, says why, and the decode step stays compiled (a failure is kept per phase, not for the
    whole engine); the tokens are transformers'."""
    from moecomp.generate import engine as engine_mod

    real = engine_mod.compiled_run

    def failing_prefill(phase, backend, dynamic):
        if phase != "prefill":
            return real(phase, backend, dynamic)

        def run(*args, **kwargs):
            raise NotImplementedError("prefill does not trace")
        return run

    monkeypatch.setattr(engine_mod, "compiled_run", failing_prefill)
    ref, opt = _pair("qwen3_moe")
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "eager"
    for S in (7, 6, 5):  # the first call's prefill is eager (no cache yet); the next two try to compile it
        ids, mask = prompts(ref.config.vocab_size, 2, S, seed=S, left_pad=(0, 2))
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), want)
        assert opt.generate.last["layers"] == "compiled", opt.generate.last
    assert opt.generate.last["prefill_layers"] == "eager (compile failed: NotImplementedError: prefill does not trace)"
    assert list(eng.compile_errors) == ["prefill"] and "NotImplementedError" in eng.compile_tracebacks["prefill"]


def test_progress_line_while_layers_compile(monkeypatch, capsys):
    """MOECOMP_PROGRESS=1: the first compiled call of a (phase, batch) says which layer compiles, one line each
    (stderr not a terminal), and the next call at that batch says nothing; MOECOMP_PROGRESS=0 (and, by default, a
    stderr that is not a terminal) keeps it quiet."""
    ref, opt = _pair("qwen3_moe")
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=9, left_pad=(0, 2))
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "eager"
    n = ref.config.num_hidden_layers
    monkeypatch.setenv("MOECOMP_PROGRESS", "1")
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    capsys.readouterr()
    assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), want)
    err = capsys.readouterr().err.splitlines()
    lines = [x for x in err if x.startswith("moecomp: compiling decode step, batch 2: layer")]
    assert lines == [f"moecomp: compiling decode step, batch 2: layer {i}/{n}" for i in range(1, n + 1)], err
    opt.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert not [x for x in capsys.readouterr().err.splitlines() if "compiling decode" in x]
    monkeypatch.setenv("MOECOMP_PROGRESS", "0")
    ids3, mask3 = prompts(ref.config.vocab_size, 3, 7, seed=3)
    opt.generate(ids3, attention_mask=mask3, max_new_tokens=6, do_sample=False)  # a new batch: compiles, quietly
    assert "moecomp:" not in capsys.readouterr().err


def test_warmup_prepares_the_slot_later_calls_use(monkeypatch):
    """moecomp.warmup: three short calls per batch size on a cache of max_length (rounded up), the last with a
    left-padded row; a later call of that batch whose prompt + new tokens fit reuses the slot and, padded, compiles
    nothing more (Dynamo traces no new graph); same tokens as transformers'; bad arguments are ValueErrors naming
    them."""
    from torch._dynamo.utils import counters

    from moecomp.generate.sampling import Sampler

    sigs = []
    from_hf = Sampler.from_hf.__func__

    def spy(cls, *a, **k):
        s, n = from_hf(cls, *a, **k)
        sigs.append(s.signature)
        return s, n

    monkeypatch.setattr(Sampler, "from_hf", classmethod(spy))
    ref, opt = _pair("qwen3_moe")
    assert ref.generation_config.eos_token_id is not None  # the min-length mask is in play
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "eager"
    got = moecomp.warmup(opt, batch_sizes=[2], max_length=300, prompt_length=5)
    assert got[2]["path"] == "moecomp" and got[2]["cache_length"] == 512, got
    assert got[2]["cache"]["load"].startswith("off") and got[2]["cache"]["save"] == "off", got  # (tests: off)
    slots = list(eng.slots)
    graphs = counters["stats"]["unique_graphs"]
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=9, left_pad=(0, 2))
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), want)
    assert opt.generate.last["cache_length"] == 512 and list(eng.slots) == slots  # no new slot
    assert opt.generate.last["prefill_layers"] == "compiled" and counters["stats"]["unique_graphs"] == graphs
    # warmup's calls (min_new_tokens set) and the user's (none) share one sampler signature: one captured step
    assert len(sigs) == 4 and len(set(sigs)) == 1, sigs
    with pytest.raises(ValueError, match="batch_sizes"):
        moecomp.warmup(opt, batch_sizes=[0])
    with pytest.raises(ValueError, match="max_length"):
        moecomp.warmup(opt, batch_sizes=[1], max_length=4, prompt_length=8)
    with pytest.raises(ValueError, match="moecomp.optimize"):
        moecomp.warmup(ref, batch_sizes=[1])


def test_capture_releases_cached_memory_and_retries_once(monkeypatch):
    """The decode step's capture (CUDA calls mocked: this runs on CPU): with the device nearly full the caching
    allocator's blocks are released first; a capture that runs out of memory is retried once after releasing them;
    a second failure propagates (the engine then runs plain launches and warns once)."""
    from moecomp.generate import engine as E

    eng = E.Engine(build("qwen3_moe"))
    calls = {"empty": 0, "enter": 0, "steps": 0}
    fail = {"n": 1}

    class FakeGraph:
        pass

    class FakeCapture:
        def __init__(self, g, pool=None):
            pass

        def __enter__(self):
            calls["enter"] += 1
            if fail["n"] > 0:
                fail["n"] -= 1
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (mocked)")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.__setitem__("empty", calls["empty"] + 1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(eng, "_step", lambda s, sampler, dtype: calls.__setitem__("steps", calls["steps"] + 1))
    slot = type("S", (), {"tok": torch.zeros(1, 1, dtype=torch.long), "pool": None})()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (50, 100))  # half free: nothing released first
    assert isinstance(eng._capture(slot, None, torch.float32), FakeGraph)
    assert calls == {"empty": 1, "enter": 2, "steps": 1} and eng.stats["capture_retries"] == 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (5, 100))  # nearly full: released first
    assert isinstance(eng._capture(slot, None, torch.float32), FakeGraph)
    assert calls == {"empty": 2, "enter": 3, "steps": 2}
    fail["n"] = 2
    with pytest.raises(torch.cuda.OutOfMemoryError):
        eng._capture(slot, None, torch.float32)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_layers_share_one_compiled_entry(family):
    """The engine's compiled steps trace one decoder layer per phase for all the layers of a 4-layer model (Dynamo
    frames counted; "eager" backend on CPU), not one per layer, and give transformers' tokens; moecomp's instance
    forwards are back in place after the call."""
    from torch._dynamo.utils import counters

    from moecomp.bind.bind import BoundForward
    from moecomp.bind.bind_experts import ExpertsForward

    ref, opt = _pair(family, layers=4)
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, "eager"
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=9, left_pad=(0, 2))
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    counters.clear()
    assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), want)
    assert opt.generate.last["layers"] == "compiled" and eng.compile_error is None
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])  # the decode step: one frame for 4 layers
    counters.clear()
    assert torch.equal(opt.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), want)
    assert opt.generate.last["prefill_layers"] == "compiled"
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])  # the prefill: one frame too
    fwd = [m.__dict__["forward"] for m in opt.modules() if "forward" in m.__dict__]
    assert fwd and all(isinstance(f, (BoundForward, ExpertsForward)) for f in fwd)
