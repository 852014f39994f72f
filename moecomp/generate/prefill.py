"""The prefill as one CUDA graph per prompt-length bucket (issue 41): the time to the first token is the GPU's.

    prompt [B, S] (rows padded to the batch bucket Bb by repeating the last, as today), S -> Sb = bucket(S)
    host, before the replay (about a dozen small launches, no device-to-host read):
        ids, pos [Bb, Sb]  static per (slot, bucket): the prompt and its positions (transformers' generate passes
                           them; else from the mask, 0 on left padding) in columns 0..S-1; columns S..Sb-1 keep
                           whatever an earlier call left there (valid ids and positions, masked out for real tokens)
        pad_mask [Bb, L]   the slot's: the attention mask in columns 0..S-1, True from S on (as the decode reads it)
        slot     []        S;   the step state started (rows, min_new_tokens)
    graph, captured once per (slot, bucket, sampler, weights fingerprint, routes buffers), then replayed:
        cache lengths <- 0
        masks [Bb, 1, Sb, L] = pad_mask[j] & j <= i, | j == i;  sliding: & j > i - window   (cache indices i, j)
        model(ids, masks, positions, static cache, logits_to_keep=[slot - 1]) -> logits [Bb, 1, V]
        cache lengths <- slot;  slot.pos <- pos[:, slot - 1] + 1;  tok <- select(logits)   (the decode starts here)

**Right padding.** The prompt stays at cache columns 0..S-1 as on today's path, so the decode steps, the slot's
cache length and the routes' columns are unchanged: the bucket's padding tokens sit at columns S..Sb-1, which the
decode steps overwrite one by one before they read them (the step writes column ``slot`` and attends to columns <=
``slot``); a real query i < S never sees them (causal), and they attend to the real tokens of their row, so every
value they write is finite. The first token is read at column S-1 through ``logits_to_keep`` given as a 1-D device
tensor (transformers' ``slice_logits_to_keep``; a model that ignores it is refused once, with the reason). Every
query also sees its own key (``| j == i``), so a left-padded query is never fully masked.

**Buckets** (``bucket``): powers of two from 16 to 256, then multiples of 256 (the cache-length grid,
``engine.LENGTH_ROUND``) up to ``MAX_LENGTH`` = 4096 tokens: 20 buckets. On the 256-grid a bucket never exceeds the
cache of the call it serves (``bucket(S) <= length_bucket(S + 1)``), so no call needs a longer cache. Padding: from
16 to 256 fewer padding tokens than prompt tokens; past 256 at most 255 (2x at 257, 1.33x at 769, shrinking), each
costing what a prompt token costs. Nothing below 16 (a prefill that short costs about what 16 tokens cost: the
weights are read once either way). Past 4096 tokens the host's launches (a fixed count per prefill) are a small
share of the GPU's time, which grows with the tokens: more buckets would buy little for their captures. Also today's
path: batch bucket x prompt bucket past ``MAX_TOKENS`` = 8192 tokens (GPU-bound there too), ``position_ids`` other
than [B or 1, S], cache layers other than plain ``StaticLayer``.

**Memory.** Per slot one private pool for its prefill graphs: they replay one at a time and every result they keep is
written to the slot's own tensors (cache, tok, pos, step state, routes), so the pool holds about one uncaptured
prefill's working memory of the largest bucket captured (the activations and masks of Bb x Sb tokens), not one per
graph. Outside the pool per graph: the ids and positions (Bb x Sb int64 each, 64 KiB at the token cap); with
``return_routed_experts`` a routes buffer of layers x Bb x Sb x k int32 per bucket. At most ``MAX_GRAPHS`` graphs per
slot (least recently used dropped first).

**Layers inside the graph** (``MOECOMP_GENERATE_PREFILL_LAYERS``): ``dynamic`` (default) the prefill's Inductor
compile with dynamic shapes that today's path uses (no compile per bucket; the capture runs the same kernels),
``static`` one Inductor compile per bucket and batch class (static shapes: Inductor picks its kernels for that size;
costs a compile per bucket, about as long as the first one without the Inductor cache), ``eager`` the decoder layers
eager (no compile at all; the graph removes the launches, but norms, rotary and residual adds stay unfused: a few
more passes over the activations per layer).

**First call of a key**: the body run eagerly (it compiles the layers and gives this call's result), then captured
(nothing runs while capturing). On a slot whose cache is not allocated yet the body runs with eager layers and is
not captured (the lazy allocation stays out of compiled code and graphs, as on today's path): the next call
captures. A capture that fails (a host sync or an uncapturable op in the model) leaves this call's result, is
remembered for the key, warned of once and said in ``last["prefill"]``; later calls of that key take today's path.
``MOECOMP_GENERATE_PREFILL_GRAPH=0`` turns the whole thing off.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from .sampling import Sampler, select

ENV_OFF = "MOECOMP_GENERATE_PREFILL_GRAPH"
ENV_LAYERS = "MOECOMP_GENERATE_PREFILL_LAYERS"
LAYER_MODES = {"dynamic": "prefill", "static": "prefill_static", "eager": None}  # mode -> Engine._call phase
SMALLEST = 16
POW2_UNTIL = 256  # powers of two up to here, then multiples of it (= engine.LENGTH_ROUND)
MAX_LENGTH = 4096
MAX_TOKENS = 8192
MAX_GRAPHS = 64
WARM_BUDGET_S = 120.0  # moecomp.warmup: no further bucket captured once this much time went to them
LOW_MEMORY_FRACTION = 0.1
_warned: set = set()


def bucket(n: int) -> int:
    """The prompt-length bucket of a prompt of ``n`` tokens (see the module docstring)."""
    if n <= SMALLEST:
        return SMALLEST
    if n <= POW2_UNTIL:
        return 1 << (n - 1).bit_length()
    return -(-n // POW2_UNTIL) * POW2_UNTIL


def buckets(upto: int) -> list[int]:
    """Every bucket <= ``upto``, ascending."""
    out, n = [], SMALLEST
    while n <= upto:
        out.append(n)
        n = n * 2 if n < POW2_UNTIL else n + POW2_UNTIL
    return out


def masks(pad_mask: torch.Tensor, arange: torch.Tensor, Sb: int, window: int | None, additive):
    """The prefill's 4-D masks [Bb, 1, Sb, L] over cache indices (query i, key j): ``pad_mask[b, j] & j <= i``, and
    ``j == i`` (no query fully masked); with ``window`` a mapping per layer type, the sliding one also ``j > i -
    window`` (transformers' sliding overlay). Bool, or additive in the dtype ``additive`` (eager attention)."""
    i = arange[:Sb, None]
    j = arange[None, :]
    keep = (pad_mask[:, None, :] & (j <= i)) | (j == i)  # [Bb, Sb, L]
    out = {"full_attention": keep}
    if window is not None:
        out["sliding_attention"] = keep & (j > i - window)
    for k, m in out.items():
        m = m[:, None]
        out[k] = m if additive is None else \
            torch.zeros(m.shape, dtype=additive, device=m.device).masked_fill(~m, torch.finfo(additive).min)
    return out if window is not None else out["full_attention"]


def graphs_on(device: torch.device) -> bool:
    """Whether prefills on ``device`` are captured (CUDA); elsewhere the bucketed body runs eagerly."""
    return device.type == "cuda"


def new_pool(device: torch.device):
    return torch.cuda.graph_pool_handle()


def capture_graph(body, pool, device: torch.device):
    """``body()`` captured into ``pool``, with the decode capture's memory policy: cached blocks released first when
    the device is nearly full, and once more on running out of memory, then one retry. A failed capture leaves the
    caller's stream current."""
    free, total = torch.cuda.mem_get_info(device)
    if free < LOW_MEMORY_FRACTION * total:
        torch.cuda.empty_cache()
    stream = torch.cuda.current_stream(device)
    for attempt in (0, 1):
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=pool):
                body()
            return g
        except BaseException as e:
            # torch.cuda.graph's exit ends the capture before it leaves the capture stream: when ending it raises
            # (a capture the body invalidated), the capture stream would stay current for everything after
            if torch.cuda.current_stream(device) != stream:
                torch.cuda.set_stream(stream)
            if attempt or not isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _warn(why: str, model_wide: bool = False) -> None:
    """Once per reason: a prefill that could not be captured (its key then takes today's path), or (``model_wide``)
    a model whose bucketed prefill failed (every call then does)."""
    if why in _warned:
        return
    _warned.add(why)
    head = (f"the bucketed prefill failed for this model ({why}); every call takes" if model_wide else
            f"the prefill could not be captured as a CUDA graph ({why}); calls with this prompt bucket take")
    warnings.warn(f"moecomp generate: {head} the uncaptured prefill (its launches on the host add to the time to "
                  f"the first token). model.generate.last['prefill'] says so per call.", UserWarning, stacklevel=6)


