"""``moecomp.optimize(model)``, ``moecomp.scan(model)``, ``moecomp.unoptimize(model)`` and the ``Report``.

For every candidate MoE block (a module owning a router weight [E, H] and 3-D expert weights, or a ModuleList of
per-expert MLPs; see :mod:`moecomp.hf.structure`):

1. detect: the FX pass (``moecomp.capture.detect_block``) first; when Dynamo cannot capture the block (or the pass
   is not installed), the attribute fallback (:mod:`moecomp.hf.fallback`), which measures routing and activation by
   running the block once;
2. check: the block's original forward and ``torch.ops.moecomp.moe_forward`` run on the same random input
   (``policy.PROBE_SHAPE``: 32 tokens, the block's dtype and device); the rewrite happens only if they agree within
   ``policy.VERIFY_TOLERANCE`` relative to the output's largest value (fp32: 1e-4; bf16: 3e-2; fp16: 1e-2; 16-bit
   routing near-ties excused per ``policy.TIE_REL`` / ``MAX_TIE_FRACTION``) and the output is finite;
3. bind: the block's forward is replaced (:mod:`moecomp.hf.bind`); parameters are shared, not copied (a
   ModuleList of expert MLPs is stacked once and its Parameters re-pointed at the stacked tensor's slices, so the
   weights are still held once and every write to them reaches the op).

Blocks that fail any step are left alone and reported with the reason (``BlockReport.reason``, text) and its
code (``BlockReport.codes``, :class:`moecomp.reject.RejectCode`). On the meta device nothing can run:
``scan`` then reports what the attribute fallback reads, marked unverified, and ``optimize`` warns (UserWarning)
that it bound nothing there.

At run time a rewritten block still runs its original forward when the op cannot stand in for it: in training mode
with router / input jitter, in training mode with gradients, in eval mode when gradients are needed (grad mode on
and the hidden states or weights require grad: the op has no backward; warned once per process), after an
attribute it was derived from changed (warned once per block; ``optimize(model)`` again re-binds it), while a
forward hook on its router / experts / shared experts is active (transformers records ``output_router_logits`` that
way; its recording hooks only count while a recording is in progress), or when it gets an extra argument it was not
checked with (e.g. ``input_ids``). Blocks that return extra outputs (gpt-oss: ``(hidden, router_scores)``) get them
from their router module, called once more on the same input.

``optimize`` on an already optimized model re-binds blocks whose attributes changed, and rebuilds the weight copies
moecomp keeps for the layouts it cannot share (separate 3-D gate / up, fp32 router copies): the way to pick up
``.data`` writes to those weights.

This module holds the API and the walk over the blocks (detection included); the check of step 2 is
:mod:`moecomp.verify`, the ``Report`` :mod:`moecomp.report`, the experts-only rewrite :mod:`moecomp.experts_only`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings

import torch
from torch import nn

from . import policy
from .experts_only import _try_experts_only
from .ops.moe_op import MOE_ARGS
from .reject import RejectCode
from .report import BlockReport, Report, _fill_from_spec, expert_style, router_style  # noqa: F401 (re-exported)
from .spec import MoESpec, SpecError
from .verify import _check_epilogue, _err_with_ties, _example, _verify  # noqa: F401 (re-exported)
from .hf import bind as _bind
from .hf import fallback as _fb
from .hf.structure import BlockParts, get_path, iter_blocks

# the verify check's rules live in moecomp.policy (re-exported here for callers that read them from optimize)
TOLERANCE = policy.VERIFY_TOLERANCE
PROBE_SHAPE = policy.PROBE_SHAPE
TIE_REL = policy.TIE_REL
MAX_TIE_FRACTION = policy.MAX_TIE_FRACTION


# ----------------------------------------------------------------------------------------------- detection
def _capture():
    """(detect_block, DetectError) of the FX pass, or (None, reason)."""
    try:
        from . import capture  # noqa: PLC0415
    except ImportError as e:
        return None, f"FX pass unavailable ({e})"
    fn = getattr(capture, "detect_block", None)
    err = getattr(capture, "DetectError", Exception)
    if fn is None:
        return None, "FX pass has no detect_block"
    return (fn, err), ""


def _is_capture_failure(e: Exception) -> bool:
    """True when the FX pass could not capture the block at all (then the attribute fallback may try)."""
    return getattr(e, "code", None) is RejectCode.CAPTURE_FAILED


def _block_device_dtype(block: nn.Module, parts: BlockParts):
    t = get_path(block, parts.w13) if parts.w13 else get_path(block, parts.expert_mlps[0].down)
    return t.device, t.dtype


def _ignored_params(block: nn.Module, x: torch.Tensor, ref, extra_params) -> frozenset:
    """Extra forward parameters (e.g. ``input_ids``) that leave this block's output unchanged."""
    ok = set()
    for p in extra_params:
        if "ids" not in p:
            continue
        val = torch.ones(x.shape[:-1], dtype=torch.long, device=x.device)
        try:
            with torch.no_grad():
                out = block(x, **{p: val})
        except Exception:
            continue
        o = _fb._primary(out)
        if isinstance(o, torch.Tensor) and torch.equal(o, _fb._primary(ref)):
            ok.add(p)
    return frozenset(ok)


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


