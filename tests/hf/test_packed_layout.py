"""``optimize`` with MOECOMP_W4_FORM=mma re-lays every ``PackedExperts`` once, in place (``QuantSpec.layout`` "mma":
no second copy), before its checks; ``unoptimize`` restores the packed bytes exactly (issue 42 item 1). Op-level
tests of the layout: tests/kernels/test_quant4_mma_load.py.

A tiny Qwen3-MoE (bf16, 2 layers) with its experts as ``PackedExperts`` (mxfp4, int4 with zero points): after
``optimize`` every block is rewritten with the mma spec, the experts' tensors keep their storage (data_ptr, bytes),
no ``w4_layout.relaid`` copy is made, and the block (the op, the CPU torch path reading the layout) equals its own
forward before the relayout on fresh hidden states (outputs NaN-poisoned); ``state_dict`` holds the packed bytes and
``load_state_dict`` of packed bytes re-lays them; the gpt-oss checkpoint writer refuses re-laid experts; ``scan`` and
``optimize`` without the variable change nothing; ``unoptimize`` gives the packed bytes back.

Tolerance: ``TOL_BLOCK`` 1e-3 (relative error, as tests/hf/test_packed_blocks.py): both sides dequantize exactly,
run fp32 GEMMs and round h to bf16 between them.
"""

from __future__ import annotations

import pytest
import torch

import moecomp
from moecomp.core import quant as q8
from moecomp.coverage import families as F
from moecomp.formats.packed import PackedExperts
from moecomp.ops import w4_layout
from moecomp.core.spec import QuantSpec
from moecomp.testing import mxfp4_write

from .conftest import rel_err

TOL_BLOCK = 1e-3
QUANTS = {"mxfp4": QuantSpec.mxfp4(), "int4 zero": QuantSpec.int4(group=32, zero_point=True)}


def packed_model(quant: QuantSpec):
    model, _ = F.build_tiny("qwen3_moe", sizes=dict(hidden_size=64, moe_intermediate_size=64))
    model = model.to(torch.bfloat16).eval()
    for m in list(model.modules()):
        ex = getattr(m, "experts", None)
        if ex is not None and getattr(ex, "gate_up_proj", None) is not None:
            p13, s13, z13 = q8.quantize_4bit(ex.gate_up_proj.detach(), quant)
            p2, s2, z2 = q8.quantize_4bit(ex.down_proj.detach(), quant)
            m.experts = PackedExperts(quant, p13, s13, p2, s2, z13, z2, gate_up="concat", activation="silu")
    return model


def _held(model):
    return {n: (t.data_ptr(), t.untyped_storage().nbytes(), t.detach().clone())
            for n, t in model.named_parameters() if ".experts." in n}


def _block_out(block, x):
    with torch.no_grad():
        y = block(x)
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("qname", sorted(QUANTS))
def test_optimize_relays_in_place_and_unoptimize_restores(qname, monkeypatch, poison):
    quant = QUANTS[qname]
    monkeypatch.delenv("MOECOMP_CPU_BACKEND", raising=False)
    monkeypatch.setenv("MOECOMP_W4_FORM", "mma")
    model = packed_model(quant)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, PackedExperts)}
    blocks = {n.rpartition(".")[0]: m for n, m in model.named_modules() if isinstance(getattr(m, "experts", None),
                                                                                        PackedExperts)}
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = {n: _block_out(b, x) for n, b in blocks.items()}
    before = _held(model)
    moecomp.scan(model)
    assert all(m.quant == quant for m in experts.values())  # scan changes nothing
    cache = dict(w4_layout._CACHE)
    _, rep = moecomp.optimize(model, report=True)
    assert sorted(rep.w4_relaid) == sorted(experts) and len(rep.rewritten) == len(blocks) == 2, rep
    assert all(b.spec.quant.layout == "mma" for b in rep.rewritten)
    after = _held(model)
    assert {n: v[:2] for n, v in after.items()} == {n: v[:2] for n, v in before.items()}  # same storage, same size
    if quant.weight == "mxfp4":
        assert any(not torch.equal(after[n][2], before[n][2]) for n in before)  # re-encoded where it was
    for n, b in blocks.items():
        assert rel_err(_block_out(b, x), want[n]) <= TOL_BLOCK, n
    assert w4_layout._CACHE == cache  # no second copy made on the way
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(sd[n], before[n][2]) for n in before)  # state_dict: the packed bytes
    model.load_state_dict(sd)  # packed bytes in: re-laid as they load
    assert all(torch.equal(t, after[n][2]) for n, t in model.named_parameters() if n in after)
    with pytest.raises(ValueError, match="'mma' layout .*unoptimize"):
        mxfp4_write.to_checkpoint(next(iter(experts.values())))
    moecomp.unoptimize(model)
    assert all(m.quant == quant for m in experts.values())
    for n, t in model.named_parameters():
        if n in before:
            assert t.data_ptr() == before[n][0] and torch.equal(t, before[n][2]), n  # the packed bytes, exactly
    for n, b in blocks.items():
        assert torch.equal(_block_out(b, x), want[n]), n


def test_optimize_without_the_form_keeps_packed(monkeypatch):
    monkeypatch.delenv("MOECOMP_W4_FORM", raising=False)
    model = packed_model(QUANTS["int4 zero"])
    _, rep = moecomp.optimize(model, report=True)
    assert rep.w4_relaid == [] and len(rep.rewritten) == 2
    assert all(b.spec.quant.layout == "packed" for b in rep.rewritten)
