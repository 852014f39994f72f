"""Any MoE block whose experts module is a ``PackedExperts`` (4-bit: mxfp4, int4 with or without zero points) is
recognised by meaning and bound to ``moe_forward`` with its packed tensors, whatever the block (issue 22).

The GPTQ / AWQ loaders put ``PackedExperts`` into Mixtral / Qwen3-MoE style blocks (gate / up "concat", silu); here
tiny bf16 models get theirs from ``moecomp.core.quant.quantize_4bit`` of their own expert weights. gpt-oss's blocks
(interleaved swiglu_oai with biases) are ``test_mxfp4.py``'s.

Tolerance: ``TOL_BLOCK`` 1e-3 (max |a - b| / max |b|), the bound block against its own forward (the
``PackedExperts`` reference) on fresh random hidden states: both dequantize exactly, run fp32 GEMMs and round h to
bf16 between them (measured 0).
"""

from __future__ import annotations

import pytest
import torch

import moecomp
from moecomp.core import quant as q8
from moecomp.coverage import families as F
from moecomp.formats.packed import PackedExperts
from moecomp.api.optimize import rewritten_blocks
from moecomp.core.spec import QuantSpec

from .conftest import rel_err

TOL_BLOCK = 1e-3
SIZES = {"qwen3_moe": dict(hidden_size=64, moe_intermediate_size=64),
         "mixtral": dict(hidden_size=64, intermediate_size=64)}
QUANTS = {"int4 zero": QuantSpec.int4(group=32, zero_point=True), "int4": QuantSpec.int4(group=32, scale_dtype="bf16"),
          "mxfp4": QuantSpec.mxfp4()}


def packed_model(family: str, quant: QuantSpec):
    model, _ = F.build_tiny(family, sizes=SIZES[family])
    model = model.to(torch.bfloat16).eval()
    for m in list(model.modules()):
        ex = getattr(m, "experts", None)
        if ex is not None and getattr(ex, "gate_up_proj", None) is not None:
            p13, s13, z13 = q8.quantize_4bit(ex.gate_up_proj.detach(), quant)  # [E, 2I, H] "concat" rows
            p2, s2, z2 = q8.quantize_4bit(ex.down_proj.detach(), quant)
            m.experts = PackedExperts(quant, p13, s13, p2, s2, z13, z2, gate_up="concat", activation="silu")
    return model


@pytest.mark.parametrize("family,qname", [("qwen3_moe", "int4 zero"), ("mixtral", "int4"), ("qwen3_moe", "mxfp4")])
def test_packed_experts_in_other_blocks(family, qname):
    quant = QUANTS[qname]
    model = packed_model(family, quant)
    layers = model.config.num_hidden_layers
    blocks = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "experts", None), PackedExperts)}
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    block = next(iter(blocks.values()))
    with torch.no_grad():
        want = block(x)
    ptrs = {n: {k: t.data_ptr() for k, t in m.experts.named_parameters()} for n, m in blocks.items()}
    _, rep = moecomp.optimize(model, report=True)
    assert len(rep.blocks) == len(rep.rewritten) == layers == len(blocks), rep
    for b in rep.rewritten:
        assert b.method == "fx" and b.spec.quant == quant and b.spec.gate_up == "concat", b
        assert f"4-bit {quant.weight}" in b.experts, b.experts
    st = rewritten_blocks(model)[next(iter(blocks))]._moecomp
    zero = "experts.w13_zero" if quant.zero_point else None
    assert (st.bindings["w13"], st.bindings["w13_scale"], st.bindings.get("w13_zero")) == (
        "experts.w13", "experts.w13_scale", zero)
    assert not st.derived  # nothing stacked or copied: the op reads the module's tensors
    assert {n: {k: t.data_ptr() for k, t in m.experts.named_parameters()} for n, m in blocks.items()} == ptrs
    counter = F.OpCounter()
    with torch.no_grad(), counter:
        got = block(x)
    assert counter.calls == 1
    got, want = (g[0] if isinstance(g, tuple) else g for g in (got, want))
    assert rel_err(got, want) <= TOL_BLOCK


def test_scale_of_wrong_shape_is_refused_by_the_module():
    quant = QUANTS["int4 zero"]
    p13, s13, z13 = q8.quantize_4bit(torch.randn(4, 64, 64), quant)  # w13 [E, 2I, H]: H 64, I 32
    p2, s2, z2 = q8.quantize_4bit(torch.randn(4, 64, 32), quant)
    PackedExperts(quant, p13, s13, p2, s2, z13, z2, gate_up="concat")
    with pytest.raises(ValueError, match=r"w13_scale has shape \(4, 64, 1\).*need \(4, 64, 2\)"):
        PackedExperts(quant, p13, s13[..., :1], p2, s2, z13, z2, gate_up="concat")


def test_moecomp_load_reads_awq_and_binds(tmp_path):
    """``moecomp.load`` of an int4 AWQ checkpoint (written by ``testing/int4_writer.py``) goes to ``api/load_gptq.py``'s loader
    (``moecomp.api.load.LOADERS``); its ``PackedExperts`` blocks (int4 with zero points) are then bound, the zero points
    read from the graph."""
    from moecomp.testing import int4_writer

    model, _ = F.build_tiny("qwen3_moe", sizes=dict(hidden_size=128, moe_intermediate_size=128, head_dim=32))
    int4_writer.write_int4_checkpoint(model.eval(), str(tmp_path), "awq", 64, False)
    loaded = moecomp.load(str(tmp_path), device="cpu")
    ex = loaded.model.layers[0].mlp.experts
    assert isinstance(ex, PackedExperts) and ex.quant.weight == "int4" and ex.quant.zero_point
    _, rep = moecomp.optimize(loaded, report=True, fast_generate=False)
    assert len(rep.rewritten) == len(rep.blocks) == loaded.config.num_hidden_layers, rep
    st = rewritten_blocks(loaded)["model.layers.0.mlp"]._moecomp
    assert (st.bindings["w13_zero"], st.bindings["w2_zero"]) == ("experts.w13_zero", "experts.w2_zero")
