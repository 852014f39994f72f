"""moe_forward / moe_experts against moecomp.oracle.reference over a grid of shapes, on CPU (torch path and Triton
kernels under the interpreter). Outputs and every scratch buffer are NaN-poisoned (``poison`` fixture).

Tolerances (relative Frobenius error vs the fp32 reference): fp32 1e-5; fp16 5e-3 (16-bit operands, the
intermediate activation and per-pair outputs are rounded to fp16 like HF does)."""

import pytest
import torch

from moecomp.oracle import reference
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_moe_args

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(spec, T, dtype, seed=0):
    args = random_moe_args(spec, T, dtype, seed=seed)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    ref = reference.moe_forward(*args, spec)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    if T:
        assert rel_err(out, ref) < TOL[dtype], f"rel err {rel_err(out, ref):.2e} for {spec.describe()} T={T}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("E", [4, 7, 8])
@pytest.mark.parametrize("k", [1, 2, "E"])
@pytest.mark.parametrize("T", [0, 1, 7, 33, 100])
def test_grid(cpu_backend, poison, T, E, k, dtype):
    k = E if k == "E" else k
    spec = MoESpec(num_experts=E, top_k=k, hidden_size=33, intermediate_size=17)
    check(spec, T, dtype, seed=T * 100 + E * 10 + k)


STYLES = {
    "mixtral": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40),
    "qwen3_no_renorm_round": MoESpec(num_experts=8, top_k=3, hidden_size=48, intermediate_size=40,
                                     renormalize=False, round_weights=True),
    "qwen2_shared_gate": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                                 shared=SharedExpertSpec(56, gate="sigmoid")),
    "deepseek_v3": MoESpec(num_experts=16, top_k=4, hidden_size=48, intermediate_size=24, scoring="sigmoid",
                           has_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           renorm_eps=1e-20, router_fp32=True, shared=SharedExpertSpec(48)),
    "deepseek_v2_softmax_group_max": MoESpec(num_experts=16, top_k=3, hidden_size=48, intermediate_size=24,
                                             n_group=4, topk_group=2, group_score="max", renormalize=False,
                                             routed_scaling_factor=1.5),
    "sigmoid_no_group": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, scoring="sigmoid",
                                has_correction_bias=True),
    "sqrtsoftplus": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, scoring="sqrtsoftplus"),
    "gpt_oss": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, score_order="topk_then_score",
                       renormalize=False, has_router_bias=True, activation="swiglu_oai", w_layout="in_out",
                       gate_up="interleaved", has_expert_bias=True, activation_alpha=1.702, activation_limit=0.5),
    # Llama 4: concatenated gate / up halves in the in_out layout (gemm1's pair_loop), weights on the input
    "llama4_in_out_concat": MoESpec(num_experts=8, top_k=1, hidden_size=48, intermediate_size=40, scoring="sigmoid",
                                    score_order="topk_then_score", renormalize=False, weight_on_input=True,
                                    w_layout="in_out", shared=SharedExpertSpec(24, layout="separate")),
    "in_out_concat_top2": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, w_layout="in_out"),
    "not_gated_gelu": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, gated=False,
                              activation="gelu"),
    "gelu_tanh_shared_concat": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                                       activation="gelu_tanh", shared=SharedExpertSpec(24, layout="concat")),
    "relu_shared_ungated_mlp": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                                       activation="relu", shared=SharedExpertSpec(24, gated=False, activation="relu")),
    # limits of 1.0 so that the clamps bind on these inputs (gate / up values ~ N(0, 1.4))
    "clamped_swiglu_shared_too": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                                         scoring="sigmoid", activation_clamp=True, activation_limit=1.0,
                                         shared=SharedExpertSpec(24, activation_clamp=True, activation_limit=1.0)),
    "relu2_ungated": MoESpec(num_experts=16, top_k=4, hidden_size=48, intermediate_size=24, gated=False,
                             activation="relu2", scoring="sigmoid", has_correction_bias=True, n_group=4, topk_group=2,
                             shared=SharedExpertSpec(32, gated=False, activation="relu2")),
    "swiglu_oai_concat_shared_oai": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                                            scoring="sigmoid", has_correction_bias=True, activation="swiglu_oai",
                                            activation_limit=1.0, routed_scaling_factor=2.0,
                                            shared=SharedExpertSpec(24, activation="swiglu_oai", layout="concat",
                                                                    activation_limit=1.0)),
    "bias_on_logits": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, scoring="sigmoid",
                              has_correction_bias=True, bias_on_logits=True, router_fp32=True),
    "group_mask_zero": MoESpec(num_experts=16, top_k=4, hidden_size=48, intermediate_size=24, n_group=4,
                               topk_group=2, group_mask_zero=True, routed_scaling_factor=1.5),
    "renorm_min": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, has_correction_bias=True,
                          renorm_min=0.6),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(STYLES))
