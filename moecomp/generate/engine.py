"""The decode engine behind the one-line fast ``generate()``: a static KV cache, and each decode step as one CUDA graph.

    prompt ids [B, S] --pad rows to Bb--> prefill -> cache slots 0..S-1, token 0
        CUDA: padded on the right to a prompt-length bucket, one CUDA graph per bucket (``prefill.py``); past the
        buckets, or where the capture failed: the prompt as it is, with transformers' own masks
    decode step t (run once eagerly, then captured once per slot, sampler and weights, then replayed):
        mask  [Bb, 1, 1, L] = pad_mask & (arange(L) <= slot)
        model(tok [Bb, 1], pos [Bb, 1], mask, static cache) -> logits [Bb, V] -> select -> tok, out[:, t]
        pos += 1, slot += 1

Inside the step the decoder layers run compiled by Inductor (norms, rotary and residual adds fused; about 290
kernels a Qwen3-MoE step instead of 850) and attention runs moecomp's decode kernel (``attention.py``). The prefill
runs the layers compiled too (dynamic shapes) once the slot's cache exists; a failed compile leaves the engine eager.

A *slot* is one static cache and the tensors its step reads and writes, for a batch bucket ``Bb`` (1, 2, 4, ... 128,
then multiples of 64; missing rows repeat the last prompt and are dropped from the result) and a cache length
``L`` (prompt + new tokens rounded up to 256), so prompts of other lengths reuse the same graphs. Slots are kept per
model (``MAX_SLOTS``, least recently used first out); the graphs of one slot share one memory pool (they replay one
at a time, and every result they keep is written to the slot's own tensors, outside the pool).

Graphs read weights at the addresses they had when captured, so every graph is keyed by a fingerprint of the
model's tensors (identity, address, version, dtype): a moved, replaced, re-loaded or in-place-updated weight gives a
new capture instead of a stale replay (the eager prefill runs first, so derived tensors are rebuilt by then).

Nothing in a step reads device memory on the host. The host replays up to ``CHECK_EVERY`` steps ahead before it
reads the stop flag, so the GPU never waits for Python; steps after every row finished only write pad tokens that
the result leaves out (``StepState.ncols`` counts the steps transformers would have taken).

Sliding-window layers (gpt-oss alternates them with full layers; Qwen2-MoE with its window on): where the model
takes a ready mask per layer type (``attention_mask={"full_attention": ..., "sliding_attention": ...}``), the slot's
cache gives every sliding layer a plain static layer of length ``L`` (written at absolute cache indices like the full
layers: no ring buffer, nothing to roll under capture) and the step passes both masks, the sliding one also
``arange(L) > slot - window`` (transformers counts the window in cache indices; with left padding that equals counting
in positions). The prefill's masks are transformers' own, sized by the same cache. Other sliding or chunked layers
are refused (``Engine.cache_unsupported``) and transformers' loop runs.

Whether the model takes a mask per layer type, and which "eager" attention (gpt-oss's, with its sinks) the decode
kernel may run, is found on the first run by one tiny forward of the base model (``attention_probe.py``): what the
layers receive and what the attention modules compute, not how the source is spelled::

    probe forward (S tokens, {"full_attention": Mf, "sliding_attention": Ms}) -> layer i got layer_types[i]'s mask?
    each eager attention module on its recorded inputs: own output == softmax(q k^T s + mask [+ sinks]) v ?
    -> Engine.window (None: the sliding cache is refused, with the reason), attn_pairs (config -> kernel function),
       kernel_window (the sliding layers' kernel reads only the window), eager_swapped (bool step masks)

On CPU, or when a capture fails, the same step runs eagerly (``info["graphs"]`` says which, and why).
"""

from __future__ import annotations

import inspect
import os
import time
import traceback
from collections import OrderedDict

import torch

from . import attention, attention_probe, warm_cache
from .progress import Progress
from .shared_layers import SharedLayer, compiled_run, method_forwards
from .sampling import Sampler, StepState, Unsupported, select
from .routes import SlotRoutes
from .prefill import PrefillGraphs

MAX_SLOTS = 3
CHECK_EVERY = 16
LENGTH_ROUND = 256


