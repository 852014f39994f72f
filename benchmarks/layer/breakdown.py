"""``--breakdown``: where one call of a path spends its time, from ``torch.profiler`` (per kernel on the GPU, per op's
self time on the CPU), and the gaps between the wall time and the kernels."""

from __future__ import annotations

import time

import torch

import report  # benchmarks/report.py (the breakdown's log table)

from . import common
from .env import save

BREAKDOWN_PATHS = ("moecomp", "vllm")  # --breakdown profiles these paths (vllm only where it was timed)
FP8_BREAKDOWN_PATHS = ("moecomp_fp8", "moecomp_fp8_w8a8", "moecomp_fp8_w8a16", "moecomp", "vllm_fp8")  # --dtype fp8
BREAKDOWN_REPS = 5  # calls per profiled session (after one warm-up call)
BREAKDOWN_NAME_CHARS = 200  # kernel names kept in the JSON (the log table shortens them further)


def _device_rows(prof, cuda: bool) -> list[tuple[str, str, int, float]]:
    """[(name, kind, count, us)] of a profile, summed over the session. CUDA: every device activity (kernels, and
    memcpy / memset as their own kinds). CPU (no device): each op's *self* CPU time (children excluded, so nested
    aten ops are not counted twice)."""
    by: dict = {}
    if cuda:
        try:
            evs = [(e.name(), e.duration_ns() / 1e3) for e in prof.profiler.kineto_results.events()
                   if "cuda" in str(e.device_type()).lower()]
        except Exception:
            evs = [(e.name, getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))
                   for e in prof.events() if "cuda" in str(getattr(e, "device_type", "")).lower()]
        for name, us in evs:
            kind = "memcpy" if "memcpy" in name.lower() else "memset" if "memset" in name.lower() else "kernel"
            b = by.setdefault((name[:BREAKDOWN_NAME_CHARS], kind), [0, 0.0])
            b[0] += 1
            b[1] += us
    else:
        for a in prof.key_averages():
            if "cpu" not in str(getattr(a, "device_type", "cpu")).lower() or a.self_cpu_time_total <= 0:
                continue
            b = by.setdefault((a.key[:BREAKDOWN_NAME_CHARS], "op"), [0, 0.0])
            b[0] += a.count
            b[1] += a.self_cpu_time_total
    return [(n, k, c, us) for (n, k), (c, us) in by.items()]


def profile_breakdown(fn, x: torch.Tensor, device: torch.device, reps: int = BREAKDOWN_REPS) -> dict:
    """Where one call of ``fn(x)`` spends its time: ``reps`` calls back to back under ``torch.profiler`` (after one
    warm-up call and ``reps`` unprofiled calls), per call: each kernel's device time (CUDA; on CPU each op's self
    time), the op's wall time (host timer around the calls, synchronised at the end) and the gaps = wall - the sum of
    the kernel times (launch overhead, host work, idle device)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        fn(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x)
        sync()
        unprof = (time.perf_counter() - t0) * 1e6 / reps
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            sync()
            wall = (time.perf_counter() - t0) * 1e6 / reps
    rows = sorted(_device_rows(prof, cuda), key=lambda r: -r[3])
    busy = sum(r[3] for r in rows) / reps
    out = dict(activities="cuda" if cuda else "cpu (no device: each op's self CPU time)", reps=reps,
               per="one call of the op (totals over the profiled calls / reps)",
               wall_us=wall, wall_us_unprofiled=unprof, kernel_us=busy, gap_us=wall - busy,
               gap_share=(wall - busy) / wall if wall > 0 else None,
               launches=sum(r[2] for r in rows) / reps,
               rows=[dict(name=n, kind=k, calls=c / reps, total_us=us / reps,
                          share=us / reps / wall if wall > 0 else None) for n, k, c, us in rows])
    if cuda:  # the same kernel times against the unprofiled wall (the profiler slows the host side)
        out["gap_us_unprofiled"] = unprof - busy
        out["kernels"] = sum(r[2] for r in rows if r[1] == "kernel") / reps
    return out


def run_breakdowns(pending: list, device: torch.device, result: dict, out_json: str | None,
                   profile=None) -> str | None:
    """Profile the queued cells (after every timing of the run, so that no timing follows a profiler session) and
    log a table per cell and path; returns a fatal CUDA error, if one happened. ``pending``: (family, cell, x,
    [(path name, fn, prepare or None)]); ``profile``: the profiling function (default ``profile_breakdown``)."""
    profile = profile or profile_breakdown
    common.log(f"[bench] breakdowns (torch.profiler, {BREAKDOWN_REPS} calls each; after every timing of the run)")
    for fname, cell, x, todo in pending:
        bd = cell.setdefault("breakdown", {})
        for pname, fn, prepare in todo:
            try:
                if prepare is not None:  # (the FP8 modes: MOECOMP_FP8_MODE as when the path was timed)
                    prepare()
                rec = profile(fn, x, device)
            except Exception as e:
                rec = dict(error=common.root_msg(e, 300))
                if not common.cuda_healthy(device):
                    bd[pname] = rec
                    result["fatal"] = f"breakdown {fname}:{cell['T']} {pname}: {rec['error']}"
                    save(result, out_json)
                    return result["fatal"]
            pr = cell["paths"].get(pname, {})
            rec.update(timed_best_ms=pr.get("best_ms"), timed_best_mode=pr.get("best_mode"),
                       timed_plain_ms=pr.get("plain_ms"))
            bd[pname] = rec
            common.log(report.render_breakdown(fname, cell["T"], pname, rec))
        for name, rec in bd.items():
            if "skipped" in rec:
                common.log(f"[breakdown {fname} T={cell['T']} {name}] skipped: {rec['skipped']}")
        save(result, out_json)
    return None


def parse_breakdown(text: str, fams: list[str], tokens: list[int]) -> tuple[list[tuple[str, int]], list[str]]:
    """``family:T,...`` -> ([(family, T)] in the run, [the named cells the run does not have])."""
    from .families import FAMILIES, FAMILY_ALIASES

    cells, missing = [], []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, t = item.partition(":")
        if not sep or not t.strip().isdigit():
            raise SystemExit(f"--breakdown {item!r}: expected family:T (e.g. qwen3:1)")
        (fam,) = common.resolve(name, FAMILIES, FAMILY_ALIASES, "family")
        c = (fam, int(t))
        if fam in fams and c[1] in tokens:
            if c not in cells:
                cells.append(c)
        else:
            missing.append(f"{fam}:{c[1]}")
    return cells, missing
