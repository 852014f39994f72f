"""Why a block was left alone: a code for control flow, a message for people.

Control flow tests ``Reject.code`` (or an exception's ``code``), never the text: messages can be reworded freely.
The text users see (``Report``, ``backend.last_results``) is the ``message``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
