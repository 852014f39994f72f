"""The parallel paths' checks, written once for two runners: threads of one process (``moecomp.parallel.emulate``,
``test_parallel_emulated.py``) and real gloo processes (``test_parallel_gloo.py``). Each check runs on every rank and
returns rows (name, rank, relative error, tolerance) or raises; the runner asserts.

The oracle is ``moecomp.oracle.reference.moe_forward`` on the WHOLE block (the one-GPU result): every rank's output must equal
it within fp32 tolerance (``TOL``; 4-bit / fp8 weights: the dequantized reference, activations not quantized, so the
same tolerance). Inputs are drawn from fixed seeds, identical on every rank where the group shares one batch.
"""

from __future__ import annotations

import torch

from moecomp import parallel as par
from moecomp.oracle import reference
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.core.spec_parallel import ParallelSpec
from moecomp.testing import quantize_moe_args, random_hash_args, random_latent_args, random_moe_args, rel_err

TOL = 2e-5  # fp32: relative Frobenius error (summation order only)

SPECS = {
    "mixtral": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16),
    "qwen3": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, round_weights=True),
    "deepseek_v3": MoESpec(num_experts=16, top_k=4, hidden_size=32, intermediate_size=16, scoring="sigmoid",
                           has_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           renorm_eps=1e-20, router_fp32=True, shared=SharedExpertSpec(24)),
    "qwen2_gated_shared": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, renormalize=False,
                                  shared=SharedExpertSpec(24, gate="sigmoid")),
    "shared_concat": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,  # (not split: rank 0)
                             shared=SharedExpertSpec(24, layout="concat", scale=0.5)),
    "qwen2_fse": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, renormalize=False,
                         shared=SharedExpertSpec(24, gate="sigmoid"), fused_shared_gate=True),
    "hash": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, scoring="sqrtsoftplus",
                    routed_scaling_factor=1.5, hash_routing=True, shared=SharedExpertSpec(16)),
    "latent": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, latent_size=16, latent_bias=True,
                      scoring="sigmoid", shared=SharedExpertSpec(24)),
    "zero_experts": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, zero_experts=2),
    "gpt_oss": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, activation="swiglu_oai",
                       gate_up="interleaved", has_expert_bias=True),
    "capacity": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, capacity=3),
    "llama4": MoESpec(num_experts=8, top_k=1, hidden_size=32, intermediate_size=16, scoring="sigmoid",
                      score_order="topk_then_score", renormalize=False, weight_on_input=True, w_layout="in_out",
                      shared=SharedExpertSpec(16)),
    "fp8_block": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=64,
                         quant=QuantSpec(block_n=16, block_k=16, activation="none")),
    "int4": MoESpec(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128, quant=QuantSpec.int4(group=32)),
}
MODES = {  # name -> ParallelSpec keywords (besides mode / world size / rank / E)
    "ep": dict(mode="ep"),
    "ep_a2a": dict(mode="ep", dispatch="all_to_all"),
    "ep_a2a_fixed": dict(mode="ep", dispatch="all_to_all", capacity=0),
    "tp": dict(mode="tp"),
    "replicated": dict(mode="replicated"),  # (every expert whole on every rank: no collective with whole shared)
}


def block(name: str, T: int, seed: int = 0):
    """(x [T, H], whole tensors by op argument name) of a spec's block (quantized where the spec says)."""
    spec = SPECS[name]
    plain = spec.replace(fused_shared_gate=False)
    args = random_moe_args(plain, T, seed=seed)
    if spec.fused_shared_gate:  # FSE: router_w [E + 1, H], the gate's row last (what the binder's buffer holds)
        fused = torch.cat([args[1], args[MOE_ARGS.index("shared_gate_w") + 1]])
        args = tuple(fused if i == 1 else None if i == MOE_ARGS.index("shared_gate_w") + 1 else a
                     for i, a in enumerate(args))
    extra = random_latent_args(spec, seed=seed + 1)
    if spec.hash_routing:
        extra.update(random_hash_args(spec, T, seed=seed))
    if spec.quant is not None:
        args, scales = quantize_moe_args(spec, args)
        extra.update(scales)
    return args[0], {**dict(zip(MOE_ARGS, args[1:])), **extra}


def parallel_spec(name: str, mode: str, W: int, rank: int, **kw) -> MoESpec:
    spec = SPECS[name]
    kw = {**MODES[mode], **kw}
    if kw["mode"] == "tp":
        kw["intermediate_size"] = spec.intermediate_size
    return spec.replace(parallel=ParallelSpec(world_size=W, rank=rank, num_global_experts=spec.num_experts, **kw))


