"""FP8 block checkpoints (issue 19): transformers' FP8Experts / FP8Linear models, reached from every entry point.

Tiny models are built from a config (bf16), converted to what transformers builds for an FP8 block checkpoint
(``moecomp.testing.fp8_convert.to_fp8``), and compared with the same model run with the plain-PyTorch FP8 forwards
(``moecomp.formats.fp8.plain_fp8``: the dequantized reference, activations quantized as the modules say; transformers'
own FP8 forwards need the hub's kernel).

Tolerances (max |a - b| / max |b| over the logits):
* ``TOL_PLAIN`` 0.1 against the dequantized reference, bf16: each block is within the policy's FP8 verify tolerance
  (``policy.VERIFY_TOLERANCE_FP8``, 6e-2: bf16 roundings between the GEMMs put some activations on the other side of
  an e4m3 rounding, 2^-4 each; measured 1.6-2.5e-2 per block), and two layers compound it (a perturbed bf16 router
  input may also send a near-tie token elsewhere in the second layer); measured 1.6-4.8e-2 on the logits;
* ``TOL_FP32`` 1e-4 for fp32 models: then the op and the plain FP8 forward compute the same math (measured 0);
* ``TOL_BF16`` 0.25 against the bf16 model before quantization: the quantization error itself (e4m3 weights and
  activations, 3 mantissa bits each, through two layers); measured (and printed) 5-12e-2.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import moecomp
from moecomp.core import policy
from moecomp.hf import experts_interface as ei
from moecomp.coverage import families as F
from moecomp.formats import fp8 as P
from moecomp.testing import fp8_convert as C
from moecomp.api.optimize import rewritten_blocks

from .conftest import rel_err

TOL_PLAIN = 0.1
TOL_FP32 = 1e-4
TOL_BF16 = 0.25

# hidden 128, I a multiple of 128 (qwen3_moe, deepseek_v3, mixtral) or below 128 (qwen2_moe), 4-8 experts
SIZES = {
    "qwen3_moe": dict(hidden_size=128, moe_intermediate_size=128, num_experts=8, head_dim=32),
    "deepseek_v3": dict(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8, n_group=4, topk_group=2,
                        intermediate_size=256),
    "qwen2_moe": dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
                      head_dim=32),
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_local_experts=4, head_dim=32),
}


def build(family: str, dtype=torch.bfloat16, **kw):
    model, _ = F.build_tiny(family, sizes={**SIZES[family], **kw})
    return model.to(dtype).eval()


def logits(model, ids):
    with torch.no_grad():
        return F._logits(model(input_ids=ids, use_cache=False)).float()


@pytest.fixture
def ids():
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))


def model_bytes(model) -> int:
    """Bytes of every distinct storage reachable from the model's parameters and buffers (persistent or not)."""
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


# --------------------------------------------------------------------------------------------- optimize
@pytest.mark.parametrize("family,dtype", [("qwen3_moe", torch.bfloat16), ("deepseek_v3", torch.bfloat16),
                                          ("qwen2_moe", torch.bfloat16), ("mixtral", torch.bfloat16),
                                          ("deepseek_v3", torch.float32)])
def test_optimize_rewrites_fp8_blocks_whole(family, dtype, ids, capsys):
    bf16 = build(family, dtype)
    model = C.to_fp8(copy.deepcopy(bf16))
    want_bf16 = logits(bf16, ids)
    with P.plain_fp8(model):
        want = logits(model, ids)
    sd0 = {k: (v.dtype, v.data_ptr() if v.dtype == P.FP8 else 0) for k, v in model.state_dict().items()}
    bytes0 = model_bytes(model)
    _, rep = moecomp.optimize(model, report=True)
    n_blocks = sum(P.fp8_kind(m) == "experts" for m in model.modules())
    assert len(rep.rewritten) == n_blocks == model.config.num_hidden_layers, rep
    for b in rep.rewritten:
        assert b.method == "fx" and b.spec.quant is not None and b.spec.quant.scale == "block", b
        if family in ("deepseek_v3", "qwen2_moe"):
            assert b.spec.shared is not None and b.spec.shared.quant is not None, b
    st = next(iter(rewritten_blocks(model).values()))._moecomp
    assert st.bindings["w13_scale"] == "experts.gate_up_proj_scale_inv"
    assert st.bindings["w2_scale"] == "experts.down_proj_scale_inv"
    assert rep.fp8_linear["bound"] == rep.fp8_linear["modules"] > 0
    counter = F.OpCounter()
    with counter:
        got = logits(model, ids)
    assert counter.calls == n_blocks
    err, err_q = rel_err(got, want), rel_err(got, want_bf16)
    with capsys.disabled():
        print(f"\n{family} {dtype}: vs dequantized reference {err:.1e}, vs the model before quantization "
              f"(quantization error) {err_q:.1e}")
    tol = TOL_FP32 if dtype == torch.float32 else TOL_PLAIN
    assert torch.isfinite(got).all() and err <= tol and err_q <= TOL_BF16
    # weights shared, never copied or dequantized: fp8 tensors stay, same storage; only router copies are added
    sd1 = {k: (v.dtype, v.data_ptr() if v.dtype == P.FP8 else 0) for k, v in model.state_dict().items()}
    assert sd1 == sd0  # (16-bit router / shared-gate rows may be re-pointed into one shared FSE buffer)
    E, H = next(b.spec for b in rep.rewritten).num_experts, model.config.hidden_size
    assert model_bytes(model) - bytes0 <= n_blocks * (E + 1) * H * 4  # at most an fp32 router copy per block
    moecomp.unoptimize(model)
    assert not any("_moecomp_fp8" in m.__dict__ for m in model.modules())


