"""Why a candidate block is refused inside the FX pass: an exception that carries a ``moecomp.core.reject.RejectCode``.

Every stage raises :class:`Reject` (``NOT_RECOGNISED`` unless it says otherwise), a ``moecomp.core.reject.Refused`` like
every other stage's refusal; ``detect_moe`` records it as a ``moecomp.core.reject.Reject`` in ``DetectResult.rejected``.
Control flow reads ``code``, people read ``message``.
"""

from __future__ import annotations

from ...core.reject import Refused, RejectCode
from ...core.reject import Reject as RejectRecord


class Reject(Refused):
    """A candidate is not an MoE the spec can express, or could not be proven equal to one."""

    default_code = RejectCode.NOT_RECOGNISED

    @property
    def message(self) -> str:
        return self.reason

    def record(self) -> RejectRecord:
        return self.reject


class NotACandidate(Reject):
    """The top-k looked like a router's, but nothing expert-like depends on it: left alone without a report when it
    was a candidate for per-expert modules only."""


def unsupported_routing(message: str) -> Reject:
    """A routing no MoESpec expresses (hash routing, an unknown scoring, a masked top-k of the wrong kind)."""
    return Reject(message, RejectCode.UNSUPPORTED_ROUTING)
