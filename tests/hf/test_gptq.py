"""int4 GPTQ / AWQ checkpoints (issue 22): the converters against an independent writer, and load_int4.

Converters: known codes, zeros and scales are packed the checkpoint way (``moecomp.testing.int4_writer.pack_gptq`` /
``pack_awq``: a shift and an OR per nibble, as the quantizers write them; plus hand-written words for the nibble
orders), converted (``gptq_to_packed`` / ``awq_to_packed``), and ``moecomp.core.quant.dequantize`` of the result must
equal ``(code - zero) * scale`` computed from the known values: exactly (both are one fp32 product of the same
numbers).

Loading: tiny random models (hidden 128, two MoE layers) are written as real-format checkpoints (per-expert keys,
experts and attention int4, group 64, config.json's quantization_config) and loaded with ``load_int4``. The
reference is the same model with every quantized weight replaced by ``dequantize(quantize_4bit(W))``, which is
what the checkpoint holds. Tolerances (max |a - b| / max |b| over the logits):
* ``TOL_FP32`` 1e-5 in fp32: the same weights and the same math, summed in another order (measured ~1e-7);
* ``TOL_BF16`` 3e-2 in bf16: the reference rounds each dequantized weight to bf16 (2^-9 relative) where
  PackedExperts multiplies the exact fp32 weight, and bf16 activations compound that over two layers (measured
  and printed);
* the quantization itself (int4 against the unquantized fp32 model) is printed, not bounded: ~1e-1 at group 64.
"""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch

import moecomp
from moecomp.core import quant as q8
from moecomp.coverage import families as F
from moecomp.api import load_gptq as L
from moecomp.formats import gptq as G
from moecomp.testing import int4_writer as W
from moecomp.formats.packed import PackedExperts
from moecomp.formats.packed_linear import Packed4Linear
from moecomp.core.spec import QuantSpec

from .conftest import rel_err

TOL_FP32 = 1e-5
TOL_BF16 = 3e-2
GROUP = 64

SIZES = {
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_local_experts=4, head_dim=32),
    "qwen3_moe": dict(hidden_size=128, moe_intermediate_size=128, num_experts=8, head_dim=32),
    "qwen2_moe": dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
                      head_dim=32),
    "olmoe": dict(hidden_size=128, intermediate_size=128, num_experts=8),
    "deepseek_v3": dict(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8, n_group=4, topk_group=2,
                        intermediate_size=256),
}


