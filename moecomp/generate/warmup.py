"""``moecomp.warmup(model, batch_sizes=..., max_length=...)``: pay the first call's compile and capture ahead of time.

    model = moecomp.optimize(model)
    moecomp.warmup(model, batch_sizes=[1, 8, 32], max_length=4096)   # what a server does before taking requests
    model.generate(ids, max_new_tokens=256)                          # no compile, no capture: the graphs replay

For each batch size: two short greedy ``generate`` calls on a dummy prompt through the engine, with a static cache
of ``max_length`` positions (rounded up like every cache length). The first compiles the decode step's layers and
captures the step; the second compiles the prefill (it runs compiled once the cache exists) and replays. Later
calls of that batch bucket whose prompt + new tokens fit in ``max_length`` use that slot (the engine takes the
shortest existing cache that is long enough), so they start on the captured graph. Greedy only: a sampling call
(another sampler signature) captures its own step on first use. The engine keeps at most ``engine.MAX_SLOTS`` slots,
the least recently used going first: warming more batch buckets than that keeps only the last ones.

Then, on CUDA, the prefill of each prompt-length bucket of ``prompt_lengths`` (None: every bucket up to
``max_length``) is captured by one greedy call of one new token (``prefill.warm``; at most ``prefill.WARM_BUDGET_S``
seconds, the rest captured on first use).
"""

from __future__ import annotations

import time

import torch

from . import engine as _engine
from . import prefill as _prefill
from .hf_generate import device_of as _device_of, fast_generate as _fast_generate

WARM_NEW_TOKENS = 3  # step 1 eager (the warm-up before a capture), step 2 captured, then replayed


def warmup(model, batch_sizes=(1,), max_length: int = 1024, prompt_length: int = 8, prompt_lengths=None) -> dict:
    """Compile and capture ``model.generate`` for each batch size (see the module docstring). Returns
    ``{batch: {"seconds", "cache_length", "graphs", "path", "prefill"}}`` ("prefill": {prompt bucket: what its
    capture did}). ``ValueError`` for a model ``moecomp.optimize`` did not give its fast generate, or bad sizes."""
    fg = _fast_generate(model)
    if fg is None:
        raise ValueError("model: moecomp.warmup needs a model that moecomp.optimize(model) gave its fast generate "
                         "(an HF model with generate(); call moecomp.optimize(model) first)")
    sizes = [batch_sizes] if isinstance(batch_sizes, int) else list(batch_sizes)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes: expected positive ints, got {batch_sizes!r}")
    if not isinstance(prompt_length, int) or prompt_length < 1:
        raise ValueError(f"prompt_length: expected a positive int, got {prompt_length!r}")
    if not isinstance(max_length, int) or max_length < prompt_length + WARM_NEW_TOKENS:
        raise ValueError(f"max_length: expected an int >= prompt_length + {WARM_NEW_TOKENS} "
                         f"({prompt_length + WARM_NEW_TOKENS}), got {max_length!r}")
    if prompt_lengths is not None and (isinstance(prompt_lengths, (int, str)) or any(
            not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < max_length for n in prompt_lengths)):
        raise ValueError(f"prompt_lengths: expected a list of ints in [1, max_length), got {prompt_lengths!r}")
    dev = _device_of(model)
    if dev is None:
        raise ValueError("model: its parameters are on several devices; the engine runs models on one device")
    eng = fg._engine()
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    token = min(3, vocab - 1)
    out = {}
    for B in sizes:
        t0 = time.perf_counter()
        dtype = model.get_input_embeddings().weight.dtype
        eng._slot(_engine.batch_bucket(B), _engine.length_bucket(max_length), dev, dtype)  # the long slot first
        ids = torch.full((B, prompt_length), token, dtype=torch.long, device=dev)
        mask = torch.ones_like(ids)
        eng.progress.say(f"warming up batch {B}, cache {_engine.length_bucket(max_length)}")
        for _ in range(2):  # decode compiled + captured, then the prefill compiled (the cache exists now)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=WARM_NEW_TOKENS,
                               min_new_tokens=WARM_NEW_TOKENS, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        eng.progress.clear()
        last = dict(fg.last)
        prefill = _prefill.warm(model, B, _engine.batch_bucket(B), max_length, prompt_lengths)
        out[B] = dict(seconds=time.perf_counter() - t0, cache_length=last.get("cache_length"),
                      graphs=last.get("graphs"), path=last.get("path", "?"), prefill=prefill)
    return out