def batch_bucket(b: int) -> int:
    if b <= 128:
        return 1 << max(0, (b - 1).bit_length())
    return -(-b // 64) * 64


def length_bucket(n: int) -> int:
    return -(-n // LENGTH_ROUND) * LENGTH_ROUND


LOW_MEMORY_FRACTION = 0.1  # free device memory under this share of the total: cached blocks released before capture
_capture_warned: set = set()


def _warn_capture(why: str) -> None:
    """Once per reason: the decode step runs without CUDA graphs (several times slower at small batches)."""
    if why in _capture_warned:
        return
    _capture_warned.add(why)
    import warnings

    warnings.warn(f"moecomp generate: the decode step could not be captured as a CUDA graph ({why}); it runs with "
                  f"plain launches, several times slower at small batches. model.generate.last says so per call.",
                  UserWarning, stacklevel=6)


def fingerprint(model: torch.nn.Module) -> tuple:
    """What a captured step depends on: every weight's identity, address and version, and the experts
    implementation transformers would dispatch to (``set_experts_implementation`` switches bound blocks)."""
    impl = getattr(getattr(model, "config", None), "_experts_implementation_internal", None)
    return (str(impl),) + tuple((id(t), t.data_ptr(), t._version, t.dtype) for t in
                                list(model.parameters()) + list(model.buffers()))


class Slot:
    def __init__(self, model, batch: int, length: int, device, dtype, window: int | None = None,
                 why_window: str | None = None):
        from transformers import StaticCache

        self.batch, self.length, self.window = batch, length, window
        self.why_window = why_window
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        if window is not None:
            full_length_layers(self.cache, length)
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.tok = z(batch, 1)
        self.pos = z(batch, 1)
        self.slot = z(())  # cache index the next step writes
        self.pad_mask = z(batch, length, dt=torch.bool)
        self.arange = torch.arange(length, device=device)
        self.state = StepState(batch, length, device)
        self.graphs: dict = {}  # (fingerprint, sampler signature) -> (graph, sampler)
        self.failed: dict = {}  # same key -> why a capture failed
        self.pool = None  # graph memory pool of this slot (made with its first graph)
        self.routes = None  # routes.SlotRoutes: the buffers return_routed_experts records into (made on demand)
        # the captured prefills (prefill.py): key -> Entry (LRU), key -> why its capture failed, their memory pool
        self.prefill_graphs: OrderedDict = OrderedDict()
        self.prefill_failed: dict = {}
        self.prefill_pool = None
        self.why_not = Engine.cache_unsupported(self)


def full_length_layers(cache, length: int) -> None:
    """Every sliding-window layer of ``cache`` replaced by a plain static layer of ``length`` positions: keys and
    values are written at their absolute cache index like the full-attention layers' (no ring buffer, nothing
    rolled, capturable); the window is applied by the sliding layers' mask instead (``Engine._mask``)."""
    from transformers.cache_utils import StaticLayer

    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            cache.layers[i] = StaticLayer(max_cache_len=length)


def sliding_layers(model) -> tuple[list | None, int | None, str | None]:
    """(layer types, window, why not) from the config: (None, None, None) for a model without sliding layers;
    (None, None, reason) for layer types the engine cannot serve beside full and sliding attention, or no window.
    Whether the base model takes a mask per layer type is the probe's to say (``attention_probe.py``)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    types = getattr(cfg, "layer_types", None)
    if not types or "sliding_attention" not in types:
        return None, None, None
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        return None, None, f"layer types {other} beside full and sliding attention"
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None, None, f"sliding_window {window!r}"
    return list(types), window, None


class Engine:
    """Static-cache decoding for one model (held by its ``FastGenerate``)."""

    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.slots: OrderedDict = OrderedDict()
        self.stats = {"calls": 0, "captures": 0, "replays": 0, "eager_steps": 0, "capture_failures": 0}
        # On CUDA the decoder layers of the decode step are compiled by Inductor (norms, rotary and residual adds
        # fused: a few hundred fewer kernels per step); MOECOMP_GENERATE_COMPILE=0 keeps them eager.
        self.compile_layers = os.environ.get("MOECOMP_GENERATE_COMPILE", "1") != "0"
        # Per phase ("decode", "prefill"): why compiling its layers failed (that phase then runs eagerly; the other
        # keeps compiling), and the whole traceback, for a bug report.
        self.compile_errors: dict[str, str] = {}
        self.compile_tracebacks: dict[str, str] = {}
        self.compile_backend = "inductor"  # tests compile on CPU with "eager" (cpu_compile = True)
        self.cpu_compile = False
        self._compiled = None
        self.warm = None  # warm_cache.Entry: the compile artifacts on disk this engine loads / saves
        self.progress = Progress()
        self._ran: set = set()  # (phase, batch) whose compiled layers have run: their first run compiles
        self.n = None  # [] int64: cache positions the running step attends to
        self.rec = None  # the running call's SlotRoutes (return_routed_experts), None when it records nothing
        self.routes = None  # [layers, B, cols] int64: the routes the last recording run recorded
        # Set by _probe() on the first run (it needs the weights where they will run): the (config, function) pairs
        # the decode step points at moecomp's decode kernel (attention.py), the sliding window the engine masks
        # (full-length static cache layers for the sliding layers), and what the probe found.
        self.attn_pairs: list | None = None
        self.window: int | None = None
        self.window_why: str | None = None
        self.kernel_window = 0  # the window the decode kernel may read alone (0: the whole cache, masked)
        self.eager_swapped = False  # "eager" configs recognised: the step's masks are bool
        self.attention_why: str | None = None  # why "eager" attention stays transformers'
        self.prefill = PrefillGraphs(self)  # the prefill captured per prompt-length bucket

    def _probe(self) -> None:
        """Once: which attention runs on moecomp's decode kernel in the decode step ("sdpa" configs; "eager" ones
        whose modules the probe found to compute the kernel's formula, sinks included), and the sliding window
        (where the base model takes a mask per layer type: the probe's forward shows it)."""
        if self.attn_pairs is not None:
            return
        model = self.model
        use_attn = os.environ.get("MOECOMP_DECODE_ATTENTION", "1") != "0" and attention.register()
        pairs = [(c, attention.NAME) for c in attention.configs_of(model, "sdpa")] if use_attn else []
        types, window, self.window_why = sliding_layers(model)
        want_eager = use_attn and bool(attention.configs_of(model, "eager"))
        if types is not None or want_eager:
            p = attention_probe.probe(model, types, window, want_eager)
            if types is not None:
                self.window, self.window_why = (window, None) if p.mask_per_type else \
                    (None, f"the model takes no mask per layer type ({p.why_mask})")
                self.kernel_window = window if p.mask_per_type and p.window_kwarg else 0
            pairs += [(c, attention.NAME_EAGER) for c in p.eager]
            self.eager_swapped = bool(p.eager)
            self.attention_why = p.why_eager if want_eager else None
        self.attn_pairs = pairs

    # ------------------------------------------------------------------------------------------- checks
    def unsupported(self) -> str | None:
        """Why this model cannot use the engine (None when it can). Cheap; called once per generate()."""
        m, cfg = self.model, self.model.config
        if cfg.is_encoder_decoder:
            return "encoder-decoder model"
        params = inspect.signature(m.forward).parameters
        for p in ("attention_mask", "position_ids", "logits_to_keep", self.cache_kw):
            if p not in params:
                return f"forward takes no {p!r}"
        impl = getattr(cfg, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            return f"attention implementation {impl!r} (sdpa and eager are supported)"
        if "create_masks_for_generate" in vars(type(m)) or any(
                "create_masks_for_generate" in vars(c) for c in type(m).__mro__[1:] if c.__name__ != "GenerationMixin"):
            return "the model builds its own generation masks"
        return None

    @staticmethod
    def cache_unsupported(slot: Slot) -> str | None:
        for layer in slot.cache.layers:
            name = type(layer).__name__
            if name == "StaticLayer":
                continue
            if name == "StaticSlidingWindowLayer" and getattr(layer, "max_cache_len", 0) >= slot.length:
                continue  # window at least as long as the cache: a plain causal cache here
            why = f"cache layer {name} (only full-attention static layers are graphed"
            return why + (f"; sliding layers: {slot.why_window})" if slot.why_window else ")")
        return None

    # ------------------------------------------------------------------------------------------- slots
    def _slot(self, batch: int, length: int, device, dtype) -> Slot:
        """The slot for (batch bucket, cache length): the shortest existing one of this batch bucket that is at least
        ``length`` long (its graphs serve shorter calls: the decode attention reads only the positions written; a
        slot made by ``moecomp.warmup`` for a longer ``max_length`` is reused so), else a new one of ``length``."""
        fits = [k for k in self.slots if k[0] == batch and k[2] == device and k[3] == dtype and k[1] >= length]
        key = min(fits, key=lambda k: k[1]) if fits else (batch, length, device, dtype)
        s = self.slots.get(key)
        if s is None:
            while len(self.slots) >= MAX_SLOTS:
                self.slots.popitem(last=False)
            self._probe()
            s = self.slots[key] = Slot(self.model, batch, length, device, dtype, self.window, self.window_why)
        self.slots.move_to_end(key)
        return s

    def release(self) -> None:
        self.slots.clear()

    # ------------------------------------------------------------------------------------------- the step
    def _mask(self, s: Slot, dtype) -> torch.Tensor | dict:
        """The step's 4-D mask [Bb, 1, 1, L] (bool for sdpa and recognised eager attention, else additive); for a
        model with sliding layers a mapping per layer type, the sliding one also dropping keys at least ``window``
        cache indices before the query's (transformers counts the window in cache indices, left padding included)."""
        keep = s.pad_mask & (s.arange <= s.slot)  # [Bb, L]
        masks = {"full_attention": keep}
        if s.window is not None:
            masks["sliding_attention"] = keep & (s.arange > s.slot - s.window)
        eager = self.model.config._attn_implementation == "eager" and not self.eager_swapped
        for k, m in masks.items():
            m = m[:, None, None, :]  # [Bb, 1, 1, L]
            masks[k] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min) \
                if eager else m
        return masks if s.window is not None else masks["full_attention"]

    def _layers(self, phase: str):
        """(ModuleList of decoder layers, compiled wrappers for ``phase``): "prefill" wrappers are compiled with
        dynamic shapes (any prompt length or batch: one compile, batch 1 apart); "decode" wrappers with torch's
        automatic dynamic shapes (the first batch bucket static, one more compile covers the other buckets)."""
        if self._compiled is None:
            warm_cache.before_compile(self)  # a saved entry's artifacts first (warm starts)
            base = getattr(self.model, self.model.base_model_prefix, None)
            layers = getattr(base, "layers", None)
            if not isinstance(layers, torch.nn.ModuleList):
                self._compiled = (None, {})
            else:
                from torch._dynamo import config as dynamo_config

                # Layers of one shape share a compiled entry per phase and batch class (shared_layers.py); layers
                # that differ get their own. Past the limits Dynamo would silently run the layers eagerly.
                for name, need in (("recompile_limit", 16 * len(layers)), ("cache_size_limit", 16 * len(layers)),
                                   ("accumulated_recompile_limit", 64 * len(layers)),
                                   ("accumulated_cache_size_limit", 64 * len(layers))):
                    if isinstance(getattr(dynamo_config, name, None), int):
                        setattr(dynamo_config, name, max(getattr(dynamo_config, name), need))
                self._compiled = (layers, {})
        layers, by_phase = self._compiled
        if layers is not None and phase not in by_phase:
            run = compiled_run(phase, self.compile_backend, {"prefill": True, "prefill_static": False}.get(phase))
            by_phase[phase] = [SharedLayer(run, m, i, self.cache_kw) for i, m in enumerate(layers)]
        return layers, by_phase.get(phase)

    def _call(self, phase: str | None, **kw):
        """The model's forward, with the decoder layers swapped for their compiled wrappers when ``phase`` is set."""
        layers, wrapped = self._layers(phase) if phase else (None, None)
        hooks = []
        if layers is not None:
            saved = list(layers)
            for i, c in enumerate(wrapped):
                layers._modules[str(i)] = c
            ids = kw.get("input_ids")
            key = (phase, int(ids.shape[0]) if ids is not None else 0)
            if key not in self._ran and not torch.compiler.is_compiling():
                self._ran.add(key)
                hooks = self.progress.layer_hooks(wrapped, f"compiling {phase} step, batch {key[1]}")
        try:
            with method_forwards(saved if layers is not None else (), skinny=phase == "decode"):
                return self.model(**{"logits_to_keep": 1, **kw}, use_cache=True, return_dict=True)
        finally:
            for h in hooks:
                h.remove()
            if hooks:
                self.progress.clear()
            if layers is not None:
                for i, m in enumerate(saved):
                    layers._modules[str(i)] = m

    @property
    def compile_error(self) -> str | None:
        """The first phase's compile failure ("phase: error"), or None when every phase that tried compiled."""
        return next((f"{k}: {v}" for k, v in self.compile_errors.items()), None)

    @property
    def compile_traceback(self) -> str | None:
        return next(iter(self.compile_tracebacks.values()), None)

    def _compiled_or_eager(self, s: Slot, phase: str, **kw):
        """``_call`` with compiled layers; if compiling fails, put back the cache lengths the layers that ran had
        advanced, remember why, and run eagerly (from then on this phase stays eager; the other is not touched: a
        prefill that Dynamo cannot trace leaves the decode step compiled)."""
        lengths = [layer.cumulative_length.clone() for layer in s.cache.layers]
        try:
            return self._call(phase, **kw)
        except Exception as e:
            self.compile_errors[phase] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.compile_tracebacks[phase] = traceback.format_exc()
            for layer, n in zip(s.cache.layers, lengths):
                layer.cumulative_length.copy_(n)
            return self._call(None, **kw)

    def _compiling(self, s: Slot, phase: str = "decode") -> bool:
        return self.compile_layers and (s.tok.is_cuda or self.cpu_compile) and phase not in self.compile_errors

    def _layers_mode(self, cuda: bool, phase: str) -> str:
        if not ((cuda or self.cpu_compile) and self.compile_layers):
            return "eager"
        err = self.compile_errors.get(phase)
        return f"eager (compile failed: {err})" if err else "compiled"

    def _forward(self, s: Slot, dtype, compiled: bool):
        kw = dict(input_ids=s.tok, position_ids=s.pos, attention_mask=self._mask(s, dtype),
                  **{self.cache_kw: s.cache})
        with attention.Swapped(self.attn_pairs, self.n, self.kernel_window):
            if compiled and not (s.tok.is_cuda and torch.cuda.is_current_stream_capturing()):
                return self._compiled_or_eager(s, "decode", **kw)  # the eager warm-up step compiles
            return self._call("decode" if compiled else None, **kw)

    def _step(self, s: Slot, sampler: Sampler, dtype) -> None:
        if self.n is None or self.n.device != s.slot.device:
            self.n = torch.zeros((), dtype=torch.long, device=s.slot.device)
        torch.add(s.slot, 1, out=self.n)
        if self.rec is not None:
            self.rec.step_begin()
        out = self._forward(s, dtype, self._compiling(s))
        if self.rec is not None:
            self.rec.step_end(s.slot)
        nxt = select(out.logits[:, -1], s.state, sampler)
        s.tok.copy_(nxt[:, None])
        s.pos.add_(1)
        s.slot.add_(1)

    def _capture(self, s: Slot, sampler: Sampler, dtype) -> "torch.cuda.CUDAGraph":
        """One decode step captured into the slot's pool. The graph's pool cannot use memory that the caching
        allocator holds for other allocations (e.g. what a transformers ``generate`` before ``optimize`` left
        cached): when the device is nearly full those blocks are released first, and a capture that runs out of
        memory is retried once after releasing them."""
        dev = s.tok.device
        free, total = torch.cuda.mem_get_info(dev)
        if free < LOW_MEMORY_FRACTION * total:
            torch.cuda.empty_cache()
        for attempt in (0, 1):
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, pool=s.pool):
                    self._step(s, sampler, dtype)
                return g
            except torch.cuda.OutOfMemoryError:
                if attempt:
                    raise
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
                self.stats["capture_retries"] = self.stats.get("capture_retries", 0) + 1

    def _graph(self, s: Slot, sampler: Sampler, dtype, fp: tuple):
        """The captured step for this slot, sampler and weights; None where graphs are off or capture failed."""
        key = (fp, sampler.signature, self.rec is not None)
        hit = s.graphs.get(key)
        if hit is not None:
            return hit[0]
        if key in s.failed:
            return None
        s.graphs = {k: v for k, v in s.graphs.items() if k[0] == fp}  # graphs of older weights are stale
        if not s.graphs:  # a pool whose graphs are all gone is freed: capturing into its handle would fail
            s.pool = torch.cuda.graph_pool_handle()
        self.progress.say(f"capturing decode step, batch {s.tok.shape[0]}")
        try:
            g = self._capture(s, sampler, dtype)
        except Exception as e:  # a host sync or an uncapturable op in the model: plain launches from now on
            self.progress.clear()
            s.failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.stats["capture_failures"] += 1
            torch.cuda.synchronize()
            _warn_capture(s.failed[key])
            return None
        self.progress.clear()
        s.graphs[key] = (g, sampler)
        self.stats["captures"] += 1
        return g

    # ------------------------------------------------------------------------------------------- generate
    def _prefill(self, s: Slot, input_ids, attention_mask, position_ids, sampler: Sampler, fp=None,
                 use_graphs: bool = False, dtype=None) -> str:
        """Prompt [B, S] into the slot's cache, first token chosen; returns "compiled" or "eager" (the layers). The
        captured, bucketed prefill where it serves the call (``self.prefill.info`` says what ran), else this one."""
        kind = self.prefill.run(s, input_ids, attention_mask, position_ids, sampler, fp, use_graphs, dtype)
        if kind is not None:
            return kind
        B, S = input_ids.shape
        dev = input_ids.device
        rows = torch.cat([torch.arange(B, device=dev), torch.full((s.batch - B,), B - 1, device=dev)]).long()
        ids = input_ids[rows]  # [Bb, S]: rows beyond B repeat the last prompt
        am = attention_mask[rows].bool() if attention_mask is not None else None
        if position_ids is None:
            position_ids = (am.long().cumsum(-1) - 1).masked_fill(~am, 0) if am is not None else \
                torch.arange(S, device=dev)[None].expand(s.batch, S)
        else:
            position_ids = position_ids.expand(B, S)[rows]
        s.cache.reset()
        kw = dict(input_ids=ids, attention_mask=am.long() if am is not None else None, position_ids=position_ids,
                  **{self.cache_kw: s.cache})
        # compiled once the cache exists (its lazy allocation stays out of the compiled code)
        tried = (self._compiling(s, "prefill") and os.environ.get("MOECOMP_GENERATE_COMPILE_PREFILL", "1") != "0"
                 and all(getattr(layer, "is_initialized", False) for layer in s.cache.layers))
        if self.rec is not None:
            self.rec.prefill_begin(ids.numel())
        out = self._compiled_or_eager(s, "prefill", **kw) if tried else self._call(None, **kw)
        if self.rec is not None:
            self.rec.prefill_end(S)
        kind = (self._layers_mode(dev.type == "cuda", "prefill") if tried or "prefill" in self.compile_errors
                else "eager")
        sampler.prepare(dev, out.logits.shape[-1])
        s.pad_mask.fill_(True)
        if am is not None:
            s.pad_mask[:, :S] = am
        s.slot.fill_(S)
        s.pos.copy_(position_ids[:, -1:] + 1)
        s.state.start(B, sampler.min_new)
        s.tok.copy_(select(out.logits[:, -1], s.state, sampler)[:, None])
        return kind

    def _decode(self, s: Slot, sampler: Sampler, dtype, max_new: int, use_graphs: bool, fp=None) -> tuple[str, int]:
        """Steps 1 .. max_new - 1: the graph of an earlier call from step 1; else step 1 eager (the warm-up before
        the capture), then the graph. Returns (what the graphs did, steps run). An eager step of a model with many
        small launches costs tens of ms (measured: 27 ms for an FP8 Qwen3-30B-A3B of 6 layers, 12 ms in bf16)."""
        cuda = s.tok.is_cuda
        graph, want = None, use_graphs and cuda
        fp = (fp if fp is not None else fingerprint(self.model)) if want else None
        steps = 0
        for t in range(1, max_new):
            steps += 1
            if want and graph is None and t == 1:  # a graph captured by an earlier call replays from step 1
                hit = s.graphs.get((fp, sampler.signature, self.rec is not None))
                graph = hit[0] if hit is not None else None
            elif want and graph is None and t >= 2:  # step 1 ran eagerly: the warm-up before a capture
                graph = self._graph(s, sampler, dtype, fp)
                want = graph is not None
            if graph is not None:
                graph.replay()
                self.stats["replays"] += 1
            else:
                self._step(s, sampler, dtype)
                self.stats["eager_steps"] += 1
            if sampler.eos and t % CHECK_EVERY == 0 and not bool(s.state.unfinished.any()):
                break
        if not cuda:
            return "off (CPU)", steps
        if not use_graphs:
            return "off", steps
        if graph is not None:
            return "replayed", steps
        fail = s.failed.get((fp, sampler.signature, self.rec is not None))
        return (f"capture failed: {fail}" if fail else "not needed (fewer than 3 steps)"), steps

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
            max_new: int, sampler: Sampler, use_graphs: bool = True, record: list | None = None
            ) -> tuple[torch.Tensor, dict]:
        """Generate ``max_new`` tokens at most: (ids [B, S + n], info). ``record``: the bound MoE blocks whose expert
        ids to record (``routes.py``), kept in ``self.routes`` [layers, B, S + n] (the last column never fed: -1)."""
        m = self.model
        B, S = input_ids.shape
        dev = input_ids.device
        emb = m.get_input_embeddings()
        dtype = emb.weight.dtype if emb is not None else m.dtype
        s = self._slot(batch_bucket(B), length_bucket(S + max_new), dev, dtype)
        if s.why_not is not None:
            raise Unsupported(s.why_not)
        self.stats["calls"] += 1
        self.routes = None
        if record is not None:
            if s.routes is None or not s.routes.same(record):  # new buffers: graphs that wrote the old ones go
                s.graphs = {k: v for k, v in s.graphs.items() if not k[2]}
                s.failed = {k: v for k, v in s.failed.items() if not k[2]}
                s.routes = SlotRoutes(record, s.batch, s.length, dev)
            self.rec = s.routes
        try:
            out, info = self._run(s, input_ids, attention_mask, position_ids, max_new, sampler, use_graphs, dtype)
        finally:
            if self.rec is not None:
                self.rec.detach()
        if self.rec is not None:
            self.routes = self.rec.result(B, out.shape[1])
            self.routes[:, :, -1] = -1  # the last token is never fed to the model
            self.rec = None
        return out, info

    def _run(self, s: Slot, input_ids, attention_mask, position_ids, max_new: int, sampler: Sampler,
             use_graphs: bool, dtype) -> tuple[torch.Tensor, dict]:
        B, S = input_ids.shape
        dev = input_ids.device
        Bb, L = s.batch, s.length
        cuda = dev.type == "cuda"
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else None
        clock = [time.perf_counter()]
        if cuda:
            ev[0].record()
        fp = fingerprint(self.model) if use_graphs and (cuda or self.prefill.cpu) else None  # (prefill and steps)
        prefill = self._prefill(s, input_ids, attention_mask, position_ids, sampler, fp, use_graphs, dtype)
        if cuda:
            ev[1].record()
        clock.append(time.perf_counter())
        graphs, steps = self._decode(s, sampler, dtype, max_new, use_graphs, fp)
        if cuda:
            ev[2].record()
        n = int(s.state.ncols)  # (waits for the device)
        clock.append(time.perf_counter())
        layers = self._layers_mode(cuda, "decode")
        info = {"batch_bucket": Bb, "cache_length": L, "graphs": graphs, "layers": layers, "prefill_layers": prefill,
                "attention": "moecomp decode kernel" if self.attn_pairs else
                f"transformers ({self.attention_why})" if self.attention_why else "transformers",
                "decode_steps": steps,  # forward passes after the prefill (the captured step's included)
                "prefill_s": ev[0].elapsed_time(ev[1]) / 1e3 if cuda else clock[1] - clock[0],
                "decode_s": ev[1].elapsed_time(ev[2]) / 1e3 if cuda else clock[2] - clock[1],
                # host time: launching the prefill (no sync in it), then the decode loop up to the final sync
                "prefill_host_s": clock[1] - clock[0], "decode_host_s": clock[2] - clock[1],
                # the prefill's graph: what ran ("replayed", "captured", "off: why", ...), its bucket, device time
                **self.prefill.info, "prefill_gpu_s": self.prefill.gpu_seconds()}
        return torch.cat([input_ids, s.state.out[:B, :n]], dim=-1), info