def _fx_detect(block, example, cap, cache):
    """The FX pass's BlockMatch for ``block`` (DetectError / other errors raised), cached per structure."""
    detect_block, _ = cap
    key = structure_key(block)
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        try:
            hit = detect_block(block, example)
        except Exception as e:
            hit = e
        if cache is not None:
            cache[key] = hit
    if isinstance(hit, Exception):
        raise hit
    return hit


COMPARE_FALLBACK = True  # when the FX pass detects a block, also run the attribute fallback and note any difference


def fallback_spec(block: nn.Module, parts: BlockParts, x: torch.Tensor | None = None) -> MoESpec:
    """The spec the attribute fallback gives (measured and output-checked when it can run): for comparisons."""
    ext = _fb.static_extract(block, parts)
    if x is None:
        return ext.match.spec
    ext, run = _fb.measure(block, x, ext)
    consts = _fb.numeric_consts(_fb.attr_sources(block, parts), ext.match.spec.top_k)
    spec, _ = _verify(block, ext.match.spec, ext.match.bindings, ext.derived, run, consts)
    return spec


def _compare_fallback(block, parts, x, spec: MoESpec, consts) -> str:
    try:
        fb = fallback_spec(block, parts, x)
    except _fb.FallbackError as e:
        return f"attribute fallback could not describe the block: {e.reason}"
    except Exception as e:
        return f"attribute fallback failed: {type(e).__name__}: {e}"
    if fb == spec:
        return "attribute fallback agrees"
    a, b = json.loads(spec.key), json.loads(fb.key)
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    return f"attribute fallback differs (fx, fallback): {diff}"


def _try_fx(block: nn.Module, H: int, device, dtype, cap, rep: BlockReport, cache, trust_fallback: bool):
    """The FX pass's BlockMatch, or None (noted in ``rep``) when the attribute fallback is to try instead; a block
    the pass traced but rejected raises FallbackError unless ``trust_fallback``."""
    detect_block, DetectError = cap
    try:
        return _fx_detect(block, _example(H, device, dtype, shape=policy.CAPTURE_PROBE_SHAPE), cap, cache)
    except DetectError as e:  # noqa: B014
        reason = getattr(e, "reason", str(e))
        if not _is_capture_failure(e):
            if not trust_fallback:
                raise _fb.FallbackError(f"FX pass: {reason}", RejectCode.NOT_RECOGNISED) from None
            rep.notes.append(f"FX pass rejected the block ({reason}); attribute fallback used (trust_fallback)")
        else:
            rep.notes.append(f"FX pass could not capture the block ({reason}); attribute fallback used")
    except Exception as e:  # Dynamo errors surface as many types
        rep.notes.append(f"FX pass failed ({type(e).__name__}: {str(e)[:120]}); attribute fallback used")
    return None


