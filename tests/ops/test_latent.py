"""``MoESpec.latent_size`` (NemotronH's ``moe_latent_size``): the routed experts run between ``latent_in`` [H -> L] and
``latent_out`` [L -> H]; the router and the shared experts read x. The spec fields, the reference against a
hand-written fp64 loop (the routed scaling before the output projection and its bias), then the op (torch path, and
the Triton kernels under the interpreter, fp32) against the reference with every torch.empty NaN-poisoned
(``poison``), at decode sizes on both decode paths and at an aligned size; bad shapes / dtypes; opcheck; (GPU only)
bf16 with CUDA-graph capture.

Tolerances: relative Frobenius error against the fp32 reference, as in test_zero_experts.py: fp32 1e-5 (fp32 dots,
no tf32; the projections are two more fp32 GEMMs). The reference against the fp64 loop: 1e-5. Applying the routed
scaling after the output projection's bias instead moves the output by more than 1e-2 here
(``test_scaling_before_the_output_bias``), far outside these tolerances."""

import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import triton_moe
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import check_op, capture_moe_forward, check_replays, random_latent_args, random_moe_args, rel_err

TOL = 1e-5

SPECS = {
    # NemotronH: sigmoid + correction bias, renormalised (eps 1e-20), scaled; relu2 experts, relu2 shared expert
    "nemotron": MoESpec(num_experts=8, top_k=2, hidden_size=40, intermediate_size=24, latent_size=32,
                        scoring="sigmoid", has_correction_bias=True, renorm_eps=1e-20, routed_scaling_factor=2.5,
                        router_fp32=True, gated=False, activation="relu2",
                        shared=SharedExpertSpec(16, activation="relu2", gated=False)),
    # projections with biases (mlp_bias), gated silu experts with biases, a sigmoid-gated shared expert, router bias
    "bias": MoESpec(num_experts=6, top_k=2, hidden_size=36, intermediate_size=20, latent_size=24, latent_bias=True,
                    has_router_bias=True, has_expert_bias=True, routed_scaling_factor=1.5,
                    shared=SharedExpertSpec(12, gate="sigmoid")),
    # zero experts (identity in the latent space: weight * xl), L wider than H, no shared expert
    "zero": MoESpec(num_experts=6, top_k=3, hidden_size=24, intermediate_size=16, latent_size=40, latent_bias=True,
                    zero_experts=2, renormalize=False),
    # the routing weights on the experts' (latent) input, Llama 4 style: each expert runs on w * xl
    "on_input": MoESpec(num_experts=6, top_k=2, hidden_size=28, intermediate_size=12, latent_size=20,
                        scoring="sigmoid", score_order="topk_then_score", renormalize=False, weight_on_input=True),
}


def _args(spec: MoESpec, T: int, dtype=torch.float32, device="cpu", seed: int = 0):
    return random_moe_args(spec, T, dtype, device, seed=seed), random_latent_args(spec, dtype, device, seed=seed + 100)


