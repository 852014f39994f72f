"""Timing: the host / ``do_bench`` timer, the copy and matmul ceilings, and one path's timing in a cell (plain
launches, then a CUDA-graph replay where it can be captured)."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import traceback

import torch

from . import common
from .checks import check_output, rel_err


class Timer:
    def __init__(self, device: torch.device, quick: bool):
        self.cuda = device.type == "cuda"
        self.quick = quick
        if self.cuda:
            import triton.testing

            self._do_bench = triton.testing.do_bench

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once_ms(self, call) -> float:
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            call()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t = time.perf_counter()
        call()
        return (time.perf_counter() - t) * 1e3

    def bench(self, call, est_ms: float) -> float:
        """Median ms. do_bench's warmup / rep are in ms; slow paths get a few calls only."""
        est_ms = max(est_ms, 1e-3)
        if not self.cuda:
            n = 3 if self.quick else max(3, min(15, int(200 / est_ms)))
            call()
            ts = []
            for _ in range(n):
                t = time.perf_counter()
                call()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        warmup, rep = (5.0, 30.0) if self.quick else (25.0, 100.0)
        if est_ms > 5:  # do_bench already runs 5 estimate calls; add 1 warm-up and ~4-8 timed calls
            warmup = est_ms
            rep = min(max(rep, (4 if self.quick else 8) * est_ms), 600.0 if self.quick else 1500.0)
        return float(self._do_bench(call, warmup=warmup, rep=rep, return_mode="median"))


def measure_ceilings(device: torch.device, timer: Timer) -> dict:
    if device.type == "cuda":
        n = 1 << 29  # 1 GiB of bf16 each way: 2 GiB moved per copy
        src = torch.randn(n, device=device, dtype=common.DTYPE)
        dst = torch.empty_like(src)
        t = timer.bench(lambda: dst.copy_(src), 1.0)
        copy = 2 * n * src.element_size() / (t * 1e-3)
        del src, dst
        m = 8192
    else:
        n = 1 << 22
        src = torch.randn(n, dtype=common.DTYPE)
        dst = torch.empty_like(src)
        t = timer.bench(lambda: dst.copy_(src), 1.0)
        copy = 2 * n * src.element_size() / (t * 1e-3)
        del src, dst
        m = 256
    a = torch.randn(m, m, device=device, dtype=common.DTYPE)
    b = torch.randn(m, m, device=device, dtype=common.DTYPE)
    c = torch.empty(m, m, device=device, dtype=common.DTYPE)
    t2 = timer.bench(lambda: torch.matmul(a, b, out=c), 1.0)
    mm = 2 * m**3 / (t2 * 1e-3)
    del a, b, c
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(copy_bytes_per_s=copy, copy_ms=t, copy_bytes=2 * n * torch.finfo(common.DTYPE).bits // 8,
                matmul_flops_per_s=mm, matmul_ms=t2, matmul_size=m, matmul_dtype=common.dtype_name(common.DTYPE))


@dataclasses.dataclass
class Path:
    name: str
    fn: object  # x [1, T, H] -> [1, T, H]
    prepare: object = None  # called before this path's calls (selects HF's experts implementation)
    skip: str | None = None  # fn is None: why the path does not run here (recorded as "skipped", not an error)
    error: str | None = None  # fn is None: why it could not be set up (recorded as an error)
    check: str = "hf"  # what its output is checked against: "hf" (the HF block), or a key of the cell's fp8 checks
    note: str | None = None  # what the path is, where its name does not say it (kept in the JSON)