def test_fallback_reader_fp8(ids):
    model = C.to_fp8(build("qwen2_moe"))
    with P.plain_fp8(model):
        want = logits(model, ids)
    _, rep = moecomp.optimize(model, report=True, use_capture=False)
    assert len(rep.rewritten) == 2 and all(b.method == "fallback" for b in rep.rewritten), rep
    spec = rep.rewritten[0].spec
    assert spec.quant is not None and spec.shared.quant is not None and spec.shared.gate == "sigmoid"
    assert rel_err(logits(model, ids), want) <= TOL_PLAIN


def test_scan_reports_fp8():
    model = C.to_fp8(build("qwen3_moe"))
    rep = moecomp.scan(model)
    assert [b.status for b in rep.blocks] == ["supported", "supported"]
    assert rep.fp8_linear == {"modules": 8, "bound": 0, "refused": {}}
    text = str(rep)
    assert "fp8 128x128 a:dynamic" in text and "FP8 linears" in text
    assert json.loads(rep.to_json())["fp8_linear"]["modules"] == 8
    assert not any("_moecomp_fp8" in m.__dict__ for m in model.modules())  # scan binds nothing


def test_static_activation_scales(ids):
    model = C.to_fp8(build("qwen3_moe"), activation_scheme="static")
    with P.plain_fp8(model):
        want = logits(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.rewritten) == 2 and rep.rewritten[0].spec.quant.activation == "static", rep
    st = model.model.layers[0].mlp._moecomp
    assert st.bindings["a13_scale"] == "experts.gate_up_proj_activation_scale"
    assert rel_err(logits(model, ids), want) <= TOL_PLAIN


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fallback_of_fp8_block_needs_no_hub_kernel(family, ids):
    """A hook on a bound FP8 block's router makes the block run its original forward (the hook must fire). That
    forward's FP8 experts would call transformers' hub kernel (ImportError offline, found on the H200 by
    benchmarks/diag_fp8_modules.py): they run their plain forward instead, so the logits are the dequantized
    reference's, the hook fires once per block, and the FP8 linears keep moecomp's kernel."""
    model = C.to_fp8(build(family))
    with P.plain_fp8(model):
        want = logits(model, ids)
    _, rep = moecomp.optimize(model, report=True)
    blocks = list(rewritten_blocks(model).values())
    assert len(rep.rewritten) == len(blocks) == model.config.num_hidden_layers
    fired = []
    hs = [b.gate.register_forward_hook(lambda m, a, o: fired.append(1)) for b in blocks]
    try:
        with pytest.MonkeyPatch.context() as mp:  # transformers' FP8 forward, if reached, fails as offline
            import transformers.integrations.finegrained_fp8 as hf8

            def offline():
                raise ImportError("finegrained-fp8 kernel unavailable (test)")

            mp.setattr(hf8, "load_finegrained_fp8_kernel", offline, raising=False)
            got = logits(model, ids)
    finally:
        for h in hs:
            h.remove()
    assert len(fired) == len(blocks)
    assert sum(b._moecomp.fallbacks for b in blocks) == len(blocks)
    assert not any("_moecomp_plain" in getattr(m.__dict__.get("forward"), "__dict__", {}) for m in model.modules())
    assert rel_err(got, want) <= TOL_PLAIN