def oracle(x, t, spec: MoESpec):
    whole = [t.get(n) for n in MOE_ARGS]
    extra = {n: v for n, v in t.items() if n not in MOE_ARGS and v is not None}
    return reference.moe_forward(x, *whole, spec.replace(parallel=None), **extra)


def on_rank(x, t, spec: MoESpec, comm):
    """The parallel forward with this rank's shards (``comm`` None: the spec's process group)."""
    return par.forward(x, {**t, **par.shard_tensors(t, spec)}, spec, comm)


def check_every_spec(rank: int, W: int, comm=None, specs=None, modes=None) -> list:
    """Every spec in every mode, the group sharing one batch of 6 tokens: equal to the whole block."""
    rows = []
    for name in specs or SPECS:
        x, t = block(name, 6)
        ref = oracle(x, t, SPECS[name])
        for mode in modes or MODES:
            out = on_rank(x, t, parallel_spec(name, mode, W, rank), comm)
            rows.append((f"{name}/{mode}", rank, rel_err(out, ref), TOL))
    return rows


def check_own_tokens(rank: int, W: int, comm=None) -> list:
    """all_to_all with each rank's own tokens: different counts, T = 0 on rank 1; a [B, S, H] input on rank 0."""
    rows = []
    sizes = [5, 0, 3, 7][:W]
    for name in ("deepseek_v3", "mixtral", "zero_experts", "capacity"):
        x, t = block(name, max(sizes), seed=0)
        xr = random_moe_args(SPECS[name], sizes[rank], seed=100 + rank)[0]
        if rank == 0:
            xr = xr.reshape(1, sizes[0], -1)
        ref = oracle(xr, t, SPECS[name])
        out = on_rank(xr, t, parallel_spec(name, "ep_a2a", W, rank), comm)
        assert out.shape == xr.shape
        rows.append((f"{name}/own tokens T={sizes[rank]}", rank, rel_err(out, ref) if out.numel() else 0.0, TOL))
    return rows


def one_rank_input(name: str, T: int, W: int):
    """(x, t) routing every token to rank 0's experts (0 .. E / W - 1, at least top_k of them): x > 0, the router's
    rows of those experts positive and the others negative."""
    x, t = block(name, T)
    x = x.abs() + 0.1
    E, H = SPECS[name].num_experts, SPECS[name].hidden_size
    n = E // W
    w = torch.full((E, H), -1.0 / H)
    w[:n] = torch.rand(n, H, generator=torch.Generator().manual_seed(3)) / H + 0.5 / H  # (the same on every rank)
    return x, {**t, "router_w": w}


