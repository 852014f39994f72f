"""The progress line of the engine's slow first calls: compiling the decoder layers, capturing the decode step.

    moecomp: compiling decode step, batch 32: layer 7/24
    moecomp: capturing decode step, batch 32

One line on stderr, redrawn with ``\\r`` and cleared when done, shown when stderr is a terminal; ``MOECOMP_PROGRESS=1``
prints it (one line per event) elsewhere too, ``MOECOMP_PROGRESS=0`` never. Layers report as each one's compiled
wrapper first runs for a (phase, batch bucket) (``Engine._call``: a forward pre-hook on the wrapper, outside the
compiled code, removed after that call).
"""

from __future__ import annotations

import os
import sys


class Progress:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.last = ""

    def enabled(self) -> bool:
        v = os.environ.get("MOECOMP_PROGRESS")
        if v is not None:
            return v not in ("0", "")
        try:
            return self.stream.isatty()
        except Exception:  # a closed or odd stream
            return False

    def _tty(self) -> bool:
        try:
            return self.stream.isatty()
        except Exception:
            return False

    def say(self, text: str) -> None:
        if not self.enabled():
            return
        line = f"moecomp: {text}"
        if self._tty():
            self.stream.write("\r" + line + " " * max(0, len(self.last) - len(line)))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.last = line

    def clear(self) -> None:
        if self.last and self._tty():
            self.stream.write("\r" + " " * len(self.last) + "\r")
            self.stream.flush()
        self.last = ""

    def layer_hooks(self, wrapped: list, what: str) -> list:
        """Forward pre-hooks on each compiled layer saying "<what>: layer i/n" as it first runs; the handles."""
        if not self.enabled():
            return []
        n = len(wrapped)
        return [c.register_forward_pre_hook(lambda mod, args, i=i: self.say(f"{what}: layer {i + 1}/{n}"))
                for i, c in enumerate(wrapped)]
