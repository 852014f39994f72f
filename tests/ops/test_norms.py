"""``MoESpec.router_scale`` / ``latent_norm`` / ``expert_norm`` (MuseSpark: logits times output_multiplier before the
sigmoid; a CenteredRMSNorm on the latent input; an input-scaled RMSNorm on each expert's output before its weight).
The spec fields and checks; the reference against a hand-written fp64 loop and its properties (scale invariances);
the op (torch path, and the Triton kernels under the interpreter, fp32) against the reference with every torch.empty
NaN-poisoned, at a decode size and an aligned one; bad arguments; opcheck; (GPU only) bf16 with CUDA-graph capture.

Tolerances (relative Frobenius error against the fp32 reference): fp32 1e-5, as tests/ops/test_latent.py (fp32 dots,
no tf32); the reference against the fp64 loop 1e-6 (both in fp64). Property tests in fp64: 1e-9. GPU bf16: 2e-2,
as tests/ops/test_gpu.py."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import (check_op, capture_moe_forward, check_replays, random_latent_args, random_moe_args,
                             random_norm_args, rel_err)

TOL = 1e-5

SPECS = {
    # MuseSpark: fp32 router scaled before the sigmoid, correction bias, renorm eps 1e-15, scaled; experts between
    # latent projections, the latent input normalised (1 + w), each expert's output normalised (scaled first)
    "muse": MoESpec(num_experts=8, top_k=2, hidden_size=40, intermediate_size=24, latent_size=32, scoring="sigmoid",
                    has_correction_bias=True, renorm_eps=1e-15, routed_scaling_factor=2.0, router_fp32=True,
                    router_scale=0.25, latent_norm="rms_1p", latent_norm_eps=1e-6, expert_norm="scaled_rms_1p",
                    expert_norm_eps=1e-5),
    # the plain-weight latent norm, no expert norm, a softmax router scaled up
    "latent_rms": MoESpec(num_experts=6, top_k=2, hidden_size=24, intermediate_size=16, latent_size=20,
                          router_scale=3.0, latent_norm="rms", latent_norm_eps=1e-5),
    # an expert-output norm without latent projections, with a sigmoid-gated shared expert and expert biases
    "out_norm": MoESpec(num_experts=6, top_k=3, hidden_size=28, intermediate_size=12, has_expert_bias=True,
                        expert_norm="scaled_rms_1p", expert_norm_eps=1e-6, shared=SharedExpertSpec(16, gate="sigmoid")),
}


def _args(spec: MoESpec, T: int, dtype=torch.float32, device="cpu", seed: int = 0):
    extra = {**random_latent_args(spec, dtype, device, seed=seed + 100),
             **random_norm_args(spec, dtype, device, seed=seed + 200)}
    return random_moe_args(spec, T, dtype, device, seed=seed), extra


def _hand_loop(spec: MoESpec, args, extra) -> torch.Tensor:
    """The block token by token in fp64, nothing from moecomp.oracle.reference."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    ex = {k: v.double() for k, v in extra.items()}
    I = spec.intermediate_size
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731

    def rms(v, eps):
        return v / torch.sqrt((v * v).mean() + eps)

    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        logits = spec.router_scale * (t["router_w"] @ x[i])
        s = torch.sigmoid(logits) if spec.scoring == "sigmoid" else torch.softmax(logits, -1)
        ids = torch.topk(s + (t["correction_bias"] if t["correction_bias"] is not None else 0), spec.top_k).indices
        w = s[ids]
        w = w / (w.sum() + spec.renorm_eps) * spec.routed_scaling_factor
        xe = x[i]
        if spec.latent_size:
            xe = ex["latent_in_w"] @ x[i]
        if spec.latent_norm != "none":
            g = ex["latent_norm_w"]
            xe = rms(xe, spec.latent_norm_eps) * (g if spec.latent_norm == "rms" else 1 + g)
        routed = torch.zeros_like(xe)
        for j in range(spec.top_k):
            e = int(ids[j])
            h = t["w13"][e] @ xe + (t["b13"][e] if t["b13"] is not None else 0)
            y = t["w2"][e] @ (silu(h[:I]) * h[I:]) + (t["b2"][e] if t["b2"] is not None else 0)
            if spec.expert_norm != "none":
                y = rms(y * (1 + ex["expert_norm_w"]), spec.expert_norm_eps)
            routed += w[j] * y
        out[i] = ex["latent_out_w"] @ routed if spec.latent_size else routed
        if spec.shared is not None:
            y = t["shared_w2"] @ (silu(t["shared_w1"] @ x[i]) * (t["shared_w3"] @ x[i]))
            out[i] += y * torch.sigmoid(t["shared_gate_w"] @ x[i])
    return out


