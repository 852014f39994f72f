"""The whole-block rewrite of ``moecomp.optimize`` (the ``"whole"`` strategy of :mod:`moecomp.api.rewrites`):
recognise the block (:func:`moecomp.recognise.recognise.recognise`), verify the Match on a probe
(:mod:`moecomp.verify.verify`), bind it (:mod:`moecomp.bind.bind`): the block's forward becomes one ``moe_forward``
call. A probe that runs out of memory is tried again smaller, then on a CPU copy of the block (:func:`checked`). On
the meta device nothing can run: the report says what the attribute reader reads, marked unverified."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from ..bind import bind as _bind
from ..core import policy
from ..core.match import Verified
from ..core.parts import BlockParts
from ..core.reject import Refused, Reject, RejectCode, StageError, describe_exception, in_stage, is_oom
from ..core.status import BlockStatus
from ..formats import fp8 as _fp8
from ..recognise.recognise import block_constants, recognise, structure_key
from ..verify.epilogue import Peeled, block_device_dtype, epilogue_of
from ..verify.verify import verify, verify_epilogue
from .report import BlockReport, fill_from_spec as _fill_from_spec


def _recognise_and_verify(block: nn.Module, parts: BlockParts, epilogue, rep: BlockReport, use_fx: bool,
                          cache, trust_fallback: bool, shape=policy.PROBE_SHAPE) -> Verified:
    """recognise (FX pass, attribute reader) -> verify on a probe of ``shape``; raises ``Refused``, or
    ``StageError`` naming the stage that raised. Epilogue children are peeled off while the MoE part is recognised
    and verified, then checked with it."""
    device, dtype = block_device_dtype(block, parts)
    x = policy.probe_input(parts.hidden_size, device, dtype, shape=shape)
    dparts = parts
    if epilogue:
        dparts = dataclasses.replace(parts, extra_modules=[n for n in parts.extra_modules if n not in epilogue])
    with Peeled(block, epilogue):
        got, notes = in_stage("recognition", recognise, block, dparts, x, use_fx=use_fx,
                              trust_fallback=trust_fallback, cache=cache)
        rep.notes += notes
        if isinstance(got, Reject):
            raise Refused(got.message, got.code)
        rep.method = got.method
        rep.notes += got.evidence.notes
        verified = in_stage("verify", verify, block, got, x, block_constants(block, dparts), rep.notes)
    return in_stage("epilogue check", verify_epilogue, block, verified, x, epilogue, rep.notes)


def _cpu_copy(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose tensors (parameters, buffers, tensor attributes) are CPU copies, made one tensor at
    a time (nothing is copied on the block's device)."""
    memo = {}
    for m in block.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()) + [
                v for v in vars(m).values() if isinstance(v, torch.Tensor)]:
            if t is not None and id(t) not in memo:
                c = t.detach().to("cpu", copy=True)
                memo[id(t)] = nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c
    return copy.deepcopy(block, memo)


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tries(device: torch.device) -> list[tuple[tuple, bool]]:
    """(probe shape, on a CPU copy) in the order ``checked`` tries them on a block on ``device``."""
    tries = [(policy.PROBE_SHAPE, False), (policy.RETRY_PROBE_SHAPE, False)]
    if device.type != "cpu":
        tries.append((policy.PROBE_SHAPE, True))
    return tries


def checked(block: nn.Module, parts: BlockParts, rep: BlockReport, use_fx: bool, cache, trust_fallback: bool):
    """(epilogue, Verified) of the block, recognised and verified on the probe; when that runs out of memory, again on
    ``policy.RETRY_PROBE_SHAPE``, then (a block off the CPU) on a CPU copy of its tensors, made one at a time: its
    Match is path-based and binds the block itself. Each retry is noted in the report; a structure that needed one
    starts there for its next block. ``StageError`` (out of memory) when every try ran out."""
    device = torch.device(block_device_dtype(block, parts)[0])
    tries = _tries(device)
    key = ("memory", structure_key(block))
    start = min(cache.get(key, 0), len(tries) - 1) if cache is not None else 0
    ran_out = []
    for i in range(start, len(tries)):
        shape, on_cpu = tries[i]
        where = f"{shape[0] * shape[1]} probe tokens" + (" on a CPU copy of the block" if on_cpu else f" on {device}")
        n_notes = len(rep.notes)
        try:
            target = _cpu_copy(block) if on_cpu else block
            with _fp8.plain_fp8(target):  # FP8 modules run in plain PyTorch while checked (formats/fp8.py); bound after
                epilogue = in_stage("epilogue", epilogue_of, target, parts)
                verified = _recognise_and_verify(target, parts, epilogue, rep, use_fx, cache, trust_fallback, shape)
        except Exception as e:
            if not is_oom(e):
                raise
            del rep.notes[n_notes:]
            ran_out.append(f"{where}: {e.describe() if isinstance(e, StageError) else describe_exception(e)}")
            del e
            _release()
            continue
        if ran_out or i:
            before = "; ".join(ran_out) or "as the blocks of this structure before it"
            rep.notes.append(f"recognised and verified with {where} after running out of memory ({before})")
        if cache is not None:
            cache[key] = i
        return epilogue, verified
    raise StageError("recognition and verify", torch.OutOfMemoryError("; ".join(ran_out)))


def report_meta(block: nn.Module, parts: BlockParts, rep: BlockReport) -> None:
    """A block on the meta device: what the attribute reader reads, marked unverified (nothing can run)."""
    got, notes = recognise(block, parts, None)
    if isinstance(got, Reject):
        rep.refuse(got.code, got.message)
        return
    _fill_from_spec(rep, got.spec, block, got.bindings, got.derived)
    rep.status, rep.method, rep.reason = BlockStatus.UNVERIFIED, got.method, ""
    rep.notes += got.evidence.notes + notes


def rewrite(name: str, block: nn.Module, parts: BlockParts, rep: BlockReport, use_fx: bool, bind_it: bool,
            cache=None, trust_fallback: bool = False) -> None:
    """Recognise, verify and bind (``bind_it``; else report it supported) the whole block; ``rep`` gets the result
    or the refusal (its code and reason)."""
    if any(p.device.type == "meta" for p in block.parameters()):
        report_meta(block, parts, rep)
        return
    try:
        epilogue, verified = checked(block, parts, rep, use_fx, cache, trust_fallback)
    except Refused as e:
        rep.refuse(e.code, e.reason)
        return
    except StageError as e:  # a stage raised (the block's own forward on the check input, the op, a reader, ...)
        rep.refuse(RejectCode.CHECK_ERROR, f"{e.describe()}")
        return
    except Exception as e:
        rep.refuse(RejectCode.CHECK_ERROR, f"check failed: {describe_exception(e, 160)}")
        return
    rep.reason = ""
    rep.epilogue = list(epilogue)
    rep.max_rel_err = verified.max_rel_err
    m = verified.match
    derived = m.derived
    if bind_it:
        derived = _bind.bind(block, name, verified).derived  # with the router buffer, where the op reads one
        rep.status = BlockStatus.REWRITTEN
    else:
        rep.status = BlockStatus.SUPPORTED
    _fill_from_spec(rep, m.spec, block, m.bindings, derived)
