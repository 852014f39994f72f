"""The decode step's sibling-linear pass (``generate/fuse_linears.py``): which skinny-op calls it groups (by their
input node and format, never by names), how it counts them, and the engine's decode with the pass on against the
pass off on tiny fp32 models (logits bit for bit: the group kernel runs each member's own tile).

On CPU the skinny kernel is not taken (``linear16.takes`` is CUDA-only); the engine tests patch ``takes`` so that the
decode step's linears are the ops the GPU's step holds, which then run under the Triton interpreter, unfused (pass
off) and grouped (pass on)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import moecomp
from moecomp.core import quant as q8
from moecomp.core.spec import QuantSpec
from moecomp.generate import fuse_linears as fl

from .models import build, prompts

@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """The fusion is opt-in until measured on a GPU: these tests turn it on (a test may set it off again)."""
    monkeypatch.setenv("MOECOMP_FUSE_LINEARS", "1")


INTERP = os.environ.get("TRITON_INTERPRET") == "1"


class _Block(torch.nn.Module):
    """q / k / v of one input, an o projection of another, and a linear whose weight is computed after q."""

    def __init__(self, n_sib: int = 3):
        super().__init__()
        self.sib = torch.nn.ModuleList(torch.nn.Linear(16, 8 * (i + 1), bias=i % 2 == 0) for i in range(n_sib))
        self.o = torch.nn.Linear(8, 16)
        self.scale = torch.nn.Parameter(torch.ones(8, 16))

    def forward(self, h):
        sl = torch.ops.moecomp.skinny_linear
        ys = [sl(h, m.weight, m.bias) for m in self.sib]
        late = sl(h, self.scale * ys[0].sum(), None)  # its weight exists only after the first sibling: not grouped
        return [y.sum(-1) for y in ys] + [sl(ys[0], self.o.weight, self.o.bias), late]


def _graph(mod, x):
    """The Dynamo graph of ``mod(x)`` as a FusingBackend sees it, and the backend (wrapping "eager")."""
    be = fl.FusingBackend("eager")
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return be(gm, ex)

    torch._dynamo.reset()
    out = torch.compile(mod, backend=capture, fullgraph=True)(x)
    return graphs[0], be, out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("n_sib,groups", [(3, [3]), (6, [4, 2]), (1, [])])
def test_pass_groups_siblings_of_one_input(n_sib, groups):
    """Siblings of one input node become one skinny_group each run of at most four; a linear of another input, and
    one whose weight is computed after the first sibling, stay; the outputs are the unfused module's."""
    import moecomp.ops  # noqa: F401

    torch.manual_seed(n_sib)
    mod = _Block(n_sib).eval()
    x = torch.randn(2, 1, 16)
    moecomp.counters.clear()
    gm, be, out = _graph(mod, x)
    assert be.fused == [groups]
    assert moecomp.counters["fuse_linears"]["groups"] == len(groups)
    assert moecomp.counters["fuse_linears"]["linears"] == sum(groups)
    t = _targets(gm)
    assert t.count(torch.ops.moecomp.skinny_group.default) == len(groups)
    sl = [x for x in t if x in (torch.ops.moecomp.skinny_linear, torch.ops.moecomp.skinny_linear.default)]
    assert len(sl) == n_sib - sum(groups) + 2  # the o projection and the late linear stay
    with torch.no_grad():
        ref = mod(x)
    assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref))


class _FP8Pair(torch.nn.Module):
    def __init__(self, activation: str):
        super().__init__()
        self.q = QuantSpec(scale="block", activation=activation, block_n=32, block_k=32)
        self.key = self.q.key  # a plain str for Dynamo
        for name, n in (("g", 64), ("u", 32)):
            w, s = q8.quantize(torch.randn(n, 64) * 0.05, self.q)
            self.register_buffer(name, w)
            self.register_buffer(name + "_s", s)
        self.register_buffer("a", torch.full((1,), 0.05) if activation == "static" else None)

    def forward(self, h):
        f = torch.ops.moecomp.fp8_linear
        return f(h, self.g, self.g_s, None, self.a, self.key), f(h, self.u, self.u_s, None, self.a, self.key)


@pytest.mark.parametrize("activation,groups", [("none", [2]), ("dynamic", [2]), ("static", [])])
def test_pass_groups_fp8_unless_statically_scaled(activation, groups):
    """Two FP8 linears of one input are grouped when weight-only or dynamic (run weight-only at decode rows: the
    skinny kernel's format), left alone with a static activation scale (always w8a8, the FP8 linear's MMA forms);
    outputs as unfused."""
    import moecomp.ops  # noqa: F401

    torch.manual_seed(1)
    mod = _FP8Pair(activation)
    x = torch.randn(1, 64)
    gm, be, out = _graph(mod, x)
    assert be.fused == [groups]
    ref = mod(x)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def _pair(family, **kw):
    ref = build(family, **kw)
    opt = moecomp.optimize(copy.deepcopy(ref))
    opt.generate.cpu = True
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, kw.pop("backend", "eager") if "backend" in kw else "eager"
    return ref, opt, eng


def _decode_logits(family, fuse: str, monkeypatch, backend="eager", **kw):
    """(tokens, lm_head outputs of every step, the decode compile's FusingBackend) with the pass on ("1") or off."""
    monkeypatch.setenv("MOECOMP_FUSE_LINEARS", fuse)
    ref = build(family, **kw)
    opt = moecomp.optimize(copy.deepcopy(ref))
    opt.generate.cpu = True
    eng = opt.generate._engine()
    eng.cpu_compile, eng.compile_backend = True, backend
    seen = []
    hook = opt.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    ids, mask = prompts(ref.config.vocab_size, 2, 7, seed=9, left_pad=(0, 2))
    try:
        out = opt.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    finally:
        hook.remove()
    assert opt.generate.last["layers"] == "compiled" and eng.compile_error is None, eng.compile_traceback
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, want)  # transformers' tokens either way
    return out, seen, eng._compiled[1]["decode"][0].run.fusing


