"""Recognition: one block in, one :class:`moecomp.core.match.Match` or :class:`moecomp.core.reject.Reject` out.

    block ─► fx: FX pass (Dynamo's graph of the block; primary) ───────────────────────────► Match
               │ capture failed on a data-dependent branch (a per-expert loop)
               ├─► fx_real_values: FX pass again, tracing with real values (the loop unrolled) ► Match
               │ Dynamo cannot capture the block at all / ids select no expert / meta / FX pass not used
               ├─► dispatch_reader: the block run, its expert modules observed ───────────────► Match
               │     (a block found by its shapes: the only reader; its refusal is the answer)
               └─► attribute_reader: names, source, one measured run ─────────────────────────► Match
             any other refusal of the FX pass ─────────────────────────────────────────────────► Reject
             (``trust_fallback=True``: the attribute reader tries those too, and the report says so)

Each step is a small :class:`Recogniser` (``name``, ``applies(attempt)`` given the refusals so far, ``run``),
held in one ordered registry, :data:`RECOGNISERS`, which :func:`recognise` walks until one matches; each Match
counts in ``moecomp.counters["recognise"][name]`` (the recogniser whose Match it is). What ``applies`` cannot say
by order alone is in the strategies' own comments: which refusal of the FX pass lets which reader try, the
attribute reader's Match taken first where it measured the routing (``DispatchReader.run``), a block found by its
shapes read by the dispatch reader only. A stage that raised is named first in the refusal (``Reject.cause``).

Every recogniser describes a block the same way (spec, bindings by block-relative path, derived tensors); the verify
stage (:mod:`moecomp.verify.verify`) then proves the Match on probes and the binder (:mod:`moecomp.bind.bind`) uses
nothing else. FX results are cached per block structure (:func:`structure_key`): one Dynamo capture per distinct
block, not per layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core import counters as _counters, policy
from ..core.registry import Registry
from . import dispatch_reader, fallback
from ..bind.bind import forward_params
from ..core.parts import BlockParts
from ..core.match import Evidence, Match, Verified, forward_arg
from ..core.reject import (Refused, Reject, RejectCode, StageError, describe_exception, in_stage, is_oom, oom_of,
                     raise_if_oom)

# When the FX pass recognises a block, also run the attribute reader and note any difference in the report
# (``coverage/families.py`` turns it on for the coverage table; off for users: it runs the block once more per structure).
COMPARE_FALLBACK = False

_SKIP_KEY_ATTRS = frozenset({"training", "layer_idx", "layer_id", "layer_number", "layer_index"})


def structure_key(block: nn.Module):
    """Blocks with equal keys trace to the same graph: class, tensor names / shapes / dtypes, scalar attributes."""
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_parameters()) + tuple(
        (n, tuple(t.shape), t.dtype) for n, t in block.named_buffers())
    scalars = []
    for mname, sub in block.named_modules():
        scalars.append((mname, type(sub).__qualname__))
        for a, v in vars(sub).items():
            if isinstance(v, (int, float, bool, str)) and not a.startswith("_") and a not in _SKIP_KEY_ATTRS:
                scalars.append((f"{mname}.{a}", v))
    return (type(block), tensors, tuple(scalars))


def block_constants(block: nn.Module, parts: BlockParts, top_k: int = 1) -> list[float]:
    """The numbers the block's attributes and forward source mention: a routed scale the verify stage fits snaps to
    one of them (``policy.snap_constant``)."""
    return fallback.numeric_consts(fallback.attr_sources(block, parts), top_k)


def fx_available() -> str:
    """'' when the FX pass can run here, else why not."""
    try:
        from . import capture  # noqa: F401, PLC0415 (imports Dynamo: only when recognising)
    except ImportError as e:
        return f"FX pass unavailable ({e})"
    return ""


# ------------------------------------------------------------------------------------------------------ FX pass
def _from_block_match(bm, parts: BlockParts) -> Match:
    return Match(bm.spec, dict(bm.bindings), list(bm.derived), parts,
                 Evidence("fx", bm.verified, dict(bm.constants), list(getattr(bm, "notes", ()))))


def _failed(e: Exception) -> Reject:
    """The FX pass raised (a failure of the pass, not a refusal; running out of memory after the numeric check's own
    retries included): CAPTURE_FAILED, so that the readers try, with the cause kept for the report."""
    e = oom_of(e) or e  # (running out of memory named as such, whatever wrapped it)
    what = e.describe() if isinstance(e, StageError) else describe_exception(e)
    cause = f"FX pass failed ({what})"
    return Reject(RejectCode.CAPTURE_FAILED, cause, cause)


def _detect_fx(block: nn.Module, parts: BlockParts, device, dtype) -> Match | Reject:
    from .capture import DetectError, detect_block  # noqa: PLC0415

    H = parts.hidden_size
    try:
        bm = detect_block(block, policy.probe_input(H, device, dtype, shape=policy.CAPTURE_PROBE_SHAPE))
        return _from_block_match(bm, parts)
    except DetectError as e:
        if is_oom(e):  # (Dynamo ran the block with real values and ran out)
            return _failed(e)
        first = e
    except Exception as e:  # Dynamo errors surface as many types
        return _failed(e)
    hashed = _detect_hash(block, parts, device, dtype)
    if hashed is not None:  # a Match, or why the pass refused the block's table lookup
        return hashed
    if first.code is not RejectCode.CAPTURE_FAILED or not _data_dependent(first):
        return first.reject
    return DataDependent(first.code, first.reason)  # (the cue for the trace with real values: FxRealValues)


@dataclass(frozen=True)
class DataDependent(Reject):
    """The FX pass's refusal when Dynamo gave up on a branch over a data-dependent value (a per-expert loop's
    ``if tok.numel():``) and no capture with token ids answered: the cue for the trace with real values."""


def _detect_fx_real(block: nn.Module, parts: BlockParts, device, dtype, first: Reject) -> Match | Reject:
    """The FX pass again, tracing with real values (``first``: the capture's refusal, a :class:`DataDependent`): a
    per-expert loop branches on the routing (``if tok.numel():``), so the trace follows the example's branches on a
    probe that reaches every expert."""
    from .capture import DetectError, detect_block  # noqa: PLC0415

    x = policy.probe_input(parts.hidden_size, device, dtype,
                           shape=policy.real_trace_shape(parts.num_experts + parts.extra_rows))
    try:
        bm = detect_block(block, x, real_values=True)
    except DetectError as e:  # the unrolled trace proves nothing either way: let the attribute reader try
        if is_oom(e):
            return _failed(e)
        return Reject(RejectCode.CAPTURE_FAILED, f"{first.message}; traced with real values: {e.reason}")
    except Exception as e:
        return _failed(StageError("traced with real values", e))
    m = _from_block_match(bm, parts)
    m.evidence.notes.append("traced with real values (data-dependent branches followed the example, which reached "
                            "every expert)")
    return m


def _table_rows(block: nn.Module) -> int | None:
    """The fewest rows among the block's 2-D integer tensors (hash tables [V, k] are such), or None when it has none:
    token ids drawn below it index every such table."""
    rows = [t.shape[0] for t in list(block.parameters()) + list(block.buffers())
            if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
            and t.shape[0] > 0]
    return min(rows) if rows else None


def _detect_hash(block: nn.Module, parts: BlockParts, device, dtype) -> Match | Reject | None:
    """A block that holds an integer table and did not capture from the hidden states alone may route by token ids
    (hash routing): captured again with probe token ids for each of its first forward parameters in turn; the first
    capture whose graph the pass reads as a table lookup of exactly that argument is the answer. A Reject when a
    capture showed such a lookup but the pass refused it (the reason says why); None when no capture showed one."""
    from .capture import DetectError, detect_block  # noqa: PLC0415

    V = _table_rows(block)
    if V is None:
        return None
    names = forward_params(block)[1][: policy.TOKEN_PARAM_TRIES]  # which one carries the ids: the graph shows
    x = policy.probe_input(parts.hidden_size, device, dtype, shape=policy.CAPTURE_PROBE_SHAPE)
    refused = None
    for name in names:
        tok = policy.probe_token_ids(x.shape[:-1], V, device)
        try:
            bm = detect_block(block, x, call_args={name: tok})
        except DetectError as e:  # not this parameter, or a lookup the pass refuses
            if is_oom(e):
                return _failed(e)
            why = [r for w, r in e.rejected if w.startswith("hash lookup")]
            if refused is None and why:
                refused = Reject(why[0].code, f"hash routing ({name!r} as token ids): {why[0]}")
            continue
        except Exception as e:  # noqa: BLE001 (Dynamo errors surface as many types)
            if is_oom(e):
                return _failed(e)
            continue
        if bm.spec.hash_routing and bm.bindings.get("token_ids") == forward_arg(name):
            m = _from_block_match(bm, parts)
            m.evidence.notes.append(f"hash routing: captured with probe token ids as {name!r}, read from the graph")
            return m
    return refused


def _data_dependent(e: Exception) -> bool:
    """Did Dynamo give up on a branch over a data-dependent value (somewhere in the exception's chain)?"""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: PLC0415

    c, seen = e.__cause__, 0
    while c is not None and seen < 16:
        if isinstance(c, GuardOnDataDependentSymNode):
            return True
        c, seen = c.__cause__ or c.__context__, seen + 1
    return False


def fx_match(block: nn.Module, parts: BlockParts, device, dtype, cache: dict | None = None) -> Match | Reject:
    """The FX pass's answer for ``block`` (its capture, and with token ids where it holds an integer table; cached
    per structure in ``cache``: bindings are block-relative, so one answer serves every block of the same
    structure). A :class:`DataDependent` refusal is the cue for :func:`fx_real_match`."""
    return _per_structure(("fx", structure_key(block)), parts, cache,
                          lambda: _detect_fx(block, parts, device, dtype))


def fx_real_match(block: nn.Module, parts: BlockParts, device, dtype, first: Reject,
                  cache: dict | None = None) -> Match | Reject:
    """The FX pass's answer traced with real values (``first``: the capture's refusal), cached like
    :func:`fx_match`."""
    return _per_structure(("fx_real_values", structure_key(block)), parts, cache,
                          lambda: _detect_fx_real(block, parts, device, dtype, first))


def _per_structure(key, parts: BlockParts, cache: dict | None, answer) -> Match | Reject:
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        hit = answer()
        if cache is not None and not (isinstance(hit, Reject) and hit.cause):  # (a failure may not repeat)
            cache[key] = hit
    if isinstance(hit, Match):  # a fresh copy per block (evidence notes are appended to)
        hit = hit.replace(parts=parts, evidence=Evidence(hit.evidence.method, hit.evidence.checked,
                                                         dict(hit.evidence.constants), list(hit.evidence.notes)))
    return hit


# ------------------------------------------------------------------------------------------------------ pipeline
@dataclass
class Attempt:
    """One block on its way through the recognisers (:data:`RECOGNISERS`)."""

    block: nn.Module
    parts: BlockParts
    x: torch.Tensor | None  # the probe input (None: meta tensors, nothing runs)
    use_fx: bool = True
    trust_fallback: bool = False
    cache: dict | None = None
    notes: list = field(default_factory=list)  # for the report
    refusal: Reject | None = None  # the last refusal: what the next recogniser is asked with
    fx: Reject | None = None  # the FX pass's refusal (None: not used, or not refused yet)
    by: str = ""  # whose answer it is (the counter: a recogniser may hand back another's Match)
    who: str = ""  # who refused, as the final message names it ("attribute reader: "; "" when it says)


class Recogniser:
    """One way to recognise a block. ``applies(a)``: is it tried, given the refusals so far (``a.refusal``, the
    FX pass's ``a.fx``); ``run(a)``: a Match (the answer), a Reject (recorded as ``a.refusal``; the answer when no
    later recogniser matches) or None (nothing to add; a note may say why). ``name``: its key in the registry and in
    ``moecomp.counters["recognise"]``."""

    name = ""

    def applies(self, a: Attempt) -> bool:
        raise NotImplementedError

    def run(self, a: Attempt) -> Match | Reject | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<recogniser {self.name!r}>"


def _fx_answer(a: Attempt, got: Match | Reject) -> Match | Reject:
    if isinstance(got, Match):
        if COMPARE_FALLBACK:
            a.notes.append(_compare_note(a.block, a.parts, a.x, got, a.cache))
    else:
        a.fx = got
    return got


class FxPass(Recogniser):
    name = "fx"

    def applies(self, a: Attempt) -> bool:
        return a.use_fx and a.x is not None

    def run(self, a: Attempt) -> Match | Reject:
        return _fx_answer(a, fx_match(a.block, a.parts, a.x.device, a.x.dtype, a.cache))


class FxRealValues(Recogniser):
    name = "fx_real_values"

    def applies(self, a: Attempt) -> bool:
        return isinstance(a.refusal, DataDependent)  # (a per-expert loop stopped the capture)

    def run(self, a: Attempt) -> Match | Reject:
        return _fx_answer(a, fx_real_match(a.block, a.parts, a.x.device, a.x.dtype, a.refusal, a.cache))


class DispatchReader(Recogniser):
    name = "dispatch_reader"

    def applies(self, a: Attempt) -> bool:
        if a.x is None:
            return False
        if a.parts.kind == "structural":  # found by shapes: the only reader, whatever the FX pass said (run says)
            return True
        r = a.refusal  # a block of named parts: Dynamo could not capture it, or its ids select no expert
        return r is not None and (r.code is RejectCode.CAPTURE_FAILED or _unselected(r))

    def run(self, a: Attempt) -> Match | Reject | None:
        if a.parts.kind == "structural":  # its answer, a refusal included, is final (no attribute reader)
            return _structural(a.block, a.parts, a.x, a.fx, a.notes)[0]
        r = a.refusal
        if r.code is RejectCode.CAPTURE_FAILED:
            # A rule older than this reader: where Dynamo could not capture the block and the attribute reader
            # measured the routing from an experts module called with it, that reader's Match is the answer (the
            # dispatch reader binds calls of at most the tokens its probes ran); counted as the attribute reader's.
            fb = in_stage("attribute reader", fallback.recognise, a.block, a.parts, a.x)
            if isinstance(fb, Match) and fallback.ROUTING_MEASURED in fb.evidence.notes:
                a.notes.append(f"FX pass could not capture the block ({r.message}); attribute fallback used")
                a.by = AttributeReader.name
                return fb
        return _observed(a.block, a.parts, a.x, r, a.notes)


class AttributeReader(Recogniser):
    name = "attribute_reader"

    def applies(self, a: Attempt) -> bool:
        if a.x is None:  # meta tensors: read only
            return True
        if a.parts.kind == "structural":  # no part names to read (the dispatch reader answered)
            return False
        r = a.refusal  # any other refusal of the FX pass is the answer, unless trust_fallback
        return r is None or r.code is RejectCode.CAPTURE_FAILED or a.trust_fallback

    def run(self, a: Attempt) -> Match | Reject:
        if a.x is None:
            a.notes.append("meta tensors: routing read from attributes and source, not measured")
            return fallback.recognise(a.block, a.parts, None)
        r = a.refusal
        if r is not None and r.code is RejectCode.CAPTURE_FAILED:
            a.notes.append(f"FX pass could not capture the block ({r.message}); attribute fallback used")
        elif r is not None:
            a.notes.append(f"FX pass rejected the block ({r.message}); attribute fallback used (trust_fallback)")
        got = in_stage("attribute reader", fallback.recognise, a.block, a.parts, a.x)
        a.who = "attribute reader: "
        return got


# The recognisers in the order a block meets them (the one place that orders them).
RECOGNISERS = Registry("recogniser", (FxPass(), FxRealValues(), DispatchReader(), AttributeReader()))


def recognise(block: nn.Module, parts: BlockParts, x: torch.Tensor | None, *, use_fx: bool = True,
              trust_fallback: bool = False, cache: dict | None = None) -> tuple[Match | Reject, list[str]]:
    """Match or Reject for ``block`` (see the module docstring), plus notes for the report.

    ``x``: a probe input for the readers' measured runs (None on the meta device: read only)."""
    a = Attempt(block, parts, x, use_fx, trust_fallback, cache)
    got = _walk(a)
    if isinstance(got, Match):
        _counters.counters["recognise"][a.by] += 1
        return got, a.notes
    fx = a.fx
    if fx is not None and fx.cause and fx.cause not in got.message:
        got = Reject(got.code, f"{fx.cause}; then {a.who}{got.message}", fx.cause)  # the first cause first
    return got, a.notes


def _walk(a: Attempt) -> Match | Reject:
    """The registered recognisers in order, until one matches; else the refusal that stands."""
    for r in RECOGNISERS:
        if not r.applies(a):
            continue
        a.by, a.who = r.name, ""
        try:
            got = r.run(a)
        except StageError as e:  # a reader raised: reported as such (its memory: optimize tries again smaller)
            if e.oom:
                raise
            return Reject(RejectCode.CHECK_ERROR, e.describe(), e.describe())
        if isinstance(got, Match):
            return got
        if got is not None:
            a.refusal = got
    if a.refusal is None:
        return Reject(RejectCode.NOT_RECOGNISED, f"no recogniser applies ({', '.join(RECOGNISERS.names())})")
    if a.refusal is a.fx:  # no reader took up the FX pass's refusal
        return Reject(a.fx.code, f"FX pass: {a.fx.message}")
    return a.refusal


def _structural(block: nn.Module, parts: BlockParts, x: torch.Tensor, fx: Reject | None, notes: list):
    """A block found by its shapes that the FX pass did not read (``fx``: its refusal; None: not used): the
    dispatch reader reads it when Dynamo could not capture it; the attribute reader has no part names to read."""
    abstract = _abstract_forward(block, x)
    if abstract is not None:
        return Reject(RejectCode.NOT_A_BLOCK, abstract), notes
    if fx is not None and fx.code is not RejectCode.CAPTURE_FAILED:
        return Reject(fx.code, f"FX pass: {fx.message} (block found by its shapes; the attribute reader cannot read "
                               "it)"), notes
    got = in_stage("dispatch reader", dispatch_reader.recognise, block, parts, x)
    if isinstance(got, Match):
        if fx is not None:
            notes.append(f"FX pass could not capture the block ({fx.message[:160]}); read by the dispatch reader")
        return got, notes
    fx_why = f"; FX pass: {fx.message}" if fx is not None and not fx.cause else ""  # (a cause: put first, above)
    return Reject(got.code, f"dispatch reader: {got.message}{fx_why} (block found by its shapes)"), notes


def _unselected(r: Reject) -> bool:
    """Did the FX pass refuse the block because its ids select no expert by a constant index?"""
    from .fx.moe_per_expert import UNSELECTED  # noqa: PLC0415 (the passes import Dynamo)

    return UNSELECTED in r.message


def _observed(block: nn.Module, parts: BlockParts, x: torch.Tensor, fx: Reject, notes: list) -> Match | None:
    """The dispatch reader's Match for a block of per-expert modules whose loop the FX pass could not read: Dynamo
    could not capture it (a data-dependent loop or branch: ``ids.unique().tolist()``, ``if counts[e] == 0``, sorted
    dispatch by ``split(counts.tolist())``), or it did but the ids select no expert by a constant index (sorted
    dispatch over slices, every expert on every token ``stack``ed). What each expert module computed on which
    tokens is observed instead; the verify stage proves it. None (a note says why) when it cannot read the block:
    the attribute reader may then try."""
    got = in_stage("dispatch reader", dispatch_reader.recognise, block, parts, x)
    if isinstance(got, Match):
        notes.append(f"FX pass: {fx.message[:300]}; read by the dispatch reader (the expert modules observed)")
        return got
    notes.append(f"dispatch reader: {got.message[:200]}")
    return None


def _abstract_forward(block: nn.Module, x: torch.Tensor) -> str | None:
    """Why a block found by its shapes is no block at all, when its own forward raises NotImplementedError on the
    probe: its parent runs its parts through other methods, around other computation (JetMoE's mixture of attention
    heads: ``map`` before attention, ``reduce`` after), so nothing stands where one op call could. None otherwise."""
    try:
        with torch.no_grad():
            block(x)
    except torch.OutOfMemoryError:
        raise
    except NotImplementedError as e:
        return (f"{type(block).__name__}'s forward is not callable ({str(e)[:120]!r}): its parent runs its parts "
                "through other methods around other computation (e.g. the two halves of a mixture of attention heads "
                "on either side of attention), so no call of the module can be replaced")
    except Exception:  # noqa: BLE001 - any other failure is the readers' to explain
        return None
    return None


def _compare_note(block, parts, x, fx: Match, cache) -> str:
    """Does the attribute reader agree with the FX pass? Once per block structure."""
    ck = ("compare", structure_key(block))
    if cache is not None and ck in cache:
        return cache[ck]
    try:
        from ..verify.verify import fit_routed_scale  # noqa: PLC0415

        fb = fallback.recognise(block, parts, x)
        if isinstance(fb, Reject):
            note = f"attribute fallback could not describe the block: {fb.message}"
        else:
            spec = fit_routed_scale(block, fb, x, block_constants(block, parts, fb.spec.top_k))
            note = "attribute fallback agrees" if spec == fx.spec else _diff(fx.spec, spec)
    except Refused as e:
        note = f"attribute fallback could not describe the block: {e.reason}"
    except Exception as e:
        raise_if_oom(e)
        note = f"attribute fallback failed: {type(e).__name__}: {e}"
    if cache is not None:
        cache[ck] = note
    return note


def _diff(a, b) -> str:
    ka, kb = json.loads(a.key), json.loads(b.key)
    return f"attribute fallback differs (fx, fallback): { {k: (ka[k], kb[k]) for k in ka if ka[k] != kb[k]} }"


# ------------------------------------------------------------------------------------------------------ one call
def match_block(block: nn.Module, example: torch.Tensor | None = None, *, use_fx: bool = True,
                cache: dict | None = None) -> Verified:
    """Recognise and verify one block, as ``optimize`` would (without binding it): the way for tools (the layer
    benchmark, scripts) to get a block's spec and the op's tensors (``moecomp.bind.bind.bound_tensors``). Raises
    :class:`moecomp.core.reject.Refused` with the reason code when the block is not one the op can stand in for.

    ``example``: the probe input (default: ``policy.probe_input`` in the block's dtype and device). ``cache``: the FX
    pass's answers per block structure, shared across calls (as ``optimize`` shares them across a model's blocks)."""
    from ..verify.epilogue import block_device_dtype  # noqa: PLC0415
    from .structure import NotABlock, find_parts, structural_parts  # noqa: PLC0415
    from ..verify.verify import verify  # noqa: PLC0415

    try:
        parts = find_parts(block)
    except NotABlock as e:
        parts = structural_parts(block)  # found by its shapes: the FX pass reads it
        if parts is None:
            raise Refused(str(e), RejectCode.NOT_A_BLOCK) from None
    if example is None:
        device, dtype = block_device_dtype(block, parts)
        example = policy.probe_input(parts.hidden_size, device, dtype)
    was = block.training
    block.eval()
    try:
        got, notes = recognise(block, parts, example, use_fx=use_fx, cache=cache)
        if isinstance(got, Reject):
            raise Refused(got.message, got.code)
        return verify(block, got, example, block_constants(block, parts), notes + got.evidence.notes)
    finally:
        block.train(was)
