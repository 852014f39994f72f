"""compressed-tensors checkpoints (FP8-dynamic, W4A16 with and without zero points) written by the
``compressed-tensors`` package itself (``moecomp.testing.ct_writer``), read by ``moecomp.load`` with the experts kept
quantized (``moecomp.api.load_compressed``, ``moecomp.formats.compressed``), ``optimize``d, and compared with:

* the oracle (``moecomp.oracle.reference.moe_forward``) on every op call a forward makes, with the op's own bound
  tensors: fp32 within 1e-5 relative (the same dequantized values and activation codes, another summation order);
* the dequantized reference: transformers' ``from_pretrained`` of the same checkpoint decompressed by the package
  (``dequantized_checkpoint``: weights decoded by compressed-tensors, not by moecomp), fp32 logits on random tokens.
  W4A16 is weight-only, so within 1e-5 relative. FP8-dynamic quantizes activations per token, which the reference
  does not: the format's own error (measured as the un-optimized loaded model, whose plain forwards quantize
  activations, against the reference; 3-6% of the logits here, asserted below 10%) bounds the optimized model's
  (within 1e-5 relative of it, plus 1e-5).

Weights are not copied (every state_dict tensor keeps its data_ptr and dtype through optimize and forwards; the op
reads the modules' tensors themselves) and stay quantized (e4m3 / uint8 codes). transformers itself (5.17 to 5.25)
dequantizes such experts to 16-bit at load: ``test_transformers_load_dequantizes_the_experts`` records that and the
dense linears' refusal code. Outputs NaN-poisoned (``poison``). Skipped without ``compressed-tensors``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install compressed-tensors)")

import moecomp  # noqa: E402
from moecomp.core.args import MOE_ARGS, OP_ARGS  # noqa: E402
from moecomp.core.spec import QuantSpec  # noqa: E402
from moecomp.formats import compressed as ct  # noqa: E402
from moecomp.formats.packed import PackedExperts  # noqa: E402
from moecomp.formats.packed_linear import Packed4Linear  # noqa: E402
from moecomp.oracle import reference  # noqa: E402
from moecomp.testing.ct_writer import dequantized_checkpoint, write_ct_checkpoint  # noqa: E402

transformers = pytest.importorskip("transformers")
LAYERS, E, H, I = 2, 4, 128, 128
FP8 = torch.float8_e4m3fn


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _model():
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, intermediate_size=256, moe_intermediate_size=I,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, num_experts=E, num_experts_per_tok=2, vocab_size=256)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{preset: (checkpoint dir, dequantized dir)}, written on first use."""
    out = {}

    def get(preset):
        if preset not in out:
            root = tmp_path_factory.mktemp(preset.lower())
            path = write_ct_checkpoint(_model(), str(root / "ct"), preset)
            out[preset] = (path, dequantized_checkpoint(path, str(root / "deq")))
        return out[preset]

    return get


def _spied_forward(model, ids):
    """(logits, [(op output, x, tensors, spec)] of every moe_forward call)."""
    import moecomp.bind.bind as B

    seen, real = [], B.call_moe_forward

    def spy(x, tensors, spec):
        y = real(x, tensors, spec)
        seen.append((y, x, tensors, spec))
        return y

    B.call_moe_forward = spy
    try:
        with torch.no_grad():
            return model(ids).logits, seen
    finally:
        B.call_moe_forward = real


def _check_op_calls(model, seen, expert_names):
    """Each call: the oracle on the op's own tensors (fp32, 1e-5), and those tensors are the experts module's."""
    assert len(seen) == LAYERS
    for i, (y, x, tensors, spec) in enumerate(seen):
        named = dict(zip(OP_ARGS, tensors))
        extra = {a: named[a] for a in OP_ARGS[len(MOE_ARGS):] if named[a] is not None}
        ref = reference.moe_forward(x, *(named[a] for a in MOE_ARGS), spec, **extra)
        assert torch.isfinite(y).all() and rel(y, ref) < 1e-5, rel(y, ref)
        ex = model.model.layers[i].mlp.experts
        for arg, attr in expert_names.items():
            assert named[arg].data_ptr() == getattr(ex, attr).data_ptr(), arg
            assert named[arg].dtype == getattr(ex, attr).dtype


