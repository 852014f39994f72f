"""benchmarks/gen_build_fp8.py (FP8 models built directly in FP8) and bench_generate_fp8.py's ``--build fp8`` on CPU.

The direct build is checked against the conversion of a float model holding the same draws (``to_fp8`` of the twin
``build(..., fp8=False)``): every tensor bit for bit and the logits exactly; its experts against those draws within
e4m3's rounding (an eighth of a binade: |error| <= 2^-4 of each 128 x 128 block's largest magnitude); and its peak
memory against the FP8 model plus a few chunks (``testing.PeakMemory`` on CPU), below what one float copy of the
experts would add (the conversion path, measured the same way, holds one)."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

gb = importlib.import_module("gen_build_fp8")
bf = importlib.import_module("bench_generate_fp8")
bg = importlib.import_module("bench_generate")

from moecomp.core import quant as q8  # noqa: E402
from moecomp.testing import PeakMemory  # noqa: E402

CHUNK = 16 << 10  # fp32 bytes drawn at a time: several chunks per expert tensor at the tiny sizes
FP8_REL = 2.0 ** -4  # e4m3 rounding: at most half a step of 3 mantissa bits, relative to the block's amax


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == q8.FP8 else t


def _fp8_pairs(model):
    """(module name, weight name, halves, e4m3 weight, fp32 scales) of every FP8 tensor of ``model``."""
    for mname, m in model.named_modules():
        for n, t in m._parameters.items():
            if t is not None and t.dtype == q8.FP8:
                yield mname, n, (2 if n == "gate_up_proj" else 1), t, getattr(m, f"{n}_scale_inv")


@pytest.mark.parametrize("shape,halves", [((3, 256, 384), 2), ((3, 256, 384), 1), ((256, 384), 1), ((2, 64, 96), 2)])
def test_block_quantize_is_quantize_bit_for_bit(shape, halves):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w[..., :128, :128] = 0  # an all-zero block (scale clamped, codes zero)
    w[..., -1, -1] = 3.0  # an outlier: its block's scale follows it
    q, s = gb.block_quantize(w, halves)
    q_ref, s_ref = q8.quantize(w, gb.block_quant(gb.BLOCK), halves)
    assert q.dtype == q8.FP8 and s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_direct_fp8_build_is_the_fp8_checkpoint_of_its_draws(name):
    """build(fp8=True) == to_fp8(build(fp8=False)) tensor for tensor and in the logits; the experts are
    transformers' FP8Experts (e4m3, fp32 scales per 128 x 128 block, gate and up blocked apart) and dequantize to the
    twin's weights within e4m3's rounding; norms and rotary buffers are bench_generate.build's."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    model, info = gb.build(name, "cpu", torch.float32, 2, True, 0, chunk_bytes=CHUNK)
    twin, _ = gb.build(name, "cpu", torch.float32, 2, True, 0, fp8=False, chunk_bytes=CHUNK)
    floats = {f"{m}.{n}": t.detach().clone() for m, n, *_ in _fp8_pairs(model)
              for t in [twin.get_submodule(m)._parameters[n]]}
    gb.to_fp8(twin, block_size=gb.BLOCK)
    a, b = model.state_dict(), twin.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(_bits(a[k]), _bits(b[k]))] == []

    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    assert len(experts) == model.config.num_hidden_layers
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    assert model.lm_head.weight.dtype == torch.float32 and model.config.quantization_config["quant_method"] == "fp8"
    for mname, n, halves, q, s in _fp8_pairs(model):
        rows, cols = q.shape[-2:]
        assert s.dtype == torch.float32
        assert s.shape[-2:] == (halves * -(-(rows // halves) // 128), -(-cols // 128)), (mname, n, tuple(s.shape))
        w = floats[f"{mname}.{n}"]
        deq = q8.dequantize(q, s, gb.block_quant(gb.BLOCK), halves).float()
        amax = q8.expand_scales(s, rows, cols, gb.block_quant(gb.BLOCK), halves) * 448.0
        assert (deq - w).abs().le(FP8_REL * amax + 1e-12).all(), (mname, n)

    ref = bg.build(name, "cpu", torch.float32, 2, True, 0)  # (the benchmark's float model: other draws)
    small = {k: v for k, v in ref.state_dict().items() if v.dim() < 2}
    assert small and all(torch.equal(a[k], v) for k, v in small.items())
    for (k, x), (k2, y) in zip(model.named_buffers(), ref.named_buffers()):  # (rotary frequencies: not saved)
        assert k == k2 and torch.equal(x, y)

    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with bf.plain(model, "fp8"), bf.plain(twin, "fp8"), torch.no_grad():
        la, lb = model(ids).logits, twin(ids).logits
    assert torch.isfinite(la).all() and torch.equal(la, lb)
    assert info["build"] == "fp8" and info["model_bytes"] == sum(p.numel() * p.element_size()
                                                                 for p in model.parameters())


def test_direct_fp8_build_never_holds_float_experts():
    """Peak CPU memory of the direct build: the FP8 model plus a few chunks; a float copy of the experts would be 4x
    that margin. The conversion path (a float model, then to_fp8), measured the same way, peaks above it."""
    with PeakMemory("cpu") as direct:
        model, info = gb.build("qwen3", "cpu", torch.float32, 6, True, 0, chunk_bytes=CHUNK)
    float_experts = sum(p.numel() * 4 for m in bg.experts_modules(model) for n, p in m.named_parameters()
                        if not n.endswith("_scale_inv"))
    margin = 8 * CHUNK
    assert 4 * margin < float_experts
    assert direct.peak <= info["model_bytes"] + margin, (direct.peak, info["model_bytes"])
    assert direct.end >= info["model_bytes"]  # (the measure sees the model it built)
    del model
    with PeakMemory("cpu") as converted:
        twin, _ = gb.build("qwen3", "cpu", torch.float32, 6, True, 0, fp8=False, chunk_bytes=CHUNK)
        gb.to_fp8(twin)
    assert converted.peak >= info["model_bytes"] + float_experts - margin


def test_bf16_fits_says_why():
    ok, why = gb.bf16_fits("mixtral", 32, False, "cpu")
    assert ok and "93." in why  # (bf16 Mixtral-8x7B: 93 GB, no limit on the CPU)
    with pytest.raises(ValueError, match="chunk_bytes"):
        gb.build("qwen3", "cpu", torch.float32, 1, True, 0, chunk_bytes=0)


def test_bench_generate_fp8_direct_build_cpu(tmp_path, capsys):
    """bench_generate_fp8.py --build bf16 --formats bf16, then --build fp8 with the first run's bf16 rows beside its
    own: every row has a floor, a TTFT, transformers' pass (plain dequantized forward for FP8) and the FP8 tokens
    under the dequantized reference; --table prints both files' rows."""
    a, c = tmp_path / "a.json", tmp_path / "c.json"
    common = ["--device", "cpu", "--tiny", "--models", "qwen3", "--batches", "1", "--layers", "qwen3=2"]
    assert bf.main(common + ["--build", "bf16", "--formats", "bf16", "--out-json", str(a)]) == 0
    assert bf.main(common + ["--build", "fp8", "--bf16-json", str(a), "--out-json", str(c)]) == 0
    res = json.loads(c.read_text())
    assert res["builds"]["qwen3"]["build"] == "fp8" and not res["errors"]
    (row,) = res["rows"]
    f8, b16 = row["fp8"], row["bf16"]
    assert b16["source"] == "a.json" and b16["peer"]["path"] == "hf"
    assert f8["peer"]["path"] == "hf_plain_fp8" and "hub kernels" in f8["peer"]["what"]
    for cell in (f8, b16):
        assert cell["decode_ms"] > 0 and cell["floor"]["decode_ms"] > 0 and cell["ttft_ms"] > 0
        assert cell["floor"]["distinct_experts_decode"] >= 1
    assert row["fp8_over_bf16"] == pytest.approx(f8["decode_ms"] / b16["decode_ms"])
    assert f8["reference_agreement"] >= 0.9  # (the CPU op quantizes activations as the stored reference does)
    assert 0.0 <= f8["reference_agreement_weight_only"] <= 1.0  # the weight-only reference, reported beside it
    assert f8["reference_logits_weight_only"]["finite"]
    assert "fp8 (built in FP8)" in res["table"] and "bf16 (from a.json)" in res["table"]
    capsys.readouterr()
    assert bf.main(["--table", str(a), str(c), str(tmp_path / "missing.json")]) == 0
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    # one header; a.json's bf16 row once (c.json's copy of it left out), c.json's fp8 row
    assert len(out) == 3 and out[0].startswith("| model |") and "from a.json" not in "".join(out)
    assert out[1].startswith("| qwen3 | 2 | 1 | bf16 |") and out[2].startswith("| qwen3 | 2 | 1 | fp8 (built in FP8) |")


def test_teacher_forced_reports_agreement_and_how_flat_the_logits_are():
    """bench_generate_fp8.teacher_forced on a stand-in model with set logits: agreement counts the generated
    positions only, chosen_gap is the chosen token's distance below the top logit over the largest |logit|."""
    from types import SimpleNamespace

    S, V = 3, 5
    seq = torch.tensor([[1, 2, 3, 4, 0, 2]])  # [1, S + 3]: tokens 4, 0, 2 generated
    logits = torch.zeros(1, 5, V)
    logits[0, 2, 4] = 10.0  # position S - 1 predicts token 4: agrees
    logits[0, 3, 1], logits[0, 3, 0] = 10.0, 9.0  # predicts 1, 0 chosen: 1.0 below the top
    logits[0, 4, 2] = 10.0  # agrees
    model = lambda input_ids: SimpleNamespace(logits=logits[:, : input_ids.shape[1]])  # noqa: E731
    tf = bf.teacher_forced(model, seq, S)
    assert tf["agreement"] == pytest.approx(2 / 3) and tf["finite"]
    assert tf["chosen_gap_max"] == pytest.approx(0.1) and tf["chosen_gap_median"] == 0.0
    assert tf["max_abs_logit"] == 10.0 and tf["top2_gap_median"] == pytest.approx(1.0)
    assert bf.teacher_forced_agreement(model, seq, S) == tf["agreement"]
