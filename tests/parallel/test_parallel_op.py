"""``torch.ops.moecomp.moe_parallel`` on a real process group of one (gloo, in this process, a HashStore: no port):
equal to the one-GPU oracle in every mode, ``torch.library.opcheck`` (schema, fake tensors, AOT dispatch; also with
routing record / replay), and traced by torch.compile as one opaque op (fullgraph: no graph break around the
collectives; record / replay compiled by Inductor)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moecomp import parallel as par
from moecomp.core.args import MOE_ARGS, OP_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.core.spec_parallel import ParallelSpec
from moecomp.oracle import reference
from moecomp.testing import random_moe_args, rel_err

SPEC = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, scoring="sigmoid",
               has_correction_bias=True, n_group=2, topk_group=1, shared=SharedExpertSpec(16, gate="sigmoid"))
MODES = [dict(mode="ep"), dict(mode="ep", dispatch="all_to_all"), dict(mode="ep", dispatch="all_to_all", capacity=0),
         dict(mode="tp", intermediate_size=16)]


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tensors(spec: MoESpec, whole: dict) -> list:
    t = {**whole, **par.shard_tensors(whole, spec)}
    return [t.get(n) for n in OP_ARGS[: len(MOE_ARGS)]]


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_op_in_every_mode(world_of_one, kw, T=5):
    spec = SPEC.replace(parallel=ParallelSpec(world_size=1, rank=0, num_global_experts=8, **kw))
    args = random_moe_args(SPEC, T, seed=2)
    whole = dict(zip(MOE_ARGS, args[1:]))
    ref = reference.moe_forward(*args, SPEC)
    out = torch.ops.moecomp.moe_parallel(args[0], _tensors(spec, whole), spec.key)
    assert rel_err(out, ref) < 2e-5
    direct = par.call(args[0], _tensors(spec, whole), spec)  # plain eager: no dispatcher
    assert rel_err(direct, ref) < 2e-5


@pytest.mark.parametrize("T", [0, 4])
def test_opcheck(world_of_one, T):
    spec = SPEC.replace(parallel=ParallelSpec("ep", 1, 0, 8))
    args = random_moe_args(SPEC, T, seed=3)
    whole = dict(zip(MOE_ARGS, args[1:]))
    torch.library.opcheck(torch.ops.moecomp.moe_parallel.default, (args[0], _tensors(spec, whole), spec.key))


def _given(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(8, generator=g)[:SPEC.top_k] for _ in range(T)]
    return torch.stack(rows).int() if rows else torch.zeros(0, SPEC.top_k, dtype=torch.int32)


@pytest.mark.parametrize("T", [0, 4])
def test_opcheck_routes(world_of_one, T):
    """Record / replay (issue 43): ``moe_parallel_routes`` (both buffers, and the weights' None) and ``moe_parallel``
    with ``routes_in``."""
    spec = SPEC.replace(parallel=ParallelSpec("ep", 1, 0, 8))
    args = random_moe_args(SPEC, T, seed=3)
    tensors = _tensors(spec, dict(zip(MOE_ARGS, args[1:])))
    out, wout = torch.zeros(T, SPEC.top_k, dtype=torch.int32), torch.zeros(T, SPEC.top_k)
    given = _given(T, 5)
    torch.library.opcheck(torch.ops.moecomp.moe_parallel.default, (args[0], tensors, spec.key, given))
    torch.library.opcheck(torch.ops.moecomp.moe_parallel_routes.default, (out, wout, args[0], tensors, spec.key))
    torch.library.opcheck(torch.ops.moecomp.moe_parallel_routes.default,
                          (out, None, args[0], tensors, spec.key, given))


def test_compiled_record_and_replay(world_of_one, T=6):
    """Under torch.compile (Inductor): ``par.call`` recording (``moe_parallel_routes``: its mutation reaches the
    caller's buffer) and replaying (``moe_parallel``'s routes_in) equal the eager calls; the recorded ids are the
    one-GPU op's, the replay equals the oracle's replay of the given ids (fp32, rel 2e-5)."""
    from moecomp.ops.moe_op import call_moe_forward

    spec = SPEC.replace(parallel=ParallelSpec("tp", 1, 0, 8, intermediate_size=16))
    args = random_moe_args(SPEC, T, seed=6)
    whole = dict(zip(MOE_ARGS, args[1:]))
    tensors = _tensors(spec, whole)
    assert spec.key
    given = _given(T, 7).long()

    def f(x, out, ids):
        return par.call(x * 1.0, tensors, spec, routes_out=out) + 2 * par.call(x, tensors, spec, routes_in=ids)

    out, out_eager, want_ids = (torch.full((T, SPEC.top_k), -7, dtype=torch.int32) for _ in range(3))
    want = f(args[0], out_eager, given)
    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor", fullgraph=True)(args[0], out, given)
    call_moe_forward(args[0], list(args[1:]), SPEC, routes_out=want_ids)
    assert torch.equal(out, out_eager) and torch.equal(out, want_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ref = reference.moe_forward(*args, SPEC) + 2 * reference.moe_forward(*args, SPEC, routes_in=given)
    assert rel_err(want, ref) < 2e-5


def test_compiled_call_is_one_op(world_of_one):
    spec = SPEC.replace(parallel=ParallelSpec("ep", 1, 0, 8, dispatch="all_to_all", capacity=0))
    args = random_moe_args(SPEC, 6, seed=4)
    tensors = _tensors(spec, dict(zip(MOE_ARGS, args[1:])))
    assert spec.key  # (made before tracing, as the binder does: Dynamo reads a computed cached_property)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = torch.compile(lambda x: par.call(x, tensors, spec) * 2, fullgraph=True, backend=backend)
    out = fn(args[0])
    assert torch.ops.moecomp.moe_parallel in seen or torch.ops.moecomp.moe_parallel.default in seen
    assert rel_err(out, 2 * reference.moe_forward(*args, SPEC)) < 2e-5


@pytest.mark.parametrize("mode, kw", [("ep", {}), ("tp", {}), ("ep", dict(dispatch="all_to_all", capacity=0))],
                         ids=["ep", "tp", "ep_a2a_fixed"])
def test_sharded_generate_with_compiled_layers(world_of_one, mode, kw):
    """moecomp's engine with its decoder layers compiled (Dynamo, "eager" backend on CPU): the bound blocks of a
    sharded model trace to one moe_parallel op each, and the tokens are the unsharded model's."""
    import os
    import sys

    import moecomp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from generate.models import build, prompts

    model = moecomp.optimize(build("qwen3_moe", layers=2, seed=0), use_capture=False)
    ids, mask = prompts(model.config.vocab_size, 2, 6, seed=2, left_pad=(0, 2))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    moecomp.shard_experts(model, None, mode, **kw)
    model.generate.cpu = True
    eng = model.generate._engine()
    seen = set()

    def backend(gm, example_inputs):  # Dynamo's graphs of the layers, run as they are
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    eng.cpu_compile, eng.compile_backend = True, backend
    got = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert model.generate.last["layers"] == "compiled", model.generate.last
    assert any("moe_parallel" in t for t in seen), sorted(seen)
    assert torch.equal(got, want)
