"""``moecomp.optimize(model)``, ``moecomp.scan(model)``, ``moecomp.unoptimize(model)`` and the ``Report``.

For every candidate MoE block (a module owning a router weight [E, H] and 3-D expert weights, or a ModuleList of
per-expert MLPs; see :mod:`moecomp.recognise.structure`):

1. recognise: the recognisers in order (:data:`moecomp.recognise.recognise.RECOGNISERS`): the FX pass
   (``moecomp.recognise.capture.detect_block``) first, again with real values where a per-expert loop stopped it;
   when Dynamo cannot capture the block (or the pass is not used), the dispatch reader and the attribute reader
   (:mod:`moecomp.recognise.fallback`), which measure routing and activation by running the block;
2. check: the block's original forward and ``torch.ops.moecomp.moe_forward`` run on the same random input
   (``policy.PROBE_SHAPE``: 32 tokens, the block's dtype and device); the rewrite happens only if they agree within
   ``policy.VERIFY_TOLERANCE`` relative to the output's largest value (fp32: 1e-4; bf16: 3e-2; fp16: 1e-2; 16-bit
   routing near-ties excused per ``policy.TIE_REL`` / ``MAX_TIE_FRACTION``) and the output is finite;
3. bind: the block's forward is replaced (:mod:`moecomp.bind.bind`); parameters are shared, not copied (a
   ModuleList of expert MLPs is stacked once and its Parameters re-pointed at the stacked tensor's slices, so the
   weights are still held once and every write to them reaches the op).

The ways to rewrite a block are small strategies, tried in order (:data:`moecomp.api.rewrites.REWRITES`, the one
place that orders them): ``sharded`` (transformers' distributed loading sharded the experts: DTensors;
:mod:`moecomp.api.hf_distributed` recognises the sharded block, checks it against its sharded forward and binds the
parallel op on the local shards, every rank of its group alike), ``whole`` (steps 1-3 above, :mod:`moecomp.api.whole`),
``pair`` (router and experts beside other things in a decoder layer: :mod:`moecomp.api.pair`), ``experts_only``
(:mod:`moecomp.api.experts_only`). The first that settles the block ends the walk; each block a strategy rewrites
counts in ``moecomp.counters["rewrite"][name]``. Blocks bound before, candidates that are no block and router /
experts next to attention are settled before the walk (``_before_rewrites``).

Blocks that fail any step are left alone and reported with the reason (``BlockReport.reason``, text) and its
code (``BlockReport.codes``, :class:`moecomp.core.reject.RejectCode`). On the meta device nothing can run:
``scan`` then reports what the attribute fallback reads, marked unverified, and ``optimize`` warns (UserWarning)
that it bound nothing there.

At run time a rewritten block still runs its original forward when the op cannot stand in for it: in training mode
with router / input jitter, in training mode with gradients, in eval mode when gradients are needed (grad mode on
and the hidden states or weights require grad: the op has no backward; warned once per process), after an
attribute it was derived from changed (warned once per block; ``optimize(model)`` again re-binds it), while a
forward hook on its router / experts / shared experts is active (transformers records ``output_router_logits`` that
way; its recording hooks only count while a recording is in progress), when it gets an extra argument it was not
checked with (e.g. ``input_ids``), or without one the op reads (hash routing's token ids). Blocks that return extra
outputs (gpt-oss: ``(hidden, router_scores)``) get them from their router module, called once more on the same
input.

``optimize`` on an already optimized model re-binds blocks whose attributes changed, and rebuilds the weight copies
moecomp keeps for the layouts it cannot share (separate 3-D gate / up, fp32 router copies): the way to pick up
``.data`` writes to those weights.

This module holds the API and the walk over the blocks; the rewrites are :mod:`moecomp.api.rewrites`, the check of
step 2 :mod:`moecomp.verify.verify`, the ``Report`` :mod:`moecomp.api.report` (``BlockReport.status``: a
:class:`moecomp.core.status.BlockStatus`).
"""