def _skinny_on_cpu(monkeypatch):
    """The decode step's linears as on the GPU: the skinny op at up to four rows (run by the interpreter)."""
    from moecomp.ops import linear16

    monkeypatch.setattr(linear16, "takes", lambda x, w: x.dtype == w.dtype and x.numel() // w.shape[1] <= 4)


@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("family,groups", [("qwen3_moe", [[3]]), ("deepseek_v3", [[2], [2, 2]])])
def test_engine_decode_pass_on_equals_off(family, groups, monkeypatch):
    """The engine's compiled decode step (tiny fp32 model, 2 layers, batch 2, 5 new tokens): with the pass its logits
    equal those without it bit for bit. Qwen3-MoE: one q / k / v group in the one compiled layer graph every layer
    shares. DeepSeek-V3 with its first layer dense: the MoE layer's graph groups the two projections of the layer's
    input (q_a, kv_a: MLA), the dense layer's graph those and the MLP's gate / up."""
    _skinny_on_cpu(monkeypatch)
    kw = dict(first_k_dense_replace=1) if family == "deepseek_v3" else {}
    moecomp.counters.clear()
    out_on, logits_on, fusing = _decode_logits(family, "1", monkeypatch, **kw)
    assert sorted(fusing.fused) == groups
    assert moecomp.counters["fuse_linears"]["groups"] == sum(len(g) for g in groups)
    out_off, logits_off, off = _decode_logits(family, "0", monkeypatch, **kw)
    # without the pass, the wrapper stays for the RMSNorm fold's default ("auto"), which leaves CPU graphs as they are
    assert off is not None and off.linears is False and all(f == [] for f in off.fused)
    assert off.then.auto and all(r["folded"] == [] for r in off.then.found)
    assert any("auto: a cpu graph" in why for r in off.then.found for why in r["skipped"])
    assert torch.equal(out_on, out_off) and len(logits_on) == len(logits_off) == 5
    assert all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))


@pytest.mark.slow
@pytest.mark.skipif(not INTERP, reason="the skinny kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_pass_through_inductor(monkeypatch):
    """The same through Inductor (CPU; what the GPU's engine compiles with): the grouped op lowers as a fallback
    kernel with one output per member, and the logits equal the unfused step's."""
    _skinny_on_cpu(monkeypatch)
    out_on, logits_on, fusing = _decode_logits("qwen3_moe", "1", monkeypatch, backend="inductor")
    # every graph the backend got holds one q / k / v group (Dynamo may trace the layer twice for Inductor: once
    # with the attention's float scaling as an input, again with it specialised)
    assert fusing.fused and all(f == [3] for f in fusing.fused), fusing.fused
    out_off, logits_off, _ = _decode_logits("qwen3_moe", "0", monkeypatch, backend="inductor")
    assert all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))


@pytest.mark.slow
@pytest.mark.skipif(not INTERP, reason="the FP8 kernels run under TRITON_INTERPRET=1 on CPU")
def test_engine_decode_fp8_dynamic_pass_on_equals_off(monkeypatch):
    """A tiny Qwen3-MoE in transformers' FP8 block format with dynamic activations (fp32 around the e4m3 weights),
    the op's Triton path under the interpreter: the decode step's q / k / v FP8 linears (weight-only at one row,
    ``tuning.fp8_mode``) become one group, launched once a layer a step, and the logits equal the unfused step's bit
    for bit."""
    from moecomp.coverage import families as F
    from moecomp.ops import skinny
    from moecomp.testing import count_calls
    from moecomp.testing import fp8_convert as C

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    model, _ = F.build_tiny("qwen3_moe", sizes=dict(hidden_size=128, moe_intermediate_size=128, num_experts=8,
                                                    head_dim=32))
    model = C.to_fp8(model.float().eval(), activation_scheme="dynamic")
    model.config.use_cache = model.generation_config.use_cache = True
    ids, mask = prompts(model.config.vocab_size, 1, 5, seed=9)
    got = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("MOECOMP_FUSE_LINEARS", fuse)
        opt = moecomp.optimize(copy.deepcopy(model))
        opt.generate.cpu = True
        eng = opt.generate._engine()
        eng.cpu_compile, eng.compile_backend = True, "eager"
        seen = []
        hook = opt.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        calls = count_calls(monkeypatch, skinny, ["skinny_group"])
        out = opt.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        hook.remove()
        assert opt.generate.last["layers"] == "compiled", opt.generate.last
        fusing = eng._compiled[1]["decode"][0].run.fusing
        layers, steps = model.config.num_hidden_layers, opt.generate.last["decode_steps"]
        if fuse == "1":
            assert fusing.fused == [[3]] and len(calls) == layers * steps, (fusing.fused, calls)
        else:
            # the wrapper stays for the RMSNorm fold's "auto" default, with the sibling-linear pass off
            assert not fusing.linears and all(f == [] for f in fusing.fused) and calls == []
        got[fuse] = out, seen
    assert torch.equal(got["1"][0], got["0"][0]) and len(got["1"][1]) == 4
    assert all(torch.equal(a, b) for a, b in zip(got["1"][1], got["0"][1]))
