"""``model.generate`` after ``moecomp.optimize(model)``: transformers' generate, with its decode loop run by our engine.

    model.generate(ids, ...)                      (FastGenerate, an instance attribute set by optimize)
      -> transformers' GenerationMixin.generate(..., custom_generate=decode)
           transformers resolves the generation config, special tokens, attention mask, position ids, max length,
           logits processors and stopping criteria exactly as it always does, then calls
      -> decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
           greedy / sampling with processors the engine can run  -> Engine.run (static cache, CUDA-graph steps)
           anything else                                          -> transformers' own _sample, unchanged

Before handing the call to transformers, ``FastGenerate`` sends a call straight to transformers' own generate
(no custom decode) when the user manages caches or loops themselves: a cache passed in (``past_key_values`` /
``cache``), ``cache_implementation`` or ``compile_config``, a streamer, an assistant model, custom logits processors
or stopping criteria, ``prefix_allowed_tokens_fn``, beam search or another decoding mode, ``synced_gpus``, or
``moecomp_fast=False``. ``model.generate.last`` says which path the last call took and why.
"""

from __future__ import annotations

import time
import warnings

import torch

from .engine import Engine
from .routes import missing
from ..core import replay
from .sampling import Sampler, Unsupported

_PLAIN_ARGS = ("past_key_values", "cache", "cache_implementation", "compile_config", "streamer", "assistant_model",
               "assistant_tokenizer", "tokenizer", "custom_generate", "prefix_allowed_tokens_fn", "logits_processor",
               "stopping_criteria", "negative_prompt_ids", "negative_prompt_attention_mask", "synced_gpus",
               "inputs_embeds", "prompt_lookup_num_tokens", "stop_strings")
_MODEL_KWARGS = ("attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                 "cache_position")
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits",
                 "output_router_logits", "return_dict_in_generate")


_ROUTES_WARNED = False


def _warn_routes_slow(why: str) -> None:
    """Once per process: ``return_routed_experts=True`` on a CUDA model ran transformers' loop, not the graphs."""
    global _ROUTES_WARNED
    _ROUTES_WARNED = True
    warnings.warn(f"return_routed_experts=True ran transformers' decode loop ({why}): slower than the engine",
                  UserWarning, stacklevel=4)


def _finished(seq: torch.Tensor, prompt: int, eos: list[int]) -> torch.Tensor:
    """[B, L] bool: from each row's first generated EOS on (that EOS included: what the model computed after it
    produced nothing the row keeps; a row that did not finish has none)."""
    gen = seq[:, prompt:]  # [B, new]
    hit = torch.zeros_like(gen, dtype=torch.bool)
    for e in eos:
        hit |= gen == e
    after = hit.int().cumsum(1) > 0  # [B, new]
    return torch.cat([torch.zeros(seq.shape[0], prompt, dtype=torch.bool, device=seq.device), after], 1)


