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

Phases are timed apart (each on inputs made by the previous), so they need not add up to ``total`` exactly. Times are
medians over ``--iters`` calls, host-timed around a device sync (CUDA: plain launches, no graphs).

    python benchmarks/bench_ep.py --preset qwen3 --tokens 1,8,128                  # one process: world size 1
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ep.py --preset deepseek_v3
    python benchmarks/bench_ep.py --dry                                            # tiny, CPU gloo, no JSON

Output: rank 0 prints a table and, unless ``--dry``, writes ``benchmarks/results/<device>-<date>-ep-w<W>.json``
(``--out`` to choose).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moecomp import parallel as par  # noqa: E402
from moecomp.ops.common import MOE_ARGS  # noqa: E402
from moecomp.parallel import capacity, dispatch, ep, local, route  # noqa: E402
from moecomp.parallel.comm import comm_for  # noqa: E402
from moecomp.spec import MoESpec, SharedExpertSpec  # noqa: E402
from moecomp.spec_parallel import ParallelSpec  # noqa: E402
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


def phases(spec: MoESpec, x, t: dict, comm, time_us) -> dict:
    """{phase: us} of one mode on this rank's shard ``t`` (module docstring)."""
    p = spec.parallel
    x2 = x.reshape(-1, x.shape[-1])
    r = route.route(x2, t, spec, x.shape)
    res = {"route": time_us(lambda: route.route(x2, t, spec, x.shape))}
    if p.dispatch == "all_to_all":
        fixed = p.capacity is not None
        via = capacity if fixed else dispatch
        plan, rows, lid, lw = via.send(comm, x2, r.ids, r.weights, p, spec.num_experts)
        res["dispatch"] = time_us(lambda: via.send(comm, x2, r.ids, r.weights, p, spec.num_experts))
        ks = local.kernel_spec(spec, 1, fixed)
        y = local.run(rows, lid, lw, t, ks)
        res["experts"] = time_us(lambda: local.run(rows, lid, lw, t, ks))
        T, k = r.ids.shape
        back = (lambda: capacity.back(comm, plan, y)) if fixed else (lambda: dispatch.back(comm, plan, y, T * k))
        res["combine"] = time_us(lambda: back().view(T, k, -1).sum(1))
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


def run(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3")
    ap.add_argument("--tokens", default="1,8,128")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry", action="store_true", help="tiny shapes, 2 iterations, CPU gloo, no JSON")
    ap.add_argument("--out", help="the JSON path (default benchmarks/results/...)")
    a = ap.parse_args(argv)
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
    rows = []
    try:
        for T in [int(v) for v in a.tokens.split(",")]:
            args = random_moe_args(spec0, T, dtype=dtype, device=device, seed=0)
            whole = dict(zip(MOE_ARGS, args[1:]))
            op_us = time_us(lambda: torch.ops.moecomp.moe_forward(*args, spec0.key))
            for mode in a.modes.split(","):
                kw = dict(MODES[mode])
                if kw["mode"] == "tp":
                    kw["intermediate_size"] = spec0.intermediate_size
                spec = spec0.replace(parallel=ParallelSpec(world_size=W, rank=rank,
                                                           num_global_experts=spec0.num_experts, **kw))
                t = {**whole, **par.shard_tensors(whole, spec)}
                res = phases(spec, args[0], t, comm_for(spec.parallel), time_us)
                rows.append(dict(T=T, mode=mode, op=op_us, added=res["total"] - op_us, **res))
    finally:
        if own_group:
            dist.destroy_process_group()
    if rank == 0:
        _report(rows, a, W, device, spec0)
    return rows


def _report(rows, a, W, device, spec0) -> None:
    cols = ("route", "dispatch", "experts", "combine", "shared", "all_reduce", "total", "op", "added")
    print(f"{spec0.describe()}  W={W}  {device}  (us, median)")
    print(f"{'T':>5} {'mode':<13}" + "".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(f"{r['T']:>5} {r['mode']:<13}" + "".join(f"{r[c]:>11.1f}" if c in r else f"{'-':>11}" for c in cols))
    if a.dry:
        return
    name = torch.cuda.get_device_name(device).replace(" ", "-").lower() if device.type == "cuda" else "cpu"
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"{name}-{datetime.date.today()}-ep-w{W}.json")
    with open(path, "w") as f:
        json.dump(dict(spec=spec0.key, world_size=W, device=str(device), rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    run()