from __future__ import annotations

import warnings

from torch import nn

from ..core import policy
from ..core.reject import RejectCode
from ..core.status import BlockStatus
from .report import (BlockReport, Report, fill_from_spec as _fill_from_spec, expert_style,  # noqa: F401 (re-exported)
                     router_style)
from ..recognise.recognise import fx_available, structure_key  # noqa: F401 (structure_key re-exported)
from ..bind import bind as _bind
from ..formats import fp8 as _fp8, packed as _packed
from ..recognise import router_probe as _router_probe
from ..bind.impl_switch import unclaimed
from ..core.parts import BlockParts
from ..recognise.structure import iter_blocks
from . import hf_distributed as _hf_distributed, pair as _pair
from .rewrites import Candidate, run_rewrites

# the verify check's rules live in moecomp.core.policy (re-exported here for callers that read them from optimize)
TOLERANCE = policy.VERIFY_TOLERANCE
PROBE_SHAPE = policy.PROBE_SHAPE
TIE_REL = policy.TIE_REL
MAX_TIE_FRACTION = policy.MAX_TIE_FRACTION


# ----------------------------------------------------------------------------------------------- one block
def _process(name: str, block: nn.Module, parts: BlockParts | None, reason: str, use_fx: bool, bind_it: bool,
             cache=None, trust_fallback: bool = False, experts_only: bool = True, calls=None) -> BlockReport:
    with unclaimed(block.modules()):  # layers bound before this one marked the shared config "moecomp"
        rep = BlockReport(name=name, cls=type(block).__name__, status=BlockStatus.SKIPPED, reason=reason)
        if _pair.report_bound(block, rep, bind_it):
            return rep
        rep = _process_block(name, block, parts, reason, use_fx, bind_it, cache, trust_fallback, experts_only, calls)
    if rep.status not in (BlockStatus.ALREADY, BlockStatus.EXPERTS_ONLY) and any(
            p.device.type == "meta" for p in block.parameters()):
        rep.notes.append(META_NOTE)
        rep.codes.append(RejectCode.META_TENSORS)
    return rep


META_NOTE = "meta tensors: nothing can run, nothing verified or bound"


def _report_already(block: nn.Module, rep: BlockReport, changed: str, bind_it: bool) -> None:
    """A block bound by an earlier ``optimize``: reported as "already" (its weight copies rebuilt when binding)."""
    st = block._moecomp
    if changed:  # (scan changes nothing)
        rep.notes.append(f"stale: {changed} since optimize; the block runs its original forward until "
                         f"moecomp.optimize(model) re-binds it")
    elif bind_it:
        _bind.refresh(block)  # rebuild weight copies (picks up .data writes to weights moecomp had to copy)
        _bind.claim(st, st.watch_mods or ())  # an experts implementation named since: moecomp's op again
    rep.status, rep.method = BlockStatus.ALREADY, st.method
    rep.epilogue = [".".join(p) for p in st.epilogue]
    _fill_from_spec(rep, st.spec, block, st.bindings, st.derived)


def _refuse_structure(block: nn.Module, parts: BlockParts, rep: BlockReport) -> bool:
    """True (refusal recorded in ``rep``) for structures the op cannot stand in for, seen without running: router
    and experts next to attention / mixer modules. (A router that reads token ids is hash routing: the recognisers
    read it, ``MoESpec.hash_routing``.)"""
    attn = [n for n in parts.extra_modules if any(k in n.lower() for k in ("attn", "attention", "mixer", "mamba"))]
    if attn:
        rep.refuse(RejectCode.UNSUPPORTED_STRUCTURE, f"router and experts sit in {type(block).__name__} next to "
                   f"{', '.join(attn)} (no separate MoE module to rewrite)")
        return True
    return False


