"""File and progress helpers of ``python -m moecomp tune`` (:mod:`moecomp.cli.tune`): the JSON table and its sidecar
(atomic, merged writes), the source commit, and the progress line. Standard library only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch


# ------------------------------------------------------------------------------------------------------- files
def read_json(path: str) -> dict:
    """The table at ``path`` ({} when there is none); a file that does not parse is an error, never overwritten."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}: not valid JSON ({e}); move it away or fix it") from None
    if not isinstance(d, dict):
        raise SystemExit(f"{path}: not a JSON object")
    return d


def write_json_atomic(path: str, obj: dict) -> None:
    """Write ``obj`` to a temporary file next to ``path``, then ``os.replace`` it: readers (and an interrupted
    run) see the old file or the new one, never half of one."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def meta_path(path: str) -> str:
    root = path[:-len(".json")] if path.endswith(".json") else path
    return root + ".meta.json"


def save_entry(path: str, key: str, bucket: int, config: dict, meta: dict) -> None:
    """Merge one entry into the file as it is on disk now (other shapes and buckets stay), then its record into
    the sidecar."""
    for p, value in ((path, config), (meta_path(path), meta)):
        table = read_json(p)
        shape = table.get(key)
        table[key] = dict(shape) if isinstance(shape, dict) else {}
        table[key][str(bucket)] = value
        write_json_atomic(p, table)


def is_done(table: dict, key: str, bucket: int) -> bool:
    e = table.get(key, {}).get(str(bucket)) if isinstance(table.get(key), dict) else None
    return isinstance(e, dict) and isinstance(e.get("BLOCK_M"), int) and isinstance(e.get("g1"), dict) \
        and isinstance(e.get("g2"), dict)


def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the source tree: MOECOMP_COMMIT when set (copies without .git), else git."""
    env = os.environ.get("MOECOMP_COMMIT")
    if env:
        return env, None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        if sha is None:
            return None, None
        dirty = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=10).returncode != 0
        return sha, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


# ---------------------------------------------------------------------------------------------------- progress
def fmt_seconds(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One status line on stderr redrawn with ``\\r`` (a terminal), or one line per finished bucket (not one)."""

    def __init__(self, total: int, stream=None, tty: bool | None = None, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.done, self.verbose = total, 0, verbose
        self.timed_s, self.timed_n = 0.0, 0
        self.entry, self.entry_t0, self.last = "", time.time(), ""

    def _eta(self) -> str:
        if not self.timed_n:
            return "ETA ?"
        left = self.timed_s / self.timed_n * (self.total - self.done) - (time.time() - self.entry_t0)
        return f"ETA {fmt_seconds(max(0.0, left))}"

    def _draw(self, text: str) -> None:
        width = shutil.get_terminal_size((120, 20)).columns - 1
        line = text[:width]
        self.stream.write("\r" + line + " " * max(0, len(self.last) - len(line)))
        self.stream.flush()
        self.last = line

    def _clear(self) -> None:
        if self.tty and self.last:
            self.stream.write("\r" + " " * len(self.last) + "\r")
            self.last = ""

    def start(self, entry: str) -> None:
        self.entry, self.entry_t0 = entry, time.time()
        self.status("")

    def status(self, detail: str) -> None:
        if self.tty:
            self._draw(f"[tune] {self.done}/{self.total} shapes x buckets  {self._eta()}  {self.entry} {detail}")

    def note(self, msg: str, always: bool = False) -> None:
        """A line of its own: rejections and failures with --verbose, or whatever ``always`` says must show."""
        if not (always or self.verbose):
            return
        self._clear()
        self.stream.write(f"[tune] {msg}\n")
        self.stream.flush()

    def finished(self, msg: str, seconds: float | None) -> None:
        self.done += 1
        if seconds is not None:
            self.timed_s, self.timed_n = self.timed_s + seconds, self.timed_n + 1
        self._clear()
        self.stream.write(f"[tune] {self.done}/{self.total} {msg}\n")
        self.stream.flush()

    def close(self) -> None:
        self._clear()


def bench(fn, rep_ms: float, device: torch.device) -> float:
    """Median milliseconds of ``fn()``. CUDA: ``do_bench`` (L2 flushed between runs). CPU (the interpreter): the
    wall clock over three runs, meaningless as a kernel timing but enough to rank in tests."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def bench_graph(fn, rep_ms: float, device: torch.device) -> float:
    """``bench`` of ``fn`` captured in a CUDA graph (the way the op runs at small T): a few-microsecond kernel is
    timed, not Python's launch cost. CPU: ``bench`` of ``fn`` itself."""
    if device.type != "cuda":
        return bench(fn, rep_ms, device)
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        fn()  # compiled and warm before the capture
    main.wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay, rep_ms, device)