def _compare_note(block, parts, x, spec: MoESpec, consts, cache) -> str:
    """``_compare_fallback``'s note, once per block structure: the other layers would repeat the same answer."""
    ck = ("compare", structure_key(block))
    if cache is None or ck not in cache:
        note = _compare_fallback(block, parts, x, spec, consts)
        if cache is not None:
            cache[ck] = note
    else:
        note = cache[ck]
    return note


def _detect(name: str, block: nn.Module, parts: BlockParts, cap, rep: BlockReport, cache=None,
            trust_fallback: bool = False):
    """Detection + check for one block with real tensors. Returns (spec, bindings, derived, contract, run)."""
    device, dtype = _block_device_dtype(block, parts)
    H = parts.hidden_size
    x = _example(H, device, dtype)
    match = _try_fx(block, H, device, dtype, cap, rep, cache, trust_fallback) if cap is not None else None
    consts = _fb.numeric_consts(_fb.attr_sources(block, parts), 1)
    if match is None:
        ext = _fb.static_extract(block, parts)
        ext, run = _fb.measure(block, x, ext)
        spec, bindings, derived = ext.match.spec, ext.match.bindings, ext.derived
        method = "fallback"
        rep.notes += ext.notes
    else:
        spec, bindings = match.spec, dict(match.bindings)
        for a in MOE_ARGS:
            bindings.setdefault(a, None)
        derived = []
        run = _fb.run_probe(block, parts, x)
        method = "fx"
        if COMPARE_FALLBACK:
            rep.notes.append(_compare_note(block, parts, x, spec, consts, cache))
    rep.method = method
    why = _fb.activation_mismatch(block, parts, spec)
    if why is not None:
        raise _fb.FallbackError(f"activation check: {why}", RejectCode.VERIFICATION_FAILED)
    contract = _bind.infer_contract(run, parts)
    try:
        spec, err = _verify(block, spec, bindings, derived, run, consts + [float(spec.top_k), 1.0 / spec.top_k],
                            rep.notes)
    except SpecError as e:
        raise _fb.FallbackError(f"op rejected the block's tensors: {e}", RejectCode.SPEC_INVALID) from None
    rep.max_rel_err = err
    tol = policy.verify_tolerance(dtype)
    if not err <= tol:
        extra = f" (block also has {', '.join(parts.extra_modules)})" if parts.extra_modules else ""
        raise _fb.FallbackError(f"op output differs from the block's: max rel. err {err:.2e} > {tol:g}{extra}",
                                RejectCode.VERIFICATION_FAILED)
    return spec, bindings, derived, contract, run, method


def _find_epilogue(block: nn.Module, parts: BlockParts, x: torch.Tensor) -> list[str]:
    """Children the block applies last to its result (``return self.post_mlp_layernorm(h)``), seen by running it.

    A candidate is a parameterised child that nothing else explains (``parts.extra_modules``), called once on one
    [.., H] tensor, whose output *is* the block's output. It is peeled off (replaced by ``nn.Identity`` while the MoE
    part is detected) and applied after the op; the whole is then checked against the block.
    """
    cands = [n for n in parts.extra_modules if isinstance(block._modules.get(n), nn.Module)]
    if not cands:
        return []
    seen: dict = {}
    handles = []
    for n in cands:
        def hook(mod, args, out, _n=n):
            seen.setdefault(_n, []).append((args, out))
        handles.append(block._modules[n].register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = block(x)
    except Exception:
        return []
    finally:
        for h in handles:
            h.remove()
    prim = _fb._primary(out)
    if not isinstance(prim, torch.Tensor):
        return []
    for n, calls in seen.items():
        if len(calls) != 1:
            continue
        args, o = calls[0]
        if (len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].shape[-1] == x.shape[-1]
                and isinstance(o, torch.Tensor) and o.numel() == prim.numel() and torch.equal(o.reshape(prim.shape),
                                                                                             prim)):
            return [n]
    return []


class _Peeled:
    """Context manager: the named children of ``block`` are ``nn.Identity`` inside it."""

    def __init__(self, block: nn.Module, names):
        self.block, self.names, self.saved = block, list(names), {}

    def __enter__(self):
        for n in self.names:
            self.saved[n] = self.block._modules[n]
            self.block._modules[n] = nn.Identity()
        return self

    def __exit__(self, *exc):
        for n, m in self.saved.items():
            self.block._modules[n] = m
        return False