def _before_rewrites(block: nn.Module, parts: BlockParts | None, reason: str, rep: BlockReport,
                     bind_it: bool) -> bool:
    """What needs no rewrite, settled in ``rep`` before the rewrites are tried: a block bound before ("already"; a
    stale one is unbound to be read again), a candidate that is no block (the reason, measured), router and
    experts next to attention (refused). True when a whole-block rewrite may be tried."""
    if parts is None:  # structure.iter_blocks says why (free text)
        if _hf_distributed.bound_shard(block):  # (its experts, a shard now, no longer match its router)
            _report_already(block, rep, "", bind_it)
            return False
        rep.codes.append(RejectCode.NOT_A_BLOCK)
        rep.reason = _router_probe.explain(block, reason)  # no plain router: what the routing reads, measured
        return False
    changed = _bind.stale(block) if getattr(block, "_moecomp", None) is not None else ""
    if changed and bind_it:  # derived from attributes that have changed since: detect and bind again
        _bind.unbind(block)
        rep.notes.append(f"re-detected: {changed} since the last optimize")
    if getattr(block, "_moecomp", None) is not None:
        _report_already(block, rep, changed, bind_it)
        return False
    return not _refuse_structure(block, parts, rep)


def _process_block(name: str, block: nn.Module, parts: BlockParts | None, reason: str, use_fx: bool, bind_it: bool,
                   cache=None, trust_fallback: bool = False, experts_only: bool = False, calls=None) -> BlockReport:
    """The block's report: the checks before the rewrites, then the registered rewrites in order
    (:data:`moecomp.api.rewrites.REWRITES`; the pair rewrite needs ``calls``, the experts-only one ``experts_only``)."""
    rep = BlockReport(name=name, cls=type(block).__name__, status=BlockStatus.SKIPPED, reason=reason)
    ctx = Candidate(name, block, parts, rep, use_fx, bind_it, cache, trust_fallback, experts_only, calls)
    ctx.whole_possible = _before_rewrites(block, parts, reason, rep, bind_it)
    run_rewrites(ctx)
    return rep


def _walk(model: nn.Module, bind_it: bool, use_capture: bool = True, trust_fallback: bool = False,
          experts_only: bool = True) -> Report:
    why = fx_available() if use_capture else "FX pass not used"
    use_fx = not why
    blocks = iter_blocks(model)
    reps = []
    cache = {}  # FX results per block structure: one Dynamo capture per distinct block, not per layer
    was_training = {}
    calls = _pair.ParentCalls(model, [mod for _, mod, parts, _ in blocks if parts is not None and parts.router_module])
    for name, mod, parts, reason in blocks:
        was_training[name] = mod.training
        mod.eval()  # checks run in eval mode (no jitter / dropout); restored below
        try:
            reps.append(_process(name, mod, parts, reason, use_fx, bind_it, cache, trust_fallback, experts_only,
                                 calls))
        finally:
            mod.train(was_training[name])
    fp8_linear = _fp8_linears(model, bind_it)
    det = "detection: FX pass, attribute fallback where Dynamo cannot capture" if use_fx else (
        f"detection: attribute fallback only — {why}")
    if reps and all(r.method == "fallback (meta)" or r.status == BlockStatus.SKIPPED for r in reps) and any(
            r.method == "fallback (meta)" for r in reps):
        det = "detection: attribute fallback (meta tensors: Dynamo cannot run the blocks; nothing verified)"
    return Report(type(model).__name__, reps, det, "optimize" if bind_it else "scan", fp8_linear=fp8_linear)


def _fp8_linears(model: nn.Module, bind_it: bool) -> dict:
    """FP8Linear-like modules (attention, dense MLPs, shared experts): bound to ``moecomp.ops.fp8_linear`` by
    ``optimize`` (their own forward needs the hub's kernel); counted by ``scan``."""
    found = _fp8.fp8_linears(model)
    out = {"modules": len(found), "bound": 0, "refused": {}}
    for name, m in found:
        if m.__dict__.get("_moecomp_fp8") is not None:
            out["bound"] += 1
            continue
        try:
            _fp8.linear_fp8(m, name)
            if bind_it and _fp8.bind_linear(m, name) is not None:
                out["bound"] += 1
        except _fp8.FP8LayoutError as e:
            out["refused"][name] = str(e)
    return out


