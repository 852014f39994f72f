"""Every bad input to ``moe_forward`` / ``moe_experts`` is a SpecError (a ValueError) that names the argument and
says what was expected, on every entry point:

  - ``torch.ops.moecomp.moe_forward`` / ``moe_experts`` (the dispatcher) with grad mode on and the float inputs
    requiring grad (the autograd path), and under ``no_grad``;
  - ``call_moe_forward`` / ``call_moe_experts`` (the eager entry points, which skip the dispatcher when nothing
    needs it: under ``no_grad`` here), with grad mode on and under ``no_grad``.

One row per bad argument: shapes and ranks, dtypes, devices (``meta`` too: a meta tensor among CPU tensors used to
dispatch to the fake implementation and return uninitialised memory), expert-id range, top-k <= E, spec strings.
Each row first checks that the same call with the good argument runs (so the error comes from the row's change;
rows that bring their own spec aside).
Then what is accepted: non-contiguous views of every argument and the mixed dtypes the kernels support compute the
reference's result on both CPU paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from moecomp.oracle import reference
from moecomp.ops.moe_op import EXPERT_ARGS, LATENT_ARGS, MOE_ARGS, OP_ARGS, call_moe_experts, call_moe_forward
from moecomp.core.spec import MoESpec, SharedExpertSpec, SpecError
from moecomp.testing import random_latent_args, random_moe_args

# Every optional tensor present: router bias, correction bias, expert biases, a gated shared expert with its gate.
SPEC = MoESpec(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, scoring="sigmoid",
               has_router_bias=True, has_correction_bias=True, has_expert_bias=True,
               shared=SharedExpertSpec(8, gate="sigmoid"))
T = 5
X = r"x \(hidden_states\)"
NAMES = ("x",) + MOE_ARGS
LATENT = SPEC.replace(latent_size=12, latent_bias=True)  # experts of width 12 between latent projections




def forward_args(dtype=torch.float32) -> dict:
    args = random_moe_args(SPEC, T, dtype, seed=0)
    d = dict(zip(NAMES, args))
    d["correction_bias"] = d["correction_bias"].float()
    return d


def experts_args(dtype=torch.float32) -> dict:
    d = forward_args(dtype)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    w = torch.rand(T, 2, generator=torch.Generator().manual_seed(1)).to(dtype)
    return {"x": d["x"], "topk_ids": ids, "topk_weights": w, **{k: d[k] for k in EXPERT_ARGS}}


@dataclass
class Row:
    id: str
    op: str  # "forward" | "experts"
    change: Callable[[dict], None]  # edits the argument dict in place
    arg: str  # regex: the argument the message must name
    expect: str  # regex: what the message must say was expected
    spec: MoESpec | str = SPEC  # a row may give the op another spec (a MoESpec, or a raw spec string)
    eager: bool = True  # False: the eager entry points take a MoESpec object, so a bad string cannot reach them


def _set(**kv):
    def change(d):
        for k, v in kv.items():
            d[k] = v(d) if callable(v) else v
    return change


def _meta(name):
    return _set(**{name: lambda d: d[name].to("meta")})


def _dtype(name, dt):
    return _set(**{name: lambda d: d[name].to(dt)})


def _shape(name, fn):
    return _set(**{name: lambda d: fn(d[name])})


def _latent(**kv):
    """The arguments of ``LATENT`` (its experts, its four projection tensors), then ``kv``'s changes."""
    def change(d):
        d.update(zip(NAMES, random_moe_args(LATENT, T, seed=0)))
        d["correction_bias"] = d["correction_bias"].float()
        d.update(random_latent_args(LATENT, seed=1))
        _set(**kv)(d)
    return change


