"""Ergo's norms in the spec: ``MoESpec.expert_norm`` "rms_per_expert" (each pair's expert output normalised and
multiplied by its expert's own row of ``expert_norm_w`` [E, H], in fp32, before the routing weight) and
``SharedExpertSpec.norm`` "rms" (the shared expert's output normalised, times ``shared_norm_w`` [H], before its gate
and scale). The spec fields and checks; the reference against a hand-written fp64 loop; the op (torch path, and the
Triton kernels under the interpreter) against the reference with every torch.empty NaN-poisoned, at a decode size
and an aligned one, fp32 and fp16; bad arguments; opcheck; (GPU only) bf16 with CUDA-graph capture.

Tolerances (relative Frobenius error against the reference): fp32 1e-5 (tests/ops/test_norms.py's); fp16 against the
fp32 reference on the same fp16 inputs 2e-3 (per-pair outputs and the shared output rounded to fp16 as the model
does; measured <= 9e-4); the reference against the fp64 loop 1e-6 (both fp64); GPU bf16 2e-2 (tests/ops/test_gpu.py).
"""

import math

import pytest
import torch

from moecomp.oracle import reference
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec, SpecError
from moecomp.testing import capture_moe_forward, check_replays, random_moe_args, random_norm_args, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def ergo(E=6, k=2, H=24, I=16, Is=12, **kw) -> MoESpec:
    """Ergo's block: fp32 sigmoid router with a correction bias, renorm eps 1e-20, times sqrt(8), weights rounded;
    ungated relu2 experts [E, in, out], a per-expert output norm; an ungated relu2 shared expert with its norm."""
    return MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, scoring="sigmoid",
                   has_correction_bias=True, renorm_eps=1e-20, routed_scaling_factor=math.sqrt(8), round_weights=True,
                   router_fp32=True, activation="relu2", gated=False, w_layout="in_out",
                   expert_norm="rms_per_expert", expert_norm_eps=1e-6,
                   shared=SharedExpertSpec(Is, activation="relu2", gated=False, norm="rms", norm_eps=1e-5), **kw)


def _args(spec: MoESpec, T: int, dtype=torch.float32, device="cpu", seed: int = 0):
    extra = {n: 1 + v for n, v in random_norm_args(spec, dtype, device, seed=seed + 200).items()}
    return random_moe_args(spec, T, dtype, device, seed=seed, std=0.4), extra


def test_spec_fields_and_checks():
    s = ergo()
    assert MoESpec.from_key(s.key) == s
    assert s.norm_shapes() == {"expert_norm_w": (6, 24), "shared_norm_w": (24,)}
    assert s.replace(shared=None).norm_shapes() == {"expert_norm_w": (6, 24)}
    with pytest.raises(SpecError, match=r"shared expert norm='layer' is not one of \('none', 'rms'\)"):
        SharedExpertSpec(8, norm="layer").validate()
    with pytest.raises(SpecError, match="shared expert norm_eps must be a finite number >= 0"):
        SharedExpertSpec(8, norm="rms", norm_eps=-1.0).validate()
    with pytest.raises(SpecError, match="norm='rms' with stacked shared experts is not supported"):
        SharedExpertSpec(8, norm="rms", stacked=2, gated=False).validate()
    with pytest.raises(SpecError, match=r"shared_gamma='joint_renorm' with a shared expert norm \(shared.norm\)"):
        MoESpec(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4, scoring="sigmoid",
                shared=SharedExpertSpec(4, gated=False, norm="rms"), shared_gamma="joint_renorm")
    with pytest.raises(SpecError, match=r"expert_norm='rms_per_expert' with quantized experts"):
        MoESpec(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, expert_norm="rms_per_expert",
                quant=QuantSpec())