def check(args, extra, spec: MoESpec) -> torch.Tensor:
    return check_op(args, extra, spec, TOL)


# ------------------------------------------------------------------------------------------------- spec
def test_spec_fields_and_checks():
    spec = SPECS["muse"]
    assert MoESpec.from_key(spec.key) == spec and '"router_scale":0.25' in spec.key
    d = spec.describe()
    assert "logits x0.25" in d and "latent-norm rms_1p" in d and "out-norm scaled_rms_1p" in d, d
    assert spec.norm_shapes() == {"latent_norm_w": (32,), "expert_norm_w": (32,)}
    ex = spec.experts_spec()
    assert (ex.latent_norm, ex.expert_norm, ex.norm_shapes()) == ("none", "scaled_rms_1p", {"expert_norm_w": (32,)})
    assert SPECS["out_norm"].norm_shapes() == {"expert_norm_w": (28,)}
    plain = MoESpec(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4)
    old = json.loads(plain.key)
    for f in ("router_scale", "latent_norm", "latent_norm_eps", "expert_norm", "expert_norm_eps"):
        del old[f]  # a key written before the fields existed: the defaults
    assert MoESpec.from_key(json.dumps(old)) == plain and plain.norm_shapes() == {}
    for bad, match in ((dict(router_scale=0.0), "router_scale must be a finite number > 0"),
                       (dict(router_scale=float("inf")), "router_scale must be a finite"),
                       (dict(latent_norm="rms"), "latent_norm='rms' needs latent projections"),
                       (dict(expert_norm="rms_1p"), r"expert_norm='rms_1p' is not one of"),
                       (dict(expert_norm="scaled_rms_1p", expert_norm_eps=-1e-6), "expert_norm_eps must be"),
                       (dict(expert_norm="scaled_rms_1p", weight_on_input=True, score_order="topk_then_score",
                             scoring="sigmoid"), "with weight_on_input is not supported"),
                       (dict(expert_norm="scaled_rms_1p", zero_experts=2), "with zero_experts is not supported"),
                       (dict(expert_norm="scaled_rms_1p", capacity=3), "with an expert capacity is not supported")):
        with pytest.raises(SpecError, match=match):
            plain.replace(**bad)


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_matches_hand_loop(name):
    spec = SPECS[name]
    args, extra = _args(spec, 19, torch.float64, seed=3)
    got = reference.moe_forward(*args, spec, acc=torch.float64, **extra)
    assert rel_err(got, _hand_loop(spec, args, extra)) < 1e-6


def test_reference_properties():
    """fp64, eps 0: the router scale is a scale of router_w; an expert-output norm makes the output independent of
    the experts' down projections' scale; a latent norm makes it independent of the input projection's scale; and
    the norms change the output (a zero expert_norm_w and none differ)."""
    spec = SPECS["muse"].replace(latent_norm_eps=0.0, expert_norm_eps=0.0)
    args, extra = _args(spec, 17, torch.float64, seed=5)
    base = reference.moe_forward(*args, spec, acc=torch.float64, **extra)
    i_r, i_w2 = MOE_ARGS.index("router_w") + 1, MOE_ARGS.index("w2") + 1

    def run(sp, a=args, ex=extra):
        return reference.moe_forward(*a, sp, acc=torch.float64, **ex)

    a = list(args)
    a[i_r] = args[i_r] * spec.router_scale
    assert rel_err(run(spec.replace(router_scale=1.0), a), base) < 1e-9
    a = list(args)
    a[i_w2] = args[i_w2] * 7.0
    assert rel_err(run(spec, a), base) < 1e-9
    assert rel_err(run(spec, ex={**extra, "latent_in_w": extra["latent_in_w"] * 0.01}), base) < 1e-9
    no_norm = spec.replace(expert_norm="none", expert_norm_eps=1e-6)
    assert rel_err(run(no_norm, ex={k: v for k, v in extra.items() if k != "expert_norm_w"}), base) > 1e-2