def _process(name: str, block: nn.Module, parts: BlockParts | None, reason: str, cap, bind_it: bool,
             cache=None, trust_fallback: bool = False, experts_only: bool = True) -> BlockReport:
    rep = _process_block(name, block, parts, reason, cap, bind_it, cache, trust_fallback)
    if rep.status == "skipped" and experts_only:
        _try_experts_only(name, block, parts, rep, bind_it)
    if rep.status not in ("already", "experts only") and any(p.device.type == "meta" for p in block.parameters()):
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
    rep.status, rep.method = "already", st.method
    rep.epilogue = [".".join(p) for p in st.epilogue]
    _fill_from_spec(rep, st.spec, block, st.bindings, st.derived)


def _refuse_structure(block: nn.Module, parts: BlockParts, rep: BlockReport) -> bool:
    """True (refusal recorded in ``rep``) for structures the op cannot stand in for, seen without running: router
    and experts next to attention / mixer modules, a router that reads token ids."""
    attn = [n for n in parts.extra_modules if any(k in n.lower() for k in ("attn", "attention", "mixer", "mamba"))]
    if attn:
        rep.refuse(RejectCode.UNSUPPORTED_STRUCTURE, f"router and experts sit in {type(block).__name__} next to "
                   f"{', '.join(attn)} (no separate MoE module to rewrite)")
        return True
    if parts.router_module:
        try:
            rsig = inspect.signature(get_path(block, parts.router_module).forward).parameters
        except (TypeError, ValueError):
            rsig = {}
        if any(n in rsig for n in ("input_ids", "token_ids")):
            rep.refuse(RejectCode.UNSUPPORTED_ROUTING,
                       "the router reads token ids (hash routing): not a routing MoESpec can express")
            return True
    return False


def _report_meta(block: nn.Module, parts: BlockParts, rep: BlockReport) -> None:
    """A block on the meta device: what the attribute fallback reads, marked unverified (nothing can run)."""
    try:
        ext = _fb.static_extract(block, parts)
    except _fb.FallbackError as e:
        rep.refuse(e.code, e.reason)
        return
    _fill_from_spec(rep, ext.match.spec, block, ext.match.bindings, ext.derived)
    rep.status, rep.method, rep.reason = "unverified", "fallback (meta)", ""
    rep.notes += ext.notes + ["meta tensors: routing read from attributes and source, not measured"]


def _epilogue_of(block: nn.Module, parts: BlockParts) -> list[str]:
    """``_find_epilogue`` on the check input; [] when the block has no unexplained children or running it fails."""
    epilogue = []
    if parts.extra_modules:
        device, dtype = _block_device_dtype(block, parts)
        try:
            epilogue = _find_epilogue(block, parts, _example(parts.hidden_size, device, dtype))
        except Exception:
            epilogue = []
    return epilogue