class _Refused(Exception):
    """The model does not take the bucketed prefill (the engine then runs today's for this model)."""


class Entry:
    """One (slot, bucket, sampler, weights, routes) key: its static ids, the graph once captured, and what the graph
    reads besides (the capture's sampler and routes buffers, kept alive with it)."""

    __slots__ = ("ids", "pos", "graph", "sampler", "rec", "vocab", "layers")

    def __init__(self, batch: int, Sb: int, device):
        self.ids = torch.zeros(batch, Sb, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, Sb, dtype=torch.long, device=device)
        self.graph = self.sampler = self.rec = self.vocab = self.layers = None


class PrefillGraphs:
    """The bucketed, captured prefill of one ``Engine`` (``engine.prefill``); ``run`` serves a call or says why not.
    ``cpu = True`` runs the bucketed body on CPU models too (eagerly: the tests check its tokens that way)."""

    def __init__(self, engine):
        self.engine = engine
        self.cpu = False
        self.refused: str | None = None  # why this model does not take the bucketed prefill (found once)
        self.info: dict = {}  # the last call's: prefill (what ran), prefill_bucket
        self._events: dict = {}  # device -> the two CUDA events put around a replay
        self._timed = None  # the events of this call's replay (gpu_seconds reads them after the call's sync)
        self._dtype = None  # the running call's activation dtype (additive masks)

    # ----------------------------------------------------------------------------------------------- decisions
    @staticmethod
    def layers_phase() -> tuple[str | None, str]:
        mode = os.environ.get(ENV_LAYERS, "dynamic")
        if mode not in LAYER_MODES:
            raise ValueError(f"{ENV_LAYERS}: expected one of {sorted(LAYER_MODES)}, got {mode!r}")
        return LAYER_MODES[mode], mode

    def why_off(self, s, S: int, position_ids, use_graphs: bool, device) -> str | None:
        """Why this call takes today's prefill (None: the bucketed one)."""
        from transformers.cache_utils import StaticLayer

        if os.environ.get(ENV_OFF, "1") == "0":
            return f"{ENV_OFF}=0"
        if self.refused is not None:
            return self.refused
        if not graphs_on(device) and not self.cpu:
            return f"{device.type} model (no graphs there)"
        if not use_graphs:
            return "graphs off"
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != S):
            return f"position_ids of shape {tuple(position_ids.shape)}"
        Sb = bucket(S)
        if Sb > MAX_LENGTH:
            return f"prompt of {S} tokens, past the largest bucket ({MAX_LENGTH})"
        if s.batch * Sb > MAX_TOKENS:
            return f"batch bucket {s.batch} x prompt bucket {Sb} past {MAX_TOKENS} tokens"
        if Sb > s.length:
            return f"prompt bucket {Sb} longer than the cache ({s.length})"
        odd = sorted({type(layer).__name__ for layer in s.cache.layers if type(layer) is not StaticLayer})
        if odd:
            return f"cache layers {odd} (plain static layers only)"
        return None

    def _phase(self, s) -> tuple[str | None, str]:
        """(the Engine._call phase the layers run in, its label for ``last["prefill_layers"]``)."""
        eng = self.engine
        phase, mode = self.layers_phase()
        if phase is None:
            return None, f"eager ({ENV_LAYERS}=eager)"
        if not eng._compiling(s, phase) or os.environ.get("MOECOMP_GENERATE_COMPILE_PREFILL", "1") == "0":
            return None, eng._layers_mode(s.tok.is_cuda, phase)
        if phase == "prefill_static":
            _widen_dynamo_limits()
        return phase, eng._layers_mode(s.tok.is_cuda, phase) + (" (static shapes per bucket)" if
                                                                phase == "prefill_static" else "")

    # ----------------------------------------------------------------------------------------------- the body
    def _load(self, s, e: Entry, input_ids, attention_mask, position_ids, sampler: Sampler) -> None:
        """The call's inputs into the static tensors the body reads (host side, before a replay; rows past B repeat
        the last row)."""
        B, S = input_ids.shape
        Bb = s.batch

        def put(dst, src):
            dst[:B, :S].copy_(src)
            if Bb > B:
                dst[B:, :S].copy_(src[B - 1:].expand(Bb - B, S))

        put(e.ids, input_ids)
        s.pad_mask.fill_(True)
        if attention_mask is not None:
            put(s.pad_mask, attention_mask)
        if position_ids is not None:
            put(e.pos, position_ids.expand(B, S))
        else:
            am = s.pad_mask[:, :S]
            e.pos[:, :S] = (am.long().cumsum(-1) - 1).masked_fill(~am, 0)
        s.slot.fill_(S)
        s.state.start(B, sampler.min_new)

    def _forward(self, s, e: Entry, phase: str | None, warm: bool):
        """The model over the static ids: cache lengths 0 .. S, the routes recorded. Device work only."""
        eng = self.engine
        Sb = e.ids.shape[1]
        for layer in s.cache.layers:
            layer.cumulative_length.zero_()
        last = (s.slot - 1).view(1)
        additive = self._dtype if eng.model.config._attn_implementation == "eager" else None
        kw = dict(input_ids=e.ids, attention_mask=masks(s.pad_mask, s.arange, Sb, s.window, additive),
                  position_ids=e.pos, logits_to_keep=last, **{eng.cache_kw: s.cache})
        if eng.rec is not None:
            eng.rec.prefill_begin(e.ids.numel(), keep=True)
        if phase is None:
            out = eng._call(None, **kw)
        else:  # the eager run compiles (a failed compile: eager from then on); the capture runs what it compiled
            out = eng._compiled_or_eager(s, phase, **kw) if warm else eng._call(phase, **kw)
        if eng.rec is not None:
            eng.rec.prefill_end(Sb)  # every bucket column: the decode steps overwrite S.. before they are returned
        for layer in s.cache.layers:
            layer.cumulative_length.copy_(s.slot)
        return out, last

    def _body(self, s, e: Entry, sampler: Sampler, phase: str | None, warm: bool) -> None:
        out, last = self._forward(s, e, phase, warm)
        logits = out.logits
        if warm:
            if logits.dim() != 3 or logits.shape[1] != 1:
                raise _Refused(f"the model's forward returned logits of shape {tuple(logits.shape)} for a tensor "
                               f"logits_to_keep of one position")
            e.vocab = logits.shape[-1]
            sampler.prepare(logits.device, e.vocab)  # (a host-to-device copy: never while capturing)
        s.pos.copy_(e.pos.index_select(1, last) + 1)
        s.tok.copy_(select(logits[:, -1], s.state, sampler)[:, None])

    # ----------------------------------------------------------------------------------------------- a call
    def run(self, s, input_ids, attention_mask, position_ids, sampler: Sampler, fp, use_graphs: bool,
            dtype) -> str | None:
        """The prompt through the bucketed prefill (replayed, or run and captured): the layers' label when it ran,
        None when the caller runs today's prefill (``self.info["prefill"]`` says why)."""
        B, S = input_ids.shape
        dev = input_ids.device
        self.info = {"prefill": None, "prefill_bucket": None}
        self._timed, self._dtype = None, dtype
        why = self.why_off(s, S, position_ids, use_graphs, dev)
        if why is not None:
            self.info["prefill"] = f"off: {why}"
            return None
        self.layers_phase()  # a bad MOECOMP_GENERATE_PREFILL_LAYERS: the ValueError, before anything runs
        Sb = bucket(S)
        eng = self.engine
        graphs = graphs_on(dev)
        key = (Sb, fp, sampler.signature, id(eng.rec) if eng.rec is not None else None)
        if graphs and key in s.prefill_failed:
            self.info["prefill"] = f"off: capture failed before ({s.prefill_failed[key]})"
            return None
        self.info["prefill_bucket"] = Sb
        e = s.prefill_graphs.get(key)
        if e is not None and e.graph is not None:
            s.prefill_graphs.move_to_end(key)
            sampler.prepare(dev, e.vocab)  # (the decode's eager steps read it; first: its copies wait for the stream)
            self._load(s, e, input_ids, attention_mask, position_ids, sampler)
            self._replay(e, dev)
            if eng.rec is not None:
                eng.rec.record_steps()  # (the graph wrote the prefill's routes; the steps record next)
            self.info["prefill"] = "replayed"
            eng.stats["prefill_replays"] = eng.stats.get("prefill_replays", 0) + 1
            return e.layers
        e = e if e is not None else Entry(s.batch, Sb, dev)
        fresh = not all(getattr(layer, "is_initialized", False) for layer in s.cache.layers)
        try:
            phase = self._first_run(s, e, input_ids, attention_mask, position_ids, sampler, fresh)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as x:  # the model does not take it: today's prefill for this model from now on, said
            why = str(x) if isinstance(x, _Refused) else _short(x)
            self.refused = f"the bucketed prefill failed ({why})"
            self.info["prefill"] = f"off: {self.refused}"
            _warn(why, model_wide=True)
            if eng.rec is not None:
                eng.rec.record_steps()
            return None
        if not graphs:
            self.info["prefill"] = f"bucket {Sb}, not captured ({dev.type}: no graphs)"
        elif fresh:
            self.info["prefill"] = f"bucket {Sb}, not captured: this call allocated the slot's cache (next: captured)"
        else:
            self._capture(s, e, key, sampler, phase, fp)
        return e.layers

    def _first_run(self, s, e: Entry, input_ids, attention_mask, position_ids, sampler: Sampler,
                   fresh: bool) -> str | None:
        """The body run eagerly: this call's result. ``fresh`` (the slot's cache not allocated yet): with eager layers
        (its lazy allocation stays out of compiled code, as on today's path). Returns the phase a capture runs the
        layers in (a compile that failed here leaves them eager)."""
        phase, e.layers = (None, "eager") if fresh else self._phase(s)
        self._load(s, e, input_ids, attention_mask, position_ids, sampler)
        self._body(s, e, sampler, phase, True)
        if phase is not None and phase in self.engine.compile_errors:
            phase, e.layers = self._phase(s)
        return phase

    def _capture(self, s, e: Entry, key: tuple, sampler: Sampler, phase: str | None, fp) -> None:
        eng = self.engine
        dev = s.tok.device
        for k in [k for k in s.prefill_graphs if k[1] != fp]:  # graphs of older weights are stale
            del s.prefill_graphs[k]
        for k in [k for k in s.prefill_failed if k[1] != fp]:
            del s.prefill_failed[k]
        if not s.prefill_graphs:  # a pool whose graphs are all gone is freed: a new one
            s.prefill_pool = new_pool(dev)
        e.sampler, e.rec = sampler, eng.rec
        eng.progress.say(f"capturing prefill, batch {s.batch}, prompt bucket {e.ids.shape[1]}")
        try:
            e.graph = capture_graph(lambda: self._body(s, e, e.sampler, phase, False), s.prefill_pool, dev)
        except Exception as x:  # a host sync or an uncapturable op: this key takes today's path from now on
            why = _short(x)
            s.prefill_failed[key] = why
            eng.stats["prefill_capture_failures"] = eng.stats.get("prefill_capture_failures", 0) + 1
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if eng.rec is not None:
                eng.rec.record_steps()
            _warn(why)
            self.info["prefill"] = (f"capture failed: {why} (this call ran bucket {e.ids.shape[1]} uncaptured; "
                                    f"later calls of the bucket: today's path)")
            return
        finally:
            eng.progress.clear()
        s.prefill_graphs[key] = e
        while len(s.prefill_graphs) > MAX_GRAPHS:
            s.prefill_graphs.popitem(last=False)
        eng.stats["prefill_captures"] = eng.stats.get("prefill_captures", 0) + 1
        self.info["prefill"] = "captured"

    def _replay(self, e: Entry, dev) -> None:
        if dev.type != "cuda":
            e.graph.replay()
            return
        ev = self._events.get(dev)
        if ev is None:
            ev = self._events[dev] = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        e.graph.replay()
        ev[1].record()
        self._timed = ev

    def gpu_seconds(self) -> float | None:
        """The last call's replay on the device (CUDA events around it), once the call synchronized; else None."""
        return self._timed[0].elapsed_time(self._timed[1]) / 1e3 if self._timed else None


