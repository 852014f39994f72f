"""detect_moe on blocks whose experts are per-expert modules (``per_expert_blocks``), captured with real values.

Each spelling: exactly one match; its spec fields; ``MoEMatch.stacked`` names placeholders that ``cap.paths`` maps
to the expert modules' parameters, in expert order; the op's stacked tensors built from those parameters give, with
``moecomp.oracle.reference.moe_forward`` and with ``torch.ops.moecomp.moe_forward``, the block's output on fresh random
tokens: fp32, max |diff| / max |block| <= 1e-5 (``poison``: torch.empty filled with NaN). A block whose example
reaches only some experts is rejected with NOT_RECOGNISED, naming the others.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch._subclasses.meta_utils as meta_utils

import per_expert_blocks as pb
from moecomp.oracle import reference
from moecomp.recognise.capture import capture_block
from moecomp.ops.moe_op import MOE_ARGS
from moecomp.recognise.fx.detect_moe import detect_moe
from moecomp.recognise.fx.rewrite_moe import rewrite_moe
from moecomp.core.reject import RejectCode

TOL = 1e-5
STACKED = ("w13", "w2", "b13", "b2")
GATED = {"w13": ["experts.{e}.w1.weight", "experts.{e}.w3.weight"], "w2": ["experts.{e}.w2.weight"]}
# spelling -> (spec fields, stacked op argument -> per-expert module paths ({e}: the expert))
CASES = {
    "classic": (dict(scoring="softmax", renormalize=True, gated=True, activation="silu"), GATED),
    "no_if": (dict(score_order="topk_then_score", renormalize=False, gated=True, activation="silu"),
              {"w13": ["experts.{e}.gate", "experts.{e}.up"], "w2": ["experts.{e}.down"]}),
    "dense": (dict(scoring="softmax", renormalize=False, gated=True, activation="silu"), GATED),
    "module_dict": (dict(scoring="softmax", renormalize=True, gated=True), GATED),
    "sequential": (dict(gated=False, activation="gelu", has_expert_bias=False),
                   {"w13": ["experts.{e}.0.weight"], "w2": ["experts.{e}.2.weight"]}),
    "exec_num_selected": (dict(scoring="softmax", renormalize=True, gated=True), GATED),
    "biased": (dict(gated=False, activation="gelu", has_expert_bias=True),
               {"w13": ["experts.{e}.fc1.weight"], "w2": ["experts.{e}.fc2.weight"], "b13": ["experts.{e}.fc1.bias"],
                "b2": ["experts.{e}.fc2.bias"]}),
    "shared": (dict(gated=True, activation="silu"), GATED),
}
SHARED = {"shared_w1": "shared_expert.w1.weight", "shared_w3": "shared_expert.w3.weight",
          "shared_w2": "shared_expert.w2.weight", "shared_gate_w": "shared_expert_gate.weight"}


@pytest.fixture(autouse=True)
def real_parameter_values(monkeypatch):
    """torch 2.13's real-value propagation copies the real value of plain tensors only (``meta_utils._safe_copy``
    tests ``type(src) is torch.Tensor``): a Parameter's is left uninitialised memory, and data-dependent branches
    follow a garbage routing. Copy Parameters as their data while these tests capture (``capture._real_values``
    should do the same; this fixture is then redundant and harmless)."""
    orig = meta_utils._safe_copy

    def copy_parameters_too(dst, src):
        return orig(dst, src.detach() if isinstance(src, torch.nn.Parameter) else src)

    monkeypatch.setattr(meta_utils, "_safe_copy", copy_parameters_too)


THREE_D = ("classic", "dense", "sequential", "biased", "shared")  # blocks that take [B, S, H] as well as [T, H]


def _capture(block, tokens=48, seed=0, three_d=False):
    g = torch.Generator().manual_seed(seed)
    shape = (2, tokens // 2, pb.H) if three_d else (tokens, pb.H)
    return capture_block(block, torch.randn(shape, generator=g), real_values=True)


def _op_tensors(block, m, cap) -> dict:
    """The op's arguments from the block's own tensors: bound ones by path, stacked ones stacked."""
    get = lambda ph: operator.attrgetter(cap.paths[ph])(block)  # noqa: E731
    out = {k: (get(m.bindings[k]) if m.bindings[k] is not None else None) for k in MOE_ARGS}
    for k, per_expert in m.stacked.items():
        out[k] = torch.stack([torch.cat([get(ph) for ph in names], 0) for names in per_expert])
    return out


def _rel_err(got, want):
    assert torch.isfinite(got).all()
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_expert_spelling(name, poison):
    fields, paths = CASES[name]
    block = pb.build(name)
    cap = _capture(block, three_d=name in THREE_D)
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res.matches) == 1, res.rejected
    m = res.matches[0]
    assert m.verified.startswith("numeric"), m.verified
    spec = m.spec
    assert (spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size) == (pb.E, pb.K, pb.H, pb.I)
    assert (spec.w_layout, spec.gate_up) == ("out_in", "concat")
    for k, v in fields.items():
        assert getattr(spec, k) == v, (k, getattr(spec, k), v)
    assert set(m.stacked) == set(paths)
    for k in STACKED:
        assert m.bindings[k] is None
    for k, pattern in paths.items():
        assert [[cap.paths[ph] for ph in names] for names in m.stacked[k]] == [
            [p.format(e=e) for p in pattern] for e in range(pb.E)], k
    router = "router.weight" if name == "exec_num_selected" else "gate.weight"
    assert cap.paths[m.bindings["router_w"]] == router
    if name == "shared":
        assert (spec.shared.intermediate_size, spec.shared.gate, spec.shared.layout) == (12, "sigmoid", "separate")
        assert {k: cap.paths[m.bindings[k]] for k in SHARED} == SHARED
    else:
        assert spec.shared is None

    x = torch.randn(3, 7, pb.H) if name in THREE_D else torch.randn(21, pb.H)  # fresh tokens, another count
    args = _op_tensors(block, m, cap)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        assert _rel_err(reference.moe_forward(x, **args, spec=spec), want) <= TOL
        assert _rel_err(torch.ops.moecomp.moe_forward(x, *[args[k] for k in MOE_ARGS], spec.key), want) <= TOL


def test_expert_index_is_the_selecting_constant(poison):
    """Module e weighted by the routing weight of id (e + 1) % E serves expert (e + 1) % E: the stacked slots follow
    the constants the graph compares the ids with, not the module order."""

    class Shifted(pb.DenseLoop):
        def forward(self, x):
            w, ids = torch.softmax(self.gate(x), dim=-1).topk(self.top_k, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                out += expert(x) * (w * (ids == (e + 1) % pb.E)).sum(-1, keepdim=True)
            return out

    block = pb._redraw(Shifted(), 0)
    cap = capture_block(block, torch.randn(16, pb.H), real_values=True)
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res.matches) == 1, res.rejected
    m = res.matches[0]
    assert [cap.paths[names[0]] for names in m.stacked["w2"]] == [
        f"experts.{(e - 1) % pb.E}.w2.weight" for e in range(pb.E)]
    x = torch.randn(9, pb.H)
    with torch.no_grad():
        assert _rel_err(reference.moe_forward(x, **_op_tensors(block, m, cap), spec=m.spec), block(x)) <= TOL


def test_expert_weighted_by_another_experts_weight_is_rejected():
    """Tokens dispatched to expert 0 but weighted by the routing weight of id 1: no spec computes it."""

    class Crossed(pb.NoIfLoop):
        def forward(self, x):
            vals, ids = torch.topk(self.gate(x), self.top_k)
            w = torch.softmax(vals, dim=-1)
            out = torch.zeros_like(x)
            for e in range(len(self.experts)):
                tok, _ = torch.where(ids == e)
                weight = (w * (ids == (e + 1) % pb.E)).sum(-1)
                out.index_add_(0, tok, self.experts[e](x[tok]) * weight[tok, None])
            return out

    cap = capture_block(pb._redraw(Crossed(), 0), torch.randn(32, pb.H), real_values=True)
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res.matches) == 0
    [(_, r)] = res.rejected
    assert r.code is RejectCode.NOT_RECOGNISED and "weighted by the routing weight of expert" in r.message, r


def test_weights_stored_in_out_are_refused():
    """``x @ W`` with W stored [in, out]: not a linear form the pass reads; refused by name, not reported as experts
    missing from the graph."""

    class InOutExpert(pb.MatmulExpert):
        def __init__(self):
            super().__init__()
            self.down_t = torch.nn.Parameter(torch.empty(pb.I, pb.H))  # [in, out]

        def forward(self, x):
            return (torch.nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)) @ self.down_t

    class InOutLoop(pb.NoIfLoop):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([InOutExpert() for _ in range(pb.E)])

    cap = capture_block(pb._redraw(InOutLoop(), 0), torch.randn(32, pb.H), real_values=True)
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res.matches) == 0
    [(_, r)] = res.rejected
    assert r.code is RejectCode.NOT_RECOGNISED and "in a form the pass does not read" in r.message, r


def test_experts_not_reached_are_named():
    """The router's bias sends every token to experts 0 and 1: the real-values graph has no computation for 2 and 3,
    and the rejection says so (the caller traces again with more tokens, or falls back)."""
    cap = _capture(pb.skewed())
    res = detect_moe(cap.gm, cap.example_inputs)
    assert len(res.matches) == 0
    [(where, r)] = res.rejected
    assert r.code is RejectCode.NOT_RECOGNISED
    assert "experts [2, 3] of 4 are not in the graph" in r.message and "[0, 1]" in r.message, r


def test_rewrite_stacks_per_expert_weights(poison):
    """rewrite_moe builds the stacked tensors in the graph (cat per expert, stack over experts): the rewritten graph
    computes what the captured one does."""
    block = pb.build("classic")
    cap = _capture(block, three_d=True)
    gm = cap.gm
    inputs = cap.concrete_inputs()
    with torch.no_grad():
        before = copy.deepcopy(gm)(*inputs)
        res = detect_moe(gm, cap.example_inputs)
        assert rewrite_moe(gm, res.matches) == 1
        after = gm(*inputs)
    names = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert names.count(torch.ops.moecomp.moe_forward.default) == 1 and torch.stack in names
    assert "index_add_" not in gm.code and "where" not in gm.code
    assert _rel_err(after[0], before[0]) <= TOL
    assert torch.equal(after[1], before[1])  # the router logits the block also returns


def test_backend_leaves_per_expert_blocks_alone(poison):
    """A dense per-expert loop traces into one graph under torch.compile: the backend reports it (the op would need
    the weights stacked on every call) and compiles the block unchanged."""
    from moecomp.api import backend

    block = pb.build("dense")
    x = torch.randn(2, 5, pb.H)
    backend.last_results.clear()
    with torch.no_grad():
        got = torch.compile(block, backend="moecomp", options={"moecomp.inner": "eager"})(x)
        want = block(x)
    assert torch.equal(got, want)
    [(_, r)] = backend.last_results[-1]["rejected"]
    assert r.code is RejectCode.UNSUPPORTED_STRUCTURE and "per-expert modules" in r.message