def _load_and_optimize(path):
    model = moecomp.load(path, dtype=torch.float32, device="cpu")
    sd0 = {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits
    _, rep = moecomp.optimize(model, report=True)
    return model, rep, sd0, ids, plain


def test_fp8_dynamic(written, poison):
    path, deq = written("FP8_DYNAMIC")
    model, rep, sd0, ids, plain = _load_and_optimize(path)
    want_q = QuantSpec(scale="channel", activation="dynamic", act_group=0)
    assert len(rep.blocks) == len(rep.rewritten) == LAYERS, rep
    assert all(b.spec.quant == want_q for b in rep.rewritten) and "a:token" in str(rep)
    assert rep.fp8_linear == {"modules": 4 * LAYERS, "bound": 4 * LAYERS, "refused": {}}  # q, k, v, o
    ex = model.model.layers[0].mlp.experts
    assert ex.gate_up_proj.dtype == FP8 and ex.gate_up_proj.shape == (E, 2 * I, H)
    assert ex.gate_up_proj_scale.dtype == torch.float32 and ex.gate_up_proj_scale.shape == (E, 2 * I)
    assert ex.down_proj.dtype == FP8 and model.model.layers[0].self_attn.q_proj.weight.dtype == FP8
    got, seen = _spied_forward(model, ids)
    _check_op_calls(model, seen, {"w13": "gate_up_proj", "w13_scale": "gate_up_proj_scale", "w2": "down_proj",
                                  "w2_scale": "down_proj_scale"})
    assert all(s.quant.per_token for _, _, _, s in seen)
    assert {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == sd0
    ref = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    with torch.no_grad():
        want = ref(ids).logits
    fmt_err = rel(plain, want)  # per-token e4m3 activations against the weight-only dequantized reference
    assert 1e-3 < fmt_err < 0.1, fmt_err
    assert rel(got, plain) < 1e-5 and rel(got, want) <= fmt_err * (1 + 1e-5) + 1e-5


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_w4a16(written, preset, poison):
    path, deq = written(preset)
    model, rep, sd0, ids, plain = _load_and_optimize(path)
    zp = preset.endswith("ASYM")
    want_q = QuantSpec.int4(128, zero_point=zp, scale_dtype="bf16")  # the checkpoint's scales, kept bf16
    assert len(rep.blocks) == len(rep.rewritten) == LAYERS, rep
    assert all(b.spec.quant == want_q for b in rep.rewritten)
    ex = model.model.layers[0].mlp.experts
    assert isinstance(ex, PackedExperts) and ex.w13.dtype == torch.uint8 and ex.w13.shape == (E, 2 * I, H // 2)
    assert (ex.w13_zero is not None) == zp and ex.w13_scale.dtype == torch.bfloat16
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Packed4Linear) and q.qweight.dtype == torch.uint8 and (q.zeros is not None) == zp
    names = {"w13": "w13", "w13_scale": "w13_scale", "w2": "w2", "w2_scale": "w2_scale"}
    if zp:
        names.update(w13_zero="w13_zero", w2_zero="w2_zero")
    got, seen = _spied_forward(model, ids)
    _check_op_calls(model, seen, names)
    assert {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == sd0
    ref = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    with torch.no_grad():
        want = ref(ids).logits
    assert rel(got, want) < 1e-5 and rel(plain, want) < 1e-5


def test_int4_codes_are_the_checkpoint_bytes(written):
    """weight_packed's int32 words, viewed as bytes, are moecomp's int4 layout: the package's own unpacking of one
    projection equals ours (codes, and the asymmetric zero points unpacked from their N-packed words)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    from moecomp.core import quant as q8

    path, _ = written("W4A16_ASYM")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        pre = "model.layers.0.mlp.experts.1.down_proj."
        t = {k: f.get_tensor(pre + k) for k in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
    quant = QuantSpec.int4(128, zero_point=True, scale_dtype="bf16")
    c = ct.int4_tensors(t, "down_proj", quant)
    assert c["w"].data_ptr() == t["weight_packed"].data_ptr()  # a view: no copy
    theirs = unpack_from_int32(t["weight_packed"], 4, torch.Size(t["weight_shape"].tolist())).to(torch.int16) + 8
    assert torch.equal(q8.unpack_4bit(c["w"]).to(torch.int16), theirs)
    zt = unpack_from_int32(t["weight_zero_point"], 4, torch.Size([H, 1]), packed_dim=0).to(torch.int16) + 8
    assert torch.equal(c["zero"].to(torch.int16), zt)


@pytest.mark.parametrize("preset,code", [("W8A8", "ct_int8"), ("FP8", "ct_fp8_scales"), ("W8A16", "ct_int8")])
def test_unsupported_presets_have_reason_codes(preset, code):
    cfg = ct.Config.read({"quant_method": "compressed-tensors", "config_groups": {preset: ["Linear"]}})
    with pytest.raises(ct.CTUnsupported, match=code) as e:
        ct.Codec(cfg).scheme("model.layers.0.self_attn.q_proj", {})
    assert e.value.code == code and isinstance(e.value, ValueError)


def test_scheme_reading_and_bad_tensors():
    fp8_static = dict(weights=dict(type="float", num_bits=8, strategy="channel"),
                      input_activations=dict(type="float", num_bits=8, strategy="tensor", dynamic=False))
    with pytest.raises(ct.CTUnsupported, match="ct_fp8_static"):
        ct.Scheme.read(fp8_static).kind()
    actorder = dict(weights=dict(type="int", num_bits=4, strategy="group", group_size=128, actorder="group"))
    with pytest.raises(ct.CTUnsupported, match="ct_actorder"):
        ct.Scheme.read(actorder).kind()
    cfg = ct.Config.read({"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp.gate$"],
                          "config_groups": {"g": dict(ct.PRESETS["W4A16"], targets=["Linear"]),
                                            "e": dict(ct.PRESETS["FP8_DYNAMIC"], targets=["re:.*experts.*"])}})
    assert cfg.scheme_for("model.layers.0.mlp.gate") is None and cfg.scheme_for("lm_head") is None
    assert cfg.scheme_for("model.layers.0.mlp.experts.3.up_proj").kind() == "fp8"  # the regex group wins
    assert cfg.scheme_for("model.layers.0.self_attn.o_proj").kind() == "int4"
    q = ct.Scheme.read(ct.PRESETS["FP8_DYNAMIC"]).quant()
    assert q == QuantSpec(scale="channel", act_group=0)
    w = torch.zeros(64, 256).to(FP8)
    with pytest.raises(ValueError, match=r"lin\.weight_scale: shape \[64, 2\]; channel scales .* need \[64\]"):
        ct.fp8_tensors({"weight": w, "weight_scale": torch.ones(64, 2)}, "lin", q)
    with pytest.raises(ValueError, match=r"lin\.weight: expected a float8_e4m3fn"):
        ct.fp8_tensors({"weight": w.float(), "weight_scale": torch.ones(64, 1)}, "lin", q)
    assert ct.fp8_tensors({"weight": w, "weight_scale": torch.ones(64, 1, dtype=torch.bfloat16)}, "lin", q)[
        "scale"].dtype == torch.float32
    with pytest.raises(ct.CTUnsupported, match="ct_not_compressed_tensors"):
        ct.Config.read({"quant_method": "gptq"})


def test_transformers_load_dequantizes_the_experts(written):
    """transformers' own load of the FP8 checkpoint: experts dequantized already (nothing quantized to keep), blocks
    rewritten as unquantized ones; the dense FP8 linears as transformers holds them are refused with their reason code."""
    path, _ = written("FP8_DYNAMIC")
    # (bf16: 5.17 dequantizes the experts to bf16 whatever dtype is asked for, and its fp32 model then fails)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.rewritten) == LAYERS and all(b.spec.quant is None for b in rep.rewritten)
    refused = rep.fp8_linear["refused"]
    assert len(refused) == 4 * LAYERS and all("ct_transformers_layout" in why for why in refused.values())
    assert dataclasses.is_dataclass(rep.blocks[0])