def known(K: int, N: int, group: int, seed: int = 0, zero_lo: int = 0, zero_hi: int = 16, sym: bool = False):
    """Random codes [K, N], zeros [G, N] and fp16 scales [G, N], and W [N, K] = (code - zero) * scale in fp32."""
    g = torch.Generator().manual_seed(seed)
    Gr = -(-K // group)
    codes = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
    zeros = (torch.full((Gr, N), 8, dtype=torch.uint8) if sym else
             torch.randint(zero_lo, zero_hi, (Gr, N), generator=g).to(torch.uint8))
    scales = (torch.rand(Gr, N, generator=g) * 0.1 + 1e-3).half()
    gi = torch.arange(K) // group
    w = ((codes.float() - zeros[gi].float()) * scales[gi].float()).t()
    return codes, zeros, scales, w


def deq(w, scale, zero, group):
    quant = QuantSpec.int4(group, zero_point=zero is not None, scale_dtype=G.SCALE_DTYPES[scale.dtype])
    return q8.dequantize(w, scale, quant, zero=zero)


# --------------------------------------------------------------------------------------------- converters
def test_nibble_orders_by_hand():
    """The documented orders, on words written by hand: GPTQ packs inputs 8r..8r+7 lowest first; AWQ packs outputs
    0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7."""
    codes = torch.arange(8, dtype=torch.uint8)
    gptq_word = torch.tensor([[0x76543210]], dtype=torch.int32)  # [K/8 = 1, N = 1]: input k in nibble k
    qw = W.pack_gptq(codes[:, None].expand(8, 8), torch.ones(1, 8), torch.ones(1, 8), v1=False)[0]
    assert torch.equal(qw, gptq_word.expand(1, 8))
    awq_word = torch.tensor([[0x75316420]], dtype=torch.int32)  # [K = 1, N/8 = 1]: nibble i holds column ORDER[i]
    assert torch.equal(W.pack_awq(codes[None, :], torch.zeros(1, 8), torch.ones(1, 8))[0], awq_word)
    zeros8 = torch.tensor([[0x77777777]], dtype=torch.int32)  # GPTQ v1 symmetric: zero 8 stored as 7
    w, s, z = G.gptq_to_packed(gptq_word.expand(4, 8).contiguous(), zeros8, torch.ones(1, 8).half(), sym=True,
                               v1_offset=True)
    assert z is None and torch.equal(q8.unpack_4bit(w)[0], torch.arange(32, dtype=torch.uint8) % 8)
    w, s, z = G.awq_to_packed(awq_word.expand(32, 1).contiguous(), awq_word, torch.ones(1, 8).half())
    assert torch.equal(q8.unpack_4bit(w)[:, 0], torch.arange(8, dtype=torch.uint8))  # column n has code n
    assert torch.equal(z[:, 0], torch.arange(8, dtype=torch.uint8))


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_sym_round_trip(v1):
    codes, zeros, scales, ref = known(256, 64, 64, sym=True)
    qw, qz, sc, g_idx = W.pack_gptq(codes, zeros, scales, v1=v1)
    w, s, z = G.gptq_to_packed(qw, qz, sc, g_idx, sym=True, v1_offset=v1)
    assert w.dtype == torch.uint8 and w.shape == (64, 128) and z is None
    assert s.dtype == torch.float16 and s.shape == (64, 4)
    assert torch.equal(w, q8.pack_4bit(codes.t()))  # moecomp's layout: input 2j in the low nibble of byte j
    assert torch.equal(deq(w, s, z, 64), ref)
    with pytest.raises(ValueError, match="sym=True"):  # the other offset reads zeros 7 or 9
        G.gptq_to_packed(qw, qz, sc, g_idx, sym=True, v1_offset=not v1)


def test_gptq_asym_v1_round_trip():
    """Asymmetric v1: zeros stored minus one; a stored 15 reads 16 (as GPTQ's kernels read it: (z & 15) + 1)."""
    codes, zeros, scales, ref = known(256, 64, 128, seed=1, zero_lo=1, zero_hi=17)
    assert int(zeros.max()) == 16
    qw, qz, sc, g_idx = W.pack_gptq(codes, zeros, scales, v1=True)
    w, s, z = G.gptq_to_packed(qw, qz, sc, g_idx, sym=False, v1_offset=True)
    assert torch.equal(z, zeros.t()) and torch.equal(deq(w, s, z, 128), ref)
    with pytest.raises(ValueError, match="sym=True"):
        G.gptq_to_packed(qw, qz, sc, g_idx, sym=True, v1_offset=True)
    with pytest.raises(ValueError, match="zero point of 0"):
        W.pack_gptq(codes, torch.zeros_like(zeros), scales, v1=True)


def test_gptq_v2_ragged_group():
    """gptq_v2 (zeros as they are, 0 included) with K not a multiple of the group: the last group is short."""
    codes, zeros, scales, ref = known(320, 32, 128, seed=2)
    qw, qz, sc, g_idx = W.pack_gptq(codes, zeros, scales, v1=False, group=128)
    w, s, z = G.gptq_to_packed(qw, qz, sc, g_idx, sym=False, v1_offset=False, group=128)
    assert s.shape == (32, 3) and torch.equal(deq(w, s, z, 128), ref)
    with pytest.raises(ValueError, match="pass group="):
        G.gptq_to_packed(qw, qz, sc, None, sym=False, v1_offset=False)


def test_awq_round_trip():
    codes, zeros, scales, ref = known(256, 64, 64, seed=3)
    qw, qz, sc = W.pack_awq(codes, zeros, scales)
    assert qw.shape == (256, 8) and qz.shape == (4, 8)
    w, s, z = G.awq_to_packed(qw, qz, sc)
    assert torch.equal(w, q8.pack_4bit(codes.t())) and torch.equal(z, zeros.t())
    assert torch.equal(deq(w, s, z, 64), ref)
    fmt = G.Int4Format("awq", 64)
    assert torch.equal(fmt.dequantize({"qweight": qw, "qzeros": qz, "scales": sc}, "x"), ref)


def test_act_order_refused_for_experts_read_elsewhere():
    """A g_idx other than k // g (act-order) is refused by the experts' converter (named, with the reason); the
    reference dequantizer reads it: W[n, k] = (q - z[g_idx[k]]) * s[g_idx[k]] (the other linears keep it 4-bit with
    an input permutation: tests/hf/test_packed_linear.py)."""
    codes, zeros, scales, _ = known(256, 32, 64, seed=4)
    qw, qz, sc, g_idx = W.pack_gptq(codes, zeros + (zeros == 0), scales, v1=True)
    perm = g_idx[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match="act-order"):
        G.gptq_to_packed(qw, qz, sc, perm, sym=False, v1_offset=True)
    z = (zeros + (zeros == 0)).float()
    want = ((codes.float() - z[perm.long()]) * sc.float()[perm.long()]).t()
    assert torch.equal(G.dequantize_gptq(qw, qz, sc, perm, v1_offset=True), want)


def test_bad_shapes_name_the_tensor():
    codes, zeros, scales, _ = known(128, 64, 64, sym=True)
    qw, qz, sc, g_idx = W.pack_gptq(codes, zeros, scales)
    cases = [
        (dict(qweight=qw.float()), r"qweight has dtype torch.float32; expected torch.int32"),
        (dict(scales=sc[:, :32]), r"scales has shape \[2, 32\]; expected \[\*, 64\]"),
        (dict(qzeros=qz[:, :4]), r"qzeros has shape \[2, 4\]; expected \[2, 8\]"),
        (dict(g_idx=g_idx[:100]), r"g_idx has shape \[100\]; expected \[128\]"),
        (dict(scales=torch.cat([sc, sc[:1]])), r"scales has 3 group rows"),
    ]
    base = dict(qweight=qw, qzeros=qz, scales=sc, g_idx=g_idx)
    for change, msg in cases:
        a = {**base, **change}
        with pytest.raises(ValueError, match=msg):
            G.gptq_to_packed(a["qweight"], a["qzeros"], a["scales"], a["g_idx"], sym=True, v1_offset=True)
    aq, az, asc = W.pack_awq(codes, zeros, scales)
    with pytest.raises(ValueError, match=r"scales has shape \[2, 32\]; expected \[\*, 64\]"):
        G.awq_to_packed(aq, az, asc[:, :32])
    with pytest.raises(ValueError, match=r"qzeros has shape \[2, 4\]; expected \[2, 8\]"):
        G.awq_to_packed(aq, az[:, :4], asc)
    with pytest.raises(ValueError, match=r"experts.3.up: qzeros has shape"):
        G.Int4Format("awq", 64).convert({"qweight": aq, "qzeros": az[:, :4], "scales": asc}, "experts.3.up")


def test_config_keys():
    gptq = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True, checkpoint_format="gptq")
    assert G.Int4Format.from_config(gptq) == G.Int4Format("gptq", 128, sym=True, v1_offset=True)
    assert not G.Int4Format.from_config({**gptq, "checkpoint_format": "gptq_v2"}).v1_offset
    assert not G.Int4Format.from_config({**gptq, "checkpoint_format": None, "format": "gptq_v2"}).v1_offset
    awq = dict(quant_method="awq", w_bit=4, q_group_size=64, zero_point=True, version="GEMM")
    assert G.Int4Format.from_config(awq) == G.Int4Format("awq", 64)
    for bad, msg in (({**gptq, "bits": 8}, "bits=8"), ({**gptq, "group_size": -1}, "group_size=-1"),
                     ({**gptq, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
                     ({**awq, "version": "gemv"}, "version='gemv'"), ({"quant_method": "fp8"}, "quant_method='fp8'"),
                     ({**gptq, "dynamic": {"x": {}}}, "dynamic"), (None, "no quantization_config")):
        with pytest.raises(ValueError, match=msg):
            G.Int4Format.from_config(bad)


# --------------------------------------------------------------------------------------------- loading
def build(family: str, seed: int = 0):
    model, _ = F.build_tiny(family, seed=seed, sizes=SIZES[family])
    return model.float().eval()


def reference(model, group: int, sym: bool, dtype=torch.float32, attention: bool = True):
    """``model`` with each weight the writer quantizes (experts; with ``attention``, the attention projections
    whose shapes allow it) replaced by ``dequantize(quantize_4bit(W))``, in ``dtype``."""
    ref = copy.deepcopy(model)
    q = W.int4_spec(group, sym)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            experts = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            attn = attention and (W.ATTENTION_KEY.search(name) and p.shape[0] % 8 == 0 and p.shape[1] % group == 0)
            if experts or attn:
                w, s, z = q8.quantize_4bit(p.float(), q)
                p.copy_(q8.dequantize(w, s, q, zero=z))
    return ref.to(dtype)


def logits(model, ids):
    with torch.no_grad():
        return F._logits(model(input_ids=ids, use_cache=False)).float()


@pytest.fixture
def ids():
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))