class FastGenerate:
    """Stands in for ``model.generate`` (see the module docstring). ``enabled = False`` turns the engine off.

    On CPU there are no graphs to replay, and transformers' loop over a dynamic cache is faster than the engine's
    static-cache step, so CPU models keep transformers' loop unless ``cpu = True`` (the tests run the engine's logic
    on CPU that way)."""

    __slots__ = ("model", "engine", "enabled", "cpu", "last", "_t0", "_record", "_modes")
    # Set by api/routing.py (the layer above), for return_routed_experts: moecomp.record_routing, and
    # engine_blocks(model) -> (the bound MoE blocks in module order, None) or (None, why the engine cannot record)
    recorder = None
    engine_blocks = None

    def __init__(self, model):
        self.model = model
        self.engine = None
        self.enabled = True
        self.cpu = False
        self.last: dict = {}
        self._t0 = None  # perf_counter at the call's start (the host-time breakdown of ``last``)
        self._modes: dict = {}  # _mode_key -> _mode_reason (transformers' config resolution deep-copies: ~1 ms)
        self._record = None  # the blocks the engine records this call (return_routed_experts), else None

    def _engine(self) -> Engine:
        if self.engine is None:
            self.engine = Engine(self.model)
        return self.engine

    def release(self) -> None:
        """Free the static caches and graphs (the next call builds them again)."""
        if self.engine is not None:
            self.engine.release()

    def _plain_reason(self, args, kwargs) -> str | None:
        if not self.enabled:
            return "disabled (model.generate.enabled = False)"
        p = next(self.model.parameters(), None)
        if p is not None and p.device.type == "cpu" and not self.cpu:
            return "CPU model: transformers' loop (the engine pays on the GPU; model.generate.cpu = True runs it)"
        for k in _PLAIN_ARGS:
            v = kwargs.get(k)
            if v is not None and v is not False and not (isinstance(v, list) and not v):
                return f"{k} given"
        if len(args) > 1:
            return "positional arguments after the inputs"
        key = _mode_key(self.model, kwargs)
        if key not in self._modes:
            if len(self._modes) >= 16:
                self._modes.pop(next(iter(self._modes)))
            self._modes[key] = _mode_reason(self.model, kwargs)
        return self._modes[key]

    def __call__(self, *args, **kwargs):
        if kwargs.pop("return_routed_experts", False):
            return self._with_routes(args, kwargs)
        return self._generate(args, kwargs)

    def _with_routes(self, args, kwargs):
        """``return_routed_experts=True``: the output's ``routed_experts`` [layers, batch, tokens, k] int64 over
        ``sequences``: -1 where the attention mask is 0, for the last token (never fed to the model), and in a
        finished row from its EOS on (the padding that follows it). The engine records inside its compiled,
        captured steps (``routes.py``) when every MoE block is bound whole; otherwise, or where the call takes
        transformers' loop, that loop runs under ``record_routing`` (the op records in each bound block) and
        ``last["routes"]`` says why."""
        if not kwargs.get("return_dict_in_generate", False):
            raise ValueError("return_routed_experts=True: expected return_dict_in_generate=True too (the routes are "
                             "the output's routed_experts; without it generate returns the sequences alone)")
        if type(self).recorder is None or type(self).engine_blocks is None:
            raise ValueError("return_routed_experts=True: moecomp.record_routing is not loaded (import moecomp.api."
                             "routing)")
        blocks, why = type(self).engine_blocks(self.model)
        if why is not None:
            kwargs["moecomp_fast"] = False
        self._record = blocks
        try:
            with type(self).recorder(self.model) as rec:  # records only where transformers' loop runs
                out = self._generate(args, kwargs)
        finally:
            self._record = None
        seq = out.sequences
        if self.last.get("path") == "moecomp" and self.engine is not None and self.engine.routes is not None:
            full = self.engine.routes
            self.last["routes"] = "recorded in the engine's steps"
        else:
            why = why or self.last.get("reason")
            self.last["routes"] = f"transformers' decode loop, recorded by the op in each block ({why})"
            if not _ROUTES_WARNED and any(p.is_cuda for p in self.model.parameters()):
                _warn_routes_slow(why)
            full = _from_recorder(rec, seq)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            full[:, :, : mask.shape[1]][:, mask.to(full.device) == 0] = -1
        prompt = (args[0] if args else kwargs.get("input_ids")).shape[1]
        done = _finished(seq, prompt, self._eos_ids(kwargs))  # [B, L]: a finished row's EOS and what follows
        full[:, done.to(full.device)] = -1
        self._check_recorded(full, seq, mask, done)
        out["routed_experts"] = full
        return out

    def _check_recorded(self, full, seq, mask, done) -> None:
        """Not silently wrong: tokens the model was fed whose ids no block recorded (a block that ran its original
        forward in the engine's steps) are counted in ``last["routes_missing"]`` and warned of."""
        fed = ~done.to(full.device)
        fed[:, -1] = False
        if mask is not None:
            fed[:, : mask.shape[1]] &= mask.to(full.device) != 0
        n = missing(full, fed)
        self.last["routes_missing"] = n
        if n:
            warnings.warn(f"return_routed_experts=True: {n} (layer, row, token) entries have no recorded expert ids "
                          f"(-1): a block ran its original forward instead of the op (model.generate.last)",
                          UserWarning, stacklevel=3)

    def _eos_ids(self, kwargs) -> list[int]:
        """The EOS ids this call stops at: ``eos_token_id`` given, else the generation config's (one or a list)."""
        gc = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        eos = kwargs.get("eos_token_id", getattr(gc, "eos_token_id", None))
        return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _generate(self, args, kwargs):
        m = self.model
        t_call = time.perf_counter()  # host setup counts our own checks too
        fast = kwargs.pop("moecomp_fast", True)
        why = "moecomp_fast=False" if not fast else self._plain_reason(args, kwargs)
        if why is not None:
            self.last = {"path": "transformers", "reason": why}
            return type(m).generate(m, *args, **kwargs)
        self.last = {}
        self._t0 = t_call
        try:
            out = type(m).generate(m, *args, custom_generate=decode, **kwargs)
        finally:
            t0, self._t0 = self._t0, None
        if self.last.get("path") == "moecomp":  # host time of the whole call (the engine's run ends in a sync)
            self.last["call_s"] = time.perf_counter() - t0
        return out

    def __getstate__(self):
        return {"model": self.model, "enabled": self.enabled, "cpu": self.cpu}

    def __setstate__(self, state):
        self.model, self.enabled, self.cpu = state["model"], state["enabled"], state.get("cpu", False)
        self.engine, self.last, self._t0, self._record, self._modes = None, {}, None, None, {}