GOOD_KEY = SPEC.key
ROWS = [
    # ---------------------------------------------------------------- moe_forward: hidden states
    Row("x_0d", "forward", _set(x=lambda d: d["x"][0, 0]), X, r"0-D; expected a tensor \[\.\.\., hidden_size=16\]"),
    Row("x_last_dim", "forward", _shape("x", lambda t: t[:, :-1]), X, r"last dim must be hidden_size=16"),
    Row("x_int", "forward", _set(x=lambda d: d["x"].long()), X, r"dtype torch.int64; expected float32, float16"),
    Row("x_complex", "forward", _set(x=lambda d: d["x"].to(torch.complex64)), X, r"expected float32, float16"),
    Row("x_fp16_weights_fp32", "forward", _dtype("x", torch.float16), r"w13",
        r"dtype torch.float32; expected torch.float16, the dtype of x \(hidden_states\)"),
    Row("x_meta", "forward", _meta("x"), r"router_w is on cpu", r"expected meta, the device of x"),
    # ---------------------------------------------------------------- moe_forward: devices (meta), one per tensor
    *[Row(f"{n}_meta", "forward", _meta(n), n, r"is on meta; expected cpu, the device of x") for n in MOE_ARGS],
    # ---------------------------------------------------------------- moe_forward: shapes / ranks
    Row("router_w_rows", "forward", _shape("router_w", lambda t: t[:-1]), "router_w", r"the spec needs \(4, 16\)"),
    Row("router_w_rank", "forward", _shape("router_w", lambda t: t[None]), "router_w", r"the spec needs \(4, 16\)"),
    Row("router_b_shape", "forward", _shape("router_b", lambda t: t[:, None]), "router_b", r"the spec needs \(4,\)"),
    Row("correction_bias_shape", "forward", _shape("correction_bias", lambda t: t[:3]), "correction_bias",
        r"the spec needs \(4,\)"),
    Row("w13_shape", "forward", _shape("w13", lambda t: t[:, :-1]), "w13", r"the spec needs \(4, 16, 16\)"),
    Row("w13_rank", "forward", _shape("w13", lambda t: t[0]), "w13", r"the spec needs \(4, 16, 16\)"),
    Row("w13_layout", "forward", _shape("w13", lambda t: t.transpose(1, 2)[:, :, :8]), "w13",
        r"the spec needs \(4, 16, 16\)"),
    Row("b13_shape", "forward", _shape("b13", lambda t: t[:, :8]), "b13", r"the spec needs \(4, 16\)"),
    Row("w2_shape", "forward", _shape("w2", lambda t: t.transpose(1, 2)), "w2", r"the spec needs \(4, 16, 8\)"),
    Row("b2_rank", "forward", _shape("b2", lambda t: t[0]), "b2", r"the spec needs \(4, 16\)"),
    Row("shared_w1_shape", "forward", _shape("shared_w1", lambda t: t[:-1]), "shared_w1", r"the spec needs \(8, 16\)"),
    Row("shared_w2_shape", "forward", _shape("shared_w2", lambda t: t.t()), "shared_w2", r"the spec needs \(16, 8\)"),
    Row("shared_gate_w_rank", "forward", _shape("shared_gate_w", lambda t: t[0]), "shared_gate_w",
        r"the spec needs \(1, 16\)"),
    # ---------------------------------------------------------------- moe_forward: presence
    Row("router_b_missing", "forward", _set(router_b=None), "router_b", r"required by the spec.*expected a tensor"),
    Row("correction_bias_missing", "forward", _set(correction_bias=None), "correction_bias", r"required by the spec"),
    Row("shared_gate_w_missing", "forward", _set(shared_gate_w=None), "shared_gate_w", r"required by the spec"),
    Row("router_b_unused", "forward", lambda d: None, "router_b", r"no use for it; expected None",
        spec=SPEC.replace(has_router_bias=False)),
    Row("shared_w3_unused", "forward", lambda d: None, "shared_w3", r"no use for it; expected None",
        spec=SPEC.replace(shared=SharedExpertSpec(4, layout="concat", gate="sigmoid"))),
    # ---------------------------------------------------------------- moe_forward: dtypes
    *[Row(f"{n}_bf16", "forward", _dtype(n, torch.bfloat16), n,
          r"dtype torch.bfloat16; expected torch.float32, the dtype of x \(hidden_states\)")
      for n in ("w13", "w2", "shared_w1", "shared_w3", "shared_w2")],
    *[Row(f"{n}_int", "forward", _dtype(n, torch.int32), n, r"dtype torch.int32; expected a floating dtype")
      for n in ("router_w", "router_b", "correction_bias", "b13", "b2", "shared_gate_w")],
    # ---------------------------------------------------------------- moe_forward: latent projections (LATENT)
    Row("latent_good", "forward", _latent(), "-", "-", spec=LATENT),  # (runs: checked apart, see the test)
    *[Row(f"{n}_meta", "forward", _latent(**{n: lambda d, n=n: d[n].to("meta")}), n,
          r"is on meta; expected cpu, the device of x", spec=LATENT) for n in LATENT_ARGS],
    Row("latent_in_w_shape", "forward", _latent(latent_in_w=lambda d: d["latent_in_w"].t()), "latent_in_w",
        r"shape \(16, 12\), the spec needs \(12, 16\)", spec=LATENT),
    Row("latent_in_b_shape", "forward", _latent(latent_in_b=lambda d: d["latent_in_b"][:-1]), "latent_in_b",
        r"the spec needs \(12,\)", spec=LATENT),
    Row("latent_out_w_shape", "forward", _latent(latent_out_w=lambda d: d["latent_out_w"][:, :-1]), "latent_out_w",
        r"the spec needs \(16, 12\)", spec=LATENT),
    Row("latent_out_b_missing", "forward", _latent(latent_out_b=None), "latent_out_b",
        r"required by the spec.*expected a tensor of shape \(16,\)", spec=LATENT),
    *[Row(f"{n}_bf16", "forward", _latent(**{n: lambda d, n=n: d[n].bfloat16()}), n,
          r"dtype torch.bfloat16; expected torch.float32, the dtype of x \(hidden_states\)", spec=LATENT)
      for n in ("latent_in_w", "latent_out_w")],
    *[Row(f"{n}_int", "forward", _latent(**{n: lambda d, n=n: d[n].int()}), n,
          r"dtype torch.int32; expected a floating dtype", spec=LATENT) for n in ("latent_in_b", "latent_out_b")],
    Row("latent_in_w_unused", "forward", _set(latent_in_w=lambda d: torch.zeros(12, 16)), "latent_in_w",
        r"no use for it; expected None"),
    Row("latent_experts_width", "forward", _latent(w13=lambda d: torch.zeros(4, 16, 16)), "w13",
        r"shape \(4, 16, 16\), the spec needs \(4, 16, 12\)", spec=LATENT),
    Row("latent_spec", "experts", lambda d: None, "moe_experts", r"latent projections \(latent_size=12\).*experts_spec",
        spec=LATENT),
    # ---------------------------------------------------------------- spec strings (the op; the eager entry points
    # take a MoESpec, whose constructor raises the same errors)
    Row("spec_missing_fields", "forward", lambda d: None, r"MoESpec field\(s\) \['top_k', 'hidden_size'",
        r"missing required", spec='{"num_experts": 4}', eager=False),
    Row("spec_unknown_field", "forward", lambda d: None, r"field\(s\) \['experts'\]", r"unknown MoESpec",
        spec=GOOD_KEY[:-1] + ',"experts":4}', eager=False),
    Row("spec_wrong_type", "forward", lambda d: None, r"field num_experts='4'", r"should be int",
        spec=GOOD_KEY.replace('"num_experts":4', '"num_experts":"4"'), eager=False),
    Row("spec_not_json", "forward", lambda d: None, r"spec string 'E=4 k=2'", r"not a MoESpec key",
        spec="E=4 k=2", eager=False),
    Row("spec_not_object", "forward", lambda d: None, r"the spec", r"must be a JSON object of MoESpec fields",
        spec="[4, 2]", eager=False),
    Row("spec_shared_missing", "forward", lambda d: None, r"SharedExpertSpec field\(s\) \['intermediate_size'\]",
        r"missing required", spec=GOOD_KEY.replace('"intermediate_size":8,"layout"', '"layout"'), eager=False),
    Row("spec_topk_gt_E", "forward", lambda d: None, r"top_k", r"must be in \[1, num_experts=4\], got 5",
        spec=GOOD_KEY.replace('"top_k":2', '"top_k":5'), eager=False),
    Row("spec_topk_gt_E", "experts", lambda d: None, r"top_k", r"must be in \[1, num_experts=4\], got 5",
        spec=GOOD_KEY.replace('"top_k":2', '"top_k":5'), eager=False),
    # ---------------------------------------------------------------- moe_experts: hidden states
    Row("x_3d", "experts", _set(x=lambda d: d["x"][None]), X,
        r"shape \(1, 5, 16\); moe_experts expects 2-D \[T, hidden_size=16\]"),
    Row("x_1d", "experts", _set(x=lambda d: d["x"][0]), X, r"moe_experts expects 2-D"),
    Row("x_last_dim", "experts", _shape("x", lambda t: t[:, :-1]), X, r"last dim must be hidden_size=16"),
    Row("x_fp16_weights_fp32", "experts", _dtype("x", torch.float16), "w13", r"expected torch.float16"),
    Row("x_meta", "experts", _meta("x"), r"topk_ids is on cpu", r"expected meta, the device of x"),
    # ---------------------------------------------------------------- moe_experts: routing
    Row("ids_ge_E", "experts", _set(topk_ids=lambda d: d["topk_ids"].index_fill(1, torch.tensor([1]), 4)),
        "topk_ids", r"ids in \[0, 4\]; expected every id in \[0, num_experts=4\)"),
    Row("ids_negative", "experts", _set(topk_ids=lambda d: d["topk_ids"] - 1), "topk_ids",
        r"ids in \[-1, 2\]; expected every id in \[0, num_experts=4\)"),
    Row("ids_int32_ge_E", "experts", _set(topk_ids=lambda d: (d["topk_ids"] + 7).int()), "topk_ids",
        r"expected every id in \[0, num_experts=4\)"),
    Row("ids_float", "experts", _set(topk_ids=lambda d: d["topk_ids"].float()), "topk_ids",
        r"dtype torch.float32; expected an integer dtype"),
    Row("ids_bool", "experts", _set(topk_ids=lambda d: d["topk_ids"] > 1), "topk_ids", r"expected an integer dtype"),
    Row("ids_1d", "experts", _set(topk_ids=lambda d: d["topk_ids"][:, 0]), "topk_ids", r"expected 2-D \[T=5, k\]"),
    Row("ids_3d", "experts", _set(topk_ids=lambda d: d["topk_ids"][None]), "topk_ids", r"expected 2-D \[T=5, k\]"),
    Row("ids_tokens", "experts", _set(topk_ids=lambda d: d["topk_ids"][:4]), "topk_ids",
        r"shape \(4, 2\); expected 2-D \[T=5, k\]"),
    Row("ids_k_gt_E", "experts", _set(topk_ids=lambda d: torch.arange(5).repeat(T, 1) % 4,
                                      topk_weights=lambda d: torch.rand(T, 5)), "topk_ids",
        r"k=5 columns; expected 1 <= k <= num_experts=4"),
    Row("ids_k_0", "experts", _set(topk_ids=lambda d: d["topk_ids"][:, :0],
                                   topk_weights=lambda d: d["topk_weights"][:, :0]),
        "topk_ids", r"k=0 columns; expected 1 <= k <= num_experts=4"),
    Row("ids_meta", "experts", _meta("topk_ids"), "topk_ids", r"is on meta; expected cpu, the device of x"),
    Row("weights_meta", "experts", _meta("topk_weights"), "topk_weights", r"is on meta; expected cpu"),
    Row("weights_int", "experts", _set(topk_weights=lambda d: d["topk_ids"].clone()), "topk_weights",
        r"dtype torch.int64; expected a floating dtype"),
    Row("weights_shape", "experts", _set(topk_weights=lambda d: torch.rand(T, 3)), "topk_weights",
        r"shape \(5, 3\); expected the shape of topk_ids \(5, 2\)"),
    Row("weights_rank", "experts", _set(topk_weights=lambda d: d["topk_weights"][None]), "topk_weights",
        r"expected 2-D \[T=5, k\]"),
    # ---------------------------------------------------------------- moe_experts: weights
    *[Row(f"{n}_meta", "experts", _meta(n), n, r"is on meta; expected cpu") for n in EXPERT_ARGS],
    Row("w13_shape", "experts", _shape("w13", lambda t: t[:3]), "w13", r"the spec needs \(4, 16, 16\)"),
    Row("w2_bf16", "experts", _dtype("w2", torch.bfloat16), "w2", r"expected torch.float32, the dtype of x"),
    Row("b13_int", "experts", _dtype("b13", torch.int64), "b13", r"expected a floating dtype"),
    Row("b2_missing", "experts", _set(b2=None), "b2", r"required by the spec"),
    Row("b13_unused", "experts", lambda d: None, "b13", r"no use for it; expected None",
        spec=SPEC.replace(has_expert_bias=False)),
]