def _hand_loop(spec: MoESpec, args, lat) -> torch.Tensor:
    """The block token by token in fp64, with nothing from moecomp.oracle.reference: routing on x, the experts on
    xl = Wi x + bi, the weighted sum (routed scaling inside the weights) through Wo (+ bo), the shared expert on x."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    lat = {k: v.double() for k, v in lat.items()}
    E, I = spec.num_experts, spec.intermediate_size
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        logits = t["router_w"] @ x[i] + (t["router_b"] if t["router_b"] is not None else 0)
        if spec.score_order == "topk_then_score":  # (sigmoid of the chosen logits)
            ids = torch.topk(logits, spec.top_k).indices
            w = torch.sigmoid(logits[ids])
        else:
            s = torch.sigmoid(logits) if spec.scoring == "sigmoid" else torch.softmax(logits, -1)
            ids = torch.topk(s + (t["correction_bias"] if t["correction_bias"] is not None else 0), spec.top_k).indices
            w = s[ids]
        if spec.renormalize:
            w = w / (w.sum() + spec.renorm_eps)
        w = w * spec.routed_scaling_factor
        xl = lat["latent_in_w"] @ x[i] + lat.get("latent_in_b", 0)
        routed = torch.zeros_like(xl)
        for j in range(spec.top_k):
            e = int(ids[j])
            if e >= E:  # a zero expert: its output is its (latent) input
                routed += w[j] * xl
                continue
            xin = w[j] * xl if spec.weight_on_input else xl
            h = t["w13"][e] @ xin + (t["b13"][e] if t["b13"] is not None else 0)
            h = silu(h[:I]) * h[I:] if spec.gated else torch.relu(h) ** 2
            y = t["w2"][e] @ h + (t["b2"][e] if t["b2"] is not None else 0)
            routed += y if spec.weight_on_input else w[j] * y
        out[i] = lat["latent_out_w"] @ routed + lat.get("latent_out_b", 0)
        sh = spec.shared
        if sh is not None:
            hs = (silu(t["shared_w1"] @ x[i]) * (t["shared_w3"] @ x[i]) if sh.gated
                  else torch.relu(t["shared_w3"] @ x[i]) ** 2)
            y = t["shared_w2"] @ hs
            out[i] += y * torch.sigmoid(t["shared_gate_w"] @ x[i]) if sh.gate == "sigmoid" else y
    return out


def check(args, lat, spec: MoESpec) -> torch.Tensor:
    return check_op(args, lat, spec, TOL)


# ------------------------------------------------------------------------------------------------- spec
def test_spec_fields():
    spec = SPECS["bias"]
    assert MoESpec.from_key(spec.key) == spec and '"latent_size":24' in spec.key and '"latent_bias":true' in spec.key
    assert "latent L=24+b" in spec.describe() and spec.expert_width == 24
    assert spec.expert_weight_shapes() == {"w13": (6, 40, 24), "w2": (6, 24, 20), "b13": (6, 40), "b2": (6, 24)}
    assert spec.latent_shapes() == {"latent_in_w": (24, 36), "latent_out_w": (36, 24), "latent_in_b": (24,),
                                    "latent_out_b": (36,)}
    ex = spec.experts_spec()
    assert (ex.hidden_size, ex.latent_size, ex.shared, ex.expert_weight_shapes()) == (24, 0, None,
                                                                                     spec.expert_weight_shapes())
    plain = spec.replace(latent_size=0, latent_bias=False)
    assert "latent" not in plain.describe() and plain.latent_shapes() == {} and plain.experts_spec() is plain
    old = json.loads(plain.key)
    del old["latent_size"], old["latent_bias"]  # a key written before the fields existed: the defaults
    assert MoESpec.from_key(json.dumps(old, sort_keys=True, separators=(",", ":"))) == plain
    for bad in (-1, True, 2.0):
        with pytest.raises(SpecError, match="latent_size must be an int >= 0"):
            spec.replace(latent_size=bad)
    with pytest.raises(SpecError, match="latent_bias needs latent projections"):
        plain.replace(latent_bias=True)


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_matches_hand_loop(name):
    spec = SPECS[name]
    args, lat = _args(spec, 23, torch.float64, seed=3)
    if spec.zero_experts:
        x, t = args[0], dict(zip(MOE_ARGS, args[1:]))
        ids = reference.route(reference.router_logits(x, t["router_w"], None, spec), None, spec)[1]
        assert (ids >= spec.num_experts).any() and (ids < spec.num_experts).any()
    assert rel_err(reference.moe_forward(*args, spec, acc=torch.float64, **lat), _hand_loop(spec, args, lat)) < 1e-5


def test_scaling_before_the_output_bias():
    """What the tolerances guard: the routed scale applied after latent_out's bias (not before it, as in the model)
    moves the output far more than any tolerance here."""
    spec = SPECS["bias"]
    args, lat = _args(spec, 16, seed=4)
    want = reference.moe_forward(*args, spec, **lat)
    c = spec.routed_scaling_factor
    t = dict(zip(MOE_ARGS, args[1:]))
    no_shared = {**t, "shared_w1": None, "shared_w3": None, "shared_w2": None, "shared_gate_w": None}
    routed1 = reference.moe_forward(args[0], **no_shared, spec=spec.replace(routed_scaling_factor=1.0, shared=None),
                                    **lat)
    shared = want - reference.moe_forward(args[0], **no_shared, spec=spec.replace(shared=None), **lat)
    assert rel_err(c * routed1 + shared, want) > 1e-2  # c * (Wo s + bo): the bias scaled too


# ------------------------------------------------------------------------------------------------- the op
FORWARD = [("torch", n, T) for n in sorted(SPECS) for T in (3, 40)] + [
    ("triton", "nemotron", 3), ("triton", "bias", 3), ("triton", "zero", 40), ("triton", "on_input", 3)]
# (the interpreter is slow: a few)


@pytest.mark.parametrize("backend,name,T", FORWARD)
def test_forward(poison, monkeypatch, backend, name, T):
    """T=3 on the decode path (fused down-combine), T=40 on the aligned one; torch path and Triton kernels."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=8, g1=tile, g2=dict(tile, mode="fused")) if T <= 4 else dict(max_t=0)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dec)))
    args, lat = _args(SPECS[name], T, seed=T)
    check(args, lat, SPECS[name])


