"""Stacked shared experts scaled by router gammas (``SharedExpertSpec.stacked``, ``MoESpec.shared_gamma``
"joint_renorm", ``MoESpec.has_weight_scale``; Inkling): the spec's checks, the reference against a hand-written fp64
loop written from the formula (logsigmoid / logsumexp, as Inkling's router spells it, nothing from
``moecomp.oracle.reference``), the reference's invariants, then the op (torch path, and the Triton kernels under the
interpreter, fp32) against the reference with every torch.empty NaN-poisoned, at decode sizes and aligned ones,
its argument checks and opcheck, and (GPU only) bf16 with CUDA-graph capture.

Tolerances: relative Frobenius error. Reference vs the fp64 loop: 1e-5 (fp32 against fp64 of the same formula).
Op (fp32) vs reference: 1e-5, as tests/ops/test_moe_op.py (fp32 dots, no tf32). GPU bf16: 2e-2, as
tests/ops/test_gpu.py. A missing joint renormalisation (gammas left out of the denominator) moves the outputs here by
more than 5e-2 (``test_the_joint_denominator_matters``), far outside these."""

import pytest
import torch
import torch.nn.functional as F

from moecomp.oracle import reference
from moecomp.core.args import MOE_ARGS, OP_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_moe_args, random_weight_scale, rel_err

TOL = 1e-5

BASE = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, scoring="sigmoid", has_correction_bias=True,
            routed_scaling_factor=2.5, router_fp32=True, shared_gamma="joint_renorm")
SPECS = {
    # Inkling: S stacked shared experts, the learned global scale, weights rounded to the model dtype
    "inkling": MoESpec(**BASE, shared=SharedExpertSpec(12, stacked=2), has_weight_scale=True, round_weights=True),
    # one 2-D shared expert whose gamma is the router's last row; sqrtsoftplus scoring, an eps and a floor
    "one_2d": MoESpec(**{**BASE, "scoring": "sqrtsoftplus", "routed_scaling_factor": 1.0}, renorm_eps=1e-3,
                      renorm_min=0.5, shared=SharedExpertSpec(20, layout="concat")),
    # three stacked ungated experts, top-3 of 6, a shared scale
    "three": MoESpec(**{**BASE, "num_experts": 6, "top_k": 3, "has_correction_bias": False},
                     shared=SharedExpertSpec(8, stacked=3, gated=False, activation="relu2", scale=0.5)),
}


def _extra(spec: MoESpec, seed: int = 0) -> dict:
    return random_weight_scale(spec, seed=seed)


def _hand_loop(spec: MoESpec, args, ws: dict) -> torch.Tensor:
    """Token by token in fp64: logits of the E routed and G shared rows; top-k of sigmoid + bias over the routed;
    w = exp(logsigmoid(l) - logsumexp(logsigmoid(l))) over the k chosen and the G shared, times the scales; the
    routed experts weighted by the first k, shared expert s by w[k + s]."""
    x, rw, _, cb, w13, _, w2, _, s1, s3, s2, _ = [None if a is None else a.double() for a in args]
    E, k, I, sh = spec.num_experts, spec.top_k, spec.intermediate_size, spec.shared
    S = sh.count
    stack = (lambda t: t) if sh.stacked else (lambda t: None if t is None else t[None])
    s1, s3, s2 = stack(s1), stack(s3), stack(s2)
    wsc = ws["weight_scale"].double().item() if ws else 1.0

    def score(v):
        return torch.sigmoid(v) if spec.scoring == "sigmoid" else torch.sqrt(F.softplus(v))

    def act(v):
        return F.silu(v) if sh.activation == "silu" else torch.relu(v) ** 2

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        lg = rw @ x[t]
        choice = score(lg[:E]) + (cb.double() if cb is not None else 0)
        ids = torch.topk(choice, k).indices
        sel = torch.cat([lg[:E][ids], lg[E:]])
        if spec.scoring == "sigmoid" and spec.renorm_eps == 0 and spec.renorm_min == 0:
            lp = F.logsigmoid(sel)
            w = torch.exp(lp - torch.logsumexp(lp, 0))
        else:
            sc = score(sel)
            w = sc / torch.clamp(sc.sum() + spec.renorm_eps, min=spec.renorm_min)
        w = w * spec.routed_scaling_factor * wsc
        if spec.round_weights:
            w = w.to(x.dtype)
        for j in range(k):
            e = int(ids[j])
            h = w13[e] @ x[t]
            out[t] += w[j] * (w2[e] @ (F.silu(h[:I]) * h[I:]))
        for s in range(S):
            if not sh.gated:
                h = act(s3[s] @ x[t])
            elif sh.layout == "concat":
                gu = s1[s] @ x[t]
                h = act(gu[: sh.intermediate_size]) * gu[sh.intermediate_size:]
            else:
                h = act(s1[s] @ x[t]) * (s3[s] @ x[t])
            out[t] += w[k + s] * (s2[s] @ h) * sh.scale
    return out


