"""Routing record and replay on the op (issue 43, ``ops/routes.py``): ``moe_forward_routes``' ``routes_out`` /
``route_weights_out`` (record) and ``moe_forward``'s ``routes_in`` (replay), on the torch path and on the Triton kernels
under the interpreter (fp32 only: the interpreter's bf16 dot is wrong).

- the recorded ids equal the oracle's routing (``moecomp.oracle.reference.route_with_gammas``), tokens within a
  relative 1e-5 of a tie (``near_tie_tokens``) excepted and counted; the recorded weights equal the oracle's
  (fp32 tolerance 1e-5);
- a call replaying the routes it recorded gives the original output exactly (same path, same weights: tolerance 0);
- a replay of other, given routes equals the oracle's replay (fp32, rtol 1e-4 / atol 1e-5), and records them;
- opcheck with the new arguments; bad arguments are ValueErrors naming them.
"""

import pytest
import torch

from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.oracle import reference as ref
from moecomp.testing import random_hash_args, random_moe_args

SPECS = {
    "softmax": MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24),
    "sigmoid_bias_groups": MoESpec(num_experts=8, top_k=3, hidden_size=32, intermediate_size=16, scoring="sigmoid",
                                   has_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                   renorm_eps=1e-20, shared=SharedExpertSpec(16, gate="sigmoid")),
    "topk_then_score": MoESpec(num_experts=8, top_k=2, hidden_size=16, intermediate_size=16,
                               score_order="topk_then_score", renormalize=False, has_router_bias=True),
    "zero_experts": MoESpec(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, zero_experts=2,
                            renormalize=False, routed_scaling_factor=1.5),
    "capacity": MoESpec(num_experts=4, top_k=2, hidden_size=24, intermediate_size=20, renorm_after_drop=True,
                        router_fp32=True, capacity_factor=0.4),
}
T = 7
TIE_REL = 1e-5


def _oracle_routes(args, spec: MoESpec, replay=None):
    """(weights, ids) of the oracle's routing of args' x (ids -1 where an expert capacity drops a pair)."""
    x, rw, rb, cb = args[0], args[1], args[2], args[3]
    logits = ref.router_logits(x, rw, rb, spec)
    w, ids, _ = ref.route_with_gammas(logits, cb, spec, group=T, replay=replay)
    return w, ids


def _record(args, spec: MoESpec, **kw):
    out = torch.full((T, spec.top_k), -7, dtype=torch.int32)
    wout = torch.full((T, spec.top_k), float("nan"))
    y = torch.ops.moecomp.moe_forward_routes(out, wout, *args, spec.key, **kw)
    return y, out, wout


@pytest.mark.parametrize("name", list(SPECS))
def test_record_equals_oracle(cpu_backend, poison, name):
    spec = SPECS[name]
    args = random_moe_args(spec, T, seed=3)
    y, out, wout = _record(args, spec)
    y_plain = torch.ops.moecomp.moe_forward(*args, spec.key)
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0)  # recording changes nothing
    w_ref, ids_ref = _oracle_routes(args, spec)
    ties = ref.near_tie_tokens(args[0], args[1], args[2], args[3], spec, TIE_REL)
    ok = ~ties
    assert int(ties.sum()) <= 1, f"{int(ties.sum())} of {T} tokens near a tie: inputs too tied to test"
    kept = ids_ref >= 0  # an expert capacity's dropped pairs: recorded as selected (the oracle says -1), weight 0
    mask = ok[:, None] & kept
    assert torch.equal(out.long()[mask], ids_ref[mask]), (out, ids_ref, ties)
    assert ((out >= 0) & (out < spec.router_width)).all()
    torch.testing.assert_close(wout[ok], w_ref.float()[ok], rtol=1e-5, atol=1e-6)
    if spec.has_capacity:
        assert (~kept).any(), "the capacity dropped nothing: the case tests no drop"
        assert (wout[~kept] == 0).all()
        _, selected = _oracle_routes(args, spec.replace(capacity_factor=0.0, renorm_after_drop=False))
        assert torch.equal(out.long()[ok], selected[ok])  # the dropped pairs too: the selection before the drop


@pytest.mark.parametrize("name", list(SPECS))
def test_replay_recorded_gives_original(cpu_backend, poison, name):
    spec = SPECS[name]
    args = random_moe_args(spec, T, seed=5)
    y, out, wout = _record(args, spec)
    y2, out2, wout2 = _record(args, spec, routes_in=out.clone())
    assert not torch.isnan(y2).any()
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    assert torch.equal(out2, out)
    torch.testing.assert_close(wout2, wout, rtol=0, atol=0)
    y3 = torch.ops.moecomp.moe_forward(*args, spec.key, routes_in=out.long())  # int64 routes too
    torch.testing.assert_close(y3, y, rtol=0, atol=0)


