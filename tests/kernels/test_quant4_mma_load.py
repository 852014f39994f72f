"""4-bit weights held in the "mma" layout (``QuantSpec.layout``, issue 42 item 1): re-laid once, in place, not a
second copy beside the packed one. Under the interpreter (CPU); the model-level path (``optimize`` re-lays every
``PackedExperts`` with MOECOMP_W4_FORM=mma, ``unoptimize`` restores): tests/hf/test_packed_layout.py; GPU at
gpt-oss-120b layer size: tests/ops/test_quant4_mma_load_gpu.py.

* The spec: a "layout" field, left out of the key while "packed" (every existing key unchanged), checked (mma only
  for 4-bit weights); ``core.quant.dequantize`` refuses mma bytes (a ValueError, never a silent misread).
* The oracle's own decode of the mma layout (``oracle/reference_quant.packed_codes``, written from the layout's
  definition) equals ``ops/w4_layout.restore`` on random bytes; ``relayout_`` / ``restore_`` (in place) equal
  ``relayout`` / ``restore`` and keep the storage.
* ``PackedExperts.set_layout``: the same storage (data_ptr, bytes), each expert re-laid with that expert's
  temporaries only (the encoder spied: never more than one expert's words a call), exact round trip; K % 8 != 0 is
  a ValueError naming the tensor, nothing changed.
* The op on mma-layout weights (spec layout "mma") against the oracle on fresh inputs, NaN-poisoned outputs: mxfp4
  (gpt-oss's interleaved swiglu_oai with biases), int4 symmetric and with zero points, T = 1 (the decode path) and
  T = 32 (aligned), on both CPU backends (torch: read back per chunk; triton: every launch the mma form on the held
  tensors, no ``w4_layout.relaid`` copy made, with or without MOECOMP_W4_FORM); the oracle on the mma bytes equals
  the oracle on the original packed bytes exactly.
* The GEMV decode kernels read mma-layout weights as held (they once refused them): with MOECOMP_W4_DECODE=gemv the
  GEMV launcher is reached with the held tensors, no ``w4_layout.relaid`` copy, the output against the oracle (the
  GEMV on the mma layout in detail: tests/kernels/test_quant4_gemv_mma.py).

Tolerances (relative Frobenius error against the fp32 oracle on the same weights): fp32 3e-5 (the same exact
weights, sums in another order), as tests/kernels/test_quant4_mma.py. fp32 only: the interpreter's bf16 dot is wrong.
"""

import dataclasses

import pytest
import torch

from moecomp.core import quant as q8
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SpecError
from moecomp.formats.packed import PackedExperts
from moecomp.ops import triton_quant4_gemv, w4_layout
from moecomp.oracle import reference, reference_quant
from moecomp.testing import quantize_moe_args, random_moe_args
from moecomp.testing.w4_launches import record_w4_forms

MX = QuantSpec.mxfp4()
QUANTS = {"mxfp4": MX, "int4": QuantSpec.int4(32), "int4zp": QuantSpec.int4(32, True)}
TOL = 3e-5


def mma(q: QuantSpec) -> QuantSpec:
    return dataclasses.replace(q, layout="mma")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ spec, oracle
def test_layout_field_key_and_checks():
    for q in QUANTS.values():
        assert '"layout"' not in q.key and QuantSpec.from_key(q.key) == q  # packed: the key as before the field
        assert '"layout":"mma"' in mma(q).key and QuantSpec.from_key(mma(q).key) == mma(q)
        spec = MoESpec(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, quant=mma(q))
        assert MoESpec.from_key(spec.key).quant.layout == "mma"
    with pytest.raises(SpecError, match="quant.layout='mma'.*fp8_e4m3"):
        dataclasses.replace(QuantSpec(), layout="mma").validate()
    with pytest.raises(SpecError, match="quant.layout='tiled'"):
        dataclasses.replace(MX, layout="tiled").validate()
    with pytest.raises(ValueError, match="quant.layout='mma'"):
        q8.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8).view(q8.E8M0),
                      mma(MX))