def _process_block(name: str, block: nn.Module, parts: BlockParts | None, reason: str, cap, bind_it: bool,
                   cache=None, trust_fallback: bool = False) -> BlockReport:
    rep = BlockReport(name=name, cls=type(block).__name__, status="skipped", reason=reason)
    if parts is None:  # structure.iter_blocks says why (free text)
        rep.codes.append(RejectCode.NOT_A_BLOCK)
        return rep
    changed = _bind.stale(block) if getattr(block, "_moecomp", None) is not None else ""
    if changed and bind_it:  # derived from attributes that have changed since: detect and bind again
        _bind.unbind(block)
        rep.notes.append(f"re-detected: {changed} since the last optimize")
    if getattr(block, "_moecomp", None) is not None:
        _report_already(block, rep, changed, bind_it)
        return rep
    if _refuse_structure(block, parts, rep):
        return rep
    meta = any(p.device.type == "meta" for p in block.parameters())
    if meta:
        _report_meta(block, parts, rep)
        return rep
    epilogue = _epilogue_of(block, parts)
    dparts = parts
    if epilogue:
        dparts = dataclasses.replace(parts, extra_modules=[n for n in parts.extra_modules if n not in epilogue])
    try:
        with _Peeled(block, epilogue):
            spec, bindings, derived, contract, run, method = _detect(name, block, dparts, cap, rep, cache,
                                                                     trust_fallback)
            hidden, extra = _bind.forward_params(block)
            ignored = _ignored_params(block, run.x, run.output, extra) if extra else frozenset()
        if epilogue:
            _check_epilogue(block, spec, bindings, derived, run.x, epilogue, rep)
    except _fb.FallbackError as e:
        rep.refuse(e.code, e.reason)
        return rep
    except _bind.BindError as e:
        rep.refuse(RejectCode.BIND_FAILED, e.reason)
        return rep
    except Exception as e:  # the block's own forward failed on the check input, or the op did
        rep.refuse(RejectCode.CHECK_ERROR,
                   f"check failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e) else ''}")
        return rep
    rep.reason = ""
    rep.epilogue = list(epilogue)
    if bind_it:
        st = _bind.bind(block, name, spec, bindings, derived, contract, dparts, ignored, method=method,
                        epilogue=epilogue)
        derived = st.derived  # with the router buffer, where the op reads one
        rep.status = "rewritten"
    else:
        rep.status = "supported"
    _fill_from_spec(rep, spec, block, bindings, derived)
    return rep


def _walk(model: nn.Module, bind_it: bool, use_capture: bool = True, trust_fallback: bool = False,
          experts_only: bool = True) -> Report:
    cap, why = _capture() if use_capture else (None, "FX pass not used")
    blocks = iter_blocks(model)
    reps = []
    cache = {}  # FX results per block structure: one Dynamo capture per distinct block, not per layer
    was_training = {}
    for name, mod, parts, reason in blocks:
        was_training[name] = mod.training
        mod.eval()  # checks run in eval mode (no jitter / dropout); restored below
        try:
            reps.append(_process(name, mod, parts, reason, cap, bind_it, cache, trust_fallback, experts_only))
        finally:
            mod.train(was_training[name])
    det = "detection: FX pass, attribute fallback where Dynamo cannot capture" if cap else (
        f"detection: attribute fallback only — {why}")
    if reps and all(r.method == "fallback (meta)" or r.status == "skipped" for r in reps) and any(
            r.method == "fallback (meta)" for r in reps):
        det = "detection: attribute fallback (meta tensors: Dynamo cannot run the blocks; nothing verified)"
    return Report(type(model).__name__, reps, det, "optimize" if bind_it else "scan")


def optimize(model: nn.Module, *, use_capture: bool = True, trust_fallback: bool = False, report: bool = False,
             experts_only: bool = True, fast_generate: bool = True):
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
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"moecomp.optimize expects a torch.nn.Module, got {type(model).__name__}")
    rep = _walk(model, bind_it=True, use_capture=use_capture, trust_fallback=trust_fallback,
                experts_only=experts_only)
    meta = [b.name or "<root>" for b in rep.blocks if RejectCode.META_TENSORS in b.codes]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        warnings.warn(
            f"moecomp.optimize: {len(meta)} MoE block(s) ({shown}) hold meta tensors and were left as they are: "
            f"meta tensors cannot run, so the rewrite cannot be verified. Use moecomp.scan(model) to see what would "
            f"be rewritten, or call moecomp.optimize(model) after the weights are loaded.", UserWarning, stacklevel=2)
    if fast_generate and (rep.rewritten or rep.experts_only):
        from .generate import install

        if install(model):
            rep.generate = "moecomp (static cache; whole decode steps as CUDA graphs on GPU)"
    model._moecomp_report = rep
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
    from .generate import uninstall

    uninstall(model)
    for m in model.modules():
        _bind.unbind(m)
    if "_moecomp_report" in model.__dict__:
        del model._moecomp_report
    return model


def rewritten_blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "_moecomp", None) is not None}


def experts_only_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules switched to ``moe_experts`` by an experts-only rewrite."""
    return {n: m for n, m in model.named_modules() if m.__dict__.get("_moecomp_experts") is not None}