class OptimizeError(RuntimeError):
    """``optimize(model, strict=True)`` left blocks that hold experts unrewritten: ``blocks`` their BlockReports
    (``name``, ``reason``, ``codes``), ``report`` the whole Report. The blocks that were rewritten stay rewritten (``moecomp.unoptimize`` restores
    them)."""

    def __init__(self, report: Report, blocks: list):
        self.report, self.blocks = report, blocks
        lines = "\n".join(f"  {b.name or '<root>'}: {b.reason}" for b in blocks)
        super().__init__(f"moecomp.optimize(strict=True): {len(blocks)} of {len(report.blocks)} MoE block(s) holding "
                         f"experts were left unrewritten:\n{lines}")


def unrewritten(rep: Report) -> list[BlockReport]:
    """Blocks holding experts that ``optimize`` left as they were (not candidates that are no block; not meta
    tensors, which have their own warning)."""
    return [b for b in rep.blocks if b.status == BlockStatus.SKIPPED and RejectCode.NOT_A_BLOCK not in b.codes
            and RejectCode.META_TENSORS not in b.codes]


def _warn_unrewritten(rep: Report, strict: bool) -> None:
    """One warning per ``optimize`` call naming how many blocks holding experts were left unrewritten and where to
    look (``strict``: ``OptimizeError`` instead)."""
    left = unrewritten(rep)
    if not left:
        return
    if strict:
        raise OptimizeError(rep, left)
    shown = ", ".join(b.name or "<root>" for b in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
    warnings.warn(
        f"moecomp.optimize: {len(left)} of {len(rep.blocks)} MoE block(s) holding experts were left unrewritten "
        f"({shown}); the first says: {left[0].reason[:300]}. Each block's reason: "
        f"moecomp.optimize(model, report=True) or moecomp.scan(model); optimize(model, strict=True) raises instead.",
        UserWarning, stacklevel=3)


def optimize(model: nn.Module, *, use_capture: bool = True, trust_fallback: bool = False, report: bool = False,
             experts_only: bool = True, fast_generate: bool = True, strict: bool = False):
    """Rewrite every MoE block of ``model`` (in place) to call ``torch.ops.moecomp.moe_forward`` once.

    Returns the same model (``(model, Report)`` with ``report=True``). Blocks that cannot be proven equal to the op
    are left alone; ``moecomp.scan(model)`` (or ``report=True``) says which and why. ``moecomp.unoptimize(model)``
    restores the original forwards.

    ``use_capture=False`` skips the FX pass (attribute fallback only). ``trust_fallback=True`` also hands blocks the
    FX pass traced but rejected to the attribute fallback; its evidence is numerical (random inputs, activations
    over [-12, 12]) rather than structural, so it is off by default.

    ``experts_only`` (default on): a block that cannot be rewritten whole (routing the spec cannot express, router
    and experts inside a decoder layer, ...) but holds a standard ``@use_experts_implementation`` experts module
    that ``moe_experts`` computes exactly (checked on probes) gets just that module switched to moecomp's experts
    path; routing stays HF's. Reported as "experts only" with the reason the whole block was not rewritten.

    ``fast_generate`` (default on): when a block was rewritten and the model has transformers' ``generate``, that
    becomes moecomp's (:mod:`moecomp.generate`): a static KV cache and, on CUDA, every decode step replayed as one
    CUDA graph; calls it cannot serve (beam search, streamers, caches passed in, custom processors, ...) run
    transformers' own generate. ``fast_generate=False``, or ``generate(..., moecomp_fast=False)`` per call, keeps
    transformers' generate (the rewritten blocks still run the op).

    Blocks holding experts that are left unrewritten (whatever the cause: a refusal, or a stage that raised, which
    the report names with the exception) give one ``UserWarning`` per call; ``strict=True`` raises
    :class:`OptimizeError` (naming each block and its reason) instead, before ``generate`` is replaced.

    4-bit experts (``PackedExperts``) with MOECOMP_W4_FORM=mma: re-laid once, in place, to the "mma" layout before
    the checks (``QuantSpec.layout``; ``Report.w4_relaid``; docs/QUANT4.md); ``unoptimize`` restores the packed bytes.

    Memory: beyond one plain forward of a block, recognising and checking it takes at most about
    ``policy.WORKING_MEMORY_BYTES`` (1 GiB); a probe that still runs out of device memory is tried again smaller, then
    on the CPU, and the report says so.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"moecomp.optimize expects a torch.nn.Module, got {type(model).__name__}")
    from ..generate.warm_cache import before_optimize

    before_optimize(model)  # Triton kernels another process compiled and saved, before the checks run them
    relaid = _w4_relayout(model)
    rep = _walk(model, bind_it=True, use_capture=use_capture, trust_fallback=trust_fallback,
                experts_only=experts_only)
    rep.w4_relaid = relaid
    meta = [b.name or "<root>" for b in rep.blocks if RejectCode.META_TENSORS in b.codes]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        warnings.warn(
            f"moecomp.optimize: {len(meta)} MoE block(s) ({shown}) hold meta tensors and were left as they are: "
            f"meta tensors cannot run, so the rewrite cannot be verified. Use moecomp.scan(model) to see what would "
            f"be rewritten, or call moecomp.optimize(model) after the weights are loaded.", UserWarning, stacklevel=2)
    model._moecomp_report = rep
    _warn_unrewritten(rep, strict)
    if fast_generate and (rep.rewritten or rep.experts_only or rep.fp8_linear.get("bound")):
        from ..generate import install
        from . import routing  # noqa: F401  (generate's return_routed_experts records with it)

        if install(model):
            rep.generate = "moecomp (static cache; whole decode steps as CUDA graphs on GPU)"
    return (model, rep) if report else model


def scan(model: nn.Module, *, use_capture: bool = True, trust_fallback: bool = False,
         experts_only: bool = True) -> Report:
    """Report the MoE blocks of ``model`` without changing it (already-rewritten blocks show as such)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"moecomp.scan expects a torch.nn.Module, got {type(model).__name__}")
    return _walk(model, bind_it=False, use_capture=use_capture, trust_fallback=trust_fallback,
                 experts_only=experts_only)


