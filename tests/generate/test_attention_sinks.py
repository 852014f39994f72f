"""gpt-oss attention (learned sinks, sliding and full layers, eager attention) on moecomp's decode kernel, and the
probe that decides it (generate/attention_probe.py): one tiny forward, no source reading, no family names.

- the kernel's eager-attention function against transformers' own gpt-oss eager attention (a tiny GptOssAttention,
  sinks of both signs, GQA, a window shorter than the cache), on the torch path and the Triton kernels under the
  interpreter, fp32 and fp16;
- the probe: gpt-oss recognised (sinks, a mask per layer type, the window kwarg on the sliding layers exactly); an
  eager attention that drops the sinks refused (its numbers differ); a base model that hands the layers the other
  type's mask refused (its source still reads the mapping: a source test would have passed it);
- the engine: gpt-oss's decode steps call the kernel with the sinks and the window, greedy tokens = transformers';
  an eager model without sinks (Qwen3-MoE set to eager) runs on the kernel too.
"""

import copy

import pytest
import torch

import moecomp
from moecomp.generate import attention, attention_probe

from .models import build as build_family
from .models import prompts
from .test_sliding_window import WINDOW, _gen, build

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet(quiet_single_thread):
    pass


def _engine_pair(ref):
    opt = moecomp.optimize(copy.deepcopy(ref))
    opt.generate.cpu = True
    return opt


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_kernel_equals_gpt_oss_eager_attention(backend, dtype, tol, monkeypatch, poison):
    """One decode token, batch 3 (one row left-padded), 8 query heads on 2 kv heads, a 150-slot cache of which 131
    are written, window 40: ``moecomp_decode_eager`` against transformers' ``eager_attention_forward`` of gpt-oss
    (computed in fp32 from the same inputs, its additive mask built from the same keep / window)."""
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    cfg = transformers.GptOssConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=16, sliding_window=40, vocab_size=64)
    torch.manual_seed(0)
    module = hf.GptOssAttention(cfg, layer_idx=0).eval()
    module.sinks.requires_grad_(False)
    with torch.no_grad():
        module.sinks.copy_(torch.randn(8) * 2)
    B, L, n, W = 3, 150, 131, 40
    q, k, v = torch.randn(B, 8, 1, 16), torch.randn(B, 2, L, 16), torch.randn(B, 2, L, 16)
    pos = torch.arange(L)
    keep = (pos < n) & (pos >= n - W) & torch.ones(B, 1, dtype=torch.bool)  # [B, L]
    keep[1, : n - 25] = False  # row 1 left-padded into the window
    mask = torch.zeros(B, 1, 1, L).masked_fill(~keep[:, None, None], torch.finfo(torch.float32).min)
    want, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)  # [B, 1, 8, 16]
    assert not torch.allclose(want, hf.eager_attention_forward(module, q, k, v, mask * 0, scaling=module.scaling)[0],
                              atol=1e-2)  # the window matters

    sinks = module.sinks.detach().to(dtype)
    attention.STATE.update(n=torch.tensor(n), window=W)
    try:
        got, _ = attention.decode_attention_eager_forward(
            module, q.to(dtype), k.to(dtype), v.to(dtype), keep[:, None, None], scaling=module.scaling,
            sliding_window=W, s_aux=sinks)
    finally:
        attention.STATE.update(n=None, window=0)
    assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
    assert float((got.float() - want).abs().max() / want.abs().max()) <= tol
    with torch.no_grad():
        module.sinks.fill_(-1e4)  # sinks that take no weight: plain softmax attention
    plain, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)
    assert float((plain - want).abs().max() / want.abs().max()) > 100 * tol  # the sinks matter here


