"""``score_order == "sparsemixer"`` (PhiMoE's eval-mode router, ``moecomp.core.spec``): the spec field, the reference
against a hand-written token loop of transformers' sparsemixer semantics (fp64, written here from the formula), the
op's CPU paths (vectorised torch; the Triton kernels under the interpreter, fp32) against the reference with every
torch.empty NaN-poisoned, the routing kernel under the interpreter, and (GPU only, marked) the compiled routing
kernel and the op in bf16 under CUDA-graph replay.

Inputs: router logits (or hidden states solved through the router to land on them) from
``policy.sparsemixer_probe_logits``: rows with a logit just inside and just outside the threshold in every round
(3% and 25% of the threshold away), for positive and negative maxima, exact ties, zeros and random rows; random
inputs alone seldom reach the threshold (``test_probes_reach_the_threshold``).

Tolerances: reference against the fp64 loop: ids equal in order, weights 1e-12 relative (the same IEEE operations);
routing kernel against the reference: ids equal as sets, weights 1e-5 relative + 1e-6 absolute (fp32 exp / sums in
another order); whole op against the fp32 reference: relative Frobenius error 1e-5 (as test_zero_experts.py: fp32
dots, no tf32). GPU (bf16): 2e-2, as tests/ops/test_gpu.py.
"""

import json
import math

import pytest
import torch

from moecomp.core import policy
from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import capture_moe_forward, check_replays, random_moe_args, rel_err

TOL = 1e-5

SPECS = {
    # PhiMoE: two rounds, jitter_eps 0.01, weights as they come (no renormalisation, no scale)
    "phimoe": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24, score_order="sparsemixer",
                      jitter_eps=0.01, renormalize=False),
    # the general form: three rounds, a wide threshold, renormalised and scaled, router bias, a gated shared expert
    "general": MoESpec(num_experts=6, top_k=3, hidden_size=20, intermediate_size=12, score_order="sparsemixer",
                       jitter_eps=0.3, routed_scaling_factor=2.0, has_router_bias=True,
                       shared=SharedExpertSpec(16, gate="sigmoid")),
}


def _hand_route(row: list, k: int, eps: float):
    """One token's (ids, weights), written out: k rounds over the experts not taken yet; the largest (first on a
    tie), weighted by the softmax at it over those within the relative threshold (0 / 0: kept)."""
    taken, ids, ws = [], [], []
    for _ in range(k):
        free = [e for e in range(len(row)) if e not in taken]
        m = max(row[e] for e in free)
        i = min(e for e in free if row[e] == m)
        kept = [e for e in free if max(abs(row[e]), m) == 0 or not (m - row[e]) / max(abs(row[e]), m) > 2 * eps]
        ids.append(i)
        ws.append(1.0 / sum(math.exp(row[e] - m) for e in kept))
        taken.append(i)
    return ids, ws


def _logits(spec: MoESpec, seed: int = 0) -> torch.Tensor:
    """Probe rows for the spec's threshold, then random ones."""
    g = torch.Generator().manual_seed(seed)
    probe = policy.sparsemixer_probe_logits(spec.num_experts, spec.top_k, spec.jitter_eps)
    return torch.cat([probe, torch.randn(8, spec.num_experts, generator=g) * 2])


def _probe_args(spec: MoESpec, T: int, seed: int, dtype=torch.float32) -> tuple:
    """The op's arguments with hidden states whose router logits are T rows spread over the probe rows (solved by
    least squares through router_w; needs E <= H)."""
    args = list(random_moe_args(spec, T, dtype, seed=seed))
    rw, rb = args[1], args[2]
    rows = _logits(spec, seed)
    target = rows[torch.linspace(0, rows.shape[0] - 1, T).long()] - (rb if rb is not None else 0)
    args[0] = torch.linalg.lstsq(rw.double(), target.double().T).solution.T.to(dtype).contiguous()
    return tuple(args)


def _same_routing(ids, w, rids, rw):
    assert torch.equal(ids.long().sort(1).values, rids.sort(1).values)
    torch.testing.assert_close(w.gather(1, ids.long().argsort(1)), rw.gather(1, rids.argsort(1)), rtol=1e-5,
                               atol=1e-6)