def test_router_and_expert_styles(cpu_backend, poison, monkeypatch, name, dtype):
    # fp32: 70 tokens, >= 70 (token, expert) pairs over a single-program limit lowered to 64 (MOECOMP_ALIGN_SMALL_P):
    # the multi-program alignment for every style (top-1 too), two BLOCK_M (16) blocks for the busier experts (13 to
    # 26 rows per expert on average above top-1, 9 at top-1); fp16: a few tokens, the single-program alignment. (150
    # fp32 tokens, to pass the default limit of 256 pairs, cost twice the interpreter time; test_alignment_large_path
    # passes that limit.)
    if dtype == torch.float32:
        monkeypatch.setenv("MOECOMP_ALIGN_SMALL_P", "64")
    check(STYLES[name], 70 if dtype == torch.float32 else 21, dtype, seed=len(name))


def test_alignment_large_path(cpu_backend, poison):
    """More than 256 (token, expert) pairs takes the multi-program alignment (atomics) path."""
    spec = MoESpec(num_experts=7, top_k=3, hidden_size=33, intermediate_size=17)
    check(spec, 150, torch.float32, seed=3)


PATHS = {  # launches of each path: (align, gemm2, combine)
    "aligned": (1, 1, 1),  # align, gemm1, gemm2, combine
    "fused": (0, 0, 0),  # gemm1 DIRECT, moe_down_combine_kernel
    "pairs": (0, 1, 1),  # gemm1 DIRECT, gemm2 DIRECT, combine
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(STYLES))
def test_decode_and_aligned_paths(monkeypatch, poison, name, path):
    """Each style through the Triton kernels at a decode size (T=5) on each routed path, which must be the path
    taken (launches counted)."""
    import json

    from moecomp.ops import triton_moe, tuning

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.delenv("MOECOMP_DECODE_MAX_T", raising=False)
    spec = STYLES[name]
    cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, 5, spec.top_k,
                            torch.float32, torch.device("cpu"))
    tile = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    dec = dict(max_t=0) if path == "aligned" else dict(max_t=8, g1=tile, g2=dict(tile, mode=path))
    monkeypatch.setenv("MOECOMP_CONFIG", json.dumps(dict(cfg, decode=dec)))
    calls = dict.fromkeys(("align", "gemm2", "combine"), 0)
    for fn in calls:
        real = getattr(triton_moe, fn)

        def counted(*a, _real=real, _fn=fn, **kw):
            calls[_fn] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, counted)
    check(spec, 5, torch.float32, seed=len(name) + 7)
    assert tuple(calls.values()) == PATHS[path]


def test_leading_dims_kept(cpu_backend):
    spec = STYLES["mixtral"]
    args = random_moe_args(spec, 10, seed=1)
    x3 = args[0].reshape(2, 5, -1)
    out = torch.ops.moecomp.moe_forward(x3, *args[1:], spec.key)
    assert out.shape == x3.shape
    torch.testing.assert_close(out.reshape(10, -1), reference.moe_forward(*args, spec), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [0, 5, 40])
def test_moe_experts_given_routing(cpu_backend, poison, T):
    spec = MoESpec(num_experts=6, top_k=2, hidden_size=33, intermediate_size=17)
    args = random_moe_args(spec, T, seed=T)
    x = args[0]
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(T)]) if T else torch.empty(0, 2, dtype=torch.long)
    w = torch.rand(T, 2)
    a = dict(zip(("w13", "b13", "w2", "b2"), (args[4], args[5], args[6], args[7])))
    out = torch.ops.moecomp.moe_experts(x, ids, w, a["w13"], a["b13"], a["w2"], a["b2"], spec.key)
    ref = reference.experts(x, ids, w, a["w13"], a["b13"], a["w2"], a["b2"], spec)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_problem():
    spec = STYLES["mixtral"]
    args = list(random_moe_args(spec, 4, seed=0))
    with pytest.raises(SpecError, match="w13 has shape"):
        bad = args.copy()
        bad[4] = bad[4][:, :-1]
        torch.ops.moecomp.moe_forward(*bad, spec.key)
    with pytest.raises(SpecError, match="hidden_size"):
        torch.ops.moecomp.moe_forward(args[0][:, :-1], *args[1:], spec.key)
    with pytest.raises(SpecError, match="shared_w1 was given"):
        bad = args.copy()
        bad[8] = torch.randn(3, 48)
        torch.ops.moecomp.moe_forward(*bad, spec.key)
    with pytest.raises(SpecError, match="top_k"):
        MoESpec(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8)
    with pytest.raises(SpecError, match="n_group"):
        MoESpec(num_experts=10, top_k=2, hidden_size=8, intermediate_size=8, n_group=4)


