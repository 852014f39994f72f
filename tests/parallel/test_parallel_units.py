"""The parallel path's parts in one process, no collectives: shard slicing (the shards put back together are the
whole tensors, for every layout the spec has), the local experts' spec, the fixed exchange's slot-major positions,
and bad input (a ValueError naming what was expected)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moecomp import parallel as par
from moecomp.core.args import MOE_ARGS
from moecomp.ops.moe_op import call_moe_forward
from moecomp.parallel import capacity, local
from moecomp.core.spec import MoESpec, QuantSpec, SpecError
from moecomp.core.spec_parallel import ParallelSpec
from moecomp.testing import quantize_moe_args, random_moe_args

BASE = MoESpec(num_experts=4, top_k=2, hidden_size=32, intermediate_size=64, has_expert_bias=True)
LAYOUTS = {
    "concat": BASE,
    "interleaved": BASE.replace(gate_up="interleaved", activation="swiglu_oai"),
    "in_out": BASE.replace(w_layout="in_out"),
    "ungated": BASE.replace(gated=False, activation="relu2"),
    "fp8_block": BASE.replace(has_expert_bias=False, quant=QuantSpec(block_n=16, block_k=16, activation="none")),
    "fp8_channel": BASE.replace(has_expert_bias=False, quant=QuantSpec(scale="channel", activation="none")),
    "int4_zero": BASE.replace(has_expert_bias=False, quant=QuantSpec.int4(group=32, zero_point=True)),
    "mxfp4": BASE.replace(has_expert_bias=False, quant=QuantSpec.mxfp4()),
}


def _whole(spec: MoESpec) -> dict:
    args = random_moe_args(spec, 2, seed=0)
    scales = {}
    if spec.quant is not None:
        args, scales = quantize_moe_args(spec, args)
    return {**dict(zip(MOE_ARGS, args[1:])), **{n: v for n, v in scales.items() if v is not None}}


def _tp_dims(name: str, spec: MoESpec) -> int:
    """Where a TP shard of ``name`` cuts (for putting the shards back): -1 = not cut."""
    q = spec.quant
    if name in ("b2", "a13_scale", "a2_scale") or (q is not None and name.startswith("w2_") and q.scale == "channel"):
        return -1
    if name.startswith("w2"):
        return 1 if spec.w_layout == "in_out" and name == "w2" else 2
    return 2 if (name == "w13" and spec.w_layout == "in_out") else 1


def _unshard(shards: list, name: str, spec: MoESpec) -> torch.Tensor:
    """The whole tensor from the TP shards: w2-like ones concatenated; gate | up ones per half."""
    dim = _tp_dims(name, spec)
    if dim < 0:
        return shards[0]
    gate_up = name.startswith("w13") or name == "b13"  # gate rows | up rows, each half cut alike
    if not gate_up or not spec.gated or spec.gate_up == "interleaved":
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shards_put_back_are_the_whole_tensors(layout):
    spec = LAYOUTS[layout]
    whole = _whole(spec)
    W = 2
    for mode in ("ep", "tp"):
        per_rank = []
        for r in range(W):
            p = ParallelSpec(mode, W, r, 4, intermediate_size=64 if mode == "tp" else 0)
            s = spec.replace(parallel=p)
            sh = par.shard_tensors(whole, s)
            local.check_shards(sh, s)  # the shapes the parallel path expects
            for n, t in sh.items():
                assert t.is_contiguous() and t.untyped_storage().data_ptr() != whole[n].untyped_storage().data_ptr()
            per_rank.append(sh)
        for n in per_rank[0]:
            back = (torch.cat([sh[n] for sh in per_rank]) if mode == "ep"
                    else _unshard([sh[n] for sh in per_rank], n, spec))
            assert torch.equal(back.view(torch.uint8) if back.dtype.itemsize == 1 else back,
                               whole[n].view(torch.uint8) if back.dtype.itemsize == 1 else whole[n]), (mode, n)


def test_kernel_spec():
    spec = LAYOUTS["interleaved"].replace(zero_experts=0, parallel=ParallelSpec("tp", 4, 1, 4, intermediate_size=64))
    ks = local.kernel_spec(spec, 2, False)
    assert (ks.num_experts, ks.intermediate_size, ks.hidden_size) == (4, 16, 32)
    assert ks.gate_up == "interleaved" and ks.activation == "swiglu_oai" and ks.has_expert_bias
    assert ks.parallel is None and ks.shared is None and ks.zero_experts == 0
    ep = BASE.replace(parallel=ParallelSpec("ep", 4, 1, 4))
    assert local.kernel_spec(ep, 2, True).num_experts == 1 and local.kernel_spec(ep, 2, True).zero_experts == 2


def test_slot_major_positions():
    T, k, W = 5, 3, 3
    dest = torch.randint(0, W + 1, (T * k,), generator=torch.Generator().manual_seed(0))
    got = capacity.positions(dest, T, k, W)
    used = [0] * (W + 1)
    want = torch.zeros(T * k, dtype=torch.long)
    for j in range(k):  # every token's first choice, then every token's second, ...
        for t in range(T):
            d = int(dest[t * k + j])
            want[t * k + j] = used[d]
            used[d] += 1
    assert torch.equal(got, want)


def test_bad_input():
    spec = BASE.replace(parallel=ParallelSpec("ep", 2, 1, 4))
    whole = _whole(BASE)
    x = torch.randn(3, 32)
    sh = par.shard_tensors(whole, spec)
    with pytest.raises(SpecError, match=r"w13 has shape \(4, 128, 32\); rank 1 of 2 \(ep\) holds experts \[2, 4\): "
                                        r"expected its shard \(2, 128, 32\) of the block's \(4, 128, 32\)"):
        par.forward(x, whole, spec, comm=_NoComm())
    bad_w2 = dict(sh, w2=sh["w2"][:, :, :32].contiguous())
    with pytest.raises(SpecError, match=r"w2 has shape \(2, 32, 32\).*expected its shard \(2, 32, 64\)"):
        par.forward(x, {**whole, **bad_w2}, spec, comm=_NoComm())
    with pytest.raises(SpecError, match=r"router_w has shape \(3, 32\), the spec needs \(4, 32\)"):
        par.forward(x, {**whole, **sh, "router_w": whole["router_w"][:3]}, spec, comm=_NoComm())
    with pytest.raises(SpecError, match="needs a spec with a parallel part"):
        par.forward(x, whole, BASE, comm=_NoComm())
    tp = BASE.replace(parallel=ParallelSpec("tp", 2, 0, 4, intermediate_size=64))
    with pytest.raises(SpecError, match=r"intermediate columns \[0, 32\) of every expert"):
        par.forward(x, {**whole, **sh}, tp, comm=_NoComm())
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="need torch.distributed initialised"):
            par.forward(x, {**whole, **sh}, spec)
    with pytest.raises(ValueError, match="group must be a torch.distributed ProcessGroup"):
        par.group_name("world")


class _NoComm:
    rank, world_size = 0, 1

    def all_reduce_(self, t):
        raise AssertionError("no collective expected")

    all_to_all = all_reduce_


def test_world_size_one_is_the_plain_op():
    """W = 1 (every expert on this rank) in every mode equals the one-GPU op, no collective needed but the identity."""
    spec = LAYOUTS["concat"]
    args = random_moe_args(spec, 5, seed=1)
    whole = dict(zip(MOE_ARGS, args[1:]))
    want = call_moe_forward(args[0], args[1:], spec)  # (the op without the dispatcher: no Dynamo import here)

    class One(_NoComm):
        def all_reduce_(self, t):
            return t

        def all_to_all(self, rows, out_splits=None, in_splits=None):
            return rows.clone()

    for kw in (dict(mode="ep"), dict(mode="ep", dispatch="all_to_all"), dict(mode="ep", dispatch="all_to_all",
                                                                          capacity=0),
               dict(mode="tp", intermediate_size=64)):
        s = spec.replace(parallel=ParallelSpec(world_size=1, rank=0, num_global_experts=4, **kw))
        out = par.forward(args[0], {**whole, **par.shard_tensors(whole, s)}, s, comm=One())
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_spec_replace_keeps_parallel():
    p = ParallelSpec("ep", 2, 0, 4)
    assert dataclasses.replace(BASE, parallel=p).experts_spec().parallel == p
