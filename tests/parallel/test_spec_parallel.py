"""ParallelSpec (``moecomp/core/spec_parallel.py``): its shard arithmetic, its validation (SpecError, a ValueError, naming
the field), and the round trip of a MoESpec with a parallel part through its key (the op's spec string)."""

from __future__ import annotations

import json

import pytest

from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.core.spec_parallel import ParallelSpec

DSV3 = MoESpec(num_experts=16, top_k=4, hidden_size=32, intermediate_size=16, scoring="sigmoid",
               has_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5, renorm_eps=1e-20,
               router_fp32=True, shared=SharedExpertSpec(24))


def test_ep_shard():
    p = ParallelSpec("ep", world_size=4, rank=2, num_global_experts=16)
    assert p.experts_per_rank == 4 and p.local_experts == range(8, 12)
    assert [p.owner(e) for e in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert p.local_intermediate == slice(0, 0) and p.capturable and "ep 2/4 experts [8, 12)" in p.describe()
    a2a = ParallelSpec("ep", 4, 2, 16, dispatch="all_to_all")
    assert not a2a.capturable and ParallelSpec("ep", 4, 2, 16, dispatch="all_to_all", capacity=0).capturable


def test_tp_shard():
    p = ParallelSpec("tp", world_size=4, rank=3, num_global_experts=6, intermediate_size=64)
    assert p.local_experts == range(0, 6) and p.intermediate_per_rank == 16
    assert p.local_intermediate == slice(48, 64) and p.owner(5) == -1
    assert "tp 3/4 I [48, 64)" in p.describe()


def test_replicated():
    """Every expert whole on every rank (E need not divide by W), the group sharing one batch."""
    p = ParallelSpec("replicated", world_size=4, rank=1, num_global_experts=6)
    assert p.experts_per_rank == 6 and p.local_experts == range(0, 6) and p.owner(5) == -1
    assert p.capturable and "replicated 1/4 every expert whole" in p.describe()
    assert ParallelSpec("replicated", 4, 1, 6, intermediate_size=16).local_intermediate == slice(0, 16)


@pytest.mark.parametrize("kw, match", [
    (dict(mode="dp"), "parallel.mode='dp'"),
    (dict(world_size=0), "parallel.world_size must be an int >= 1"),
    (dict(world_size=2.0), "parallel.world_size"),
    (dict(rank=4), r"parallel.rank must be an int in \[0, world_size=4\)"),
    (dict(rank=-1), "parallel.rank"),
    (dict(num_global_experts=10), "num_global_experts=10 is not divisible by world_size=4"),
    (dict(dispatch="broadcast"), "parallel.dispatch='broadcast'"),
    (dict(capacity=4), "capacity=4 is for dispatch 'all_to_all'"),
    (dict(dispatch="all_to_all", capacity=-1), "parallel.capacity must be None or an int >= 0"),
    (dict(mode="tp"), "intermediate_size is required with mode 'tp'"),
    (dict(mode="tp", intermediate_size=30), "intermediate_size=30 is not divisible by world_size=4"),
    (dict(mode="tp", intermediate_size=32, dispatch="all_to_all"), "tensor parallelism shares one batch"),
    (dict(mode="replicated", dispatch="all_to_all"), "mode 'replicated': every rank runs every routed expert"),
    (dict(group=3), "parallel.group must be a process group's name"),
])
def test_bad_parallel_spec(kw, match):
    base = dict(mode="ep", world_size=4, rank=1, num_global_experts=16)
    with pytest.raises(SpecError, match=match):
        ParallelSpec(**{**base, **kw})
    assert issubclass(SpecError, ValueError)


def test_moe_spec_with_parallel_round_trips():
    for p in (ParallelSpec("ep", 4, 1, 16), ParallelSpec("ep", 2, 0, 16, dispatch="all_to_all", capacity=3, group="7"),
              ParallelSpec("tp", 2, 1, 16, intermediate_size=16), ParallelSpec("replicated", 3, 2, 16, group="5")):
        spec = DSV3.replace(parallel=p)
        back = MoESpec.from_key(spec.key)
        assert back == spec and back.parallel == p and back.key == spec.key
        assert p.describe() in spec.describe()
    assert json.loads(DSV3.key)["parallel"] is None and MoESpec.from_key(DSV3.key) == DSV3
    old = json.loads(DSV3.key)
    del old["parallel"]  # a key written before the field existed
    assert MoESpec.from_key(json.dumps(old)) == DSV3


def test_bad_key_and_cross_checks():
    d = json.loads(DSV3.replace(parallel=ParallelSpec("ep", 4, 1, 16)).key)
    d["parallel"]["ranks"] = 3
    with pytest.raises(SpecError, match=r"unknown ParallelSpec field\(s\) \['ranks'\]"):
        MoESpec.from_key(json.dumps(d))
    d["parallel"].pop("ranks")
    d["parallel"]["mode"] = 5
    with pytest.raises(SpecError, match="ParallelSpec field mode=5 should be str"):
        MoESpec.from_key(json.dumps(d))
    with pytest.raises(SpecError, match="num_global_experts=8 differs from num_experts=16"):
        DSV3.replace(parallel=ParallelSpec("ep", 4, 1, 8))
    with pytest.raises(SpecError, match="intermediate_size=32 differs from intermediate_size=16"):
        DSV3.replace(parallel=ParallelSpec("tp", 2, 1, 16, intermediate_size=32))
    with pytest.raises(SpecError, match="parallel must be a ParallelSpec"):
        DSV3.replace(parallel={"mode": "ep"})
    with pytest.raises(SpecError, match="expert_norm"):
        MoESpec(8, 2, 16, 8, expert_norm="scaled_rms_1p", parallel=ParallelSpec("ep", 2, 0, 8))


def test_tp_quant_alignment():
    fp8 = MoESpec(num_experts=4, top_k=2, hidden_size=256, intermediate_size=512, quant=QuantSpec())
    fp8.replace(parallel=ParallelSpec("tp", 4, 0, 4, intermediate_size=512))  # 128 a rank: whole blocks
    with pytest.raises(SpecError, match=r"intermediate slice \(64 = 512 / 8\) must be a multiple of 128"):
        fp8.replace(parallel=ParallelSpec("tp", 8, 0, 4, intermediate_size=512))
    int4 = MoESpec(num_experts=4, top_k=2, hidden_size=64, intermediate_size=128, quant=QuantSpec.int4(group=32))
    int4.replace(parallel=ParallelSpec("tp", 4, 3, 4, intermediate_size=128))
    with pytest.raises(SpecError, match="multiple of 32"):
        int4.replace(parallel=ParallelSpec("tp", 8, 3, 4, intermediate_size=128))
    fp8.replace(parallel=ParallelSpec("ep", 4, 0, 4))  # EP slices whole experts: any I