# ------------------------------------------------------------------------------------------------- spec
def test_spec_checks_name_the_field():
    sh = SharedExpertSpec(8, stacked=2)
    for bad, what in ((dict(shared=None), "shared experts"), (dict(scoring="softmax"), "elementwise scoring"),
                      (dict(renormalize=False), "renormalize"), (dict(has_router_bias=True), "router bias"),
                      (dict(shared_gamma="softmax"), "shared_gamma")):
        with pytest.raises(SpecError, match=what):
            MoESpec(**{**BASE, "shared": sh, **bad})
    with pytest.raises(SpecError, match="sigmoid gate"):
        SharedExpertSpec(8, stacked=2, gate="sigmoid").validate()
    with pytest.raises(SpecError, match="stacked"):
        SharedExpertSpec(8, stacked=-1).validate()
    with pytest.raises(SpecError, match="has_weight_scale"):
        MoESpec(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8, has_weight_scale=True, capacity=2)
    s = SPECS["inkling"]
    assert MoESpec.from_key(s.key) == s and s.gamma_rows == 2 and SPECS["one_2d"].gamma_rows == 1


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("name", list(SPECS))
def test_reference_against_hand_loop(name):
    spec = SPECS[name]
    args = random_moe_args(spec, 9, seed=3)
    ws = _extra(spec, 3)
    got = reference.moe_forward(*args, spec, acc=torch.float64, **ws)
    assert rel_err(got, _hand_loop(spec, args, ws)) < TOL


def test_reference_weights_and_gammas_share_one_denominator():
    """Without eps / floor, the k weights and G gammas of every token sum to routed_scaling * weight_scale, and the
    gammas are the shared logits' sigmoids over the same denominator as the weights."""
    spec = SPECS["inkling"].replace(round_weights=False)
    T, E = 16, spec.num_experts
    logits = torch.randn(T, E + 2, dtype=torch.float64) * 3
    ws = torch.tensor([0.7], dtype=torch.float64)
    w, ids, g = reference.route_with_gammas(logits, torch.zeros(E), spec, torch.float64, ws)
    total = spec.routed_scaling_factor * 0.7
    assert torch.allclose(w.sum(-1) + g.sum(-1), torch.full((T,), total, dtype=torch.float64))
    ratio = (g / torch.sigmoid(logits[:, E:])) / (w / torch.sigmoid(logits[:, :E].gather(1, ids)))[:, :1]
    assert torch.allclose(ratio, torch.ones_like(ratio))
    # the selection ignores the shared rows: a huge shared logit changes no id
    logits2 = logits.clone()
    logits2[:, E:] = 50.0
    assert torch.equal(reference.route_with_gammas(logits2, torch.zeros(E), spec, torch.float64, ws)[1], ids)


def test_reference_nan_shared_logit_weighs_nothing():
    spec = SPECS["one_2d"].replace(renorm_eps=0.0, renorm_min=0.0)
    logits = torch.randn(4, spec.num_experts + 1)
    logits[1, -1] = float("nan")
    w, _, g = reference.route_with_gammas(logits, torch.zeros(spec.num_experts), spec)
    assert torch.isfinite(w).all() and g[1, 0] == 0 and torch.allclose(w[1].sum(), torch.tensor(1.0))


