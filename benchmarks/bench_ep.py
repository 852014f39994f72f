#!/usr/bin/env python3
"""Per-phase times of moecomp's parallel MoE path (``moecomp/parallel``; docs/PARALLEL.md), and what it adds to the
one-GPU op.

For each mode (EP all-reduce, EP all-to-all uneven and fixed, TP) and token count T, every rank times, on its shard:

    route       the routing over the E global experts (the op's own routing kernels)
    dispatch    all-to-all only: pairs to their experts' owners (counts first, or fixed buffers)
    experts     this rank's experts on moe_experts (the same grouped-GEMM kernels)
    combine     all-to-all only: the rows back, summed per token
    shared      the shared experts (this rank's slice in the partial modes)
    all_reduce  the partial modes' one all-reduce of [T, H]
    total       parallel.forward as a whole;   op: the one-GPU op on the whole block (the same rank, for reference)
    routed      all-to-all only: the routed part as one (dispatch + experts + combine; with ``chunks`` > 1 they are
                pipelined and not timed apart)

Phases are timed apart (each on inputs made by the previous), so they need not add up to ``total`` exactly. Times are
medians over ``--iters`` calls, host-timed around a device sync (CUDA: plain launches, no graphs).

Chunked overlap (``--chunks 1,2,4``): the uneven all-to-all mode runs once per chunk count (``ParallelSpec.chunks``;
the other modes at 1).

The all-to-all floor, from the same run's collective: ``all_to_all_single`` timed at ``--a2a-sizes`` bytes a rank
(equal splits; small: latency, large: bandwidth), fitted as latency + bytes / bandwidth (least squares on relative
error). Each all-to-all row then has

    a2a_bytes   dispatch + combine bytes of the busiest rank (each exchange: the larger of what it sends and
                receives; rows, the (id, weight) pairs and the counts; self included, as in the fit)
    floor       collectives * latency + a2a_bytes / bandwidth (uneven: counts, rows, meta, back = 4; fixed: 3;
                chunks C: 1 + 3 C)
    comm        measured: dispatch + combine; chunked rows: routed - the unchunked row's experts (what the overlap
                leaves exposed)
    vs_floor    comm / floor

    python benchmarks/bench_ep.py --preset qwen3 --tokens 1,8,128                  # one process: world size 1
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ep.py --preset deepseek_v3
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ep.py --modes ep_a2a --tokens 512,4096 --chunks 1,2,4
    python benchmarks/bench_ep.py --dry                                            # tiny, CPU gloo, no JSON

Output: rank 0 prints a table and, unless ``--dry``, writes ``benchmarks/results/<device>-<date>-ep-w<W>.json``
(``--out`` to choose): the spec, world size, device, GPU name, versions, date, commit, the a2a fit and the rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from moecomp import parallel as par  # noqa: E402
from moecomp.core.args import MOE_ARGS  # noqa: E402
from layer.env import environment, git_commit  # noqa: E402  (benchmarks/layer: versions, GPU, commit)
from moecomp.parallel import capacity, dispatch, ep, local, route  # noqa: E402
from moecomp.parallel.comm import comm_for  # noqa: E402
from moecomp.core.spec import MoESpec, SharedExpertSpec  # noqa: E402
from moecomp.core.spec_parallel import ParallelSpec  # noqa: E402
from moecomp.testing import LAYER_PRESETS, random_moe_args  # noqa: E402

PRESETS = {"qwen3": LAYER_PRESETS["qwen3_30b_a3b"], "deepseek_v3": LAYER_PRESETS["deepseek_v3"],
           "mixtral": LAYER_PRESETS["mixtral_8x7b"],
           "tiny": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, shared=SharedExpertSpec(16))}
MODES = {"ep": dict(mode="ep"), "ep_a2a": dict(mode="ep", dispatch="all_to_all"),
         "ep_a2a_fixed": dict(mode="ep", dispatch="all_to_all", capacity=0), "tp": dict(mode="tp")}


def _timer(device: torch.device, iters: int):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_us(fn) -> float:
        fn()  # warm (Triton compiles)
        out = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(out)

    return time_us


def a2a_fit(comm, device, dtype, sizes, time_us) -> dict:
    """all_to_all_single timed at ``sizes`` bytes a rank (equal splits), fitted as latency + bytes / bandwidth by
    least squares on the relative error (fallbacks where the fit is not positive: the smallest message's time as
    the latency, the largest message's bytes / time as the bandwidth)."""
    es, W = torch.empty((), dtype=dtype).element_size(), comm.world_size
    pts = []
    for b in sizes:
        n = max(W, b // es // W * W)
        send = torch.ones(n, dtype=dtype, device=device)
        pts.append((n * es, time_us(lambda: comm.all_to_all(send))))
    sw = sws = swss = swt = swst = 0.0
    for b, t in pts:  # weights 1 / t^2: every size counts alike
        w = 1.0 / t / t
        sw, sws, swss, swt, swst = sw + w, sws + w * b, swss + w * b * b, swt + w * t, swst + w * b * t
    det = sw * swss - sws * sws
    lat, per_byte = ((swss * swt - sws * swst) / det, (sw * swst - sws * swt) / det) if det > 0 else (0.0, 0.0)
    fit = "least squares"
    if lat <= 0 or per_byte <= 0:
        fit = "fallback"
        lat = lat if lat > 0 else min(t for _, t in pts)
        per_byte = per_byte if per_byte > 0 else max(pts)[1] / max(pts)[0]
    return dict(latency_us=lat, bandwidth_gbps=1e-3 / per_byte, fit=fit, points=pts)


def a2a_bytes(spec: MoESpec, comm, plan, T: int, k: int, width: int, es: int) -> int:
    """Dispatch + combine bytes of the busiest rank (module docstring): each exchange, the larger of what this rank
    sends and receives."""
    p, W = spec.parallel, comm.world_size
    if p.capacity is not None:
        sent = recv = W * capacity.capacity_of(p, T, k)
    else:
        sent, recv = sum(plan.send_splits), sum(plan.recv_splits)
    counts = 0 if p.capacity is not None else W * p.chunks * 8
    b = max(sent, recv) * (width * es + 8) + counts + max(sent, recv) * width * es
    t = torch.tensor([float(b)], device=comm_device(comm))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    return int(t.item())


def comm_device(comm) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(comm.group) == "nccl" else \
        torch.device("cpu")


def _exchange_phases(spec: MoESpec, x2, r, t: dict, comm, time_us, res: dict) -> None:
    """dispatch / experts / combine timed apart (unchunked), routed as one, and the bytes of the floor."""
    p = spec.parallel
    T, k = r.ids.shape
    res["routed"] = time_us(lambda: ep.routed(x2, r, t, spec, comm))
    fixed = p.capacity is not None
    via = capacity if fixed else dispatch
    plan, rows, lid, lw = via.send(comm, x2, r.ids, r.weights, p, spec.num_experts)
    res["a2a_bytes"] = a2a_bytes(spec, comm, plan, T, k, x2.shape[1], x2.element_size())
    res["collectives"] = 3 if fixed else (4 if p.chunks == 1 else 1 + 3 * p.chunks)
    if p.chunks > 1:
        return  # (pipelined: dispatch, experts and combine interleave)
    res["dispatch"] = time_us(lambda: via.send(comm, x2, r.ids, r.weights, p, spec.num_experts))
    ks = local.kernel_spec(spec, 1, fixed)
    y = local.run(rows, lid, lw, t, ks)
    res["experts"] = time_us(lambda: local.run(rows, lid, lw, t, ks))
    back = (lambda: capacity.back(comm, plan, y)) if fixed else (lambda: dispatch.back(comm, plan, y, T * k))
    res["combine"] = time_us(lambda: back().view(T, k, -1).sum(1))


def phases(spec: MoESpec, x, t: dict, comm, time_us) -> dict:
    """{phase: us} of one mode on this rank's shard ``t`` (module docstring)."""
    p = spec.parallel
    x2 = x.reshape(-1, x.shape[-1])
    r = route.route(x2, t, spec, x.shape)
    res = {"route": time_us(lambda: route.route(x2, t, spec, x.shape))}
    if p.dispatch == "all_to_all":
        _exchange_phases(spec, x2, r, t, comm, time_us, res)
    else:
        routed = ep.routed if p.mode == "ep" else None
        res["experts"] = time_us(lambda: routed(x2, r, t, spec, comm) if routed else
                                 par.tp.routed(x2, r, t, spec))
        out = x2.clone()
        res["all_reduce"] = time_us(lambda: comm.all_reduce_(out))
    if spec.shared is not None:
        res["shared"] = time_us(lambda: route.shared_part(x2, t, spec, r))
    res["total"] = time_us(lambda: par.forward(x, t, spec, comm))
    return res


def with_floor(row: dict, fit: dict, experts_unchunked: float | None) -> dict:
    """The row with its all-to-all floor, the communication measured and their ratio (module docstring)."""
    if "a2a_bytes" not in row:
        return row
    row["floor"] = row["collectives"] * fit["latency_us"] + row["a2a_bytes"] / (fit["bandwidth_gbps"] * 1e3)
    if row["chunks"] == 1:
        row["comm"] = row["dispatch"] + row["combine"]
    elif experts_unchunked is not None:
        row["comm"] = row["routed"] - experts_unchunked
    if "comm" in row:
        row["vs_floor"] = row["comm"] / row["floor"]
    return row


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3")
    ap.add_argument("--tokens", default="1,8,128")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--chunks", default="1,2,4", help="chunk counts of the uneven all-to-all (ParallelSpec.chunks)")
    ap.add_argument("--a2a-sizes", default="4096,65536,1048576,16777216,67108864",
                    help="bytes a rank of the all_to_all_single fit (--dry: 1024,16384,262144)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry", action="store_true", help="tiny shapes, 2 iterations, CPU gloo, no JSON")
    ap.add_argument("--out", help="the JSON path (default benchmarks/results/...)")
    return ap.parse_args(argv)


def _mode_specs(spec0: MoESpec, modes: str, chunks: list, W: int, rank: int):
    """(mode name, chunks, spec) of every row at one T."""
    for mode in modes.split(","):
        kw = dict(MODES[mode])
        if kw["mode"] == "tp":
            kw["intermediate_size"] = spec0.intermediate_size
        uneven = kw.get("dispatch") == "all_to_all" and kw.get("capacity") is None
        for c in chunks if uneven else [1]:
            yield mode, c, spec0.replace(parallel=ParallelSpec(world_size=W, rank=rank,
                                                               num_global_experts=spec0.num_experts, chunks=c, **kw))


def run(argv=None) -> list:
    a = _args(argv)
    cuda = torch.cuda.is_available() and not a.dry
    own_group = not dist.is_initialized()
    if own_group:
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            dist.init_process_group("gloo" if not cuda else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    W, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    spec0 = PRESETS["tiny" if a.dry else a.preset]
    dtype = torch.float32 if a.dry or a.dtype == "fp32" else torch.bfloat16
    time_us = _timer(device, 2 if a.dry else a.iters)
    chunks = [int(v) for v in a.chunks.split(",")]
    rows = []
    try:
        world = comm_for(ParallelSpec("ep", W, rank, W))
        sizes = "1024,16384,262144" if a.dry else a.a2a_sizes
        fit = a2a_fit(world, device, dtype, [int(v) for v in sizes.split(",")], time_us)
        for T in [int(v) for v in a.tokens.split(",")]:
            args = random_moe_args(spec0, T, dtype=dtype, device=device, seed=0)
            whole = dict(zip(MOE_ARGS, args[1:]))
            op_us = time_us(lambda: torch.ops.moecomp.moe_forward(*args, spec0.key))
            experts1 = None  # the unchunked uneven row's experts time at this T
            for mode, c, spec in _mode_specs(spec0, a.modes, chunks, W, rank):
                t = {**whole, **par.shard_tensors(whole, spec)}
                res = phases(spec, args[0], t, comm_for(spec.parallel), time_us)
                if mode == "ep_a2a" and c == 1:
                    experts1 = res["experts"]
                row = dict(T=T, mode=mode, chunks=c, op=op_us, added=res["total"] - op_us, **res)
                rows.append(with_floor(row, fit, experts1))
    finally:
        if own_group:
            dist.destroy_process_group()
    if rank == 0:
        _report(rows, a, W, device, spec0, fit)
    return rows


def _report(rows, a, W, device, spec0, fit) -> None:
    cols = ("route", "dispatch", "experts", "combine", "shared", "all_reduce", "routed", "total", "op", "added",
            "floor", "comm")
    env, commit = environment(device), git_commit()
    print(f"{spec0.describe()}  W={W}  {env['gpu']}  torch {env['torch']} triton {env['triton']}  commit "
          f"{commit[:12]}  {datetime.date.today()}  (us, median)")
    print(f"all_to_all_single fit ({fit['fit']}): latency {fit['latency_us']:.1f} us, bandwidth "
          f"{fit['bandwidth_gbps']:.2f} GB/s a rank; " + ", ".join(f"{b} B {t:.1f} us" for b, t in fit["points"]))
    print(f"{'T':>5} {'mode':<13}{'C':>3}" + "".join(f"{c:>11}" for c in cols) + f"{'vs_floor':>9}")
    for r in rows:
        print(f"{r['T']:>5} {r['mode']:<13}{r['chunks']:>3}" +
              "".join(f"{r[c]:>11.1f}" if c in r else f"{'-':>11}" for c in cols) +
              (f"{r['vs_floor']:>9.2f}" if "vs_floor" in r else f"{'-':>9}"))
    if a.dry:
        return
    name = torch.cuda.get_device_name(device).replace(" ", "-").lower() if device.type == "cuda" else "cpu"
    path = a.out or os.path.join(HERE, "results", f"{name}-{datetime.date.today()}-ep-w{W}.json")
    with open(path, "w") as f:
        json.dump(dict(spec=spec0.key, world_size=W, device=str(device), gpu=env["gpu"], env=env, commit=commit,
                       date=str(datetime.date.today()), a2a_fit=fit, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    run()