def _entry_points(op: str):
    """(name, fn(args dict, spec) -> tensor, grad) for each way in."""
    def op_forward(d, spec):
        key = spec if isinstance(spec, str) else spec.key
        return torch.ops.moecomp.moe_forward(*(d[n] for n in NAMES), key,
                                             **{n: d[n] for n in LATENT_ARGS if n in d})

    def op_experts(d, spec):
        key = spec if isinstance(spec, str) else spec.key
        return torch.ops.moecomp.moe_experts(d["x"], d["topk_ids"], d["topk_weights"],
                                             *(d[n] for n in EXPERT_ARGS), key)

    def eager_forward(d, spec):
        return call_moe_forward(d["x"], [d.get(n) for n in OP_ARGS], spec)

    def eager_experts(d, spec):
        return call_moe_experts(d["x"], d["topk_ids"], d["topk_weights"], *(d[n] for n in EXPERT_ARGS), spec)

    fns = (("op", op_forward), ("eager", eager_forward)) if op == "forward" else \
        (("op", op_experts), ("eager", eager_experts))
    return [(f"{name}-{'grad' if grad else 'no_grad'}", fn, grad) for name, fn in fns for grad in (True, False)]


def _prepare(d: dict, grad: bool) -> dict:
    """Float leaves require grad in grad mode (the dispatcher's autograd path); fresh leaves each call."""
    out = {}
    for k, t in d.items():
        if isinstance(t, torch.Tensor):
            t = t.detach().clone()
            if grad and t.is_floating_point():
                t.requires_grad_(True)
        out[k] = t
    return out