def test_spec_key_roundtrip_and_hash():
    for spec in STYLES.values():
        again = MoESpec.from_key(spec.key)
        assert again == spec and hash(again) == hash(spec)
    assert len({s.key for s in STYLES.values()}) == len(STYLES)


def test_derived_weights_follow_the_parameters(cpu_backend):
    """FSE / fp32-router copies are cached per parameter: new tensors (even at a recycled address) and in-place
    updates must be seen (a stale cache gave wrong routing once)."""
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, router_fp32=True,
                   shared=SharedExpertSpec(16, gate="sigmoid"))
    for seed in range(3):
        args = random_moe_args(spec, 6, seed=seed)
        out = torch.ops.moecomp.moe_forward(*args, spec.key)
        torch.testing.assert_close(out, reference.moe_forward(*args, spec), rtol=1e-5, atol=1e-6)
        del args, out
    args = random_moe_args(spec, 6, seed=9)
    torch.ops.moecomp.moe_forward(*args, spec.key)
    with torch.no_grad():
        args[1].mul_(-3.0)  # router weights, in place
        args[-1].mul_(-2.0)  # shared-expert gate, in place
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    torch.testing.assert_close(out, reference.moe_forward(*args, spec), rtol=1e-5, atol=1e-6)


def test_fused_shared_gate_argument_form(cpu_backend, poison):
    """FSE form (what recognise/fx/fse.py emits): router_w = cat([router_w, shared_gate_w]) and no shared_gate_w."""
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40,
                   shared=SharedExpertSpec(24, gate="sigmoid"))
    args = list(random_moe_args(spec, 13, seed=5))
    plain = torch.ops.moecomp.moe_forward(*args, spec.key)
    fused_spec = spec.replace(fused_shared_gate=True)
    args[1] = torch.cat([args[1], args[-1]], 0)
    args[-1] = None
    fused = torch.ops.moecomp.moe_forward(*args, fused_spec.key)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, reference.moe_forward(*args, fused_spec), rtol=1e-5, atol=1e-6)
    with pytest.raises(SpecError, match="router_w has shape"):
        torch.ops.moecomp.moe_forward(args[0], args[1][:8], *args[2:], fused_spec.key)


@pytest.mark.parametrize("name,unset", [
    ("clamped_swiglu_shared_too", dict(activation_clamp=False)),
    ("relu2_ungated", dict(activation="relu")),
    ("swiglu_oai_concat_shared_oai", dict(activation="silu")),
    ("bias_on_logits", dict(bias_on_logits=False)),
])
def test_new_styles_are_not_noops(name, unset):
    """On the inputs of test_router_and_expert_styles each new spec field changes the reference output, so
    those tests would catch a kernel that ignored it."""
    spec = STYLES[name]
    args = random_moe_args(spec, 300, torch.float32, seed=len(name))
    other = spec.replace(**unset)
    if name == "clamped_swiglu_shared_too":
        other = other.replace(shared=SharedExpertSpec(24))
    assert rel_err(reference.moe_forward(*args, other), reference.moe_forward(*args, spec)) > 1e-2


def test_call_moe_forward_skips_the_dispatcher_only_when_that_changes_nothing(cpu_backend):
    from torch.utils._python_dispatch import TorchDispatchMode

    from moecomp.ops.moe_op import call_moe_forward

    spec = STYLES["qwen2_shared_gate"]
    args = random_moe_args(spec, 9, torch.float32, seed=11)
    want = torch.ops.moecomp.moe_forward(*args, spec.key)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        torch.testing.assert_close(call_moe_forward(args[0], args[1:], spec), want, rtol=0, atol=0)
        with Seen() as mode:  # a dispatch mode is active: the call must show up as the op
            torch.testing.assert_close(call_moe_forward(args[0], args[1:], spec), want, rtol=0, atol=0)
    assert any("moecomp.moe_forward" in o for o in mode.ops)
    with pytest.raises(SpecError, match="w13 has shape"):
        call_moe_forward(args[0], args[1:4] + (args[4][:, :-1],) + args[5:], spec)