# ------------------------------------------------------------------------------------------------- spec
def test_spec_field():
    spec = SPECS["phimoe"]
    assert MoESpec.from_key(spec.key) == spec and '"jitter_eps":0.01' in spec.key
    assert "sparsemixer eps=0.01" in spec.describe()
    plain = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24)
    old = json.loads(plain.key)
    del old["jitter_eps"]  # a key written before the field existed: the default
    assert MoESpec.from_key(json.dumps(old, sort_keys=True, separators=(",", ":"))) == plain
    for bad, match in [(dict(jitter_eps=-0.1), "jitter_eps must be"), (dict(jitter_eps=float("nan")), "jitter_eps"),
                       (dict(jitter_eps=True), "jitter_eps"), (dict(scoring="sigmoid"), "scoring must be 'softmax'"),
                       (dict(has_correction_bias=True), "no correction bias"),
                       (dict(n_group=2, topk_group=1), "no correction bias, group-limited"),
                       (dict(zero_experts=2), "zero experts")]:
        with pytest.raises(SpecError, match=match):
            spec.replace(**bad)
    with pytest.raises(SpecError, match="read by score_order 'sparsemixer' only"):
        plain.replace(jitter_eps=0.01)


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("k,eps", [(2, 0.01), (2, 0.0), (3, 0.3), (4, 1.5)])
def test_reference_matches_hand_loop(k, eps):
    spec = MoESpec(num_experts=7, top_k=k, hidden_size=8, intermediate_size=8, score_order="sparsemixer",
                   jitter_eps=eps, renormalize=False)
    logits = _logits(spec, seed=k).double()
    w, ids = reference.route(logits, None, spec, acc=torch.float64)
    for t in range(logits.shape[0]):
        hid, hw = _hand_route(logits[t].tolist(), k, eps)
        assert ids[t].tolist() == hid, t
        torch.testing.assert_close(w[t], torch.tensor(hw, dtype=torch.float64), rtol=1e-12, atol=0)


def test_probes_reach_the_threshold():
    """The probe rows are what makes these tests able to fail: on them, a threshold 3% off changes weights; on
    random logits it hardly ever does."""
    spec = SPECS["phimoe"]
    probe = policy.sparsemixer_probe_logits(8, 2, 0.01)
    for eps in (0.0095, 0.0105):
        w0, _ = reference.route(probe, None, spec)
        w1, _ = reference.route(probe, None, spec.replace(jitter_eps=eps))
        assert (w0 - w1).abs().amax(1).gt(1e-3).sum() >= 4


def test_reference_block_matches_hand_loop():
    """The whole block (router bias, shared expert, renormalised, scaled) token by token in fp64."""
    spec = SPECS["general"]
    args = _probe_args(spec, 20, seed=3, dtype=torch.float64)
    x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
    logits = reference.router_logits(x, t["router_w"], t["router_b"], spec)  # (one rounding of the ties' logits)
    I = spec.intermediate_size
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        ids, w = _hand_route(logits[i].tolist(), spec.top_k, spec.jitter_eps)
        w = torch.tensor(w, dtype=torch.float64)
        w = w / w.sum() * spec.routed_scaling_factor
        for j, e in enumerate(ids):
            h = t["w13"][e] @ x[i]
            out[i] += w[j] * (t["w2"][e] @ (silu(h[:I]) * h[I:]))
        hs = silu(t["shared_w1"] @ x[i]) * (t["shared_w3"] @ x[i])
        out[i] += (t["shared_w2"] @ hs) * torch.sigmoid(t["shared_gate_w"] @ x[i])
    assert rel_err(reference.moe_forward(*args, spec, acc=torch.float64), out) < 1e-9


# ------------------------------------------------------------------------------------------------- the op
def _config(monkeypatch, decode: str | None) -> None:
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=8, g1=tile, g2=dict(tile, mode=decode)) if decode else dict(max_t=0)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dec)))