def _call(fn, d, spec, grad):
    with torch.set_grad_enabled(grad):
        return fn(d, spec)


CASES = [(row, entry) for row in ROWS for entry in _entry_points(row.op) if (row.eager or entry[0].startswith("op"))
         and row.id != "latent_good"]


@pytest.mark.parametrize("entry", _entry_points("forward"), ids=lambda e: e[0])
def test_latent_rows_start_from_a_good_call(entry):
    """The latent rows' unchanged arguments run (so each row's error comes from its change)."""
    _, fn, grad = entry
    d = forward_args()
    next(r for r in ROWS if r.id == "latent_good").change(d)
    out = _call(fn, _prepare(d, grad), LATENT, grad)
    assert out.shape == (T, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("row,entry", CASES, ids=[f"{r.op}-{r.id}-{e[0]}" for r, e in CASES])
def test_bad_input_is_a_spec_error_naming_the_argument(row: Row, entry):
    _, fn, grad = entry
    base = forward_args() if row.op == "forward" else experts_args()
    good_spec = SPEC if isinstance(row.spec, str) else row.spec
    if good_spec is SPEC:  # the unchanged call runs: the error below comes from the row's change
        out = _call(fn, _prepare(base, grad), SPEC, grad)
        assert torch.isfinite(out).all()
    bad = dict(base)
    row.change(bad)
    with pytest.raises(SpecError) as info:
        _call(fn, _prepare(bad, grad), row.spec, grad)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert re.search(row.arg, msg), f"message does not name {row.arg!r}: {msg}"
    assert re.search(row.expect, msg), f"message does not say {row.expect!r}: {msg}"


@pytest.mark.parametrize("row", [r for r in ROWS if isinstance(r.spec, str)], ids=lambda r: f"{r.op}-{r.id}")
def test_bad_spec_string_in_from_key(row):
    """The same spec-string errors from ``MoESpec.from_key`` (SpecError, never TypeError / KeyError)."""
    with pytest.raises(SpecError) as info:
        MoESpec.from_key(row.spec)
    assert re.search(row.arg, str(info.value)) and re.search(row.expect, str(info.value)), str(info.value)


def test_non_string_spec():
    with pytest.raises(SpecError, match=r"spec must be a MoESpec key string"):
        MoESpec.from_key({"num_experts": 4})


def test_every_argument_has_a_row():
    """The table covers each tensor argument of both ops for device and shape (or presence) and, where it has one,
    dtype: a new argument without rows fails here."""
    ids = {r.id for r in ROWS}
    for n in MOE_ARGS + LATENT_ARGS:
        assert f"{n}_meta" in ids, n
        assert any(r.id.startswith(n) and r.op == "forward" and ("shape" in r.id or "rank" in r.id or "rows" in
                   r.id or "missing" in r.id or "unused" in r.id) for r in ROWS), n
        assert any(r.id.startswith(n) and ("bf16" in r.id or "int" in r.id) for r in ROWS), n
    for n in ("topk_ids", "topk_weights"):
        short = n.replace("topk_", "")
        assert {f"{short}_meta"} <= ids
    assert {"ids_ge_E", "ids_negative", "ids_k_gt_E", "spec_topk_gt_E", "spec_missing_fields", "x_0d", "x_3d",
            "x_meta"} <= ids


# --------------------------------------------------------------------------------------------------- float64
def test_float64_refused_by_the_triton_path_only(monkeypatch):
    """float64 hidden states: the Triton GEMMs have no fp64 (they returned garbage under the interpreter), so that
    path refuses them by name; the torch path keeps computing them (fp32 math, float64 out)."""
    d = {k: (None if v is None else v.double()) for k, v in forward_args().items()}
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    with pytest.raises(SpecError, match=r"x \(hidden_states\) has dtype torch.float64; expected float32, float16 or "
                                        r"bfloat16 \(float64 on the torch path only\)"):
        torch.ops.moecomp.moe_forward(*(d[n] for n in NAMES), SPEC.key)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "torch")
    out = torch.ops.moecomp.moe_forward(*(d[n] for n in NAMES), SPEC.key)
    ref = reference.moe_forward(*(d[n] for n in NAMES), SPEC, acc=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------- meta
def test_all_meta_still_gives_a_meta_result():
    """Shape propagation on a model on the meta device keeps working: every tensor on meta is consistent."""
    d = {k: (None if v is None else v.to("meta")) for k, v in forward_args().items()}
    out = torch.ops.moecomp.moe_forward(*(d[n] for n in NAMES), SPEC.key)
    assert out.device.type == "meta" and out.shape == (T, 16)
    e = {k: (None if v is None else v.to("meta")) for k, v in experts_args().items()}
    out = torch.ops.moecomp.moe_experts(e["x"], e["topk_ids"], e["topk_weights"], *(e[n] for n in EXPERT_ARGS),
                                        SPEC.key)
    assert out.device.type == "meta" and out.shape == (T, 16)


def test_fake_tensor_mode_reports_device_mismatch():
    """Under FakeTensorMode (tracing) the fake implementation checks too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    d = forward_args()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        f = {k: (None if v is None else mode.from_tensor(v)) for k, v in d.items()}
        f["w2"] = torch.empty(tuple(d["w2"].shape), device="meta")
        with pytest.raises(SpecError, match=r"w2 is on meta; expected cpu"):
            torch.ops.moecomp.moe_forward(*(f[n] for n in NAMES), SPEC.key)


# --------------------------------------------------------------------------------------------------- accepted
def _strided(t: torch.Tensor) -> torch.Tensor:
    """t as a view with a step of 2 in its last dim (NaN in the gaps): non-contiguous in every dim."""
    buf = torch.full(t.shape[:-1] + (2 * t.shape[-1],), float("nan") if t.is_floating_point() else 99,
                     dtype=t.dtype)
    v = buf[..., ::2]
    v.copy_(t)
    return v


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_arguments_compute_correctly(cpu_backend, name):
    """Where contiguity mattered (the Triton path read the correction bias, expert biases and flattened ids as if
    contiguous), non-contiguous views now compute the reference's result; every argument is tried."""
    d = forward_args()
    want = reference.moe_forward(*(d[n] for n in NAMES), SPEC)
    d[name] = _strided(d[name])
    out = torch.ops.moecomp.moe_forward(*(d[n] for n in NAMES), SPEC.key)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    if name in ("x",) + EXPERT_ARGS:
        e = experts_args()
        want = reference.experts(*(e[n] for n in ("x", "topk_ids", "topk_weights") + EXPERT_ARGS), SPEC)
        e[name] = _strided(e[name])
        out = torch.ops.moecomp.moe_experts(*(e[n] for n in ("x", "topk_ids", "topk_weights") + EXPERT_ARGS),
                                            SPEC.key)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["topk_ids", "topk_weights", "topk_ids_int32"])
