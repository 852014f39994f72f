"""The "moecomp" torch.compile backend on whole tiny models and single blocks.

Whole models compile with ``options={"moecomp.inner": "eager"}``: the passes run exactly as always, and the
rewritten graph runs as is instead of going through Inductor codegen (minutes of C++ compiles on 2 cores). The
single-block tests go through Inductor for real. Logits: fp32, within 1e-4 relative to eager's max.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "passes"))

import moecomp  # noqa: E402
import tiny_models as tm  # noqa: E402
from moecomp.api import backend  # noqa: E402

EAGER_INNER = {"moecomp.inner": "eager"}
MOE_CALL = "torch.ops.moecomp.moe_forward.default("
GONE = ("grouped_mm_fallback", "torch.topk", "torch.histc", "torch.bmm", ".topk(", "torch.sort")


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    moecomp.counters.clear()
    backend.last_results.clear()
    yield
    torch._dynamo.reset()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


CASES = [(f, "grouped_mm") for f in tm.FAMILIES] + [
    (f, impl) for f in ("mixtral", "deepseek_v3", "gpt_oss") for impl in ("eager", "batched_mm")
]


@pytest.mark.parametrize("family, impl", CASES)
def test_whole_model(family, impl, poison):
    model = tm.hf_model(family, impl)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        compiled = torch.compile(model, backend="moecomp", dynamic=True, options=EAGER_INNER)
        got = compiled(ids).logits
        assert rel_err(got, want) <= 1e-4
        # another sequence length: same graph, still equal
        ids2 = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
        with torch._dynamo.config.patch(error_on_recompile=True):
            got2 = compiled(ids2).logits
        assert rel_err(got2, model(ids2).logits) <= 1e-4

    assert_every_block_rewritten(graphs=1)


def assert_every_block_rewritten(graphs: int) -> list[str]:
    """``graphs`` graphs compiled, each with one moe_forward per MoE layer and no routing left; their code."""
    c = moecomp.counters
    assert c["backend"]["graphs"] == graphs
    assert c["detect_moe"]["matched"] == graphs * tm.LAYERS, [r["rejected"] for r in backend.last_results]
    assert c["detect_moe"]["rejected"] == 0, [r["rejected"] for r in backend.last_results]
    assert c["rewrite_moe"]["replaced"] == graphs * tm.LAYERS
    codes = [r["code"] for r in backend.last_results[-graphs:]]
    for code in codes:
        assert code.count(MOE_CALL) == tm.LAYERS
        for op in GONE:
            assert op not in code, op
    return codes


# Static shapes (torch.compile's default): (dynamic, input shape) spread over the cases, each pair several times
STATIC = [(None, (2, 5)), (False, (8, 1)), (None, (8, 1)), (False, (2, 5))]
STATIC_CASES = [
    pytest.param(f, impl, dyn, shape, id=f"{f}-{impl}-dynamic={dyn}-{shape[0]}x{shape[1]}")
    for (f, impl), (dyn, shape) in zip(CASES, STATIC * len(CASES))
]


@pytest.mark.parametrize("family, impl, dynamic, shape", STATIC_CASES)
def test_whole_model_static_shapes(family, impl, dynamic, shape, poison):
    """dynamic=None / False trace with static shapes: the token ids are as static as any weight, yet they are the
    call's input, not a weight; every block is still found. [8, 1] is a decode step."""
    model = tm.hf_model(family, impl)
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        compiled = torch.compile(model, backend="moecomp", dynamic=dynamic, options=EAGER_INNER)
        got = compiled(ids).logits
        assert rel_err(got, want) <= 1e-4
        ids2 = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(4))
        with torch._dynamo.config.patch(error_on_recompile=True):
            got2 = compiled(ids2).logits
        assert rel_err(got2, model(ids2).logits) <= 1e-4
    (code,) = assert_every_block_rewritten(graphs=1)
    assert "torch.SymInt" not in code  # the graph really was static


def test_static_then_dynamic_recompile():
    """dynamic=None: a static graph for the first shape, a dynamic one once the shape changes; both rewritten, and
    the dynamic one serves further shapes without recompiling."""
    model = tm.hf_model("qwen2_moe")
    with torch.no_grad():
        compiled = torch.compile(model, backend="moecomp", options=EAGER_INNER)
        for i, shape in enumerate([(8, 1), (2, 5), (3, 4)]):
            ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(i))
            with torch._dynamo.config.patch(error_on_recompile=i == 2):
                got = compiled(ids).logits
            assert rel_err(got, model(ids).logits) <= 1e-4, shape
    static, dynamic = assert_every_block_rewritten(graphs=2)
    assert "torch.SymInt" not in static and "torch.SymInt" in dynamic