def run_path(path: Path, x: torch.Tensor, ref: torch.Tensor, timer: Timer, args, device, tol: float,
             amb: torch.Tensor | None = None, check=None) -> dict:
    """Check, then time ``path`` on ``x``: the first call (compile / autotune included), its verdict (``check(out)``
    when given, else against ``ref`` the HF block's output), plain launches, then a CUDA-graph replay where it can be
    captured; the better of the two is ``best_ms``."""
    rec: dict = dict(plain_ms=None, graph_ms=None, best_ms=None, best_mode=None)
    T = x.shape[1]
    try:
        if path.prepare:
            path.prepare()
        t0 = time.perf_counter()
        out = path.fn(x)
        timer.sync()
        rec["first_call_s"] = round(time.perf_counter() - t0, 4)
        rec.update(check(out) if check is not None else check_output(out, ref, amb, tol))
        est = timer.once_ms(lambda: path.fn(x))
        rec["plain_ms"] = timer.bench(lambda: path.fn(x), est)
    except torch.cuda.OutOfMemoryError as e:
        rec["error"] = common.root_msg(e)
        out = None
        gc.collect()
        torch.cuda.empty_cache()
    except Exception as e:
        rec["error"] = common.root_msg(e)
        out = None
        if not common.cuda_healthy(device):
            raise common.FatalCudaError(f"{path.name}: {rec['error']}") from e
        if args.verbose:
            traceback.print_exc()
    # ---- CUDA graph replay
    if device.type != "cuda":
        rec["graph_note"] = "n/a (cpu)"
    elif args.no_graph:
        rec["graph_note"] = "n/a (--no-graph)"
    elif T > args.graph_max_t:
        rec["graph_note"] = f"n/a (T > {args.graph_max_t})"
    elif out is None:
        rec["graph_note"] = "n/a (plain call failed)"
    else:
        rec.update(time_graph(path, x, out, timer, est, device))
    cands = [(v, m) for v, m in ((rec["plain_ms"], "plain"), (rec["graph_ms"], "graph")) if v is not None]
    if cands:
        rec["best_ms"], rec["best_mode"] = min(cands)
    return rec


def time_graph(path: Path, x, out_plain, timer: Timer, est: float, device) -> dict:
    g = xs = gout = None
    main_stream = torch.cuda.current_stream()
    try:
        xs = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream (allocator / autotune / compile)
            for _ in range(2):
                path.fn(xs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = path.fn(xs)
        torch.cuda.synchronize()
    except Exception as e:
        reason = common.root_msg(e, 120)
        # torch.cuda.graph's __exit__ skips restoring the stream when capture_end raises: restore it here
        torch.cuda.set_stream(main_stream)
        del g, gout
        gc.collect()
        if not common.cuda_healthy(device):
            raise common.FatalCudaError(f"{path.name} graph capture: {reason}") from e
        return dict(graph_ms=None, graph_note=f"n/a (capture failed: {reason})")
    try:
        g.replay()
        torch.cuda.synchronize()
        same = rel_err(gout, out_plain)
        # A graph that baked in host-side decisions (e.g. which experts run) would pass on the capture input
        # and fail here: replay on a fresh input and compare with a plain call on it.
        x_new = torch.randn_like(x)
        xs.copy_(x_new)
        g.replay()
        want = path.fn(x_new)
        torch.cuda.synchronize()
        fresh = rel_err(gout, want)
        xs.copy_(x)
        if not (fresh <= common.GRAPH_CONSISTENCY_TOL and same <= common.GRAPH_CONSISTENCY_TOL):
            return dict(graph_ms=None, graph_note=f"n/a (replay disagrees with plain call: rel err {same:.2g} on the "
                                                  f"capture input, {fresh:.2g} on a fresh input)",
                        graph_rel_err=fresh)
        ms = timer.bench(g.replay, est)
        return dict(graph_ms=ms, graph_note="ok", graph_rel_err=max(same, fresh))
    except Exception as e:
        reason = common.root_msg(e, 120)
        if not common.cuda_healthy(device):
            raise common.FatalCudaError(f"{path.name} graph replay: {reason}") from e
        return dict(graph_ms=None, graph_note=f"n/a (replay failed: {reason})")
    finally:
        del g, gout, xs
        gc.collect()