def test_rms_norm_forms():
    """rms_norm's forms against their formulas, and the bf16 rounding of the scaled form: the scale first, rounded,
    then the normalisation (1 + w in w's dtype)."""
    v, w = torch.randn(5, 16, dtype=torch.float64), 0.3 * torch.randn(16, dtype=torch.float64)
    r = v / (v.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert torch.allclose(reference.rms_norm(v, w, "rms_1p", 1e-6, torch.float64, torch.float64), r * (1 + w))
    assert torch.allclose(reference.rms_norm(v, w, "rms", 1e-6, torch.float64, torch.float64), r * w)
    vb, wb = v.bfloat16(), w.bfloat16()
    s = (vb.float() * (1 + wb).float()).bfloat16().float()
    want = (s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).bfloat16()
    assert torch.equal(reference.rms_norm(vb, wb, "scaled_rms_1p", 1e-6, torch.bfloat16), want)


# ------------------------------------------------------------------------------------------------- the op
FORWARD = [("torch", n, T) for n in sorted(SPECS) for T in (3, 40)] + [
    ("triton", "muse", 3), ("triton", "muse", 24), ("triton", "latent_rms", 3), ("triton", "out_norm", 24)]
# (the interpreter is slow: a few; T=24 > max_t: aligned)


@pytest.mark.parametrize("backend,name,T", FORWARD)
def test_forward(poison, monkeypatch, backend, name, T):
    """T=3 (a decode size: the expert-norm specs take the aligned path anyway), T=24 / 40 aligned."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=8, g1=tile, g2=dict(tile, mode="fused")) if T <= 4 else dict(max_t=0)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dec)))
    args, extra = _args(SPECS[name], T, seed=T)
    check(args, extra, SPECS[name])


def test_forward_fse_router_scale(poison, monkeypatch, cpu_backend):
    """The shared gate fused into the router (FSE) with a router scale: the experts' logits are scaled, the gate's
    logit is not."""
    spec = SPECS["out_norm"].replace(has_expert_bias=False, router_scale=0.5)
    args, extra = _args(spec, 5, seed=9)
    fused = spec.replace(fused_shared_gate=True)
    a = list(args)
    i, g = MOE_ARGS.index("router_w") + 1, MOE_ARGS.index("shared_gate_w") + 1
    a[i], a[g] = torch.cat([args[i], args[g]], 0), None
    out = torch.ops.moecomp.moe_forward(*a, fused.key, **extra)
    assert rel_err(out, reference.moe_forward(*args, spec, **extra)) < TOL


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_arguments():
    spec = SPECS["muse"]
    args, extra = _args(spec, 3, seed=1)
    op = torch.ops.moecomp.moe_forward
    with pytest.raises(SpecError, match=r"expert_norm_w is required by the spec .* shape \(32,\) \(a norm's weight\)"):
        op(*args, spec.key, **{k: v for k, v in extra.items() if k != "expert_norm_w"})
    with pytest.raises(SpecError, match=r"latent_norm_w has shape \(40,\), the spec needs \(32,\)"):
        op(*args, spec.key, **{**extra, "latent_norm_w": torch.zeros(40)})
    with pytest.raises(SpecError, match=r"expert_norm_w has dtype torch.int64; expected a floating dtype"):
        op(*args, spec.key, **{**extra, "expert_norm_w": torch.zeros(32, dtype=torch.long)})
    plain = spec.replace(latent_norm="none", expert_norm="none")
    with pytest.raises(SpecError, match=r"latent_norm_w was given but the spec has no use for it"):
        op(*args, plain.key, **extra)
    x, w13, w2 = args[0], args[4], args[6]
    with pytest.raises(SpecError, match=r"moe_experts has no expert_norm_w argument"):
        torch.ops.moecomp.moe_experts(torch.zeros(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2),
                                      w13, None, w2, None, spec.experts_spec().key)


@pytest.mark.parametrize("backend,T", [("torch", 0), ("torch", 5), ("triton", 0)])  # triton T > 0: test_forward
def test_opcheck(monkeypatch, backend, T):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    spec = SPECS["muse"]
    args, extra = _args(spec, T, seed=T)
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key), extra)


# ------------------------------------------------------------------------------------------------- GPU
MUSE_GPU = MoESpec(num_experts=64, top_k=4, hidden_size=1024, intermediate_size=512, latent_size=768,
                   scoring="sigmoid", has_correction_bias=True, renorm_eps=1e-15, routed_scaling_factor=2.5,
                   router_fp32=True, router_scale=1024 ** -0.5, latent_norm="rms_1p", latent_norm_eps=1e-6,
                   expert_norm="scaled_rms_1p", expert_norm_eps=1e-8)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_cuda_graph_capture_and_replay(T, shared):
    """bf16 on the GPU, decode sizes and aligned ones, captured once and replayed on new inputs (the output
    NaN-poisoned before each replay, ``check_replays``); without latent projections with a gated shared expert."""
    spec = MUSE_GPU if not shared else MUSE_GPU.replace(
        latent_size=0, latent_norm="none", shared=SharedExpertSpec(512, gate="sigmoid"))
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1))
    extra = {**random_latent_args(spec, torch.bfloat16, "cuda", seed=101),
             **random_norm_args(spec, torch.bfloat16, "cuda", seed=201)}
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, extra=extra)
    xs = [torch.randn(T, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
          for seed in range(3)]
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec, **extra), 2e-2)