def unoptimize(model: nn.Module):
    """Restore the original forward of every block ``optimize`` rewrote. Returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"moecomp.unoptimize expects a torch.nn.Module, got {type(model).__name__}")
    from ..generate import uninstall

    uninstall(model)
    for m in model.modules():
        _bind.unbind(m)
        _fp8.unbind_linear(m)
    _packed.relayout_experts(model, "packed", only_relaid=True)  # the packed bytes back (in place, exactly)
    if "_moecomp_report" in model.__dict__:
        del model._moecomp_report
    return model


def _w4_relayout(model: nn.Module) -> list[str]:
    """With the 4-bit "mma" form asked (MOECOMP_W4_FORM=mma), every ``PackedExperts`` that can take its layout is
    re-laid once, in place, before the checks run (``formats/packed.py``: ``QuantSpec.layout`` "mma", no second copy;
    ``unoptimize`` restores the packed bytes). The names of those re-laid."""
    from ..ops.triton_quant4 import options

    return _packed.relayout_experts(model, "mma") if options()["w4_form"] == "mma" else []


def rewritten_blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "_moecomp", None) is not None}


def experts_only_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules switched to ``moe_experts`` by an experts-only rewrite."""
    return {n: m for n, m in model.named_modules() if m.__dict__.get("_moecomp_experts") is not None}
