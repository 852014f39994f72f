"""gpt-oss MXFP4 checkpoints (issue 22): written in the real format, loaded packed by ``moecomp.load`` (never
dequantized to bf16), bound to ``moe_forward`` with ``spec.quant = QuantSpec.mxfp4()`` by ``optimize``.

A tiny random ``GptOssForCausalLM`` (hidden 64, intermediate 64, 8 experts, top-2, 2 layers) is written with
``write_mxfp4_checkpoint`` (experts quantized by ``moecomp.core.quant.quantize_4bit``) and loaded back.

Tolerances (max |a - b| / max |b| over the logits):
* ``TOL_REF_FP32`` 1e-5: the loaded model (``PackedExperts``, fp32 GEMMs of the exactly dequantized weights) against
  transformers' own ``GptOssExperts`` holding the same dequantized weights, in fp32: the same math in another order
  (measured 2e-7);
* ``TOL_REF_BF16`` 2e-2: the same in bf16, where transformers' experts round each GEMM to bf16 and ours keep fp32
  (measured 6e-3);
* ``TOL_OPT`` 1e-3: the optimized model (``moe_forward``, CPU path) against the loaded one: both dequantize exactly
  and accumulate in fp32 (measured 0 in bf16); greedy tokens must be equal;
* ``TOL_QUANT`` 0.3: the loaded model against the bf16 model it was written from: the quantization error itself
  (e2m1 keeps 1 mantissa bit; measured 8e-2 through two layers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moecomp
from moecomp.core import policy
from moecomp.oracle import reference
from moecomp.coverage import families as F
from moecomp.formats import mxfp4 as M
from moecomp.testing import mxfp4_write as W
from moecomp.formats.packed import PackedExperts
from moecomp.api.optimize import rewritten_blocks
from moecomp.core.reject import RejectCode

from .conftest import rel_err

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

TOL_REF_FP32 = 1e-5
TOL_REF_BF16 = 2e-2
TOL_OPT = 1e-3
TOL_QUANT = 0.3
E, H, I, LAYERS = 8, 64, 64, 2


def tiny_config(**kw) -> GptOssConfig:
    base = dict(vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, sliding_window=16,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return GptOssConfig(**{**base, **kw})


def source_model(seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config()).to(torch.bfloat16).eval()
    F._randomize_biases(model, seed)  # router / expert biases are zero at init: random ones, so their reading counts
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the bf16 source model, a real-format checkpoint of it in 3+ shards)."""
    model = source_model()
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    W.write_mxfp4_checkpoint(model, path, max_shard_bytes=40_000)
    return model, path


@pytest.fixture
def ids():
    return torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# --------------------------------------------------------------------------------------------- the format
