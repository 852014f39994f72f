"""Expert capacity (``MoESpec.capacity`` / ``capacity_factor``; Switch Transformers, NLLB-MoE): per group of tokens
(the call, or each sequence of x [B, S, H]) an expert takes its pairs in slot-major order up to its capacity; the rest
are dropped (they add nothing). The spec field; the reference against a hand-written token loop (fp64, nothing from
moecomp.oracle.reference); the sort-based ranks of the Triton path against the reference's one-hot cumsum; the op (torch
path, and the Triton kernels under the interpreter, fp32) against the reference with every torch.empty NaN-poisoned,
on the decode paths and the aligned one; opcheck; (GPU only) CUDA-graph capture.

Every case here drops pairs (asserted), and ``test_the_drop_matters`` shows that ignoring the capacity moves the
output by more than 0.1 relative, far outside the tolerances: fp32 1e-5 (relative Frobenius error, as
test_zero_experts.py: fp32 dots, the drop itself is exact), the reference against the fp64 loop 1e-6."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import capacity as cap
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import capture_moe_forward, check_replays, random_moe_args, rel_err

TOL = 1e-5

SPECS = {
    # Switch Transformers: top-1 softmax, not renormalised, a fixed capacity per sequence, relu experts
    "switch": MoESpec(num_experts=4, top_k=1, hidden_size=32, intermediate_size=24, renormalize=False,
                      activation="relu", gated=False, router_fp32=True, capacity=3, capacity_per="sequence"),
    # NLLB-MoE: top-2, renormalised over the kept pairs, capacity a fraction of the call's tokens, expert biases,
    # the output scaled (its eval-mode token dropout)
    "nllb": MoESpec(num_experts=4, top_k=2, hidden_size=24, intermediate_size=20, renorm_after_drop=True,
                    renorm_min=1.1920928955078125e-07, routed_scaling_factor=0.8, activation="relu", gated=False,
                    has_expert_bias=True, router_fp32=True, capacity_factor=0.4),
    # renormalised before the drop, gated experts and a sigmoid-gated shared expert, per sequence
    "before": MoESpec(num_experts=6, top_k=2, hidden_size=40, intermediate_size=16, capacity=2,
                      capacity_per="sequence", shared=SharedExpertSpec(24, gate="sigmoid")),
}


def _groups(spec: MoESpec, shape) -> list[range]:
    """Token index ranges counted together."""
    T = shape[0] * shape[1]
    n = shape[1] if spec.capacity_per == "sequence" else T
    return [range(g, g + n) for g in range(0, T, n)]


def _hand_loop(spec: MoESpec, args, shape) -> torch.Tensor:
    """The block in fp64 written out: each token's top-k, then per group a count per expert taken slot by slot in
    token order; a pair over the capacity is skipped; renormalised before or after dropping."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    T, I, k = x.shape[0], spec.intermediate_size, spec.top_k
    act = (lambda v: torch.relu(v)) if spec.activation == "relu" else (lambda v: v / (1 + torch.exp(-v)))
    probs = torch.softmax(x @ t["router_w"].T, -1)
    ids = [torch.topk(probs[i], k).indices.tolist() for i in range(T)]
    kept = [[True] * k for _ in range(T)]
    for grp in _groups(spec, shape):
        C = spec.capacity or -(-int(spec.capacity_factor * 10 * len(grp)) // 10)  # ceil(f * n), f has one decimal
        used = [0] * spec.num_experts
        for j in range(k):
            for i in grp:
                kept[i][j] = used[ids[i][j]] < C
                used[ids[i][j]] += 1
    out = torch.zeros_like(x)
    for i in range(T):
        w = [float(probs[i, e]) for e in ids[i]]
        if spec.renorm_after_drop:
            w = [wj if kj else 0.0 for wj, kj in zip(w, kept[i])]
        if spec.renormalize:
            s = max(sum(w) + spec.renorm_eps, spec.renorm_min)
            w = [wj / s for wj in w]
        for j, e in enumerate(ids[i]):
            if not kept[i][j]:
                continue
            h = t["w13"][e] @ x[i] + (t["b13"][e] if t["b13"] is not None else 0)
            h = act(h[:I]) * h[I:] if spec.gated else act(h)
            y = t["w2"][e] @ h + (t["b2"][e] if t["b2"] is not None else 0)
            out[i] += w[j] * spec.routed_scaling_factor * y
        if spec.shared is not None:
            hs = act(t["shared_w1"] @ x[i]) * (t["shared_w3"] @ x[i])
            out[i] += (t["shared_w2"] @ hs) * torch.sigmoid(t["shared_gate_w"] @ x[i])
    return out


def _args(spec: MoESpec, B: int, S: int, seed: int, dtype=torch.float32):
    """Random arguments with x as [B, S, H]; tokens that share a direction expert 0's router row favours, so that
    it is crowded (drops are sure) while the others still get tokens."""
    args = list(random_moe_args(spec, B * S, dtype, seed=seed))
    H = spec.hidden_size
    args[0] = (args[0] + 0.5).reshape(B, S, H)
    args[1] = args[1].clone()
    args[1][0] += 1.5 / H**0.5
    return tuple(args)


def _dropped(spec: MoESpec, args) -> int:
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits = reference.router_logits(x.reshape(-1, x.shape[-1]), t["router_w"], t["router_b"], spec)
    _, ids = reference.route(logits, t["correction_bias"], spec, group=reference.group_size(x.shape, spec))
    return int((ids < 0).sum())


# ------------------------------------------------------------------------------------------------- spec
def test_spec_fields():
    spec = SPECS["nllb"]
    assert MoESpec.from_key(spec.key) == spec and spec.has_capacity and "cap 0.4T/call renorm-kept" in spec.describe()
    assert spec.capacity_for(10) == 4 and spec.capacity_for(11) == 5 and SPECS["switch"].capacity_for(99) == 3
    plain = spec.replace(capacity_factor=0.0, renorm_after_drop=False)
    assert not plain.has_capacity and "cap" not in plain.describe()
    old = json.loads(plain.key)
    for f in ("capacity", "capacity_factor", "capacity_per", "renorm_after_drop"):
        del old[f]  # a key written before the fields existed: the defaults
    assert MoESpec.from_key(json.dumps(old, sort_keys=True, separators=(",", ":"))) == plain
    for bad, match in ((dict(capacity=-1), "capacity must be an int"), (dict(capacity=2.5), "capacity must be an int"),
                       (dict(capacity_factor=float("nan")), "capacity_factor must be a finite"),
                       (dict(capacity=4), "give one"), (dict(capacity_per="batch"), "capacity_per='batch'"),
                       (dict(renormalize=False), "renorm_after_drop needs renormalize"),
                       (dict(scoring="sigmoid", score_order="topk_then_score", weight_on_input=True,
                             renorm_after_drop=False, renormalize=False), "weight_on_input")):
        with pytest.raises(SpecError, match=match):
            spec.replace(**bad)
    with pytest.raises(SpecError, match="need an expert capacity"):
        plain.replace(capacity_per="sequence")


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_matches_hand_loop(name):
    spec = SPECS[name]
    args = _args(spec, 3, 7, seed=1, dtype=torch.float64)
    assert _dropped(spec, args) > 0
    flat = (args[0].reshape(21, -1),) + args[1:]
    want = _hand_loop(spec, flat, (3, 7)).reshape(args[0].shape)
    assert rel_err(reference.moe_forward(*args, spec, acc=torch.float64), want) < 1e-6


def test_the_drop_matters():
    """What the tolerances guard: the same block without its capacity differs by far more than any of them, and
    counting per call instead of per sequence differs too."""
    spec = SPECS["switch"]
    args = _args(spec, 3, 7, seed=2)
    out = reference.moe_forward(*args, spec)
    assert rel_err(reference.moe_forward(*args, spec.replace(capacity=0, capacity_per="call")), out) > 0.1
    assert rel_err(reference.moe_forward(*args, spec.replace(capacity_per="call")), out) > 0.1


@pytest.mark.parametrize("name", sorted(SPECS))
def test_sorted_ranks_match_onehot_ranks(name):
    """The Triton path's kept pairs (a stable sort of (group, expert) keys) are the reference's (a one-hot cumsum)."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    for T, group in ((1, 1), (12, 4), (30, 30), (64, 16)):
        ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(T)])
        ids[: T // 2, 0] = 1  # crowd one expert
        want = reference.capacity_kept(ids, spec, group)
        assert torch.equal(cap.kept(ids.int(), spec, group), want)
        assert not want.all() or T <= 2


# ------------------------------------------------------------------------------------------------- the op
def _config(monkeypatch, decode: str | None) -> None:
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=8, g1=tile, g2=dict(tile, mode=decode)) if decode else dict(max_t=0)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dec)))


@pytest.mark.parametrize("name,B,S,path", [("switch", 2, 4, "fused"), ("nllb", 1, 5, "pairs"),
                                           ("switch", 3, 9, "aligned"), ("nllb", 2, 11, "aligned"),
                                           ("before", 2, 10, "aligned"), ("before", 1, 4, "fused")])
def test_forward(cpu_backend, poison, monkeypatch, name, B, S, path):
    spec = SPECS[name]
    _config(monkeypatch, None if path == "aligned" else path)
    args = _args(spec, B, S, seed=B * S)
    assert _dropped(spec, args) > 0
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL, f"{spec.describe()}: rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("T", [0, 6])
def test_opcheck(cpu_backend, T):
    spec = SPECS["nllb"]
    args = _args(spec, 1, T, seed=3) if T else random_moe_args(spec, 0, seed=0)
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key))


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B,S", [(1, 1), (2, 3), (4, 300)])
def test_gpu_cuda_graph_capture_and_replay(B, S):
    """bf16 on the GPU, Switch-like (E=64, capacity 8 per sequence) on the decode and aligned paths, captured once
    and replayed on new inputs: the ranks and drops run on the device (no host sync, no data-dependent size).
    Tolerance 2e-2, as tests/ops/test_gpu.py."""
    spec = MoESpec(num_experts=64, top_k=2, hidden_size=1024, intermediate_size=512, capacity=8,
                   capacity_per="sequence", renorm_after_drop=True)
    args = list(random_moe_args(spec, B * S, torch.bfloat16, "cuda", std=0.02, seed=1))
    static_x = args[0].reshape(B, S, -1).clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, sync_check=True)  # a host sync raises
    gen = torch.Generator("cuda").manual_seed(0)
    xs = [torch.randn(B, S, spec.hidden_size, device="cuda", generator=gen) for _ in range(3)]
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec), 2e-2)
