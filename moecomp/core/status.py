"""What ``optimize`` / ``scan`` did with a block: :class:`BlockStatus` (``BlockReport.status``).

A ``str`` enum: each member equals its text (``rep.status == "rewritten"``), hashes like it (a dict keyed by the
text finds it), formats as it (``str()``, f-strings, ``%s``) and serialises as it (``json.dumps``), so reports and
their JSON read exactly as they did when the status was a plain string.
"""

from __future__ import annotations

import enum


class BlockStatus(str, enum.Enum):
    REWRITTEN = "rewritten"  # the block's forward is one moe_forward call (whole block, pair, or sharded)
    SKIPPED = "skipped"  # left alone: ``BlockReport.reason`` says why, ``codes`` the RejectCodes
    SUPPORTED = "supported"  # scan: would be rewritten (recognised and verified, not bound)
    UNVERIFIED = "unverified"  # meta tensors: what the attribute reader reads, nothing run
    ALREADY = "already"  # bound by an earlier optimize
    EXPERTS_ONLY = "experts only"  # only the experts module runs moe_experts; routing stays the block's
    EXPERTS_ONLY_SUPPORTED = "experts only supported"  # scan: would be rewritten experts only

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
