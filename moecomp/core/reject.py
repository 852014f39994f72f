"""Why a block was left alone: a code for control flow, a message for people.

Control flow tests ``Reject.code`` (or an exception's ``code``), never the text: messages can be reworded freely.
The text users see (``Report``, ``backend.last_results``) is the ``message``.

A stage that *raised* (rather than refused) is a :class:`StageError`: the stage named, the exception kept. Its text
(``describe``: stage, exception type, first line of the message) reaches the report, ahead of what a later reader
then says (``Reject.cause``). Running out of memory is never turned into a refusal or a skipped probe
(:func:`raise_if_oom` in every ``except Exception`` of recognition and verify): whoever can try again smaller (the
numeric check, ``optimize``) sees it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class RejectCode(enum.Enum):
    NOT_A_BLOCK = "not_a_block"  # structure: a candidate without a router / experts moecomp can name
    UNSUPPORTED_STRUCTURE = "unsupported_structure"  # router + experts share a module with attention, odd layout
    UNSUPPORTED_ROUTING = "unsupported_routing"  # hash routing, a routing no MoESpec expresses
    CAPTURE_FAILED = "capture_failed"  # Dynamo could not capture the block (the attribute fallback may try)
    NOT_RECOGNISED = "not_recognised"  # captured, but the FX pass found no MoE it can prove
    SPEC_INVALID = "spec_invalid"  # the derived spec, or the op given the block's tensors, is invalid
    VERIFICATION_FAILED = "verification_failed"  # op and block differ on the probe input (or the activation check)
    CHECK_ERROR = "check_error"  # the block's forward (or the op) raised on the probe input
    BIND_FAILED = "bind_failed"  # the forward's contract cannot be bound (outputs, arguments)
    GRAD_MODE = "grad_mode"  # grad mode on and weights / input require grad: the op has no backward
    META_TENSORS = "meta_tensors"  # meta device: nothing can run, nothing verified or bound


@dataclass(frozen=True)
class Reject:
    code: RejectCode
    message: str
    cause: str = ""  # a stage raised on the way here (``StageError.describe``): shown first in the report

    def __str__(self) -> str:
        return self.message


class Refused(Exception):
    """A stage refuses a block: the exception form of :class:`Reject` (``code`` for control flow, ``reason`` the
    message). The stages' own errors (``FallbackError``, ``BindError``, ``DetectError``, the experts interface's
    ``Unsupported``) are subclasses, so a caller catches one type and reads one code."""

    default_code = RejectCode.UNSUPPORTED_STRUCTURE

    def __init__(self, reason: str, code: RejectCode | None = None):
        super().__init__(reason)
        self.reason = reason
        self.code = code if code is not None else self.default_code

    @property
    def reject(self) -> Reject:
        return Reject(self.code, self.reason)


def is_oom(e: BaseException | None) -> bool:
    """Is ``e`` running out of memory on a device or the host: an ``OutOfMemoryError`` itself, wrapped in a
    :class:`StageError`, or the cause Dynamo (or another wrapper) chained it to?"""
    return oom_of(e) is not None


def oom_of(e: BaseException | None) -> BaseException | None:
    """The ``OutOfMemoryError`` (or the StageError naming it) that ``e`` is or wraps; None if none."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, torch.OutOfMemoryError) or (isinstance(e, StageError) and isinstance(
                e.error, torch.OutOfMemoryError)):
            return e
        e = e.error if isinstance(e, StageError) else e.__cause__
        seen += 1
    return None


def raise_if_oom(e: BaseException) -> None:
    """Re-raise ``e`` when it is running out of memory (call first in an ``except Exception`` that would otherwise
    turn the failure into a refusal or a skipped probe)."""
    if is_oom(e):
        raise e


def describe_exception(e: BaseException, limit: int = 240) -> str:
    """"Type: first line of the message" (cut at ``limit`` characters)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first[:limit]}" if first else type(e).__name__


class StageError(Exception):
    """``stage`` raised ``error`` (not a refusal: a failure of the stage itself, an out-of-memory error included).
    ``describe()``: "<stage>: <Type>: <message>" for the report."""

    def __init__(self, stage: str, error: BaseException):
        self.stage, self.error = stage, error
        super().__init__(self.describe())

    def describe(self) -> str:
        inner = self.error.describe() if isinstance(self.error, StageError) else describe_exception(self.error)
        return f"{self.stage}: {inner}"

    @property
    def oom(self) -> bool:
        return is_oom(self)


def in_stage(stage: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception that is neither a refusal nor already a ``StageError`` comes out as
    ``StageError(stage, it)``."""
    try:
        return fn(*args, **kwargs)
    except (Refused, StageError):
        raise
    except Exception as e:
        raise StageError(stage, e) from e
