"""Tune the grouped-GEMM configs on this GPU: a thin wrapper around ``python -m moecomp tune`` (``moecomp/cli/tune.py``).

    python3 benchmarks/tune_moe.py [--presets a,b] [--tokens 1,16,...] [--out DIR] [--rep MS] [--copy-to DIR]

The old flags keep their meaning (``--out DIR`` writes ``DIR/<gpu>.json``; with no ``--out``, ``$OUT`` when set, else
``moecomp/kernels/configs/``), and every option of ``python -m moecomp tune --help`` is accepted. One change: runs
resume, so entries already in the file are skipped; ``--restart`` measures them again.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moecomp.cli import tune  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    has_out = any(a == "--out" or a.startswith("--out=") for a in argv)
    if not has_out and os.environ.get("OUT"):  # the old default: $OUT when set
        argv = ["--out", os.environ["OUT"]] + argv
    return tune.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