@pytest.mark.parametrize("name", sorted(QUANTS))
def test_oracle_decode_is_restore_on_random_bytes(name):
    quant = QUANTS[name]
    g = torch.Generator().manual_seed(len(name))
    r = torch.randint(0, 256, (3, 5, 24), generator=g, dtype=torch.uint8)  # any bytes: read as the mma layout
    assert torch.equal(reference_quant.packed_codes(r, mma(quant)), w4_layout.restore(r, quant))
    q = torch.randint(0, 256, (3, 5, 24), generator=g, dtype=torch.uint8)
    assert torch.equal(reference_quant.packed_codes(w4_layout.relayout(q, quant), mma(quant)), q)
    with pytest.raises(ValueError, match="q: .*32-bit words"):
        reference_quant.packed_codes(torch.zeros(2, 6, dtype=torch.uint8), mma(MX))


@pytest.mark.parametrize("name", sorted(QUANTS))
def test_in_place_relayout_is_relayout(name):
    quant = QUANTS[name]
    q = torch.randint(0, 256, (3, 5, 24), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    orig, ptr = q.clone(), q.data_ptr()
    assert w4_layout.relayout_(q, quant) is q and q.data_ptr() == ptr
    assert torch.equal(q, w4_layout.relayout(orig, quant))
    assert torch.equal(w4_layout.restore_(q, quant), orig) and q.data_ptr() == ptr
    with pytest.raises(ValueError, match="q: .*contiguous"):
        w4_layout.relayout_(torch.zeros(4, 16, dtype=torch.uint8)[:, :8], quant)


# ------------------------------------------------------------------------------------------------ the module
def _experts(quant: QuantSpec, E=4, H=64, I=32, seed=0) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    (w13, s13, z13), (w2, s2, z2) = (q8.quantize_4bit(torch.randn(E, r, c, generator=g) / c**0.5, quant)
                                     for r, c in ((2 * I, H), (H, I)))
    return PackedExperts(quant, w13, s13, w2, s2, z13, z2, gate_up="concat", activation="silu")


@pytest.mark.parametrize("name", sorted(QUANTS))
def test_set_layout_in_place_one_expert_at_a_time(name, monkeypatch):
    quant = QUANTS[name]
    ex = _experts(quant)
    before = {n: (t.data_ptr(), t.untyped_storage().nbytes(), t.detach().clone()) for n, t in ex.named_parameters()}
    seen = []
    real = w4_layout._mx_encode
    monkeypatch.setattr(w4_layout, "_mx_encode", lambda r: (seen.append(r.numel()), real(r))[1])
    assert ex.set_layout("mma") and ex.quant == mma(quant) and ex.spec().quant.layout == "mma"
    for n, t in ex.named_parameters():  # the same storage, the same bytes held: no second copy
        assert (t.data_ptr(), t.untyped_storage().nbytes()) == before[n][:2], n
    one_expert = max(ex.w13[0].numel(), ex.w2[0].numel()) // 4  # int32 words of one expert
    assert seen == ([] if quant.weight == "int4" else [ex.w13[0].numel() // 4] * 4 + [ex.w2[0].numel() // 4] * 4)
    assert all(s <= one_expert for s in seen)
    if quant.weight == "mxfp4":
        assert not torch.equal(ex.w13, before["w13"][2])  # re-encoded
    for n in ("w13", "w2"):
        assert torch.equal(w4_layout.restore(getattr(ex, n), quant), before[n][2])
    assert not ex.set_layout("mma")  # already
    assert ex.set_layout("packed") and ex.quant == quant
    for n, t in ex.named_parameters():
        assert t.data_ptr() == before[n][0] and torch.equal(t, before[n][2]), n  # exactly the packed bytes back
    assert w4_layout._CACHE == {} or all(k[0] not in {b[0] for b in before.values()} for k in w4_layout._CACHE)


def test_set_layout_refuses_what_cannot_take_it():
    ex = _experts(QUANTS["int4"], I=36)  # w2's K = 36: 18 bytes a row, not whole 32-bit words
    w13 = ex.w13.detach().clone()
    with pytest.raises(ValueError, match="w2: the mma layout needs K % 8 == 0"):
        ex.set_layout("mma")
    assert ex.quant.layout == "packed" and torch.equal(ex.w13, w13)  # nothing changed (checked before touching)
    with pytest.raises(ValueError, match="layout='tiled'"):
        ex.set_layout("tiled")


# ------------------------------------------------------------------------------------------------ the op
def _spec(quant, oai: bool) -> MoESpec:
    return MoESpec(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, gate_up="interleaved" if oai else
                   "concat", activation="swiglu_oai" if oai else "silu", has_expert_bias=oai, quant=quant)


def _relaid_args(name: str, T: int, seed: int):
    """(spec with layout "mma", args with w13 / w2 re-laid in place, scales, the packed originals)."""
    quant = QUANTS[name]
    spec = _spec(quant, name == "mxfp4")
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, torch.float32, seed=seed))
    named = dict(zip(MOE_ARGS, args[1:]))
    packed = {n: named[n].clone() for n in ("w13", "w2")}
    for n in ("w13", "w2"):
        w4_layout.relayout_(named[n], quant)
    return spec.replace(quant=mma(quant)), args, scales, packed, spec


def _spy(monkeypatch):
    return record_w4_forms(monkeypatch, with_weights=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("T", [1, 32])
@pytest.mark.parametrize("name", sorted(QUANTS))
def test_op_on_mma_layout_matches_oracle(name, T, backend, monkeypatch, poison):
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_DECODE", "MOECOMP_W4_FORM"):
        monkeypatch.delenv(var, raising=False)  # (no MOECOMP_W4_FORM: the layout alone selects the form)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    spec, args, scales, packed, spec_packed = _relaid_args(name, T, seed=T + len(name))
    named = dict(zip(MOE_ARGS, args[1:]))
    seen = _spy(monkeypatch)
    cache = dict(w4_layout._CACHE)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)  # the oracle's own decode of the mma bytes
    orig = list(args)
    orig[1 + MOE_ARGS.index("w13")], orig[1 + MOE_ARGS.index("w2")] = packed["w13"], packed["w2"]
    assert torch.equal(ref, reference.moe_forward(*orig, spec_packed, **scales))  # = the oracle on the packed bytes
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL, f"{name} T={T} {backend}: rel err {err:.2e}"
    assert w4_layout._CACHE == cache  # no relaid copy made
    if backend == "triton":
        held = {named["w13"].data_ptr(), named["w2"].data_ptr()}
        assert seen and all(form == 4 and ptr in held for _, form, ptr in seen), seen  # the held bytes, mma form
        assert [f for f, _, _ in seen] == (["gemm1", "decode_down"] if T == 1 else ["gemm1", "gemm2"])
    else:
        assert seen == []


@pytest.mark.parametrize("name", ["mxfp4", "int4zp"])
def test_gemv_reads_mma_layout_as_held(name, monkeypatch, poison):
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    monkeypatch.setenv("MOECOMP_W4_DECODE", "gemv")
    monkeypatch.setenv("MOECOMP_DECODE_MAX_T", "8")
    seen, real = [], triton_quant4_gemv.routed

    def spy(x, ids_flat, weights, args, *a, **kw):
        seen.append((args["w13"].data_ptr(), args["w2"].data_ptr()))
        return real(x, ids_flat, weights, args, *a, **kw)

    monkeypatch.setattr(triton_quant4_gemv, "routed", spy)
    spec, args, scales, packed, spec_packed = _relaid_args(name, 1, seed=5)
    named = dict(zip(MOE_ARGS, args[1:]))
    cache = dict(w4_layout._CACHE)
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert seen == [(named["w13"].data_ptr(), named["w2"].data_ptr())]  # the GEMV, on the held tensors
    assert w4_layout._CACHE == cache  # no relaid copy made
    assert torch.isfinite(out).all() and rel_err(out, reference.moe_forward(*args, spec, **scales)) < TOL
