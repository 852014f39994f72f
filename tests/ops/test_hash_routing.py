"""``MoESpec.hash_routing`` (DeepSeek-V4's ``hash_moe`` layers: the ids are ``hash_table[token_ids]``, the weights the
router's scores there, renormalised and scaled): the spec field, the reference against a hand-written loop, then the
op (torch path, and the Triton routing kernel's HASH branch with the rest of the Triton path under the interpreter,
fp32) against the reference with every torch.empty NaN-poisoned, at a decode size and an aligned one; bad tables /
token ids -> SpecError (a ValueError) naming the argument; out-of-range values clamped (never read out of bounds) on
the paths the checks cannot reach; and (GPU only, unrun here) bf16 against the reference and CUDA-graph replays with
new token ids.

Tolerances: relative Frobenius error against the fp32 reference: fp32 1e-5 (as test_moe_op.py: fp32 dots, no tf32;
the lookup is exact). The reference against the fp64 loop: 1e-6. GPU bf16: 2e-2 (test_gpu.py's)."""

import dataclasses
import json

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops import hash_routing, torch_moe
from moecomp.core.args import MOE_ARGS, OP_ARGS
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_hash_args, random_moe_args

TOL = 1e-5
V = 37

SPECS = {
    # DeepSeek-V4's hash layer: sqrt(softplus) scores, renormalised (+1e-20), x1.5, clamped SwiGLU, a clamped shared
    "dsv4": MoESpec(num_experts=8, top_k=2, hidden_size=48, intermediate_size=40, scoring="sqrtsoftplus",
                    renorm_eps=1e-20, routed_scaling_factor=1.5, activation_clamp=True, activation_limit=10.0,
                    shared=SharedExpertSpec(24, activation_clamp=True, activation_limit=10.0), hash_routing=True),
    # softmax scores, not renormalised, router and expert biases, k = 3 (table rows may repeat an expert)
    "softmax_bias": MoESpec(num_experts=6, top_k=3, hidden_size=33, intermediate_size=17, renormalize=False,
                            has_router_bias=True, has_expert_bias=True, hash_routing=True),
}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(name: str, T: int, seed: int = 0, dtype=torch.float32, device="cpu", distinct: bool = True):
    spec = SPECS[name]
    args = random_moe_args(spec, T, dtype, device, seed=seed)
    return spec, args, random_hash_args(spec, T, V, device, seed=seed + 1, distinct=distinct)


def _score(v, scoring):
    return {"softmax": lambda: torch.softmax(v, -1), "sigmoid": lambda: torch.sigmoid(v),
            "sqrtsoftplus": lambda: torch.log1p(torch.exp(v)).sqrt()}[scoring]()


def _hand_loop(spec: MoESpec, args, h: dict) -> torch.Tensor:
    """The block token by token in fp64, nothing from moecomp.oracle.reference: ids = table[token id], weights = scores at
    them, renormalised (+ eps), scaled."""
    x, t = args[0].double(), {k: (v.double() if v is not None else None) for k, v in zip(MOE_ARGS, args[1:])}
    I, L = spec.intermediate_size, spec.activation_limit
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731

    def act(g, u):
        if spec.activation_clamp:
            g, u = g.clamp(max=L), u.clamp(-L, L)
        return silu(g) * u

    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        logits = t["router_w"] @ x[i] + (t["router_b"] if t["router_b"] is not None else 0)
        ids = h["hash_table"][h["token_ids"][i]]
        w = _score(logits, spec.scoring)[ids]
        if spec.renormalize:
            w = w / (w.sum() + spec.renorm_eps)
        w = w * spec.routed_scaling_factor
        for j in range(spec.top_k):
            e = int(ids[j])
            hh = t["w13"][e] @ x[i] + (t["b13"][e] if t["b13"] is not None else 0)
            out[i] += w[j] * (t["w2"][e] @ act(hh[:I], hh[I:]) + (t["b2"][e] if t["b2"] is not None else 0))
        if spec.shared is not None:
            out[i] += t["shared_w2"] @ act(t["shared_w1"] @ x[i], t["shared_w3"] @ x[i])
    return out