def _hand_loop(spec: MoESpec, args, extra) -> torch.Tensor:
    """The block token by token in fp64, nothing from moecomp.oracle.reference."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    nw, sw = extra["expert_norm_w"].double(), extra["shared_norm_w"].double()

    def rms(v, eps):
        return v / torch.sqrt((v * v).mean() + eps)

    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        s = torch.sigmoid(t["router_w"] @ x[i])
        ids = torch.topk(s + t["correction_bias"], spec.top_k).indices
        w = s[ids] / (s[ids].sum() + spec.renorm_eps) * spec.routed_scaling_factor
        for e, we in zip(ids.tolist(), w):
            h = torch.relu(x[i] @ t["w13"][e]) ** 2  # in_out: [H, I]
            out[i] += we * rms(h @ t["w2"][e], spec.expert_norm_eps) * nw[e]
        hs = torch.relu(t["shared_w3"] @ x[i]) ** 2
        out[i] += rms(t["shared_w2"] @ hs, spec.shared.norm_eps) * sw
    return out


def test_reference_matches_hand_loop():
    spec = ergo()
    args, extra = _args(spec, 7, dtype=torch.float64, seed=4)
    ref = reference.moe_forward(*args, spec, acc=torch.float64, **extra)
    assert rel_err(ref, _hand_loop(spec, args, extra)) < 1e-6


FORWARD = [(b, T, dt) for b in ("torch", "triton") for T in (3, 24) for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("backend,T,dtype", FORWARD, ids=lambda v: str(v).replace("torch.", ""))
def test_forward(poison, monkeypatch, backend, T, dtype):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    spec = ergo()
    args, extra = _args(spec, T, dtype, seed=T)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **extra)
    ref = reference.moe_forward(*args, spec, **extra)
    assert out.dtype == dtype and torch.isfinite(out).all() and rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


@pytest.mark.parametrize("gate", ["none", "sigmoid"])
def test_shared_norm_alone(poison, cpu_backend, gate):
    """A gated silu shared expert (separate gate / up) with its output norm, scaled, sigmoid-gated or not, beside
    plain routed experts: the norm comes before the gate and the scale."""
    sh = SharedExpertSpec(10, norm="rms", norm_eps=1e-6, gate=gate, scale=0.5)
    spec = MoESpec(num_experts=5, top_k=2, hidden_size=20, intermediate_size=8, shared=sh)
    args, extra = _args(spec, 6, seed=2)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **extra)
    assert rel_err(out, reference.moe_forward(*args, spec, **extra)) < TOL[torch.float32]
    plain = reference.moe_forward(*args, spec.replace(shared=None))
    t = dict(zip(MOE_ARGS, args[1:]))
    y = (torch.nn.functional.silu(args[0] @ t["shared_w1"].T) * (args[0] @ t["shared_w3"].T)) @ t["shared_w2"].T
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * extra["shared_norm_w"]
    y = y * (torch.sigmoid(args[0] @ t["shared_gate_w"].T) if gate == "sigmoid" else 1) * 0.5
    assert rel_err(out, plain + y) < TOL[torch.float32]


def test_bad_arguments():
    spec = ergo()
    args, extra = _args(spec, 3, seed=1)
    op = torch.ops.moecomp.moe_forward
    with pytest.raises(SpecError, match=r"expert_norm_w has shape \(24,\), the spec needs \(6, 24\)"):
        op(*args, spec.key, **{**extra, "expert_norm_w": torch.ones(24)})
    with pytest.raises(SpecError, match=r"shared_norm_w is required by the spec .* shape \(24,\) \(a norm's weight\)"):
        op(*args, spec.key, expert_norm_w=extra["expert_norm_w"])
    with pytest.raises(SpecError, match=r"shared_norm_w was given but the spec has no use for it"):
        plain = spec.replace(shared=SharedExpertSpec(12, activation="relu2", gated=False))
        op(*args, plain.key, **extra)


@pytest.mark.parametrize("backend,T", [("torch", 0), ("torch", 5), ("triton", 0), ("triton", 3)])
def test_opcheck(monkeypatch, backend, T):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    spec = ergo()
    args, extra = _args(spec, T, seed=T)
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key), extra)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 600])
def test_gpu_cuda_graph_capture_and_replay(T):
    """bf16 on the GPU at Ergo-like sizes, decode sizes and aligned ones, captured once and replayed on new inputs
    (the output NaN-filled before each replay), against the fp32 reference on the same bf16 inputs."""
    spec = ergo(E=64, k=8, H=1024, I=256, Is=512)
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=1))
    extra = {n: (1 + v.float()).to(torch.bfloat16) for n, v in random_norm_args(spec, torch.bfloat16, "cuda",
                                                                               seed=201).items()}
    static_x = args[0].clone()
    graph, static_out = capture_moe_forward(static_x, args[1:], spec, extra=extra)
    xs = [torch.randn(T, spec.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
          for seed in range(3)]
    check_replays(graph, static_x, static_out, xs, lambda x: reference.moe_forward(x, *args[1:], spec, **extra), 2e-2)
