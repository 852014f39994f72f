"""``set_experts_implementation(name)`` after ``moecomp.optimize``: the bound blocks run what was asked for, and come
back to moecomp's op on ``set_experts_implementation("moecomp")`` or ``optimize`` again (bind/impl_switch.py). The
check transformers' own model tests make (``test_eager_matches_batched_and_grouped_inference``: the implementation
named is called), done here with a counting wrapper instead of a mock."""

import warnings
from unittest import mock

import pytest
import torch

import moecomp
from moecomp.coverage import families as F

from .conftest import rel_err

TOL = 1e-4


def run(model, ids):
    counter = F.OpCounter()
    with counter, torch.no_grad():
        out = F._logits(model(input_ids=ids, use_cache=False))
    return out, counter


@pytest.fixture
def ids():
    return torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))


def _counting(name, calls):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fn = ALL_EXPERTS_FUNCTIONS[name]

    def wrapper(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)

    return mock.patch.dict(ALL_EXPERTS_FUNCTIONS._global_mapping, {name: wrapper})


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "olmoe"])
def test_named_implementation_runs_after_optimize(family, ids, poison, monkeypatch):
    from moecomp.bind import impl_switch

    monkeypatch.setattr(impl_switch, "_warned", set())  # (once per process: this test looks for the warning)
    model, _ = F.build_tiny(family)
    before = model.config._experts_implementation
    ref, _ = run(model, ids)
    rep = moecomp.optimize(model, report=True)[1]
    n = sum(b.status == "rewritten" for b in rep.blocks)
    assert n == model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0), rep
    assert model.config._experts_implementation == "moecomp"
    out, c = run(model, ids)
    assert c.calls == n and rel_err(out, ref) <= TOL
    for name in ("batched_mm", "grouped_mm", "eager"):
        model.set_experts_implementation(name)
        calls = {}
        with warnings.catch_warnings(record=True) as w, _counting("batched_mm", calls), \
                _counting("grouped_mm", calls):
            warnings.simplefilter("always")
            out, c = run(model, ids)
        assert c.calls == 0 and c.experts_calls == 0, name  # no moecomp op ran
        if name != "eager":
            assert calls == {name: n}, (name, calls)
        else:
            assert calls == {}, calls
        assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL
        if name == "batched_mm":  # warned once per name, saying how to come back
            assert any("set_experts_implementation('moecomp')" in str(x.message) for x in w)
    model.set_experts_implementation("moecomp")
    out, c = run(model, ids)
    assert c.calls == n and rel_err(out, ref) <= TOL
    model.set_experts_implementation("grouped_mm")
    moecomp.optimize(model)  # optimize again takes them back too
    assert model.config._experts_implementation == "moecomp"
    assert run(model, ids)[1].calls == n
    moecomp.unoptimize(model)
    assert model.config._experts_implementation == "grouped_mm"  # the name asked for last, not "moecomp"
    del before


def test_unoptimize_restores_the_name(ids):
    model, _ = F.build_tiny("qwen3_moe")
    before = model.config._experts_implementation
    moecomp.optimize(model)
    assert model.config._experts_implementation == "moecomp"
    moecomp.unoptimize(model)
    assert model.config._experts_implementation == before
    out, c = run(model, ids)
    assert c.calls == 0 and c.experts_calls == 0


def test_saved_config_does_not_carry_moecomp(tmp_path):
    model, _ = F.build_tiny("qwen3_moe")
    moecomp.optimize(model)
    model.config.save_pretrained(tmp_path)
    assert "moecomp" not in (tmp_path / "config.json").read_text()


def test_later_layers_are_verified_against_transformers_experts(monkeypatch):
    """Layers share one config: once optimize binds the first block it names "moecomp", and the blocks after it
    would run moecomp's experts (with that path's own check of every layer's experts) as their "original" forward.
    optimize verifies each block against transformers' own experts path instead (``impl_switch.unclaimed``): the
    experts-only check never runs, every block is rewritten, and the config names "moecomp" afterwards. (Before
    the fix: one experts-only check per layer after the first; 54-68 s of optimize on a 48-layer Qwen3-30B-A3B on
    an H200.)"""
    from moecomp.hf import experts_interface as ei

    checks, impls = [], []
    real = ei.verify_experts
    monkeypatch.setattr(ei, "verify_experts", lambda *a, **k: (checks.append(1), real(*a, **k))[1])
    model, _ = F.build_tiny("qwen3_moe")  # 2 layers: the second is verified after the first was bound
    before = model.config._experts_implementation
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fn = ALL_EXPERTS_FUNCTIONS[before]
    with mock.patch.dict(ALL_EXPERTS_FUNCTIONS._global_mapping,
                         {before: lambda *a, **k: (impls.append(before), fn(*a, **k))[1]}):
        rep = moecomp.optimize(model, report=True)[1]
    n = sum(b.status == "rewritten" for b in rep.blocks)
    assert n == model.config.num_hidden_layers >= 2, rep
    assert checks == [] and impls, (checks, impls)  # every probe ran transformers' implementation, none moecomp's
    assert model.config._experts_implementation == "moecomp"