def test_probe_recognises_gpt_oss_and_engine_calls_the_sink_kernel(monkeypatch):
    """Tiny gpt-oss (2 layers, window 8, sinks N(0, 0.5)): the probe finds sinks, a mask per layer type and the
    window kwarg on exactly the sliding layers; every decode-step attention call goes to the kernel with the module's
    sinks, the sliding layers with the window; greedy tokens = transformers' (eager, dynamic cache)."""
    ref = build("gpt_oss", num_hidden_layers=2)
    p = attention_probe.probe(ref, list(ref.config.layer_types), WINDOW, True)
    assert p.mask_per_type and p.window_kwarg and p.eager == [ref.config] and p.why_eager is None, p

    calls = []
    decode = attention._decode

    def spy(query, key, value, mask, scaling, sinks, sliding_window):
        calls.append((sinks, sliding_window))
        return decode(query, key, value, mask, scaling, sinks, sliding_window)

    monkeypatch.setattr(attention, "_decode", spy)
    opt = _engine_pair(ref)
    ids, mask = prompts(ref.config.vocab_size, 2, 11, seed=1, left_pad=(0, 4))
    assert torch.equal(_gen(opt, ids, mask, 14), _gen(ref, ids, mask, 14))  # 11 + 14 > 2 windows
    last = opt.generate.last
    assert last["path"] == "moecomp" and last["attention"] == "moecomp decode kernel", last
    eng = opt.generate.engine
    assert eng.kernel_window == WINDOW and eng.eager_swapped
    layers = opt.model.layers
    steps = last["decode_steps"]
    assert len(calls) == steps * len(layers)
    sinks = [layer.self_attn.sinks for layer in layers] * steps
    assert all(s is want for (s, _), want in zip(calls, sinks))
    kinds = [WINDOW if t == "sliding_attention" else None for t in ref.config.layer_types] * steps
    assert [w for _, w in calls] == kinds


def test_probe_refuses_eager_attention_that_drops_the_sinks(monkeypatch):
    """An eager attention that ignores the sinks (plain softmax) is not what the kernel computes with the module's
    sinks: the probe says so, the decode step keeps transformers' attention, and the tokens are transformers'."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    def no_sinks(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return attention.reference_attention(module, query, key, value, attention_mask, scaling)

    monkeypatch.setattr(hf, "eager_attention_forward", no_sinks)
    ref = build("gpt_oss", num_hidden_layers=2)
    p = attention_probe.probe(ref, list(ref.config.layer_types), WINDOW, True)
    assert p.eager == [] and "differ by" in p.why_eager, p
    assert p.mask_per_type  # the mask mapping is still there
    opt = _engine_pair(ref)
    ids, mask = prompts(ref.config.vocab_size, 2, 10, seed=2, left_pad=(0, 3))
    assert torch.equal(_gen(opt, ids, mask, 10), _gen(ref, ids, mask, 10))
    last = opt.generate.last
    assert last["path"] == "moecomp" and last["attention"].startswith("transformers (GptOssAttention"), last


def _swap_layer_masks(model) -> None:
    """The base model's forward (this instance only) hands each layer type the other type's mask."""
    base = model.model
    forward = base.forward

    def swapped(*args, attention_mask=None, **kwargs):
        if isinstance(attention_mask, dict):
            attention_mask = {"full_attention": attention_mask["sliding_attention"],
                              "sliding_attention": attention_mask["full_attention"]}
        return forward(*args, attention_mask=attention_mask, **kwargs)

    base.forward = swapped


def test_probe_reads_what_the_layers_get_not_the_source():
    """A gpt-oss whose base model swaps the masks of the two layer types (its class source still tests for a dict):
    the probe sees layer 0 given the full mask, the engine refuses the sliding cache with that reason, and
    transformers' loop runs."""
    ref = build("gpt_oss", num_hidden_layers=2)
    opt = _engine_pair(ref)
    _swap_layer_masks(ref)
    _swap_layer_masks(opt)
    p = attention_probe.probe(opt, list(ref.config.layer_types), WINDOW, False)
    assert not p.mask_per_type and "given the mask of full_attention" in p.why_mask, p
    ids, mask = prompts(ref.config.vocab_size, 2, 10, seed=3, left_pad=(0, 3))
    assert torch.equal(_gen(opt, ids, mask, 6), _gen(ref, ids, mask, 6))
    last = opt.generate.last
    assert last["path"] == "transformers" and "no mask per layer type" in last["reason"], last


def test_eager_model_without_sinks_runs_on_the_kernel():
    """Qwen3-MoE set to eager attention: recognised without sinks; its decode steps use the kernel, tokens equal."""
    ref = build_family("qwen3_moe")
    ref.config._attn_implementation_internal = "eager"
    opt = _engine_pair(ref)
    ids, mask = prompts(ref.config.vocab_size, 2, 9, seed=5, left_pad=(0, 2))
    assert torch.equal(_gen(opt, ids, mask, 8), _gen(ref, ids, mask, 8))
    last = opt.generate.last
    assert last["path"] == "moecomp" and last["attention"] == "moecomp decode kernel", last
    assert opt.generate.engine.eager_swapped