def check_one_rank_gets_all(rank: int, W: int, comm=None) -> list:
    rows = []
    for name in ("mixtral", "qwen3"):
        x, t = one_rank_input(name, 6, W)
        ids = reference.route(x @ t["router_w"].T, None, SPECS[name])[1]
        assert bool((ids < SPECS[name].num_experts // W).all())  # (the input does what it says)
        ref = oracle(x, t, SPECS[name])
        for mode in ("ep", "ep_a2a", "ep_a2a_fixed"):
            out = on_rank(x, t, parallel_spec(name, mode, W, rank), comm)
            rows.append((f"{name}/{mode} all to one rank", rank, rel_err(out, ref), TOL))
    return rows


def expected_with_drops(x, t, spec: MoESpec, W: int, C: int):
    """The one-GPU block with the pairs the fixed exchange drops zeroed: each destination rank keeps its first C
    pairs, slot-major (every token's first choice, tokens in order, then the second choices, ...)."""
    whole = spec.replace(parallel=None)
    weights, ids = reference.route(x @ t["router_w"].T, t.get("correction_bias"), whole)
    per_rank = whole.num_experts // W
    T, k = ids.shape
    used = [0] * W
    kept = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for tok in range(T):
            d = int(ids[tok, j]) // per_rank
            kept[tok, j] = used[d] < C
            used[d] += 1
    w = weights * kept
    return reference.experts(x, ids, w, t["w13"], t["b13"], t["w2"], t["b2"], whole)


def check_capacity_drops(rank: int, W: int, comm=None) -> list:
    """all_to_all with capacity C = 2 rows a destination: the dropped pairs add nothing, the others are exact."""
    x, t = one_rank_input("mixtral", 4, W)  # every pair to rank 0: 8 pairs for 2 rows from each sender
    spec = parallel_spec("mixtral", "ep_a2a", W, rank, capacity=2)
    out = on_rank(x, t, spec, comm)
    ref = expected_with_drops(x, t, spec, W, 2)
    full = oracle(x, t, SPECS["mixtral"])
    assert rel_err(out, full) > 0.05  # (something was dropped)
    return [("mixtral/capacity 2 drops", rank, rel_err(out, ref), TOL)]


def check_experts_entry(rank: int, W: int, comm=None) -> list:
    """``parallel.experts``: routing given (global ids), EP, TP and replicated, equal to the whole experts."""
    rows = []
    name = "deepseek_v3"
    spec0 = SPECS[name]
    x, t = block(name, 6)
    weights, ids = reference.route((x @ t["router_w"].T).float(), t["correction_bias"], spec0)
    ref = reference.experts(x, ids, weights, t["w13"], None, t["w2"], None, spec0)
    for mode in ("ep", "ep_a2a", "tp", "replicated"):
        spec = parallel_spec(name, mode, W, rank)
        out = par.experts(x, ids, weights, par.shard_tensors(t, spec), spec, comm)
        rows.append((f"{name}/{mode} experts entry", rank, rel_err(out, ref), TOL))
    return rows


ALL_CHECKS = (check_every_spec, check_own_tokens, check_one_rank_gets_all, check_capacity_drops, check_experts_entry)


def run_all(rank: int, W: int, comm=None) -> list:
    rows = []
    for check in ALL_CHECKS:
        rows += check(rank, W, comm)
    return rows


def failures(rows) -> list:
    return [r for r in rows if not r[2] < r[3]]


# ------------------------------------------------------------------------------ jobs of the real process groups
def check_bad_groups(rank: int, W: int, comm=None) -> list:
    """On a real process group: a spec whose world size or rank is not the group's, and a group that does not hold
    this rank, are ValueErrors naming what was expected."""
    import pytest
    import torch.distributed as dist

    x, t = block("mixtral", 4)
    expect = [(parallel_spec("mixtral", "ep", 2 * W, rank), f"world_size={2 * W}, the process group 'default' has {W}"),
              (parallel_spec("mixtral", "ep", W, (rank + 1) % W), f"this process is rank {rank} of the process group")]
    for spec, match in expect:
        with pytest.raises(ValueError, match=match):
            on_rank(x, t, spec, None)
    sub = dist.new_group([0])  # (every rank calls new_group)
    if rank != 0:
        with pytest.raises(ValueError, match="does not hold this process"):
            par.group_name(sub)
        named = SPECS["mixtral"].replace(parallel=ParallelSpec("ep", 1, 0, 8, group="no-such-group"))
        with pytest.raises(ValueError, match="names no process group of this process"):
            on_rank(x, t, named, None)
    else:
        spec = SPECS["mixtral"].replace(parallel=ParallelSpec("ep", 1, 0, 8, group=par.group_name(sub)))
        out = on_rank(x, t, spec, None)  # a group of one: the whole block on rank 0
        assert rel_err(out, oracle(x, t, SPECS["mixtral"])) < TOL
    dist.barrier()
    return [("bad groups", rank, 0.0, 1.0)]


JOBS = {"all": run_all, "bad_groups": check_bad_groups}



# ------------------------------------------------------------------------------ shard_experts on whole models
def _same_on_every_rank(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(g, t) for g in got)


def check_hf_generate(rank: int, W: int, comm=None) -> list:
    """Tiny HF models (Qwen3-MoE on EP, DeepSeek-V3 with groups + bias + a shared expert on TP) built alike on every
    rank: optimize + generate (the whole model), then shard_experts + generate again. The tokens equal the unsharded
    ones on every rank; the expert parameters are this rank's shard (the whole ones freed). (optimize without the FX
    pass: the attribute reader binds these blocks alike, without Dynamo's seconds of start-up in every process.)"""
    import gc
    import os
    import sys
    import weakref

    import moecomp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: generate.models
    from generate.models import build, prompts

    rows = []
    for family, mode, E, I in (("qwen3_moe", "ep", 8, 32), ("deepseek_v3", "tp", 8, 32)):
        model = build(family, layers=2, seed=0)
        ids, mask = prompts(96, 2, 5, seed=1, left_pad=(0, 2))
        moecomp.optimize(model, use_capture=False)
        gen = model.generate  # moecomp's (optimize installed it); .cpu: its engine on CPU (static cache, eager steps)

        def run(engine: bool):
            gen.cpu = engine
            with torch.no_grad():
                return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)

        want, want_engine = run(False), run(True)
        experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
        old = [weakref.ref(m.gate_up_proj) for m in experts]
        report = moecomp.shard_experts(model, None, mode)
        gc.collect()
        assert len(report) == 2 and all(mode in v for v in report.values()), report
        assert all(r() is None for r in old)  # the whole expert tensors are gone
        for m in experts:
            want_shape = (E // W, 2 * I, 64) if mode == "ep" else (E, 2 * I // W, 64)
            assert tuple(m.gate_up_proj.shape) == want_shape and tuple(m.down_proj.shape) == (
                (E // W, 64, I) if mode == "ep" else (E, 64, I // W)), (family, mode, m.gate_up_proj.shape)
        got, got_engine = run(False), run(True)
        assert gen.last["path"] == "moecomp", gen.last
        for g in (got, got_engine):
            assert _same_on_every_rank(g), f"{family}/{mode}: ranks generated different tokens"
        rows.append((f"hf {family}/{mode} generate", rank, float((got != want).sum()), 0.5))
        rows.append((f"hf {family}/{mode} generate engine", rank, float((got_engine != want_engine).sum()), 0.5))
    return rows


def check_plain_model(rank: int, W: int, comm=None) -> list:
    """A plain PyTorch model whose experts are a ModuleList of MLPs (the binder stacks them into a shared buffer):
    shard_experts keeps this rank's experts (views of the shard), empties the others, and the output is the whole
    model's."""
    import moecomp
    from moecomp.testing import LinearExpert

    class Block(torch.nn.Module):
        def __init__(self, H=32, I=16, E=4, k=2):
            super().__init__()
            self.top_k = k
            self.gate = torch.nn.Linear(H, E, bias=False)
            self.experts = torch.nn.ModuleList([LinearExpert(H, I) for _ in range(E)])

        def forward(self, hidden_states):
            b, s, h = hidden_states.shape
            x = hidden_states.view(-1, h)
            w = torch.softmax(self.gate(x), dim=1, dtype=torch.float)
            w, sel = torch.topk(w, self.top_k, dim=-1)
            w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(sel == e)
                if tok.numel():
                    out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
            return out.view(b, s, h)

    rows = []
    for mode in ("ep", "tp"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(Block(), Block()).eval()
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = net(x)
            moecomp.optimize(net, use_capture=False)
            report = moecomp.shard_experts(net, None, mode)
            assert len(report) == 2, report
            got = net(x)
        for blk in net:
            for e, ex in enumerate(blk.experts):
                mine = mode == "tp" or e // (4 // W) == rank
                shape = tuple(ex.w1.weight.shape)
                assert shape == ((16 // W if mode == "tp" else 16, 32) if mine else (0,)), (mode, e, shape)
        rows.append((f"plain ModuleList model/{mode}", rank, rel_err(got, want), TOL))
    import pytest

    odd = moecomp.optimize(torch.nn.Sequential(Block(E=2 * W + 1)).eval(), use_capture=False)  # E % W != 0: refused
    with torch.no_grad(), pytest.raises(ValueError, match=f"num_global_experts={2 * W + 1} is not divisible by "
                                                          f"world_size={W}"):
        moecomp.shard_experts(odd, None, "ep")
    for bad in ("dp", "replicated"):  # (replicated: nothing to shard)
        with pytest.raises(ValueError, match=f"mode='{bad}': expected one of \\('ep', 'tp'\\)"):
            moecomp.shard_experts(odd, None, bad)
    return rows


def one_rank_raises(rank: int, W: int, comm=None) -> list:
    """Rank 1 calls the op with a wrong input (a ValueError before any collective); the others call it rightly and
    wait in its all-reduce for rank 1, which never comes: the run must end at rank 1's error, not hang."""
    x, t = block("mixtral", 4)
    if rank == 1:
        x = x[:, :-1]  # [T, H - 1]
    return [("unreachable", rank, rel_err(on_rank(x, t, parallel_spec("mixtral", "ep", W, rank), comm),
                                          oracle(x, t, SPECS["mixtral"])), TOL)]


def _routes_job(name: str):
    """A job of ``scenarios_routes.py`` (imported at the call: that module imports this one)."""
    def job(rank: int, W: int, comm=None) -> list:
        import scenarios_routes

        return getattr(scenarios_routes, name)(rank, W, comm)

    job.__name__ = name
    return job


JOBS.update(hf_generate=check_hf_generate, plain_model=check_plain_model, one_rank_raises=one_rank_raises,
            routes_op=_routes_job("check_routes_op"), routes_model=_routes_job("check_routes_model"))