def test_non_contiguous_routing_computes_correctly(cpu_backend, name):
    e = experts_args()
    if name == "topk_ids_int32":
        e["topk_ids"], name = e["topk_ids"].int(), "topk_ids"
    order = ("x", "topk_ids", "topk_weights") + EXPERT_ARGS
    want = reference.experts(*(e[n] for n in order), SPEC)
    e[name] = _strided(e[name])
    out = torch.ops.moecomp.moe_experts(*(e[n] for n in order), SPEC.key)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# (x dtype, {argument: dtype}) that the kernels and the torch path both support: kept working.
MIXED = [
    ("fp32_router_fp16_experts", torch.float16, {"router_w": torch.float32, "router_b": torch.float32}),
    ("fp16_correction_bias", torch.float16, {"correction_bias": torch.float16}),
    ("fp32_biases", torch.float16, {"b13": torch.float32, "b2": torch.float32}),
    ("fp32_shared_gate", torch.float16, {"shared_gate_w": torch.float32}),
    ("fp64_router_fp32", torch.float32, {"router_w": torch.float64, "correction_bias": torch.float64}),
]


@pytest.mark.parametrize("case", MIXED, ids=lambda c: c[0])
def test_supported_mixed_dtypes_keep_working(cpu_backend, case):
    _, dtype, changes = case
    d = forward_args(dtype)
    for n, dt in changes.items():
        d[n] = d[n].to(dt)
    for spec in (SPEC, SPEC.replace(router_fp32=True)):
        out = torch.ops.moecomp.moe_forward(*(d[n] for n in NAMES), spec.key)
        ref = reference.moe_forward(*(d[n] for n in NAMES), spec)
        assert out.dtype == dtype and torch.isfinite(out).all()
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 5e-3), err


