"""experts_implementation="moecomp": transformers' experts interface routed through torch.ops.moecomp.moe_experts."""

import copy
import warnings

import pytest
import torch

import moecomp  # noqa: F401  (registers "moecomp")
from moecomp.hf import experts_interface as ei
from moecomp.coverage import families as F

from .conftest import rel_err

TOL = 1e-4


def run(model, ids):
    import inspect

    counter = F.OpCounter()
    kw = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with counter, torch.no_grad():
        out = F._logits(model(input_ids=ids, **kw))
    return out, counter


@pytest.fixture
def ids():
    return torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))


def test_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["moecomp"] is ei.moecomp_experts_forward


# clamped SwiGLU (hy_v4, glm5_next, deepseek_v4), relu^2 ungated (nemotron_h), swiglu_oai concat (minimax_m3_vl),
# gelu_tanh in a decoder layer (gemma4)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen2_moe", "hy_v4", "glm5_next",
                                    "deepseek_v4", "nemotron_h", "minimax_m3_vl", "gemma4"])
def test_set_experts_implementation(family, ids, poison):
    model, _ = F.build_tiny(family)
    ref, c0 = run(model, ids)
    assert c0.experts_calls == 0
    model.set_experts_implementation("moecomp")
    out, c = run(model, ids)
    n_moe = sum(F.is_experts_class(type(m)) for m in model.modules())
    assert c.experts_calls == n_moe and c.calls == 0
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOL


def test_from_config_experts_implementation(ids):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = F.tiny_config(Qwen3MoeConfig, "qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moecomp").eval()
    assert model.config._experts_implementation == "moecomp"
    plain = copy.deepcopy(model)
    plain.set_experts_implementation("grouped_mm")
    out, c = run(model, ids)
    ref, _ = run(plain, ids)
    assert c.experts_calls == cfg.num_hidden_layers and rel_err(out, ref) <= TOL


def test_spec_from_gpt_oss_experts():
    model, _ = F.build_tiny("gpt_oss")
    spec = ei.experts_spec(model.model.layers[0].mlp.experts, top_k=2)
    assert (spec.w_layout, spec.gate_up, spec.activation, spec.has_expert_bias) == (
        "in_out", "interleaved", "swiglu_oai", True)
    experts = model.model.layers[0].mlp.experts  # its alpha / limit (from the config in 5.24, constants in 5.17)
    assert (spec.activation_alpha, spec.activation_limit) == (experts.alpha, experts.limit)


@pytest.mark.parametrize("family", ["muse_spark"])
def test_unsupported_experts_fall_back_with_one_warning(family, ids):
    """A norm after each expert (muse_spark) is not in MoESpec: transformers' own path runs. (inkling2's soft-capped
    SwiGLU was here too: it is MoESpec.gate_softcap / up_softcap now, test_softcapped_experts_run_moecomp.)"""
    pytest.importorskip(f"transformers.models.{family}", reason=f"this transformers has no {family}")
    model, _ = F.build_tiny(family)
    ref, _ = run(model, ids)
    model.set_experts_implementation("moecomp")
    ei._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, c = run(model, ids)
        run(model, ids)
    msgs = [str(x.message) for x in w if "moecomp experts" in str(x.message)]
    assert len(msgs) == 1, msgs
    assert c.experts_calls == 0
    assert rel_err(out, ref) <= TOL


def test_softcapped_experts_run_moecomp(ids):
    """inkling2's experts (a soft-capped SwiGLU, caps 4 / 25 fitted by the gate probe) run moecomp's experts op with no
    fallback warning, equal to transformers' path."""
    pytest.importorskip("transformers.models.inkling2.modeling_inkling2")  # (not in transformers 5.17)
    model, _ = F.build_tiny("inkling2")
    ref, _ = run(model, ids)
    spec = ei.experts_spec(model.model.layers[0].mlp.experts, top_k=2)
    assert (spec.activation, spec.gate_softcap, spec.up_softcap) == ("silu", 4.0, 25.0), spec.describe()
    model.set_experts_implementation("moecomp")
    ei._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, c = run(model, ids)
    assert not [str(x.message) for x in w if "moecomp experts" in str(x.message)]
    assert c.experts_calls > 0
    assert rel_err(out, ref) <= TOL


def test_training_falls_back(ids):
    model, _ = F.build_tiny("qwen3_moe")
    model.set_experts_implementation("moecomp")
    model.train()
    counter = F.OpCounter()
    with counter, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.experts_calls == 0
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


@pytest.mark.parametrize("family,want", [
    ("hy_v4", dict(activation="silu", activation_clamp=True, gated=True)),
    ("deepseek_v4", dict(activation="silu", activation_clamp=True, activation_limit=10.0)),
    ("nemotron_h", dict(activation="relu2", gated=False)),
    ("minimax_m3_vl", dict(activation="swiglu_oai", gate_up="concat", activation_clamp=False)),
])
def test_spec_new_activations(family, want):
    model, _ = F.build_tiny(family)
    m = next(m for m in model.modules() if F.is_experts_class(type(m)))
    spec = ei.experts_spec(m, top_k=2)
    assert {k: getattr(spec, k) for k in want} == want
    err, tol = ei.verify_experts(m, spec)
    assert err <= tol


def test_wrong_gate_is_refused_by_the_probe():
    """A module whose forward clamps but whose _apply_gate does not is caught by the numeric probe."""
    model, _ = F.build_tiny("hy_v4")
    m = next(m for m in model.modules() if F.is_experts_class(type(m)))
    spec = ei.experts_spec(m, top_k=2)
    err, tol = ei.verify_experts(m, spec.replace(activation_clamp=False))
    assert err > tol