def _widen_dynamo_limits() -> None:
    """Static shapes compile one entry per bucket and batch class: room for every bucket of every batch bucket."""
    from torch._dynamo import config as dynamo_config

    need = 16 * len(buckets(MAX_LENGTH))
    for name in ("recompile_limit", "cache_size_limit"):
        if isinstance(getattr(dynamo_config, name, None), int):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), need))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if isinstance(getattr(dynamo_config, name, None), int):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4 * need))


def warm_lengths(lengths, max_length: int, Bb: int) -> dict[int, int]:
    """{prompt bucket: a prompt length in it whose call of one new token fits ``max_length``}: of ``lengths``, or
    (None) of every bucket that fits the warm slot's cache, ``MAX_LENGTH`` and ``MAX_TOKENS``."""
    if lengths is not None:
        return {bucket(n): n for n in lengths}
    cache = -(-max_length // POW2_UNTIL) * POW2_UNTIL  # the slot warmup made (engine.length_bucket(max_length))
    out, prev = {}, 0
    for b in buckets(min(MAX_LENGTH, cache, MAX_TOKENS // Bb)):
        n = min(b, max_length - 1)
        if n > prev:
            out[b] = n
        prev = b
    return out


def warm(model, batch: int, Bb: int, max_length: int, lengths) -> dict:
    """``moecomp.warmup(..., prompt_lengths=lengths)``: one greedy ``generate`` of one new token per prompt bucket
    (batch ``batch``, batch bucket ``Bb``; ``warm_lengths`` picks them), in the slot ``warmup`` made: the first
    captures the bucket's prefill (the slot's cache exists by then). ``{bucket: what last["prefill"] said}``; buckets
    left after ``WARM_BUDGET_S`` seconds of it say so and are captured on first use."""
    dev = next(model.parameters()).device
    if os.environ.get(ENV_OFF, "1") == "0" or not graphs_on(dev):
        return {}
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    token = min(3, vocab - 1)
    out, t0 = {}, time.perf_counter()
    for Sb, n in sorted(warm_lengths(lengths, max_length, Bb).items()):
        if time.perf_counter() - t0 > WARM_BUDGET_S:
            out[Sb] = f"not captured: warm-up budget ({WARM_BUDGET_S:.0f} s) spent; captured on first use"
            continue
        ids = torch.full((batch, n), token, dtype=torch.long, device=dev)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                           do_sample=False)
        out[Sb] = model.generate.last.get("prefill") or model.generate.last.get("reason")
    return out