def test_checkpoint_is_in_gpt_oss_format(written):
    from safetensors import safe_open

    _, path = written
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": W.NOT_CONVERTED}
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    assert len(set(where.values())) >= 3
    tensors = {}
    for fname in set(where.values()):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(tensors) == set(where)
    pre = "model.layers.1.mlp.experts."
    want = {"gate_up_proj_blocks": ((E, 2 * I, H // 32, 16), torch.uint8),
            "gate_up_proj_scales": ((E, 2 * I, H // 32), torch.uint8),
            "gate_up_proj_bias": ((E, 2 * I), torch.bfloat16),
            "down_proj_blocks": ((E, H, I // 32, 16), torch.uint8),
            "down_proj_scales": ((E, H, I // 32), torch.uint8),
            "down_proj_bias": ((E, H), torch.bfloat16)}
    for suf, (shape, dt) in want.items():
        assert (tuple(tensors[pre + suf].shape), tensors[pre + suf].dtype) == (shape, dt), suf
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in tensors)
    others = [t for k, t in tensors.items() if ".experts." not in k]
    assert others and all(t.dtype == torch.bfloat16 for t in others)


def test_transformers_reads_our_checkpoint_the_same(written):
    """transformers' own loader (its CPU path dequantizes MXFP4 to bf16 on load) gives exactly the weights our
    reference dequantization gives: the nibble order, the interleaved gate / up rows and the e8m0 bias agree."""
    _, path = written
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True))
    ours = W.dequantized_experts(moecomp.load(path, device="cpu"))
    for i in range(LAYERS):
        a, b = ours.model.layers[i].mlp.experts, hf.model.layers[i].mlp.experts
        for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            assert torch.equal(getattr(a, n), getattr(b, n)), (i, n)


# --------------------------------------------------------------------------------------------- loading
def test_load_keeps_experts_packed(written, ids):
    src, path = written
    model = moecomp.load(path, device="cpu")
    assert model.training is False and model.config.dtype == torch.bfloat16
    assert not hasattr(model.config, "quantization_config")
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == LAYERS
    ex = model.model.layers[0].mlp.experts
    assert ex.quant == M.QUANT and ex.gate_up == "interleaved" and ex.activation == "swiglu_oai"
    assert (ex.activation_alpha, ex.activation_limit) == (src.model.layers[0].mlp.experts.alpha,
                                                           src.model.layers[0].mlp.experts.limit)
    assert ex.w13.dtype == torch.uint8 and tuple(ex.w13.shape) == (E, 2 * I, H // 2)
    assert ex.w2.dtype == torch.uint8 and tuple(ex.w2.shape) == (E, H, I // 2)
    assert ex.w13_scale.dtype == torch.float8_e8m0fnu and tuple(ex.w13_scale.shape) == (E, 2 * I, H // 32)
    # no 16-bit tensor of an expert weight's size anywhere in the model
    assert max(t.numel() for t in model.parameters() if t.is_floating_point()) < E * I * H
    # the bytes are the checkpoint's, the rest is the source model's in bf16
    want = W.to_checkpoint(src.model.layers[0].mlp.experts)
    assert torch.equal(ex.w13.view(want["gate_up_proj_blocks"].shape), want["gate_up_proj_blocks"])
    assert torch.equal(ex.w2_scale.view(torch.uint8), want["down_proj_scales"])
    sd = src.state_dict()
    for k, v in model.state_dict().items():
        if ".experts." not in k:
            assert v.dtype == torch.bfloat16 and torch.equal(v, sd[k]), k
    rot, rot0 = model.model.rotary_emb, GptOssForCausalLM(tiny_config()).model.rotary_emb
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, rot0.inv_freq)
    assert rel_err(logits(model, ids), logits(src, ids)) <= TOL_QUANT


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL_REF_FP32), (torch.bfloat16, TOL_REF_BF16)])
def test_loaded_model_matches_dequantized_reference(written, ids, dtype, tol):
    _, path = written
    model = moecomp.load(path, dtype=dtype, device="cpu")
    assert rel_err(logits(model, ids), logits(W.dequantized_experts(model), ids)) <= tol


class _FloatAllocations(TorchDispatchMode):
    """The largest floating tensor any op made outside the meta device (numel)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def test_load_never_makes_a_dense_expert(written):
    _, path = written
    with _FloatAllocations() as seen:
        moecomp.load(path, device="cpu")
    assert 0 < seen.largest < E * I * H  # (one dense w2 alone would be E * I * H)
    with _FloatAllocations() as control:  # the check sees a dequantization when there is one
        W.dequantized_experts(moecomp.load(path, device="cpu"))
    assert control.largest >= E * 2 * I * H


def test_load_peak_memory_near_packed_size(tmp_path):
    """A larger random checkpoint (4 layers of 32 experts, 512 x 512: 56 MB held after loading, 201 MB of bf16
    experts) loads in a fresh process, every tensor then read, with the peak resident memory (VmHWM, mapped file
    pages included) at most 1.5x what the model holds above the baseline (the process after its imports and a meta
    build of the model); dequantized experts alone would be 3.6x."""
    cfg = tiny_config(hidden_size=512, intermediate_size=512, num_local_experts=32, num_hidden_layers=4,
                      head_dim=64, num_attention_heads=8)
    W.write_random_mxfp4_checkpoint(cfg, str(tmp_path))
    code = textwrap.dedent(f"""
        import torch, moecomp, transformers
        from moecomp.formats import checkpoint as C
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        config, _ = C.load_config({str(tmp_path)!r})
        C.build_on_meta(config, torch.bfloat16)  # imports and the meta build happen before the baseline
        base = status("VmRSS")
        model = moecomp.load({str(tmp_path)!r}, device="cpu")
        held = 0
        for t in model.state_dict().values():
            held += t.numel() * t.element_size()
            t.view(torch.uint8).max()  # every page read (loaded CPU tensors may be mapped from the file)
        print(base, status("VmHWM"), held)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(moecomp.__file__))})
    assert r.returncode == 0, r.stderr
    base, peak, held = map(int, r.stdout.split()[-3:])
    dense = 4 * 32 * 3 * 512 * 512 * 2
    assert held < dense / 3 and peak - base < 1.5 * held, (base, peak, held, dense)


def test_tied_embeddings(tmp_path, ids):
    """A config that ties ``lm_head`` to the embeddings: the writer leaves ``lm_head.weight`` out (as transformers
    saves it) and the loader ties it back (``model.tie_weights()``)."""
    torch.manual_seed(0)
    src = GptOssForCausalLM(tiny_config(tie_word_embeddings=True)).to(torch.bfloat16).eval()
    W.write_mxfp4_checkpoint(src, str(tmp_path))
    from safetensors import safe_open

    with safe_open(os.path.join(str(tmp_path), "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = moecomp.load(str(tmp_path), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert rel_err(logits(model, ids), logits(src, ids)) <= TOL_QUANT


def test_random_packed_model():
    model = W.random_packed_model(tiny_config(), "cpu", seed=1)
    ex = model.model.layers[1].mlp.experts
    assert isinstance(ex, PackedExperts) and ex.w13.dtype == torch.uint8
    assert not any(p.device.type == "meta" for p in list(model.parameters()) + list(model.buffers()))
    w = ex.dequantized("w13", 0)
    assert 0.015 < float(w.pow(2).mean().sqrt()) < 0.04  # weights of rms about 0.026 (mxfp4_write's docstring)
    out = logits(model, torch.randint(3, 128, (1, 5)))
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------- bad checkpoints
def _rewrite(path: str, key: str, fn) -> None:
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        fname = json.load(f)["weight_map"][key]
    t = load_file(os.path.join(path, fname))
    t[key] = fn(t[key])
    save_file(t, os.path.join(path, fname), metadata={"format": "pt"})


@pytest.mark.parametrize("suffix,fn,msg", [
    ("gate_up_proj_scales", lambda t: t[:, :, :1].contiguous(), "expected (8, 128, 2)"),
    ("down_proj_blocks", lambda t: t.reshape(E, H, -1).contiguous(), "expected (8, 64, 2, 16)"),
    ("down_proj_scales", lambda t: t.to(torch.int32), "expected torch.uint8"),
])
def test_bad_expert_tensor_raises_naming_it(tmp_path, suffix, fn, msg):
    W.write_mxfp4_checkpoint(source_model(), str(tmp_path), max_shard_bytes=40_000)
    key = f"model.layers.1.mlp.experts.{suffix}"
    _rewrite(str(tmp_path), key, fn)
    with pytest.raises(ValueError, match=rf"{key} has .*{msg}".replace("(", r"\(").replace(")", r"\)")):
        moecomp.load(str(tmp_path), device="cpu")


def test_missing_tensor_and_not_a_directory(tmp_path):
    W.write_mxfp4_checkpoint(source_model(), str(tmp_path))
    from safetensors.torch import load_file, save_file

    f = os.path.join(str(tmp_path), "model.safetensors")
    t = load_file(f)
    del t["model.norm.weight"]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing from the checkpoint: model.norm.weight"):
        moecomp.load(str(tmp_path), device="cpu")
    with pytest.raises(FileNotFoundError, match="local"):
        moecomp.load("openai/gpt-oss-20b")


# --------------------------------------------------------------------------------------------- optimize
def test_optimize_binds_packed_blocks(written, ids):
    _, path = written
    model = moecomp.load(path, device="cpu")
    ref_model = moecomp.load(path, device="cpu")
    want = logits(model, ids)
    sd0 = {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.blocks) == len(rep.rewritten) == LAYERS, rep  # exactly one block a layer, all bound
    assert "4-bit mxfp4" in str(rep)
    for b in rep.rewritten:
        assert b.method == "fx" and b.spec.quant == M.QUANT and b.spec.gate_up == "interleaved", b
        assert b.spec.activation == "swiglu_oai" and b.spec.has_expert_bias and b.spec.top_k == 2, b
    blocks = rewritten_blocks(model)
    st = next(iter(blocks.values()))._moecomp
    assert {k: st.bindings[k] for k in ("w13", "w13_scale", "w2", "w2_scale", "b13", "b2")} == {
        "w13": "experts.w13", "w13_scale": "experts.w13_scale", "w2": "experts.w2", "w2_scale": "experts.w2_scale",
        "b13": "experts.b13", "b2": "experts.b2"}
    assert st.bindings.get("w13_zero") is None and not st.derived
    # the op reads the packed tensors themselves (spy on the op call: same storage, uint8)
    import moecomp.bind.bind as B

    seen, real = [], B.call_moe_forward

    def spy(x, tensors, spec):
        seen.append(tensors)
        return real(x, tensors, spec)

    B.call_moe_forward = spy
    try:
        counter = F.OpCounter()
        with counter:
            got = logits(model, ids)
    finally:
        B.call_moe_forward = real
    assert counter.calls == LAYERS and len(seen) == LAYERS
    from moecomp.core.args import OP_ARGS

    for i, tensors in enumerate(seen):
        ex = model.model.layers[i].mlp.experts
        named = dict(zip(OP_ARGS, tensors))
        for k in ("w13", "w13_scale", "w2", "w2_scale"):
            assert named[k].data_ptr() == getattr(ex, k).data_ptr() and named[k].dtype == getattr(ex, k).dtype
    assert {k: (v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == sd0
    assert rel_err(got, want) <= TOL_OPT
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **gen), ref_model.generate(ids, **gen))
    moecomp.unoptimize(model)
    assert not rewritten_blocks(model)


def test_wrong_readings_are_far_outside_the_tolerance(written):
    """What ``policy``'s 4-bit note claims: each wrong reading of the packed tensors moves the experts' output by
    more than 10x the bf16 verify tolerance (the tolerance 4-bit blocks get)."""
    _, path = written
    ex = moecomp.load(path, dtype=torch.float32, device="cpu").model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    x, ids_, w = torch.randn(64, H, generator=g), torch.randint(0, E, (64, 2), generator=g), torch.rand(64, 2,
                                                                                                         generator=g)
    t = dict(w13=ex.w13, b13=ex.b13, w2=ex.w2, b2=ex.b2, w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
    spec = ex.spec(2)
    good = reference.experts(x, ids_, w, spec=spec, **t)

    def err(spec=spec, **change):
        return rel_err(reference.experts(x, ids_, w, spec=spec, **{**t, **change}), good)

    def swap(p):
        return (p >> 4) | (p << 4)

    def rows(s):
        return s.view(torch.uint8).roll(1, 1).view(s.dtype)

    e8 = torch.float8_e8m0fnu
    wrong = {"nibbles": err(w13=swap(ex.w13), w2=swap(ex.w2)),
             "concat": err(spec=ex.spec(2).__class__(**{**ex.spec(2).__dict__, "gate_up": "concat"})),
             "scale rows": err(w13_scale=rows(ex.w13_scale), w2_scale=rows(ex.w2_scale)),
             "scale exponent": err(w13_scale=(ex.w13_scale.float() * 2).to(e8))}
    tol = policy.verify_tolerance(torch.bfloat16, spec)
    assert tol == policy.VERIFY_TOLERANCE[torch.bfloat16]  # (4-bit: the 16-bit tolerance, not the FP8 one)
    assert all(v > 10 * tol for v in wrong.values()), wrong


def test_attribute_reader_refuses_packed_experts(written):
    from moecomp.recognise import fallback
    from moecomp.recognise.structure import find_parts

    _, path = written
    block = moecomp.load(path, device="cpu").model.layers[0].mlp
    r = fallback.recognise(block, find_parts(block))
    assert r.code == RejectCode.UNSUPPORTED_STRUCTURE and "PackedExperts" in r.message


def test_compile_backend_rewrites_packed_blocks(written, ids):
    """``torch.compile(model, backend="moecomp")``: ``PackedExperts`` traces as its batched spelling, the FX pass
    reads it and each block becomes one moe_forward (no dequant_4bit left in the compiled code)."""
    import moecomp.api.backend as B

    _, path = written
    torch._dynamo.reset()
    moecomp.counters.clear()
    model = moecomp.load(path, device="cpu")
    want = logits(model, ids)
    got = logits(torch.compile(model, backend="moecomp", options={"moecomp.inner": "aot_eager"}), ids)
    c = moecomp.counters.snapshot()
    assert c["rewrite_moe"]["replaced"] == LAYERS, c
    code = B.last_results[-1]["code"]
    assert "dequant_4bit" not in code and "moe_forward" in code
    assert rel_err(got, want) <= TOL_OPT
    torch._dynamo.reset()