def _mode_reason(model, kwargs) -> str | None:
    """Why transformers' own loop must run this call's decoding mode (None: greedy or sampling on a dynamic cache,
    which the engine runs): the generation config transformers resolves from the call's arguments, the model's
    generation config and its config."""
    try:
        gc, _ = model._prepare_generation_config(kwargs.get("generation_config"),
                                                 **{k: v for k, v in kwargs.items() if k != "generation_config"})
        mode = gc.get_generation_mode(None)
    except Exception as e:  # let transformers raise its own error
        return f"generation config: {type(e).__name__}"
    if getattr(mode, "name", str(mode)) not in ("GREEDY_SEARCH", "SAMPLE"):
        return f"decoding mode {getattr(mode, 'name', mode)}"
    if gc.cache_implementation is not None:
        return f"cache_implementation={gc.cache_implementation!r} in the generation config"
    return None


def _mode_key(model, kwargs) -> str:
    """Everything ``_mode_reason`` reads, as text: the call's arguments (a tensor by its type alone: the mode does
    not depend on values), the generation config given or the model's, and the model's config, each by the repr of
    its attributes, so a changed attribute is a new key (an object whose repr hides its state cannot give a wrong
    answer either: the key then holds its identity)."""
    def text(v):
        if isinstance(v, torch.Tensor):
            return "Tensor"
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return f"{type(v).__name__}@{id(v)}:{sorted(vars(v).items(), key=lambda kv: kv[0])!r}"
        return repr(v)
    args = sorted((k, text(v)) for k, v in kwargs.items())
    return repr((args, text(getattr(model, "generation_config", None)), text(getattr(model, "config", None))))


def _from_recorder(rec, seq: torch.Tensor) -> torch.Tensor:
    """[layers, B, cols] from ``record_routing``'s calls: with a cache, one call per new token (joined); without,
    each call the whole prefix (the last one covers every column but the last)."""
    calls = rec.calls
    routes = calls[-1] if calls and calls[-1].shape[2] == seq.shape[1] - 1 else rec.routes
    full = torch.full(routes.shape[:2] + (seq.shape[1],) + routes.shape[3:], -1, dtype=routes.dtype,
                      device=routes.device)
    full[:, :, : routes.shape[2]] = routes[:, :, : seq.shape[1]]
    return full