def test_the_joint_denominator_matters():
    """The routed weights renormalised alone (the gammas out of the sum) differ by far more than TOL."""
    spec = SPECS["inkling"]
    args = random_moe_args(spec, 9, seed=4)
    ws = _extra(spec, 4)
    alone = spec.replace(shared_gamma="none", shared=SharedExpertSpec(12, stacked=2))
    a = [*args]
    a[1] = args[1][: spec.num_experts]
    assert rel_err(reference.moe_forward(*a, alone, **ws), reference.moe_forward(*args, spec, **ws)) > 5e-2


# ------------------------------------------------------------------------------------------------- the op
# a learned weight scale alone (no shared gammas): softmax routing, a sigmoid-gated shared expert
SCALE_ONLY = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, has_weight_scale=True,
                     shared=SharedExpertSpec(12, gate="sigmoid"))


@pytest.mark.parametrize("T", [1, 3, 40])
@pytest.mark.parametrize("name", list(SPECS) + ["scale_only"])
def test_op_matches_reference(cpu_backend, poison, name, T):
    spec = SPECS.get(name, SCALE_ONLY)
    args = random_moe_args(spec, T, seed=T)
    ws = _extra(spec, T)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **ws)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference.moe_forward(*args, spec, **ws)) < TOL


def test_op_reads_the_weight_scale_each_call(cpu_backend):
    spec = SPECS["inkling"].replace(round_weights=False)
    args = random_moe_args(spec, 5, seed=1)
    ws = torch.tensor([1.0])
    a = torch.ops.moecomp.moe_forward(*args, spec.key, weight_scale=ws)
    ws.fill_(2.0)  # every weight and gamma doubles: the output doubles (the experts are linear in their weight)
    b = torch.ops.moecomp.moe_forward(*args, spec.key, weight_scale=ws)
    assert rel_err(b, 2 * a) < TOL


def test_op_argument_checks():
    spec = SPECS["inkling"]
    args = list(random_moe_args(spec, 4, seed=0))
    ws = _extra(spec)
    op = torch.ops.moecomp.moe_forward
    bad = list(args)
    bad[1] = args[1][: spec.num_experts]  # the gamma rows missing
    with pytest.raises(SpecError, match="router_w"):
        op(*bad, spec.key, **ws)
    with pytest.raises(SpecError, match="weight_scale"):
        op(*args, spec.key)
    with pytest.raises(SpecError, match="weight_scale"):
        op(*args, spec.key, weight_scale=torch.ones(2))
    bad = list(args)
    bad[MOE_ARGS.index("shared_w1") + 1] = args[MOE_ARGS.index("shared_w1") + 1][0]  # one expert's 2-D weight
    with pytest.raises(SpecError, match="shared_w1"):
        op(*bad, spec.key, **ws)
    plain = spec.replace(has_weight_scale=False)
    with pytest.raises(SpecError, match="weight_scale"):
        op(*args, plain.key, **ws)


@pytest.mark.parametrize("T", [0, 5])
def test_opcheck(cpu_backend, T):
    spec = SPECS["inkling"]
    args = random_moe_args(spec, T, seed=T)
    between = [None] * (OP_ARGS.index("weight_scale") - len(MOE_ARGS))
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default,
                          (*args, spec.key, *between, _extra(spec)["weight_scale"]))


# ------------------------------------------------------------------------------------------------- GPU
INKLING_GPU = MoESpec(num_experts=64, top_k=6, hidden_size=1024, intermediate_size=512, scoring="sigmoid",
                      has_correction_bias=True, routed_scaling_factor=8.0, router_fp32=True, round_weights=True,
                      shared=SharedExpertSpec(512, stacked=2), shared_gamma="joint_renorm", has_weight_scale=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_bf16_cuda_graph(T):
    """bf16 on the GPU: the decode path (T = 1, 4) and the aligned one, the stacked shared experts on the side stream,
    their gamma sum at the join; captured once and replayed on new inputs (outputs NaN-poisoned before each
    replay). Tolerance 2e-2, as tests/ops/test_gpu.py."""
    from moecomp.testing import capture_moe_forward, check_replays

    spec = INKLING_GPU
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1))
    ws = {"weight_scale": torch.tensor([1.25], device="cuda")}
    out = torch.ops.moecomp.moe_forward(args[0], *args[1:], spec.key, **ws)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference.moe_forward(*args, spec, **ws)) < 2e-2
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, extra=ws)
    xs = [torch.randn(T, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
          for seed in range(3)]
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec, **ws), 2e-2)