# ------------------------------------------------------------------------------------------------- spec
def test_spec_field():
    spec = SPECS["dsv4"]
    assert MoESpec.from_key(spec.key) == spec and '"hash_routing":true' in spec.key and "hash" in spec.describe()
    plain = spec.replace(hash_routing=False)
    assert "hash" not in plain.describe()
    old = json.loads(plain.key)
    del old["hash_routing"]  # a key written before the field existed: the default
    assert MoESpec.from_key(json.dumps(old, sort_keys=True, separators=(",", ":"))) == plain
    for bad, msg in ((dict(score_order="topk_then_score", scoring="softmax"), "topk_then_score"),
                     (dict(has_correction_bias=True), "correction bias"),
                     (dict(scoring="sigmoid", n_group=2, topk_group=1), "group-limited"),
                     (dict(zero_experts=2), "zero_experts"), (dict(hash_routing=1), "must be a bool")):
        with pytest.raises(SpecError, match=msg):
            spec.replace(**bad)


# ------------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_matches_hand_loop(name):
    spec, args, h = make(name, 23, seed=3, dtype=torch.float64, distinct=name == "dsv4")
    want = _hand_loop(spec, args, h)
    assert rel_err(reference.moe_forward(*args, spec, acc=torch.float64, **h), want) < 1e-6
    # the table decides: another table (same scores) gives another result
    other = dict(h, hash_table=h["hash_table"].roll(1, 0))
    assert rel_err(reference.moe_forward(*args, spec, acc=torch.float64, **other), want) > 1e-2


# ------------------------------------------------------------------------------------------------- the op
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_forward(cpu_backend, poison, name, T):
    spec, args, h = make(name, T, seed=T, distinct=name == "dsv4")
    ref = reference.moe_forward(*args, spec, **h)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, hash_table=h["hash_table"], token_ids=h["token_ids"])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL, f"{spec.describe()}: {rel_err(out, ref):.2e}"


def test_forward_3d_tokens(poison):
    """x [B, S, H] with token ids [B, S] (how a decoder layer passes them), positional: the two arguments after the
    latent projections (only the norms' weights follow)."""
    spec, args, h = make("dsv4", 6, seed=5)
    x = args[0].reshape(2, 3, -1)
    tok = h["token_ids"].reshape(2, 3)
    between = [None] * (OP_ARGS.index("hash_table") - len(MOE_ARGS))  # the scales and latent projections
    i = OP_ARGS.index("hash_table")
    assert OP_ARGS[i:i + 2] == ("hash_table", "token_ids")  # the optional arguments after them: None below
    out = torch.ops.moecomp.moe_forward(x, *args[1:], spec.key, *between, h["hash_table"], tok)
    assert out.shape == x.shape
    assert rel_err(out.reshape(6, -1), reference.moe_forward(*args, spec, **h)) < TOL


def _call(args, spec, **h):
    return torch.ops.moecomp.moe_forward(*args, spec.key, **h)


