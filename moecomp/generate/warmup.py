"""``moecomp.warmup(model, batch_sizes=..., max_length=...)``: pay the first call's compile and capture ahead of time.

    model = moecomp.optimize(model)
    moecomp.warmup(model, batch_sizes=[1, 8, 32], max_length=4096)   # what a server does before taking requests
    model.generate(ids, max_new_tokens=256)                          # no compile, no capture: the graphs replay

For each batch size: three short greedy ``generate`` calls on a dummy prompt through the engine, with a static cache
of ``max_length`` positions (rounded up like every cache length). The first compiles the decode step's layers and
captures the step; the second compiles the prefill (it runs compiled once the cache exists) and replays; the third
has one left-padded row: where nothing is padded transformers hands the layers no mask at all (sdpa's causal path),
so a batch with padding would otherwise compile the prefill again on its first real call. Later
calls of that batch bucket whose prompt + new tokens fit in ``max_length`` use that slot (the engine takes the
shortest existing cache that is long enough), so they start on the captured graph. Greedy only: a sampling call
(another sampler signature) captures its own step on first use. The engine keeps at most ``engine.MAX_SLOTS`` slots,
the least recently used going first: warming more batch buckets than that keeps only the last ones.

Then, on CUDA, the prefill of each prompt-length bucket of ``prompt_lengths`` (None: every bucket up to
``max_length``) is captured by one greedy call of one new token (``prefill.warm``; at most ``prefill.WARM_BUDGET_S``
seconds, the rest captured on first use).

Warm starts (``warm_cache.py``): before the first compile, the compile artifacts a previous process saved for this
model, stack and device are loaded from the cache directory (``cache_dir``, else ``$MOECOMP_CACHE_DIR``, else
``~/.cache/moecomp``; ``MOECOMP_WARM_CACHE=0`` or ``cache_dir=False``: off), and after each batch size what this
process compiled is saved there. Another process (container, machine) with that directory then skips Inductor's and
Triton's compiles; Dynamo's tracing and the CUDA graph captures still run.
"""

from __future__ import annotations

import time

import torch

from . import engine as _engine, prefill as _prefill, warm_cache as _warm_cache
from .hf_generate import device_of as _device_of, fast_generate as _fast_generate

WARM_NEW_TOKENS = 3  # step 1 eager (the warm-up before a capture), step 2 captured, then replayed


def warmup(model, batch_sizes=(1,), max_length: int = 1024, prompt_length: int = 8, prompt_lengths=None,
           cache_dir=None) -> dict:
    """Compile and capture ``model.generate`` for each batch size (see the module docstring). Returns
    ``{batch: {"seconds", "cache_length", "graphs", "path", "prefill", "cache"}}``: ``seconds`` the batch's wall time
    (the first batch's includes loading the artifacts, every batch's its save); ``prefill``: {prompt bucket: what its
    capture did}; ``cache`` what the artifact cache did: the load (once, before the first batch; every batch repeats
    it: "load": "hit" | "miss" | "failed" | "off (why)", "load_s", "loaded_bytes", "artifacts", "ignored", "entry",
    "triton_load": moecomp's Triton kernels restored) and this batch's save ("save": "saved" | "unchanged" |
    "nothing to save (...)" | "off" | "failed (...)", "saved_bytes", "save_s", "triton_save": kernels packed).
    ``ValueError`` for a model ``moecomp.optimize`` did not give its fast generate, bad sizes or a bad
    ``cache_dir``."""
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
    _warm_cache.resolve(cache_dir)  # (a bad cache_dir raises before anything runs)
    dev = _device_of(model)
    if dev is None:
        raise ValueError("model: its parameters are on several devices; the engine runs models on one device")
    eng = fg._engine()
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    token = min(3, vocab - 1)
    out = {}
    t0 = time.perf_counter()
    compiles = eng.compile_layers and (dev.type == "cuda" or eng.cpu_compile)
    loaded = _warm_cache.load(eng, cache_dir) if compiles else dict(
        load="off (the engine's layers run eagerly here: nothing compiles)", entry=None)
    for i, B in enumerate(sizes):
        t0 = t0 if i == 0 else time.perf_counter()
        dtype = model.get_input_embeddings().weight.dtype
        eng._slot(_engine.batch_bucket(B), _engine.length_bucket(max_length), dev, dtype)  # the long slot first
        ids = torch.full((B, prompt_length), token, dtype=torch.long, device=dev)
        mask = torch.ones_like(ids)
        eng.progress.say(f"warming up batch {B}, cache {_engine.length_bucket(max_length)}")
        padded = mask.clone()
        padded[0, 0] = 0  # a left-padded row: the prefill's layers get a mask tensor (none where nothing is padded)
        # decode compiled + captured; the prefill compiled (the cache exists now); the prefill with padding compiled
        for m in (mask, mask, padded) if prompt_length > 1 else (mask, mask):
            with torch.no_grad():
                model.generate(ids, attention_mask=m, max_new_tokens=WARM_NEW_TOKENS,
                               min_new_tokens=WARM_NEW_TOKENS, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        eng.progress.clear()
        last = dict(fg.last)
        prefill = _prefill.warm(model, B, _engine.batch_bucket(B), max_length, prompt_lengths)
        saved = _warm_cache.save(eng) if compiles else dict(save="off", saved_bytes=0, save_s=0.0)
        out[B] = dict(seconds=time.perf_counter() - t0, cache_length=last.get("cache_length"),
                      graphs=last.get("graphs"), path=last.get("path", "?"), prefill=prefill,
                      cache={**loaded, **saved})
    return out