def check_packed(model, group: int, zero_point: bool) -> int:
    """Every MoE block's experts are a PackedExperts holding uint8 codes; no float tensor of an expert's size
    anywhere (the experts were never materialised in 16 bits). Returns the number of blocks."""
    blocks = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert blocks
    for ex in blocks:
        E, H, I = ex.num_experts, ex.hidden_size, ex.intermediate_size
        assert ex.quant == QuantSpec.int4(group, zero_point=zero_point, scale_dtype="fp16")
        assert ex.w13.dtype == torch.uint8 and ex.w13.shape == (E, 2 * I, H // 2)
        assert ex.w2.dtype == torch.uint8 and ex.w2.shape == (E, H, I // 2)
        assert ex.w13_scale.shape == (E, 2 * I, H // group) and ex.w13_scale.dtype == torch.float16
        assert (ex.w13_zero is not None) == zero_point and (ex.w2_zero is not None) == zero_point
        big = {(E, 2 * I, H), (E, H, I), (E, I, H)}
        assert not [n for n, t in model.state_dict().items() if t.is_floating_point() and tuple(t.shape) in big]
    assert not [n for n, t in model.state_dict().items() if t.is_meta]
    return len(blocks)


CASES = [("mixtral", "gptq", True, True), ("mixtral", "awq", False, True), ("qwen3_moe", "gptq", False, False),
         ("qwen3_moe", "awq", False, True)]


@pytest.mark.parametrize("family,fmt,sym,v1", CASES)
def test_load_int4_matches_dequantized(tmp_path, ids, family, fmt, sym, v1, caplog):
    model = build(family)
    W.write_int4_checkpoint(model, str(tmp_path), fmt, GROUP, sym, attention=True, v1=v1)
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == fmt
    with caplog.at_level(logging.WARNING, logger="moecomp.api.load_gptq"):
        got = L.load_int4(str(tmp_path), dtype=torch.float32)
    assert not caplog.text  # the int4 attention projections stay 4-bit: nothing dequantized, nothing to warn about
    lin = {n: m for n, m in got.named_modules() if isinstance(m, Packed4Linear)}
    assert len(lin) == 4 * model.config.num_hidden_layers and all(n.split(".")[-2] == "self_attn" for n in lin)
    n = check_packed(got, GROUP, zero_point=not sym)
    assert n == model.config.num_hidden_layers
    want = logits(reference(model, GROUP, sym), ids)
    err = rel_err(logits(got, ids), want)
    print(f"{family} {fmt}: fp32 err {err:.2e}, quantization itself {rel_err(want, logits(model, ids)):.2e}")
    assert err <= TOL_FP32


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_load_int4_bf16(tmp_path, ids, family):
    """bf16, from a sharded checkpoint (an index and several files)."""
    model = build(family, seed=1)
    W.write_int4_checkpoint(model, str(tmp_path), "gptq", GROUP, True, max_shard_size="200KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    got = L.load_int4(str(tmp_path))
    assert got.model.embed_tokens.weight.dtype == torch.bfloat16
    check_packed(got, GROUP, zero_point=False)
    err = rel_err(logits(got, ids), logits(reference(model, GROUP, True, torch.bfloat16, attention=False), ids))
    print(f"{family} bf16 err {err:.2e}")
    assert err <= TOL_BF16


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "deepseek_v3"])
def test_load_int4_other_families(tmp_path, ids, family):
    """Qwen2-MoE (shared expert and its gate stay 16-bit), OLMoE, DeepSeek-V3 (MLA attention, shared experts,
    correction bias): GPTQ v1 asymmetric."""
    model = build(family)
    W.write_int4_checkpoint(model, str(tmp_path), "gptq", GROUP, False, attention=True)
    got = L.load_int4(str(tmp_path), dtype=torch.float32)
    assert check_packed(got, GROUP, zero_point=True) == model.config.num_hidden_layers
    assert rel_err(logits(got, ids), logits(reference(model, GROUP, False), ids)) <= TOL_FP32


def test_load_int4_tied_embeddings(tmp_path, ids):
    """A checkpoint without lm_head (tie_word_embeddings): the head is the embedding, as transformers ties it."""
    model, _ = F.build_tiny("qwen3_moe", sizes={**SIZES["qwen3_moe"], "tie_word_embeddings": True})
    model = model.float().eval()
    W.write_int4_checkpoint(model, str(tmp_path), "awq", GROUP, False)
    got = L.load_int4(str(tmp_path), dtype=torch.float32)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert rel_err(logits(got, ids), logits(reference(model, GROUP, False, attention=False), ids)) <= TOL_FP32


def test_load_int4_refusals(tmp_path):
    model = build("mixtral")
    path = W.write_int4_checkpoint(model, str(tmp_path), "gptq", GROUP, True)
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    key = "model.layers.1.block_sparse_moe.experts.2.w2.g_idx"
    good = t[key].clone()
    t[key] = good.flip(0).contiguous()  # act-order
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.2.down: g_idx is not k // 64.*act-order"):
        L.load_int4(path)
    t[key] = good
    up = "model.layers.0.block_sparse_moe.experts.0.w3.scales"
    t[up] = t[up][:, :64].contiguous()
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts.0.up: scales has shape \[2, 64\]; expected \[\*, 128\]"):
        L.load_int4(path)


def test_optimize_binds_packed_blocks(tmp_path, ids):
    """After ``moecomp.optimize`` every block runs the op on the packed tensors, within the CPU path's tolerance of
    the loaded model (the FX pass reads PackedExperts blocks: docs/QUANT4.md, "Recognition")."""
    model = build("qwen3_moe")
    W.write_int4_checkpoint(model, str(tmp_path), "gptq", GROUP, True)
    got = L.load_int4(str(tmp_path), dtype=torch.float32)
    want = logits(got, ids)
    packed = {n: m.w13 for n, m in got.named_modules() if isinstance(m, PackedExperts)}
    got, rep = moecomp.optimize(got, report=True, fast_generate=False)
    assert len(rep.rewritten) == model.config.num_hidden_layers, rep
    assert all(dict(got.named_modules())[n].w13 is w for n, w in packed.items())  # the same tensors, not copies
    assert rel_err(logits(got, ids), want) <= TOL_FP32


@pytest.mark.gpu
def test_load_int4_cuda(tmp_path, ids):
    """Loaded straight to the GPU (repacked there), bf16: the same logits as the CPU load within TOL_BF16."""
    model = build("qwen3_moe")
    W.write_int4_checkpoint(model, str(tmp_path), "awq", GROUP, False, attention=True)
    got = L.load_int4(str(tmp_path), device="cuda")
    check_packed(got, GROUP, zero_point=True)
    assert all(t.device.type == "cuda" for t in got.state_dict().values())
    want = logits(L.load_int4(str(tmp_path), dtype=torch.float32), ids)
    assert rel_err(logits(got, ids.cuda()).cpu(), want) <= TOL_BF16
