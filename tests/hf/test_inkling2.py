"""Inkling2 and Inkling2Loop (transformers' ``inkling2`` / ``inkling2_loop``, tiny, fp32): their MoE blocks route
with an fp32 sigmoid router (correction bias for the choice, renormalised with eps 1e-20, times
``routed_scaling_factor``) and their experts compute a softcapped SwiGLU, cap(g, 4) * sigmoid(g) * cap(u, 25)
with cap(v, c) = c * tanh(v / c) in fp32 (``MoESpec.gate_softcap`` / ``up_softcap``).

The experts' weights are redrawn large here, so that the gate reaches well past 4 and up past 25 (checked on the
experts' own inputs): with the default init the caps never bend and an optimize that ignored them would pass.
``moecomp.optimize`` must rewrite every MoE block whole (FX pass, and the attribute reader alone), one
``moe_forward`` per block, and the logits must equal the original's within 1e-4 relative on fresh tokens (the torch
path and the Triton kernels under the interpreter)."""

import pytest
import torch

import moecomp
from moecomp.probe import activations
from moecomp.coverage import families as F
from moecomp.probe import softcap as softcap_probe

from .conftest import rel_err

transformers = pytest.importorskip("transformers")
TOL = 1e-4
FAMILIES = ["inkling2", "inkling2_loop"]


def tiny(family: str, seed: int = 0):
    model, _ = F.build_tiny(family, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj"):
                m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 1.5)
                m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * 0.02)
    return model


def to_bf16(model):
    """``model`` in bf16 as ``from_pretrained(dtype=torch.bfloat16)`` gives it: its ``_keep_in_fp32_modules_strict``
    (the router weight and correction bias, the short convolutions, ...) stay fp32."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    model.to(torch.bfloat16)
    for name, mod in model.named_modules():
        for pname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            if t.is_floating_point() and any(k in full for k in keep):
                t.data = t.data.float()
    return model


def _expert_inputs(model, ids):
    """(max |gate|, max |up|) the experts' activation sees on ``ids`` (the original forward)."""
    seen = []
    hooks = [m.act_fn.register_forward_hook(lambda mod, a, out: seen.append((a[0].abs().max(), a[1].abs().max())))
             for m in model.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "act_fn")]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return max(float(g) for g, _ in seen), max(float(u) for _, u in seen)


# (family, CPU backend, FX pass or the attribute reader alone); Triton once: both families share the expert code
CASES = [(f, "torch", cap) for f in FAMILIES for cap in (True, False)] + [("inkling2", "triton", True)]


@pytest.mark.parametrize("family, backend, use_capture", CASES)
def test_rewritten_whole_and_equal(monkeypatch, family, backend, use_capture):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    model = tiny(family)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(5))
    g_max, u_max = _expert_inputs(model, ids)
    assert g_max > 8 and u_max > 30, f"the caps must bend on this input: |gate| {g_max:.1f}, |up| {u_max:.1f}"
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    _, rep = moecomp.optimize(model, report=True, use_capture=use_capture, fast_generate=False)
    assert len(rep.rewritten) == len(rep.blocks) >= 2, str(rep)
    for b in rep.rewritten:
        s = b.spec
        assert b.method == ("fx" if use_capture else "fallback"), b.method
        assert (s.activation, s.gated, s.gate_softcap, s.up_softcap) == ("silu", True, 4.0, 25.0), s.describe()
        assert (s.scoring, s.has_correction_bias, s.renormalize, s.renorm_eps, s.router_fp32) == (
            "sigmoid", True, True, 1e-20, True), s.describe()
    with torch.no_grad():
        got, per, total = F.count_calls_per_block(model, lambda: model(input_ids=ids).logits)
    assert total == len(rep.rewritten) and all(n == 1 for n in per.values()), per
    assert torch.isfinite(got).all() and rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_probe_gate_fits_the_caps():
    """The attribute reader's gate probe names Inkling2's activation and fits both caps from the function."""
    model = tiny("inkling2")
    experts = next(m for m in model.modules() if type(m).__name__ == "Inkling2Experts")
    assert activations.probe_gate(experts, None) == activations.GateReading("silu", "concat", 1.702, 7.0, False, 4.0,
                                                                            25.0)


@pytest.mark.parametrize("cg, cu", [(4.0, 25.0), (0.0, 3.0), (0.5, 0.0), (2500.0, 7.25)])
def test_fit_softcaps_on_functions(cg, cu):
    from moecomp.oracle import reference

    def fn(h):
        g, u = h.chunk(2, dim=-1)
        return reference.gated_activation(g, u, "silu", 1.702, 7.0, False, cg, cu)

    got = softcap_probe.fit_softcaps(fn)
    assert got is not None and all(abs(a - b) <= 1e-5 * max(b, 1.0) for a, b in zip(got, (cg, cu))), got


def test_fit_softcaps_refuses_what_is_no_softcap():
    """A gate whose values no cap explains (negative, or past the probe value) fits nothing."""
    assert softcap_probe.fit_softcaps(lambda h: -h[:, :1].abs()) is None
    assert softcap_probe.fit_softcaps(lambda h: h[:, :1] * h[:, 1:] * 2) is None
    assert softcap_probe.fit_softcaps(lambda h: (_ for _ in ()).throw(RuntimeError("no"))) is None


@pytest.mark.gpu
def test_inkling2_bf16_cuda():
    """Inkling2 in bf16 on the GPU (where the installed transformers has it): rewritten whole by the FX pass, the
    Triton kernels' softcap epilogue on the experts; logits equal the original's within 3e-2 of their max (bf16, the
    verify tolerance of tests/hf/test_capacity_blocks.py's bf16 test); caps that bend, as above."""
    pytest.importorskip("transformers.models.inkling2")
    model = to_bf16(tiny("inkling2").to("cuda"))
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(6)).to("cuda")
    g_max, u_max = _expert_inputs(model, ids)
    assert g_max > 8 and u_max > 30, (g_max, u_max)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    assert len(rep.rewritten) == len(rep.blocks) >= 2 and all(b.method == "fx" for b in rep.rewritten), str(rep)
    assert all((b.spec.gate_softcap, b.spec.up_softcap) == (4.0, 25.0) for b in rep.rewritten), str(rep)
    with torch.no_grad():
        got, per, total = F.count_calls_per_block(model, lambda: model(input_ids=ids).logits.float())
    assert total == len(rep.rewritten) and torch.isfinite(got).all() and rel_err(got, ref) <= 3e-2, rel_err(got, ref)
