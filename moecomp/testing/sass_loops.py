"""Offline (no GPU) SASS of a kernel's PTX for sm_90a and the instruction count of its loops: what the 4-bit decode
kernels' "instructions a code" figures (docs/QUANT4.md) are measured with. Run without TRITON_INTERPRET (the
interpreter's jit functions do not compile).

    sass(ptx)         -> (SASS text, "ptxas name", ptxas -v notes), or None where no bundled ptxas reads the PTX
                         (``gluon_sm90.sass``)
    loops(sass_text)  -> [(first address, branch address, instruction count)] of each backward branch's body, in
                         address order of the branch (the innermost loops first: a body that holds no other)
    inner_loops(...)  -> the counts of the loops whose bodies hold no other loop
"""

from __future__ import annotations

import re

from .gluon_sm90 import sass  # noqa: F401  (re-exported: the tests read it here)

_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"BRA\s+0x([0-9a-f]+)")


def loops(text: str) -> list[tuple[int, int, int]]:
    """(start, branch, count) of every backward branch (a loop's latch) in ``text``: the instructions from the
    branch target to the branch, both included."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_INS.match, text.splitlines()) if m]
    out = []
    for addr, op in ins:
        m = _BRA.search(op)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            out.append((start, addr, sum(1 for a, _ in ins if start <= a <= addr)))
    return out


def inner_loops(text: str) -> list[int]:
    """Instruction counts of the loops that hold no other loop (a kernel's K loop: the down-combine's inside its
    loop over the k slots)."""
    ls = loops(text)
    return [n for s, e, n in ls if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2, _ in ls)]