def _other_routes(spec: MoESpec, seed: int) -> torch.Tensor:
    """Distinct ids per token over the router's width, unlike the router's choice."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(spec.router_width, generator=g)[: spec.top_k] for _ in range(T)]).int()


@pytest.mark.parametrize("name", list(SPECS))
def test_replay_given_equals_oracle(cpu_backend, poison, name):
    spec = SPECS[name]
    args = random_moe_args(spec, T, seed=7)
    given = _other_routes(spec, seed=1)
    y, out, wout = _record(args, spec, routes_in=given)
    y_ref = ref.moe_forward(*args, spec, routes_in=given)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(out, given)
    w_ref, _ = _oracle_routes(args, spec, replay=given)
    torch.testing.assert_close(wout, w_ref.float(), rtol=1e-5, atol=1e-6)
    y_own = torch.ops.moecomp.moe_forward(*args, spec.key)
    assert not torch.allclose(y, y_own, rtol=1e-3, atol=1e-4), "the given routes changed nothing"


def test_replay_ignores_bias_and_groups():
    """The correction bias and the group limits only select: replayed weights are the scores at the given ids,
    renormalised and scaled, whatever the bias (here a bias that would pick other experts)."""
    spec = SPECS["sigmoid_bias_groups"]
    args = list(random_moe_args(spec, T, seed=11))
    given = _other_routes(spec, seed=2)
    y1 = torch.ops.moecomp.moe_forward(*args, spec.key, routes_in=given)
    args[3] = torch.randn(spec.num_experts) * 10
    y2 = torch.ops.moecomp.moe_forward(*args, spec.key, routes_in=given)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    logits = ref.router_logits(args[0], args[1], args[2], spec).float()
    s = torch.sigmoid(logits).gather(1, given.long())
    w = s / (s.sum(-1, keepdim=True) + spec.renorm_eps) * spec.routed_scaling_factor
    wout = torch.empty(T, spec.top_k)
    torch.ops.moecomp.moe_forward_routes(torch.empty(T, spec.top_k, dtype=torch.int32), wout, *args, spec.key,
                                         routes_in=given)
    torch.testing.assert_close(wout, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [0, 5])
@pytest.mark.parametrize("name", ["softmax", "sigmoid_bias_groups"])
def test_opcheck_routes(cpu_backend, name, n):
    spec = SPECS[name]
    args = random_moe_args(spec, n, seed=n)
    k = spec.top_k
    out, wout = torch.zeros(n, k, dtype=torch.int32), torch.zeros(n, k)
    torch.library.opcheck(torch.ops.moecomp.moe_forward_routes.default, (out, wout, *args, spec.key))
    given = torch.stack([torch.randperm(spec.num_experts)[:k] for _ in range(n)]).int() if n else out
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key), {"routes_in": given})
    torch.library.opcheck(torch.ops.moecomp.moe_forward_routes.default, (out, None, *args, spec.key),
                          {"routes_in": given})


def _bad(spec: MoESpec, match: str, routes_out=None, route_weights_out=None, **kw):
    args = random_moe_args(spec, T, seed=0)
    with pytest.raises(ValueError, match=match):
        if routes_out is None and route_weights_out is None:
            torch.ops.moecomp.moe_forward(*args, spec.key, **kw)
        else:
            out = torch.zeros(T, spec.top_k, dtype=torch.int32) if routes_out is None else routes_out
            torch.ops.moecomp.moe_forward_routes(out, route_weights_out, *args, spec.key, **kw)


def test_bad_routes():
    spec, k = SPECS["softmax"], SPECS["softmax"].top_k
    _bad(spec, r"routes_out has dtype torch.int64; expected torch.int32",
         routes_out=torch.zeros(T, k, dtype=torch.long))
    _bad(spec, r"routes_out has shape \(7, 3\); expected \[T=7, top_k=2\]",
         routes_out=torch.zeros(T, k + 1, dtype=torch.int32))
    _bad(spec, r"route_weights_out has dtype torch.bfloat16; expected torch.float32",
         route_weights_out=torch.zeros(T, k, dtype=torch.bfloat16))
    _bad(spec, r"routes_in has dtype torch.float32; expected torch.int32 or torch.int64",
         routes_in=torch.zeros(T, k))
    _bad(spec, r"routes_in has shape \(7,\); expected \[T=7", routes_in=torch.zeros(T, dtype=torch.int32))
    _bad(spec, r"routes_in holds ids in \[0, 8\]; expected every id in \[0, num_experts=8\)",
         routes_in=torch.full((T, k), 8, dtype=torch.int32).tril())
    _bad(spec, r"routes_in holds ids in \[-1, 0\]", routes_in=-torch.ones(T, k, dtype=torch.int32).triu())
    _bad(spec, r"routes_out is on meta; expected cpu", routes_out=torch.zeros(T, k, dtype=torch.int32, device="meta"))


def test_replay_refused_where_meaningless():
    sm = MoESpec(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, score_order="sparsemixer",
                 renormalize=False)
    _bad(sm, "routes_in was given, but replaying routes is not meaningful for sparsemixer",
         routes_in=torch.zeros(T, 2, dtype=torch.int32))
    hs = MoESpec(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, scoring="sqrtsoftplus",
                 hash_routing=True)
    args = random_moe_args(hs, T, seed=0)
    h = random_hash_args(hs, T, vocab=11, seed=0)
    with pytest.raises(ValueError, match="not meaningful for hash routing"):
        torch.ops.moecomp.moe_forward(*args, hs.key, hash_table=h["hash_table"], token_ids=h["token_ids"],
                                      routes_in=torch.zeros(T, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="sparsemixer"):
        ref.replayed(torch.zeros(T, 8), torch.zeros(T, 2, dtype=torch.long), sm)
    out = torch.full((T, 2), -7, dtype=torch.int32)  # recording is fine there: the table's ids
    torch.ops.moecomp.moe_forward_routes(out, None, *args, hs.key, hash_table=h["hash_table"],
                                         token_ids=h["token_ids"])
    want = h["hash_table"][h["token_ids"].reshape(-1).long()]
    assert torch.equal(out.long(), want.long())


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_leading_dims_and_call_helper(cpu_backend):
    """x [B, S, H]: routes are [B * S, k]; ``call_moe_forward`` (the bound blocks' entry point) passes them."""
    from moecomp.ops.moe_op import call_moe_forward

    spec = SPECS["softmax"]
    args = random_moe_args(spec, T - 1, seed=2)
    x3 = args[0].reshape(2, 3, -1)
    out = torch.full((6, 2), -7, dtype=torch.int32)
    y = call_moe_forward(x3, args[1:], spec, routes_out=out)
    _, ids_ref = ref.route(ref.router_logits(args[0], args[1], None, spec), None, spec)
    assert torch.equal(out.long(), ids_ref)
    y2 = call_moe_forward(x3, args[1:], spec, routes_in=out)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    with _PassThrough():  # through the dispatcher (not plain eager: a function mode is on)
        y3 = call_moe_forward(x3, args[1:], spec, routes_in=out)
    torch.testing.assert_close(y3, y, rtol=0, atol=0)


def test_compiled_record_and_replay():
    """Under torch.compile (Inductor): the recording op's mutation reaches the caller's buffer, the replaying and the
    plain op compile beside it (a moe_forward with optional mutated arguments all None did not: see ``moe_op``)."""
    spec = SPECS["softmax"]
    args = random_moe_args(spec, T, seed=4)
    key = spec.key

    def f(x, out, given):
        y = torch.ops.moecomp.moe_forward_routes(out, None, x * 1.0, *args[1:], key)
        return y + torch.ops.moecomp.moe_forward(x, *args[1:], key, routes_in=given) + torch.ops.moecomp.moe_forward(
            x, *args[1:], key)

    given = _other_routes(spec, seed=3)
    out, out_eager = (torch.full((T, spec.top_k), -7, dtype=torch.int32) for _ in range(2))
    want = f(args[0], out_eager, given)
    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor", fullgraph=True)(args[0], out, given)
    assert torch.equal(out, out_eager) and (out >= 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_triton_records_in_the_routing_kernel(monkeypatch):
    """The Triton path writes routes_out / route_weights_out in the routing kernel's one launch (no copy after it,
    no second launch), and reads routes_in there: ``route`` (the kernel's launcher) runs once a call, the torch-level
    ``routes.record`` never (an expert capacity aside: its drop follows the kernel)."""
    from moecomp.ops import routes, triton_moe
    from moecomp.testing import count_calls

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    spec = SPECS["sigmoid_bias_groups"]
    args = random_moe_args(spec, T, seed=9)
    count = count_calls(monkeypatch, triton_moe, ["route"])
    rec = count_calls(monkeypatch, routes, ["record"])
    y, out, wout = _record(args, spec)
    y2, out2, _ = _record(args, spec, routes_in=out)
    assert count == ["route", "route"] and rec == [], (count, rec)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    assert torch.equal(out2, out) and torch.isfinite(wout).all()
