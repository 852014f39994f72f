"""The parallel path on one GPU: a NCCL process group of one (FileStore, no port) in this process.

* every mode (EP all-reduce, EP all-to-all uneven / fixed, TP, replicated) equal to the one-GPU op (``moe_forward``) on
  the Triton kernels, fp32 and bf16, decode and prefill sizes;
* the capturable variants inside a CUDA graph (NCCL collectives captured with the kernels): replays on new inputs
  equal the eager call; a capacity that drops pairs replays the same drops; the uneven exchange refuses capture with a
  clear error;
* a tiny model's ``generate()`` with ``shard_experts`` (EP all-reduce, EP fixed all-to-all, TP) equal to the unsharded
  ``generate()``, its decode steps replayed as CUDA graphs;
* the time the parallel machinery adds at world size 1 (printed: op vs parallel path, both replayed from graphs).

Run: ``pytest tests/parallel/test_parallel_gpu.py -q -s`` (a few seconds after the kernels compile).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

import moecomp
from moecomp import parallel as par
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.core.spec_parallel import ParallelSpec
from moecomp.testing import random_moe_args, rel_err

pytestmark = pytest.mark.gpu

SPEC = MoESpec(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128, scoring="sigmoid",
               has_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5, renorm_eps=1e-20,
               router_fp32=True, shared=SharedExpertSpec(128))
MODES = {"ep": dict(mode="ep"), "ep_a2a": dict(mode="ep", dispatch="all_to_all"),
         "ep_a2a_fixed": dict(mode="ep", dispatch="all_to_all", capacity=0),
         "tp": dict(mode="tp", intermediate_size=128), "replicated": dict(mode="replicated")}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # against the one-GPU op (bf16: per-pair / partial roundings)


@pytest.fixture(scope="module")
def nccl_one(tmp_path_factory):
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    dist.all_reduce(torch.ones(1, device="cuda"))  # the communicator exists before any capture
    yield
    dist.destroy_process_group()


def _block(dtype, T, seed=0):
    args = random_moe_args(SPEC, T, dtype=dtype, device="cuda", seed=seed)
    return args, dict(zip(MOE_ARGS, args[1:]))


def _spec(mode: str, **kw) -> MoESpec:
    return SPEC.replace(parallel=ParallelSpec(world_size=1, rank=0, num_global_experts=16, **{**MODES[mode], **kw}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 5, 64])
def test_every_mode_equals_the_op(nccl_one, dtype, T):
    args, whole = _block(dtype, T, seed=T)
    want = torch.ops.moecomp.moe_forward(*args, SPEC.key)
    for mode in MODES:
        spec = _spec(mode)
        out = par.forward(args[0], {**whole, **par.shard_tensors(whole, spec)}, spec)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert rel_err(out, want) < TOL[dtype], (mode, rel_err(out, want))


def _capture(fn, static_x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # Triton compiles, the allocator warms up
            fn(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static_x)
    return g, out


@pytest.mark.parametrize("mode, kw", [("ep", {}), ("ep_a2a_fixed", {}), ("ep_a2a_fixed", dict(capacity=2)),
                                      ("tp", {}), ("replicated", {})],
                         ids=["ep", "a2a_fixed", "a2a_cap2", "tp", "replicated"])
def test_capturable_variants_in_a_cuda_graph(nccl_one, mode, kw, T=4):
    spec = _spec(mode, **kw)
    args, whole = _block(torch.bfloat16, T, seed=7)
    t = {**whole, **par.shard_tensors(whole, spec)}
    static_x = args[0].clone()
    g, out = _capture(lambda x: par.forward(x, t, spec), static_x)
    for seed in (11, 12):
        x = random_moe_args(SPEC, T, dtype=torch.bfloat16, device="cuda", seed=seed)[0]
        static_x.copy_(x)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = par.forward(x, t, spec)
        assert torch.isfinite(out).all() and rel_err(out, eager) < 1e-3, rel_err(out, eager)
        if "capacity" not in kw:
            assert rel_err(out, torch.ops.moecomp.moe_forward(x, *args[1:], SPEC.key)) < TOL[torch.bfloat16]


def test_uneven_exchange_refuses_capture(nccl_one):
    spec = _spec("ep_a2a")
    args, whole = _block(torch.bfloat16, 3)
    t = {**whole, **par.shard_tensors(whole, spec)}
    par.forward(args[0], t, spec)  # (warm)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot do; use capacity=0"):
        with torch.cuda.graph(g):
            par.forward(args[0], t, spec)


@pytest.mark.parametrize("family, mode, kw", [("qwen3_moe", "ep", {}),
                                              ("qwen3_moe", "ep", dict(dispatch="all_to_all", capacity=0)),
                                              ("deepseek_v3", "tp", {})], ids=["ep", "ep_a2a_fixed", "dsv3_tp"])
def test_sharded_generate_replays_graphs(nccl_one, family, mode, kw):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from generate.models import build, prompts

    model = moecomp.optimize(build(family, "cuda", torch.float32))
    ids, mask = prompts(model.config.vocab_size, 3, 9, seed=1, left_pad=(0, 3, 5))
    ids, mask = ids.cuda(), mask.cuda()
    gen = lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)  # noqa: E731
    want = gen(model)  # the whole experts (graphs captured for these weights; sharding makes new ones)
    moecomp.shard_experts(model, None, mode, **kw)
    for _ in range(2):
        got = gen(model)
        assert model.generate.last["path"] == "moecomp", model.generate.last
        assert torch.equal(got, want)
    assert model.generate.last["graphs"] == "replayed", model.generate.last
    assert model.generate.engine.stats["capture_failures"] == 0


def test_time_added_at_world_size_one(nccl_one):
    """Printed, not asserted: microseconds a replayed call of the op and of the parallel path (EP all-reduce, fixed
    all-to-all, TP) take at decode sizes, bf16."""
    rows = []
    for T in (1, 8):
        args, whole = _block(torch.bfloat16, T, seed=3)
        fns = {"op": lambda x: torch.ops.moecomp.moe_forward(x, *args[1:], SPEC.key)}
        for mode in ("ep", "ep_a2a_fixed", "tp"):
            spec = _spec(mode)
            t = {**whole, **par.shard_tensors(whole, spec)}
            fns[mode] = lambda x, t=t, spec=spec: par.forward(x, t, spec)
        for name, fn in fns.items():
            g, _ = _capture(fn, args[0].clone())
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            rows.append((T, name, start.elapsed_time(end) / 200 * 1e3))
    print("\n".join(f"T={T:<3} {name:<13} {us:8.1f} us" for T, name, us in rows))
    assert all(us > 0 for _, _, us in rows)