def test_bad_arguments_name_the_argument():
    spec, args, h = make("dsv4", 4, seed=1)
    tab, tok = h["hash_table"], h["token_ids"]
    cases = [
        (dict(token_ids=tok), r"hash_table is required"),
        (dict(hash_table=tab), r"token_ids is required"),
        (dict(hash_table=tab.float(), token_ids=tok), r"hash_table has dtype torch.float32; expected an integer"),
        (dict(hash_table=tab, token_ids=tok.float()), r"token_ids has dtype torch.float32"),
        (dict(hash_table=tab[:, :1], token_ids=tok), r"hash_table has shape \(37, 1\); expected 2-D \[V >= 1, "
                                                     r"top_k=2\]"),
        (dict(hash_table=tab, token_ids=tok[:3]), r"token_ids has shape \(3,\) \(3 ids\); expected one id per "
                                                  r"token of x \(4, 48\) \(4 tokens\)"),
        (dict(hash_table=tab, token_ids=tok.to("meta")), r"token_ids is on meta"),
        (dict(hash_table=tab, token_ids=torch.tensor([0, 1, V, 2])), r"token_ids holds ids in \[0, 37\]; expected "
                                                                     r"every id in \[0, V=37\)"),
        (dict(hash_table=tab, token_ids=torch.tensor([0, -1, 3, 2])), r"token_ids holds ids in \[-1, 3\]"),
        (dict(hash_table=tab.clone().index_fill_(0, tok[:1], 8), token_ids=tok),
         r"hash_table rows of these tokens hold expert ids in \[\d+, 8\]; expected every id in \[0, num_experts=8\)"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _call(args, spec, **kw)
    with pytest.raises(SpecError, match=r"hash_table was given but the spec has no hash routing"):
        _call(args, spec.replace(hash_routing=False), **h)
    with pytest.raises(SpecError, match=r"hash_table holds expert ids in \[-3, \d\]"):
        hash_routing.check_table(tab.clone().index_fill_(0, torch.tensor([5]), -3), spec)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_out_of_range_values_are_clamped(poison, path):
    """Where the checks cannot run (CUDA under capture / compile), the implementations clamp: token ids into
    [0, V - 1], table entries into [0, E - 1]. Called below the checks here, each path gives exactly what the
    reference gives on the clamped values, finite (no read past the table or the weights)."""
    spec, args, h = make("dsv4", 5, seed=7)
    tok = torch.tensor([-4, 0, V, 3, 10 * V])
    tab = h["hash_table"].clone()
    tab[0, 0], tab[3, 1], tab[V - 1, 0] = -2, 50, 9  # rows these tokens select
    want = reference.moe_forward(*args, spec, hash_table=tab.clamp(0, 7), token_ids=tok.clamp(0, V - 1))
    named = dict(zip(MOE_ARGS, args[1:]), hash_table=tab, token_ids=tok)
    if path == "torch":
        out = torch_moe.moe_forward(args[0], named, spec)
    else:
        from moecomp.ops import triton_moe

        out = triton_moe.moe_forward(args[0], named, spec)
    assert torch.isfinite(out).all() and rel_err(out, want) < TOL


# ------------------------------------------------------------------------------------------------- GPU (unrun here)
GPU_SPEC = dataclasses.replace(SPECS["dsv4"], num_experts=64, top_k=6, hidden_size=1024, intermediate_size=512,
                               shared=SharedExpertSpec(512, activation_clamp=True, activation_limit=10.0))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 200])
def test_gpu_bf16_against_reference(T):
    """The Triton path in bf16 (decode and aligned sizes) against the fp32 reference on the same bf16 inputs."""
    spec = GPU_SPEC
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", seed=T)
    h = random_hash_args(spec, T, 1000, "cuda", seed=T + 1)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **h)
    ref = reference.moe_forward(*[a.float() if a is not None else None for a in args], spec, **h)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_gpu_token_ids_are_read_at_every_replay():
    """Captured in a CUDA graph with a static token-id buffer, then replayed after new ids are written into it: each
    replay routes by the ids it finds (an input of the captured step, not a constant of the capture). The op's own
    eager graphs (``ops/graphs.py``, captured on a shape's second eager call) copy the ids in like x."""
    from moecomp.ops import graphs
    from moecomp.ops.moe_op import OP_ARGS, call_moe_forward

    spec, T = GPU_SPEC, 4
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", seed=11)
    h = random_hash_args(spec, T, 1000, "cuda", seed=12)
    x, table, tok = args[0].clone(), h["hash_table"], h["token_ids"].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.ops.moecomp.moe_forward(x, *args[1:], spec.key, hash_table=table, token_ids=tok)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.moecomp.moe_forward(x, *args[1:], spec.key, hash_table=table, token_ids=tok)
    f32 = [a.float() if a is not None else None for a in args[1:]]
    for seed in range(3):
        new = torch.randint(0, 1000, (T,), generator=torch.Generator().manual_seed(seed)).cuda()
        tok.copy_(new)
        graph.replay()
        want = reference.moe_forward(x.float(), *f32, spec, hash_table=table, token_ids=new)
        assert rel_err(static_out, want) < 2e-2
    graphs.clear()
    tensors = [dict(zip(OP_ARGS[: len(args) - 1], args[1:]), hash_table=table).get(a) for a in OP_ARGS]
    i = OP_ARGS.index("token_ids")
    for seed in range(4):  # plain, captured, replayed, replayed
        new = torch.randint(0, 1000, (T,), generator=torch.Generator().manual_seed(100 + seed)).cuda()
        tensors[i] = new
        with torch.no_grad():
            out = call_moe_forward(x, tensors, spec)
        want = reference.moe_forward(x.float(), *f32, spec, hash_table=table, token_ids=new)
        assert rel_err(out, want) < 2e-2
    assert graphs.stats["replayed"] >= 2