def test_topk_weights_in_model_dtype_and_int32_ids(cpu_backend):
    """HF passes weights in the model dtype and int64 ids; int32 ids work as well."""
    e = experts_args(torch.float16)
    order = ("x", "topk_ids", "topk_weights") + EXPERT_ARGS
    want = reference.experts(*(e[n] for n in order), SPEC)
    for ids in (e["topk_ids"], e["topk_ids"].int()):
        out = torch.ops.moecomp.moe_experts(e["x"], ids, e["topk_weights"], *(e[n] for n in EXPERT_ARGS), SPEC.key)
        assert ((out.double() - want.double()).norm() / want.double().norm()).item() < 5e-3


# --------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_cuda_ids_range_checked_outside_capture_only():
    """On CUDA the id range is read (one host sync) outside CUDA-graph capture: bad ids raise there; inside a
    capture the check is skipped (no sync), and the captured graph replays correctly."""
    e = {k: (None if v is None else v.to("cuda", torch.bfloat16 if v.is_floating_point() else v.dtype))
         for k, v in experts_args().items()}
    bad = e["topk_ids"].clone()
    bad[0, 0] = 4
    with pytest.raises(SpecError, match=r"topk_ids holds ids in \[0, 4\]"):
        torch.ops.moecomp.moe_experts(e["x"], bad, e["topk_weights"], *(e[n] for n in EXPERT_ARGS), SPEC.key)
    args = (e["x"], e["topk_ids"], e["topk_weights"], *(e[n] for n in EXPERT_ARGS), SPEC.key)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        want = torch.ops.moecomp.moe_experts(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = torch.ops.moecomp.moe_experts(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
