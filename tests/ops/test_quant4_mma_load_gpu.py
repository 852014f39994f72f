"""GPU: 4-bit experts re-laid once, in place, to the "mma" layout (``QuantSpec.layout``; issue 42 item 1) at real
layer sizes (skipped without CUDA). CPU tests: tests/kernels/test_quant4_mma_load.py, tests/hf/test_packed_layout.py.

gpt-oss-120b's layer (E 128, H = I = 2880, top-4, swiglu_oai, biases, mxfp4: 1.06 + 0.53 GB of codes) and a
Qwen3-30B-A3B-size int4 layer (group 128, zero points) as a ``PackedExperts``, re-laid by
``formats.packed.relayout_experts`` (what ``optimize`` calls with MOECOMP_W4_FORM=mma):

* memory: the codes keep their storage (data_ptr), allocated memory is the same after, and the peak during the
  relayout is at most ``PEAK_EXPERTS`` experts' w13 bytes above it (one expert's int32 temporaries; a second copy of
  the codes would be 1.6 GB for gpt-oss);
* the op with the module's spec (layout "mma"; MOECOMP_W4_FORM unset: the layout selects the form) at T = 1 (the
  decode path: the GEMV kernels where the decode config says mode "gemv", they read the mma layout, else the DIRECT
  dot kernels) and T = 32 (aligned), uninitialised memory NaN-poisoned (the ``poison`` fixture) and the output
  checked finite, every launch the mma form or the GEMV on the held tensors, no ``w4_layout.relaid`` copy; against
  the oracle on the mma bytes (its own decode) and on
  the original packed bytes (relative Frobenius error < 1e-2 in bf16, as tests/ops/test_quant4_mma_gpu.py);
* ``set_layout("packed")`` gives the packed bytes back exactly.
"""

import pytest
import torch
from torch import nn

from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.formats.packed import PackedExperts, relayout_experts
from moecomp.ops import tuning
from moecomp.oracle import reference
from test_gpu import rel_err  # (tests/ops is on sys.path, no package: the bf16 GPU tests)
from test_quant4_gpu import packed_args

pytestmark = pytest.mark.gpu

GPT_OSS_120B = MoESpec(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, gate_up="interleaved",
                       activation="swiglu_oai", activation_alpha=1.702, activation_limit=7.0, has_expert_bias=True,
                       has_router_bias=True, score_order="topk_then_score", quant=QuantSpec.mxfp4())
QWEN3_INT4 = MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, round_weights=True,
                     quant=QuantSpec.int4(128, zero_point=True))
SPECS = {"gpt_oss_120b": GPT_OSS_120B, "qwen3_30b_a3b_int4_zp": QWEN3_INT4}
TOL = 1e-2
PEAK_EXPERTS = 16  # the relayout's peak above the held codes, in one expert's w13 bytes (its int32 temporaries)


def _module(spec: MoESpec, named: dict, extra: dict) -> PackedExperts:
    oai = spec.gate_up == "interleaved"
    return PackedExperts(spec.quant, named["w13"], extra["w13_scale"], named["w2"], extra["w2_scale"],
                         extra.get("w13_zero"), extra.get("w2_zero"), named["b13"] if oai else None,
                         named["b2"] if oai else None, gate_up=spec.gate_up, activation=spec.activation,
                         activation_alpha=spec.activation_alpha, activation_limit=spec.activation_limit)


def _spy(monkeypatch):
    from moecomp.ops import triton_quant4_gemv
    from moecomp.testing.w4_launches import record_w4_forms

    seen = record_w4_forms(monkeypatch, with_weights=True)
    real = triton_quant4_gemv.routed

    def gemv(x, ids_flat, weights, args, *a, **kw):  # recorded as ("gemv", None, each weight's data_ptr)
        seen.extend([("gemv", None, args["w13"].data_ptr()), ("gemv", None, args["w2"].data_ptr())])
        return real(x, ids_flat, weights, args, *a, **kw)

    monkeypatch.setattr(triton_quant4_gemv, "routed", gemv)
    return seen


@pytest.mark.parametrize("name", sorted(SPECS))
def test_load_time_relayout_real_layer(name, monkeypatch, poison):
    from moecomp.ops import w4_layout

    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM", "MOECOMP_W4_DECODE",
                "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM"):
        monkeypatch.delenv(var, raising=False)
    spec = SPECS[name]
    args, extra = packed_args(spec, 32, torch.bfloat16, seed=3)
    named = dict(zip(MOE_ARGS, args[1:]))
    held = nn.ModuleDict({"experts": _module(spec, named, extra)})
    ex = held["experts"]
    packed_cpu = {n: getattr(ex, n).detach().cpu() for n in ("w13", "w2")}
    ref_packed = {T: reference.moe_forward(args[0][:T], *args[1:], spec, **extra) for T in (1, 32)}
    ptrs = {n: getattr(ex, n).data_ptr() for n in ("w13", "w2")}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert relayout_experts(held, "mma") == ["experts"]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    one = ex.w13[0].numel()
    assert peak <= PEAK_EXPERTS * one, f"{name}: relayout peak {peak / 2**20:.1f} MiB over the held codes"
    assert torch.cuda.memory_allocated() == base
    assert {n: getattr(ex, n).data_ptr() for n in ("w13", "w2")} == ptrs
    mspec = spec.replace(quant=ex.quant)
    assert mspec.quant.layout == "mma"
    seen = _spy(monkeypatch)
    cache = dict(w4_layout._CACHE)
    for T in (1, 32):
        seen.clear()
        x = args[0][:T].contiguous()
        out = torch.ops.moecomp.moe_forward(x, *args[1:], mspec.key, **extra)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{name} T={T}: non-finite output"
        assert seen and all((f == 4 or n == "gemv") and p in ptrs.values() for n, f, p in seen), f"{name} T={T}: {seen}"
        cfg = tuning.get_config(spec.num_experts, spec.intermediate_size, spec.hidden_size, T, spec.top_k,
                                x.dtype, x.device, mspec.quant)
        dec = tuning.decode_config(cfg, T, x.device)
        gemv = dec is not None and dec.get("mode") == "gemv"
        assert any(n == "gemv" for n, _, _ in seen) == gemv, f"{name} T={T}: decode {dec}, launches {seen}"
        ref = reference.moe_forward(x, *args[1:], mspec, **extra)  # the oracle's own decode of the mma bytes
        err, err_packed = rel_err(out, ref), rel_err(out, ref_packed[T])
        assert err < TOL and err_packed < TOL, f"{name} T={T}: vs oracle {err:.2e}, vs packed oracle {err_packed:.2e}"
    assert w4_layout._CACHE == cache
    assert ex.set_layout("packed")
    assert all(torch.equal(getattr(ex, n).cpu(), packed_cpu[n]) for n in ("w13", "w2"))