def test_forward_decode_pairs_and_fse(monkeypatch, poison):
    """The Triton decode path's gemm2 DIRECT + combine mode, with the shared gate fused into the router (FSE): the
    projected output and the gated shared expert meet in the one-slot combine."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(BLOCK_M=16, g1=tile, g2=tile, decode=dict(
        max_t=8, g1=tile, g2=dict(tile, mode="pairs")))))
    spec = SPECS["bias"].replace(has_router_bias=False)
    args, lat = _args(spec, 2, seed=7)
    fused = spec.replace(fused_shared_gate=True)
    a = list(args)
    i, g = MOE_ARGS.index("router_w") + 1, MOE_ARGS.index("shared_gate_w") + 1
    a[i], a[g] = torch.cat([args[i], args[g]], 0), None
    out = torch.ops.moecomp.moe_forward(*a, fused.key, **lat)
    assert rel_err(out, reference.moe_forward(*args, spec, **lat)) < TOL
    calls = []
    real = triton_moe.combine
    monkeypatch.setattr(triton_moe, "combine", lambda *x, **k: (calls.append(x[2]), real(*x, **k))[1])
    check(args, lat, spec)
    assert calls == [2, 1]  # the routed combine over k = 2 slots in L, then the shared expert's one slot in H


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_arguments():
    spec = SPECS["bias"]
    args, lat = _args(spec, 3, seed=1)
    op = torch.ops.moecomp.moe_forward
    with pytest.raises(SpecError, match=r"latent_in_w has shape \(36, 24\), the spec needs \(24, 36\)"):
        op(*args, spec.key, **{**lat, "latent_in_w": lat["latent_out_w"]})
    with pytest.raises(SpecError, match=r"latent_out_b has shape \(24,\), the spec needs \(36,\)"):
        op(*args, spec.key, **{**lat, "latent_out_b": lat["latent_in_b"]})
    with pytest.raises(SpecError, match=r"latent_out_w is required by the spec .* expected a tensor of shape \(36, 24\)"):
        op(*args, spec.key, **{k: v for k, v in lat.items() if k != "latent_out_w"})
    with pytest.raises(SpecError, match=r"latent_in_w has dtype torch.float64; expected torch.float32"):
        op(*args, spec.key, **{**lat, "latent_in_w": lat["latent_in_w"].double()})
    plain = spec.replace(latent_size=0, latent_bias=False)
    with pytest.raises(SpecError, match=r"latent_in_w was given but the spec has no use for it"):
        op(*random_moe_args(plain, 3, seed=1), plain.key, **lat)
    wide = list(args)
    wide[MOE_ARGS.index("w13") + 1] = torch.zeros(6, 40, 36)  # experts on the hidden width H, not L
    with pytest.raises(SpecError, match=r"w13 has shape \(6, 40, 36\), the spec needs \(6, 40, 24\)"):
        op(*wide, spec.key, **lat)
    x, w13, b13, w2, b2 = args[0], args[4], args[5], args[6], args[7]
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    with pytest.raises(SpecError, match=r"moe_experts .* latent projections .* experts_spec\(\)"):
        torch.ops.moecomp.moe_experts(x, ids, w, w13, b13, w2, b2, spec.key)
    xl = reference.latent_in(x, lat["latent_in_w"], lat["latent_in_b"])  # the experts alone, on their own width
    out = torch.ops.moecomp.moe_experts(xl, ids, w, w13, b13, w2, b2, spec.experts_spec().key)
    assert out.shape == (3, 24)


@pytest.mark.parametrize("backend,T", [("torch", 0), ("torch", 5), ("triton", 0)])  # triton T > 0: test_forward
def test_opcheck(monkeypatch, backend, T):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    spec = SPECS["bias"]
    args, lat = _args(spec, T, seed=T)
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key), lat)


# ------------------------------------------------------------------------------------------------- GPU
NEMOTRON_GPU = MoESpec(num_experts=64, top_k=6, hidden_size=1024, intermediate_size=512, latent_size=256,
                       scoring="sigmoid", has_correction_bias=True, n_group=1, renorm_eps=1e-20,
                       routed_scaling_factor=2.5, router_fp32=True, gated=False, activation="relu2",
                       shared=SharedExpertSpec(1024, activation="relu2", gated=False))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_cuda_graph_capture_and_replay(T, bias):
    """bf16 on the GPU: the decode path (T = 1, 4) and the aligned one, with the shared experts on the side stream,
    captured once and replayed on new inputs. Tolerance 2e-2, as tests/ops/test_gpu.py."""
    spec = NEMOTRON_GPU.replace(latent_bias=bias)
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1))
    lat = random_latent_args(spec, torch.bfloat16, "cuda", seed=101)
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, extra=lat)
    xs = [torch.randn(T, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
          for seed in range(3)]
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec, **lat), 2e-2)