# --------------------------------------------------------------------------------------------- other doors
def test_experts_interface_fp8(ids):
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    fn = ALL_FP8_EXPERTS_FUNCTIONS["moecomp"]  # (wrapped for tracing once the compile backend is imported)
    assert fn is ei.moecomp_experts_forward or getattr(fn, "__wrapped__", None) is ei.moecomp_experts_forward
    model = C.to_fp8(build("deepseek_v3"))
    with P.plain_fp8(model):
        want = logits(model, ids)
    for name, m in P.fp8_linears(model):  # attention / shared experts: moecomp.fp8_linear
        P.bind_linear(m, name)
    model.set_experts_implementation("moecomp")
    counter = F.OpCounter()
    with counter:
        got = logits(model, ids)
    assert counter.experts_calls == model.config.num_hidden_layers and counter.calls == 0
    assert rel_err(got, want) <= TOL_PLAIN


def test_fp8_linear_binding():
    model = C.to_fp8(build("qwen3_moe"))
    name, lin = P.fp8_linears(model)[0]
    x = torch.randn(5, lin.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        want = P.plain_linear_forward(lin, x)
        st = P.bind_linear(lin, name)
        assert st is not None and isinstance(lin.__dict__["forward"], P.LinearForward)
        got = lin(x)
    assert st.calls == 1 and torch.allclose(got.float(), want.float(), rtol=0, atol=1e-2 * want.abs().max().item())
    assert lin.weight.dtype == P.FP8  # the module's own tensors, not a copy
    x.requires_grad_(True)
    y = lin(x)  # grad mode: the op's value, the dequantized dense linear's gradient
    y.float().sum().backward()
    assert x.grad is not None and torch.allclose(y.detach().float(), got.float(), rtol=1e-2, atol=1e-2)
    assert P.unbind_linear(lin) and "forward" not in lin.__dict__ and "_moecomp_fp8" not in lin.__dict__


def test_bad_scales_raise_naming_both_tensors(ids):
    model = C.to_fp8(build("qwen3_moe"))
    ex = model.model.layers[0].mlp.experts
    ex.gate_up_proj_scale_inv = torch.nn.Parameter(ex.gate_up_proj_scale_inv.data[:, :1].clone())
    with pytest.raises(ValueError, match=r"gate_up_proj_scale_inv.*gate_up_proj"):
        P.experts_fp8(ex)
    with P.plain_fp8(ex), pytest.raises(ValueError, match=r"gate_up_proj_scale_inv.*gate_up_proj"):
        ex(torch.randn(3, 128, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    rep = moecomp.scan(model)
    assert rep.blocks[0].status == "skipped" and "gate_up_proj_scale_inv" in rep.blocks[0].reason, rep
    assert rep.blocks[1].status == "supported"
    name, lin = P.fp8_linears(model)[0]
    lin.weight_scale_inv = torch.nn.Parameter(torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"weight_scale_inv.*weight"):
        P.bind_linear(lin, name)
    assert name in moecomp.scan(model).fp8_linear["refused"]


# --------------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_writer(tmp_path):
    from safetensors import safe_open

    model = build("deepseek_v3")
    path = C.write_fp8_checkpoint(model, str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic"
    f = safe_open(os.path.join(path, "model.safetensors"), "pt")
    keys = set(f.keys())
    pre = "model.layers.0.mlp."
    q = C.block_quant()
    for i in range(8):
        for proj, shape in (("gate_proj", (128, 128)), ("up_proj", (128, 128)), ("down_proj", (128, 128))):
            w, s = f.get_tensor(f"{pre}experts.{i}.{proj}.weight"), f.get_tensor(f"{pre}experts.{i}.{proj}.weight_scale_inv")
            assert w.dtype == P.FP8 and w.shape == shape and s.dtype == torch.float32 and s.shape == (1, 1)
    ref = model.model.layers[0].mlp.experts.down_proj[3].detach().float()
    deq = moecomp.core.quant.dequantize(f.get_tensor(f"{pre}experts.3.down_proj.weight"),
                                   f.get_tensor(f"{pre}experts.3.down_proj.weight_scale_inv"), q)
    assert rel_err(deq, ref) <= 2 ** -4  # one e4m3 rounding
    for k in (f"{pre}gate.weight", "lm_head.weight", "model.embed_tokens.weight", f"{pre}gate.e_score_correction_bias"):
        assert f.get_tensor(k).dtype == torch.bfloat16 and f"{k}_scale_inv" not in keys
    for k in (f"{pre}shared_experts.gate_proj", "model.layers.0.self_attn.q_a_proj"):
        assert f.get_tensor(f"{k}.weight").dtype == P.FP8 and f"{k}.weight_scale_inv" in keys


def test_checkpoint_reload_dequantizes(tmp_path):
    """On CPU transformers dequantizes an FP8 checkpoint when it loads it: the same weights as ours, dequantized."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model = build("qwen3_moe")
    C.write_fp8_checkpoint(model, str(tmp_path))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    fp8 = C.to_fp8(copy.deepcopy(model))
    ex = fp8.model.layers[0].mlp.experts
    deq = moecomp.core.quant.dequantize(ex.gate_up_proj, ex.gate_up_proj_scale_inv, C.block_quant(), 2)
    got = back.model.layers[0].mlp.experts.gate_up_proj.float()
    assert rel_err(got, deq) <= 1e-2


def test_compile_backend_rewrites_fp8(ids):
    """``torch.compile(backend="moecomp")`` on an FP8 model: FP8Experts / FP8Linear trace as the plain forwards
    (for this backend only), each block becomes one moe_forward with its scales, the other FP8 linears fp8_linear."""
    import moecomp.api.backend as B

    torch._dynamo.reset()
    moecomp.counters.clear()
    model = C.to_fp8(build("deepseek_v3"))
    with P.plain_fp8(model):
        want = logits(model, ids)
    got = logits(torch.compile(model, backend="moecomp", options={"moecomp.inner": "aot_eager"}), ids)
    c = moecomp.counters.snapshot()
    assert c["rewrite_moe"]["replaced"] == 2 and c["fp8_linear"]["replaced"] == 10, c  # 5 attention linears a layer
    code = B.last_results[-1]["code"]
    assert "dequant_fp8" not in code and "fake_quant_act" not in code and "fp8_linear" in code
    assert rel_err(got, want) <= TOL_PLAIN
    torch._dynamo.reset()


def test_tracing_ops_opcheck():
    """moecomp::dequant_fp8 / moecomp::fake_quant_act (the tracing vocabulary): fake kernels agree with the real ones
    (``test_schema`` cannot run on fp8 inputs on CPU: docs/FP8.md), results equal moecomp.core.quant's."""
    q = C.block_quant()
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.moecomp.fake_quant_act.default, (x, q.key, None))
    assert torch.equal(torch.ops.moecomp.fake_quant_act(x, q.key, None), moecomp.core.quant.fake_quant_act(x, q))
    w, s = moecomp.core.quant.quantize(torch.randn(256, 128), q)
    torch.library.opcheck(torch.ops.moecomp.dequant_fp8.default, (w, s, q.key, 1),
                          test_utils=("test_faketensor", "test_aot_dispatch_static"))
    assert torch.equal(torch.ops.moecomp.dequant_fp8(w, s, q.key, 1), moecomp.core.quant.dequantize(w, s, q))


def test_plain_reference_weight_only(ids):
    """``plain_fp8(activations="none")``: the reference of a dynamic scheme run weight-only (the kernel table's w8a16
    at small T): an FP8 linear's plain forward is then x times its dequantized weight exactly (fp32, 1e-6), and the
    experts' forward differs from the stored-activation reference (whose activations are quantized); a bad value is a
    ValueError naming the argument; the stored reference's nesting is unchanged."""
    model = C.to_fp8(build("qwen2_moe", torch.float32))
    lin = next(m for m in model.modules() if P.fp8_kind(m) == "linear")
    lq = P.linear_fp8(lin)
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(1))
    W = q8_dequant(lin, lq)
    b = lin.bias.detach().float() if getattr(lin, "bias", None) is not None else 0.0
    with torch.no_grad(), P.plain_fp8(model, activations="none"):
        got = lin(x)
    with torch.no_grad(), P.plain_fp8(model):
        stored = lin(x)
        with P.plain_fp8(model, activations="none"):  # an inner context of the other mode takes over, then restores
            inner = lin(x)
        again = lin(x)
    assert rel_err(got, x @ W.T + b) <= 1e-6 and rel_err(stored, x @ W.T + b) > 1e-3
    assert torch.equal(inner, got) and torch.equal(again, stored)
    with torch.no_grad(), P.plain_fp8(model):
        want_q = logits(model, ids)
    with torch.no_grad(), P.plain_fp8(model, activations="none"):
        want_w = logits(model, ids)
    assert rel_err(want_w, want_q) > 1e-3
    with pytest.raises(ValueError, match="activations"):
        with P.plain_fp8(model, activations="w8a16"):
            pass


def q8_dequant(lin, lq):
    from moecomp.core import quant as q8

    return q8.dequantize(getattr(lin, lq.weight), getattr(lin, lq.scale), lq.quant).float().detach()