def fast_generate(model) -> FastGenerate | None:
    fg = model.__dict__.get("generate")
    return fg if isinstance(fg, FastGenerate) else None


def device_of(model) -> torch.device | None:
    devs = {p.device for p in model.parameters()}
    return devs.pop() if len(devs) == 1 else None


def _why_not(self, input_ids, generation_config, streamer, synced_gpus, model_kwargs,
             routes: bool = False) -> str | None:
    """Why the engine cannot run this call (None: it can). ``routes``: return_routed_experts records in the engine,
    whose output is then a ``GenerateDecoderOnlyOutput`` of the sequences alone (no cache: the engine's is static
    and its own), so ``return_dict_in_generate`` is allowed there only."""
    if streamer is not None or synced_gpus:
        return "streamer / synced_gpus"
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        return f"input_ids of shape {tuple(input_ids.shape)}"
    for f in _OUTPUT_FLAGS:
        if routes and f == "return_dict_in_generate":
            continue
        if getattr(generation_config, f, False) or model_kwargs.get(f):
            return f"{f}=True"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False"
    for k, v in model_kwargs.items():
        if k not in _MODEL_KWARGS and k not in _OUTPUT_FLAGS and v is not None:
            return f"model argument {k!r}"
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and (type(cache).__name__ != "DynamicCache" or cache.get_seq_length() != 0):
        return f"a {type(cache).__name__} prepared by transformers or the caller"
    dev = device_of(self)
    if dev is None or dev != input_ids.device:
        return "model on several devices, or inputs on another device"
    return None


def decode(self, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
           synced_gpus=False, streamer=None, **model_kwargs):
    """transformers' decoding-method contract (like ``GenerationMixin._sample``); ``self`` is the model."""
    fg = fast_generate(self)
    t_setup = time.perf_counter() - fg._t0 if fg is not None and fg._t0 is not None else None
    record = fg._record if fg is not None else None
    why = _why_not(self, input_ids, generation_config, streamer, synced_gpus, model_kwargs, record is not None)
    eng = fg._engine() if fg is not None else None
    if why is None and eng is None:
        why = "model.generate is not moecomp's"
    if why is None:
        why = eng.unsupported()
    sampler = None
    if why is None:
        try:
            sampler, max_length = Sampler.from_hf(logits_processor, stopping_criteria, generation_config,
                                                  input_ids.shape[1])
        except Unsupported as e:
            why = str(e)
    if why is None:
        max_new = max_length - input_ids.shape[1]
        if max_new <= 0:
            why = "no tokens to generate"
    if why is None:
        token = replay.activate(None) if record is not None else None  # the engine records, not the session
        try:
            out, info = eng.run(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"),
                                max_new, sampler, use_graphs=True, record=record)
        except Unsupported as e:
            why = str(e)
        else:
            if fg is not None:
                fg.last = {"path": "moecomp", **info, "host_setup_s": t_setup}
            if record is not None and generation_config.return_dict_in_generate:
                from transformers.generation.utils import GenerateDecoderOnlyOutput

                return GenerateDecoderOnlyOutput(sequences=out)
            return out
        finally:
            if token is not None:
                replay.deactivate(token)
    if fg is not None:
        fg.last = {"path": "transformers", "reason": why}
    return type(self)._sample(self, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer,
                              **model_kwargs)


def install(model) -> bool:
    """Set ``model.generate`` to a ``FastGenerate`` (idempotent). False when the model has no HF ``generate``."""
    if fast_generate(model) is not None:
        return True
    gen = getattr(type(model), "generate", None)
    if gen is None or not any(c.__name__ == "GenerationMixin" for c in type(model).__mro__):
        return False
    if "generate" in model.__dict__:  # someone else's instance-level generate: leave it
        return False
    model.generate = FastGenerate(model)
    return True


def uninstall(model) -> bool:
    fg = fast_generate(model)
    if fg is None:
        return False
    fg.release()
    del model.__dict__["generate"]
    return True
