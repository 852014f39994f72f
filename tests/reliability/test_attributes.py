"""Attribute changes after ``moecomp.optimize``: followed or refused, never the old block computed silently.

A rewritten block snapshots the attributes its spec came from (scalars, callables, child modules). After a change
it runs its original forward (same result as the unoptimized model), warns once naming the attribute, and
``moecomp.optimize(model)`` re-binds it. Experts-only modules re-derive and re-check their spec instead. Under
``torch.compile`` the comparison is traced, so Dynamo guards on the attributes and recompiles on a change.

Each model is compared with its unoptimized reference (a deep copy taken before ``optimize``) given the same change,
on fresh random inputs: fp32 within 1e-4 relative (max |optimized - reference| / max |reference|).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.bind import bind as B  # noqa: E402
from moecomp.coverage import families as F  # noqa: E402
from moecomp.api.optimize import experts_only_modules, rewritten_blocks  # noqa: E402

from .test_weights import TinyMoEConfig, TinyMoEModel, experts_only_tiny  # noqa: E402

TOL = 1e-4




def rel_err(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max())


def _ids(seed):
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(seed))


def _x(seed):
    return torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _plain(model, x):
    with torch.no_grad():
        return model(x)


def _calls(model):
    return sum(m._moecomp.calls for m in rewritten_blocks(model).values()) + sum(
        m._moecomp_experts.calls for m in experts_only_modules(model).values())


def _fallbacks(model):
    return sum(m._moecomp.fallbacks for m in rewritten_blocks(model).values())


def _qwen3():
    model = F.build_tiny("qwen3_moe", seed=0)[0]
    assert model.model.layers[0].mlp.gate.norm_topk_prob is False and model.model.layers[0].mlp.gate.top_k == 2
    return model


def _modulelist():
    torch.manual_seed(0)
    return TinyMoEModel(TinyMoEConfig()).eval()


def _set_all(model, path, value_fn):
    """Set ``path`` (relative to each MoE block) on every block."""
    blocks = [layer.mlp for layer in model.model.layers] if hasattr(model, "model") else list(model.layers)
    for blk in blocks:
        owner, _, name = path.rpartition(".")
        setattr(blk.get_submodule(owner) if owner else blk, name, value_fn())


# (model, inputs, output, change path, new value, name in the warning, status after optimize again)
BLOCK_CASES = {
    "qwen3_gate.top_k": (_qwen3, _ids, _logits, "gate.top_k", lambda: 1, "gate.top_k", "rewritten"),
    "qwen3_gate.norm_topk_prob": (_qwen3, _ids, _logits, "gate.norm_topk_prob", lambda: True, "gate.norm_topk_prob",
                                  "rewritten"),
    "qwen3_experts.act_fn": (_qwen3, _ids, _logits, "experts.act_fn", nn.GELU, "experts.act_fn", "rewritten"),
    "modulelist_top_k": (_modulelist, _x, _plain, "top_k", lambda: 1, "'top_k'", "rewritten"),
    "modulelist_norm_topk_prob": (_modulelist, _x, _plain, "norm_topk_prob", lambda: False, "norm_topk_prob",
                                  "rewritten"),
    # one expert's activation differs from the others': no spec expresses that, so optimize refuses the block
    "modulelist_expert_act_fn": (_modulelist, _x, _plain, "experts.3.act_fn", nn.GELU, "experts.3.act_fn", "skipped"),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_attribute_change_runs_original_then_rebinds(case):
    make, inputs, out, path, value, name, status = BLOCK_CASES[case]
    model = make()
    ref = copy.deepcopy(model)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["rewritten"] * 2, str(rep)
    assert rel_err(out(model, inputs(1)), out(ref, inputs(1))) <= TOL
    before = out(ref, inputs(2))
    for m in (model, ref):
        _set_all(m, path, value)
    want = out(ref, inputs(2))
    assert rel_err(want, before) > 1e-3  # the change matters
    c0, f0 = _calls(model), _fallbacks(model)
    with pytest.warns(UserWarning, match=rf"{name}.*moecomp\.optimize\(model\) again") as rec:
        got = out(model, inputs(2))
    assert len([w for w in rec if "after moecomp.optimize" in str(w.message)]) == 2  # once per block
    assert rel_err(got, want) <= TOL
    assert _calls(model) == c0 and _fallbacks(model) == f0 + 2  # the original forward ran
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per block
        assert rel_err(out(model, inputs(3)), out(ref, inputs(3))) <= TOL
    assert all(B.stale(b) for b in rewritten_blocks(model).values())
    scan = moecomp.scan(model)  # says so, changes nothing
    assert [b.status for b in scan.blocks] == ["already"] * 2
    assert all(any(n.startswith("stale:") for n in b.notes) for b in scan.blocks)
    assert all(B.stale(b) for b in rewritten_blocks(model).values())
    # optimize again: stale blocks are detected afresh (not reported "already") and bound again where provable
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == [status] * 2, str(rep)
    assert all(any("re-detected" in n for n in b.notes) for b in rep.blocks)
    if status == "skipped":
        assert not rewritten_blocks(model) and all("differs" in b.reason for b in rep.blocks)
        assert rel_err(out(model, inputs(4)), out(ref, inputs(4))) <= TOL
        return
    assert not any(B.stale(b) for b in rewritten_blocks(model).values())
    c0 = _calls(model)
    assert rel_err(out(model, inputs(4)), out(ref, inputs(4))) <= TOL
    assert _calls(model) == c0 + 2
    _, rep = moecomp.optimize(model, report=True)  # and now it is just "already"
    assert [b.status for b in rep.blocks] == ["already"] * 2


def test_no_false_alarms():
    """Things that leave the spec alone do not count as changes: train() / eval(), private attributes (transformers
    sets ``_is_hf_initialized``), hooks, requires_grad, weight updates, a no-op ``.to``."""
    model = _qwen3()
    ref = copy.deepcopy(model)
    moecomp.optimize(model)
    model.train()
    model.eval()
    blk = model.model.layers[0].mlp
    blk._is_hf_initialized = True
    blk.gate._some_cache = 3
    h = blk.experts.register_forward_hook(lambda *a: None)
    h.remove()
    model.requires_grad_(False)
    model.to(torch.float32)
    with torch.no_grad():
        blk.gate.weight.mul_(1.0)
    c0 = _calls(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in (1, 2):
            assert rel_err(_logits(model, _ids(s)), _logits(ref, _ids(s))) <= TOL
    assert _calls(model) == c0 + 4
    assert not any(B.stale(b) for b in rewritten_blocks(model).values())


def test_callable_attribute_change():
    """A plain function attribute (not a module) is watched by identity."""
    model = _modulelist()
    for blk in model.layers:
        for e in blk.experts:
            del e.act_fn
            e.act_fn = torch.nn.functional.silu  # a function in __dict__, not a child module
    ref = copy.deepcopy(model)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["rewritten"] * 2, str(rep)
    assert rel_err(_plain(model, _x(1)), _plain(ref, _x(1))) <= TOL
    for m in (model, ref):
        m.layers[1].experts[2].act_fn = torch.nn.functional.gelu
    with pytest.warns(UserWarning, match=r"experts\.2\.act_fn"):
        got = _plain(model, _x(2))
    assert rel_err(got, _plain(ref, _x(2))) <= TOL
    assert B.stale(model.layers[1]) and not B.stale(model.layers[0])


def test_experts_only_follows_act_fn():
    """An experts-only module re-derives and re-checks its spec when its attributes change (here: ``act_fn``)."""
    model = experts_only_tiny()
    ref = copy.deepcopy(model)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["experts only"] * 2, str(rep)
    assert rel_err(_logits(model, _ids(1)), _logits(ref, _ids(1))) <= TOL
    before = _logits(ref, _ids(2))
    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.experts.act_fn = nn.GELU()
    want = _logits(ref, _ids(2))
    assert rel_err(want, before) > 1e-3
    c0 = _calls(model)
    assert rel_err(_logits(model, _ids(2)), want) <= TOL
    assert _calls(model) == c0 + 2  # still moe_experts, with the re-derived spec
    mods = experts_only_modules(model)
    assert all(s.activation == "gelu" for m in mods.values() for s in m._moecomp_experts_specs.values())
    assert all("act_fn" in B.experts_stale(m) for m in mods.values())  # the binding's report is out of date
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["experts only"] * 2 and all("gelu" in b.experts for b in rep.blocks)
    assert all(B.experts_stale(m) == "" for m in experts_only_modules(model).values())
    assert rel_err(_logits(model, _ids(3)), _logits(ref, _ids(3))) <= TOL


def test_experts_only_stale_binding_is_rebound():
    model = experts_only_tiny()
    moecomp.optimize(model)
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = nn.GELU()
    assert all(B.experts_stale(m) for m in experts_only_modules(model).values())
    _, rep = moecomp.optimize(model, report=True)
    assert [b.status for b in rep.blocks] == ["experts only"] * 2
    assert all(any("re-detected" in n for n in b.notes) and "gelu" in b.experts for b in rep.blocks)


@contextlib.contextmanager
def _compiled_pair(model):
    """(compiled optimized model, unoptimized reference copy), under no_grad, Dynamo reset before and after."""
    ref = copy.deepcopy(model)
    moecomp.optimize(model)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            yield torch.compile(model, backend="eager"), ref
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("what", ["gate.top_k", "experts.act_fn"])
def test_compiled_model_follows_attribute_change(what):
    """torch.compile(backend="eager") of an optimized model: no recompiles while nothing changes; after a change
    the guards fail, the recompiled graph runs the original forward, and the output follows."""
    model = _qwen3()
    with _compiled_pair(model) as (compiled, ref):
        assert rel_err(compiled(_ids(1)).logits, _logits(ref, _ids(1))) <= TOL
        torch.compiler.set_stance("fail_on_recompile")
        try:
            for s in (2, 3):
                assert rel_err(compiled(_ids(s)).logits, _logits(ref, _ids(s))) <= TOL
        finally:
            torch.compiler.set_stance("default")
        before = _logits(ref, _ids(4))
        for m in (model, ref):
            _set_all(m, what, (lambda: 1) if what == "gate.top_k" else nn.GELU)
        want = _logits(ref, _ids(4))
        assert rel_err(want, before) > 1e-3
        assert rel_err(compiled(_ids(4)).logits, want) <= TOL


def test_compiled_experts_only_follows_act_fn():
    model = experts_only_tiny()
    with _compiled_pair(model) as (compiled, ref):
        assert rel_err(compiled(_ids(1)).logits, _logits(ref, _ids(1))) <= TOL
        for m in (model, ref):
            for layer in m.model.layers:
                layer.mlp.experts.act_fn = nn.GELU()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the fallback path says it runs transformers' experts)
            got = compiled(_ids(2)).logits
        assert rel_err(got, _logits(ref, _ids(2))) <= TOL