def test_reduce_overhead_mode_static_decode(poison):
    """What users write: ``torch.compile(model, backend="moecomp", mode="reduce-overhead")``, static shapes, a
    decode-shaped call, through Inductor for real (on CPU the mode is Inductor options: cudagraphs stay off)."""
    model = tm.hf_model("qwen3_moe")
    ids = torch.randint(0, 128, (8, 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
        compiled = torch.compile(model, backend="moecomp", mode="reduce-overhead")
        assert rel_err(compiled(ids).logits, want) <= 1e-4
        ids2 = torch.randint(0, 128, (8, 1), generator=torch.Generator().manual_seed(6))
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert rel_err(compiled(ids2).logits, model(ids2).logits) <= 1e-4
    (code,) = assert_every_block_rewritten(graphs=1)
    assert "torch.SymInt" not in code


def test_counts_only_graphs_that_compiled():
    """Through AOTAutograd, Dynamo traces an HF model twice (it restarts to specialise float scalars): matches of
    the abandoned attempt are not counted."""
    model = tm.hf_model("qwen3_moe")
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend="moecomp", dynamic=True, options={"moecomp.inner": "aot_eager"})(ids)
    assert rel_err(got.logits, want) <= 1e-4
    assert moecomp.counters["backend"]["graphs"] == 1
    assert moecomp.counters["rewrite_moe"]["replaced"] == tm.LAYERS


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_block_inductor_no_recompile(family, poison):
    """One block, fullgraph, through Inductor; after the first dynamic compile, no token count recompiles.

    The batch dim is marked unbacked on the first call (else Dynamo specialises size 1 and recompiles for it)."""
    block = tm.moe_blocks(tm.hf_model(family))[0]
    compiled = torch.compile(block, backend="moecomp", fullgraph=True, dynamic=True)
    x0 = torch.randn(2, 5, tm.H)
    torch._dynamo.decorators.mark_unbacked(x0, 0)
    with torch.no_grad():
        compiled(x0)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for b in (1, 2, 3, 4, 7, 16, 33, 128, 1000, 4096):
                x = torch.randn(b, 3, tm.H)
                got, want = compiled(x), block(x)
                if isinstance(got, tuple):  # gpt-oss: (hidden, router_scores)
                    assert rel_err(got[1], want[1]) <= 1e-5
                    got, want = got[0], want[0]
                assert torch.isfinite(got).all()
                assert rel_err(got, want) <= 1e-4, b
    assert moecomp.counters["backend"]["graphs"] == 1
    assert moecomp.counters["rewrite_moe"]["replaced"] == 1
    assert backend.last_results[-1]["code"].count(MOE_CALL) == 1


def test_dense_model_unchanged():
    """A dense model: zero matches, the graph handed on is exactly Dynamo's, same output."""
    model = tm.hf_model("llama")
    ids = torch.randint(0, 128, (2, 6))
    seen = {}

    def spy(gm, example_inputs):
        seen["before"] = gm.code
        res = backend.run_passes(gm, example_inputs)
        seen["after"], seen["res"] = gm.code, res
        return gm.forward

    with torch.no_grad():
        want = model(ids).logits
        torch.compile(model, backend=spy, dynamic=True)(ids)
        got = torch.compile(model, backend="moecomp", dynamic=True, options=EAGER_INNER)(ids).logits
    assert seen["before"] == seen["after"]
    assert len(seen["res"].matches) == 0 and seen["res"].rejected == []
    assert torch.equal(got, want) or rel_err(got, want) <= 1e-6
    assert moecomp.counters["detect_moe"]["matched"] == 0
    assert moecomp.counters["rewrite_moe"]["replaced"] == 0


def test_plain_pytorch_moe_in_a_model(poison):
    """A hand-written MoE (no transformers) inside a small residual model."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(tm.H)
            self.moe = tm.EinsumMoE()
            self.head = torch.nn.Linear(tm.H, 10)

        def forward(self, x):
            return self.head(x + self.moe(self.norm(x)))

    net = Net().eval()
    x = torch.randn(3, 4, tm.H)
    with torch.no_grad():
        got = torch.compile(net, backend="moecomp", dynamic=True, options=EAGER_INNER)(x)
        assert rel_err(got, net(x)) <= 1e-4
    assert moecomp.counters["rewrite_moe"]["replaced"] == 1
    assert backend.last_results[-1]["code"].count(MOE_CALL) == 1


def test_grad_mode_leaves_blocks_alone():
    """moe_forward has no backward: with grad on and weights requiring grad, the block is not rewritten."""
    model = tm.hf_model("mixtral")
    ids = torch.randint(0, 128, (1, 5))
    want = model(ids).logits
    got = torch.compile(model, backend="moecomp", dynamic=True, options=EAGER_INNER)(ids).logits
    assert rel_err(got, want.detach()) <= 1e-5
    assert moecomp.counters["rewrite_moe"]["replaced"] == 0
    assert moecomp.counters["backend"]["skipped_autograd"] == tm.LAYERS


def test_cache_key_follows_pass_sources(tmp_path, monkeypatch):
    """The post-grad pass's uuid hashes the pass sources (a changed pass is a new Inductor cache key) and chains a
    pass the user set."""
    patches = backend._config_patches(None, None)
    p = patches["post_grad_custom_post_pass"]
    uuid0 = p.uuid()
    assert uuid0[0] == "moecomp" and uuid0[1] == backend.passes_hash()

    copy = tmp_path / "detect_moe.py"
    copy.write_text(open(backend._PASS_FILES[1]).read() + "\n# changed\n")
    monkeypatch.setattr(backend, "_PASS_FILES", backend._PASS_FILES[:1] + (str(copy),) + backend._PASS_FILES[2:])
    backend.passes_hash.cache_clear()
    try:
        assert p.uuid() != uuid0
    finally:
        backend.passes_hash.cache_clear()

    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Mine(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Mine.calls += 1

        def uuid(self):
            return "mine"

    chained = backend._config_patches(None, {"post_grad_custom_post_pass": Mine()})["post_grad_custom_post_pass"]
    chained(torch.fx.Graph())
    assert Mine.calls == 1 and chained.uuid()[2] == "mine"


def test_counters_module_is_subscriptable():
    moecomp.counters["x"]["y"] += 2
    assert moecomp.counters["x"]["y"] == 2 and "x" in moecomp.counters
    assert moecomp.counters.snapshot()["x"] == {"y": 2}
    moecomp.counters.clear()
    assert moecomp.counters["x"]["y"] == 0


@pytest.mark.parametrize("dynamic", [True, None])
def test_jetmoe_output_bias_in_whole_model_graph(dynamic, poison):
    """JetMoE's MoE MLP returns ``layer_output + self.bias``: in the backend's whole-model graph the add stays as a
    tail reading the op's result (one moe_forward per MoE MLP; its attention experts, JetMoeMoA, are refused with a
    reason). Its router calls ``.tolist()``, so Dynamo gives the backend the block in one graph only with
    ``fullgraph=True`` (or ``torch._dynamo.config.capture_scalar_outputs``). The biases are zero when compiling
    (a model not loaded yet) and set afterwards: the compiled graph must still add them (a zero add folded into the
    op would drop them)."""
    from moecomp.coverage import families as F

    model, _ = F.build_tiny("jetmoe")
    mlps = [m for m in model.modules() if type(m).__name__ == "JetMoeMoE"]
    with torch.no_grad():
        for m in mlps:
            m.bias.zero_()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        compiled = torch.compile(model, backend="moecomp", dynamic=dynamic, fullgraph=True, options=EAGER_INNER)
        compiled(ids)
        for m in mlps:
            m.bias.normal_()
        ids2 = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(2))
        got, want = compiled(ids2).logits, model(ids2).logits
    assert rel_err(got, want) <= 1e-4
    c = moecomp.counters
    assert c["backend"]["graphs"] == 1 and c["rewrite_moe"]["replaced"] == len(mlps) == 2
    (res,) = backend.last_results
    assert res["code"].count(MOE_CALL) == len(mlps)
    assert len(res["rejected"]) == 2 and all("expert activation not recognised" in str(r) for _, r in res["rejected"])