@pytest.mark.parametrize("name,T", [("phimoe", 3), ("general", 14)])
def test_forward(cpu_backend, poison, monkeypatch, name, T):
    """The op on hidden states whose logits are probe rows: T = 3 on the decode path (fused down-combine), 14 on
    the aligned one."""
    spec = SPECS[name]
    _config(monkeypatch, "fused" if T <= 4 else None)
    args = _probe_args(spec, T, seed=T)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL


def test_route_kernel(poison):
    """The routing kernel under the interpreter on probe rows and NaN / inf rows: the reference's ids and weights,
    one token per program and 16-token programs."""
    spec = SPECS["general"].replace(renormalize=False, routed_scaling_factor=1.0)
    logits = _logits(spec, seed=1)
    logits[3, 1], logits[4, 2], logits[5] = float("nan"), float("inf"), float("-inf")
    rw, rids = reference.route(logits, None, spec)
    many = dict(block_t=16, num_warps=4, group_3d=False)
    ids, w = triton_moe.route(logits, None, spec, torch.float32, tiles=many)
    _same_routing(ids, w, rids, rw)
    one = dict(block_t=1, num_warps=1, group_3d=False)  # (every program runs in Python: a few rows only)
    ids1, w1 = triton_moe.route(logits[:8], None, spec, torch.float32, tiles=one)
    _same_routing(ids1, w1, rids[:8], rw[:8])
    other = triton_moe.route(logits, None, spec.replace(jitter_eps=0.25), torch.float32, tiles=many)[1]
    assert not torch.allclose(other, w)  # the threshold reaches the kernel


# ------------------------------------------------------------------------------------------------- GPU
PHIMOE_GPU = MoESpec(num_experts=16, top_k=2, hidden_size=1024, intermediate_size=512, score_order="sparsemixer",
                     jitter_eps=0.01, renormalize=False, round_weights=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [9, 2048])
def test_gpu_route_kernel(T):
    """The compiled routing kernel (one-token programs at T=9, 16-token ones at 2048) on fp32 and bf16 logits of
    probe rows (repeated) and random rows: the reference on the same logits, as sets; weights 1e-5 (fp32) / 1e-2
    after bf16 rounding. Rows within a rounding of the threshold (SPARSEMIXER_MASK_REL) are left out in bf16."""
    spec = PHIMOE_GPU
    probe = policy.sparsemixer_probe_logits(16, 2, 0.01)
    g = torch.Generator().manual_seed(T)
    logits = torch.cat([probe.repeat(T // probe.shape[0] + 1, 1), torch.randn(T, 16, generator=g)])[:T].cuda()
    for dt in (torch.float32, torch.bfloat16):
        lg = logits.to(dt)
        ids, w = triton_moe.route(lg, None, spec, dt)
        rw, rids = reference.route(lg.float(), None, spec)
        keep = torch.ones(T, dtype=torch.bool, device="cuda")
        if dt == torch.bfloat16:
            rw = reference.round_weights(rw, dt)
            keep = ~reference.sparsemixer_contested(lg, spec, rel=policy.SPARSEMIXER_MASK_REL[dt])
        assert torch.equal(ids[keep].long().sort(1).values, rids[keep].sort(1).values)
        tol = 1e-5 if dt == torch.float32 else 1e-2
        torch.testing.assert_close(w[keep].gather(1, ids[keep].long().argsort(1)),
                                   rw[keep].gather(1, rids[keep].argsort(1)), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_cuda_graph_capture_and_replay(T):
    """bf16 on the GPU: decode (T = 1, 4) and aligned paths, captured once and replayed on new inputs whose logits
    are probe rows where T allows (the rest random). Tolerance 2e-2, as tests/ops/test_gpu.py."""
    spec = PHIMOE_GPU
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1))
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec)
    rw = args[1].double().cpu()  # (least squares on the CPU: an underdetermined system)
    xs = []
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        target = torch.cat([policy.sparsemixer_probe_logits(16, 2, 0.01), torch.randn(T, 16, generator=g)])[:T]
        xs.append(torch.linalg.lstsq(rw, target.double().T).solution.T.cuda())
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec), 2e-2)
