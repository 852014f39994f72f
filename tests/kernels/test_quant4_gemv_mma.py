"""The dot-free (GEMV) 4-bit decode kernels on weights held in the "mma" layout (``QuantSpec.layout``, issue 42
item 1; ``ops/w4_layout.py``), under the interpreter (CPU): ``kernels/quant4_gemv.py`` with W4_MMA (mxfp4: the
word decode of the re-encoded words; int4: the mma bytes are the packed bytes, no flag). GPU at gpt-oss-120b layer
size: tests/ops/test_quant4_gemv_mma_gpu.py; the packed GEMV's own tests: tests/kernels/test_quant4_gemv.py.

* The word decode: ``_e2m1_word(r, ASM 0, W4_MMA 1)`` on ``w4_layout.relayout``'s words gives the packed decoder's
  values on the packed words bit for bit (every code at every one of a word's 8 positions, every pair of
  neighbours), and e2m1 * 2^-14 of each code (the plain-torch table); int4's relayout is the identity on its bytes.
* Exact weights: the down-combine and gemm1 on identity activations over mma-laid weights return
  ``quant.dequantize`` of the packed weights bit for bit (mxfp4 scale bytes from 0 to 252, fp32 and fp16, a partial
  last group; int4 with zero points: the held bytes are the packed ones).
* ``triton_quant4_gemv.routed`` with the spec's layout "mma" on the re-laid tensors equals the same call on the
  packed tensors bit for bit (the same values, summed in the same order) and the oracle (``reference.experts`` on the
  packed tensors): mxfp4 and int4 (symmetric, zero points), gate / up interleaved (swiglu_oai, biases) and concat
  (silu), ungated gelu, T 1 / 3, k 1..4, fp32 / fp16, REDUCE_END 0, PREFETCH 1; outputs NaN-poisoned.
* The whole op (``moe_forward``) with the spec's layout "mma" and MOECOMP_W4_DECODE=gemv: the GEMV launches run
  (counted: none of the DIRECT dot ones) on the held tensors (their data_ptr; no ``w4_layout.relaid`` copy), with a
  gated shared expert, zero experts, weight_on_input; against the oracle on the mma bytes, and equal to the op on
  the packed bytes.
* Mutation: the mma bytes read with W4_MMA 0 (as the packed decode) are far off the oracle: the flag is what makes
  the result right.

Tolerances (relative Frobenius error against the fp32 oracle on the same weights, as tests/kernels/test_quant4_gemv.py):
fp32 3e-5 (the same exact weights, sums in another order), fp16 2e-3 (h and the output rounded to fp16 as the oracle
rounds them). GEMV on mma against GEMV on packed: equal (torch.equal), no tolerance.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from moecomp.core import quant as q8
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.kernels import quant4_gemv as qg
from moecomp.oracle import reference
from moecomp.ops import triton_moe, triton_quant4, triton_quant4_gemv, w4_layout
from moecomp.testing import quantize_moe_args, random_moe_args
from test_quant4_gemv import rel_err, triton_backend  # noqa: F401  (tests/kernels is on sys.path; a fixture)

TOL = {torch.float32: 3e-5, torch.float16: 2e-3}
MX = QuantSpec.mxfp4()


def mma(q: QuantSpec) -> QuantSpec:
    return dataclasses.replace(q, layout="mma")


# ------------------------------------------------------------------------------------------------ the word decode
@triton.jit
def _mx_word_kernel(w_ptr, out_ptr, N: tl.constexpr, W4_MMA: tl.constexpr):
    offs = tl.arange(0, N)
    r = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + offs)
    c0, c1, c2, c3, c4, c5, c6, c7 = qg._e2m1_word(r, 0, W4_MMA)
    o = out_ptr + offs * 8
    tl.store(o + 0, c0)
    tl.store(o + 1, c1)
    tl.store(o + 2, c2)
    tl.store(o + 3, c3)
    tl.store(o + 4, c4)
    tl.store(o + 5, c5)
    tl.store(o + 6, c6)
    tl.store(o + 7, c7)


def _codes(n: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, 8), generator=g, dtype=torch.uint8)
    codes[:16] = torch.arange(16, dtype=torch.uint8)[:, None]  # every code at every position
    codes[16:32] = (torch.arange(16, dtype=torch.uint8)[:, None] + torch.arange(8)) % 16  # every pair of neighbours
    return codes


def test_mma_word_decode_is_the_packed_decode_bit_for_bit(poison):
    codes = _codes()
    packed = q8.pack_4bit(codes)  # [128, 4]: one int32 word a row, column i in bits 4i..4i+3
    words = w4_layout.relayout(packed, MX)
    assert not torch.equal(words, packed)  # (the layouts differ: the check below can fail)
    out_p, out_m = torch.empty(128, 8), torch.empty(128, 8)
    _mx_word_kernel[(1,)](packed.reshape(-1), out_p, N=128, W4_MMA=0)
    _mx_word_kernel[(1,)](words.reshape(-1), out_m, N=128, W4_MMA=1)
    want = torch.tensor(q8.E2M1)[codes.long()] * 2.0 ** -14  # exact: a power of two
    assert torch.equal(out_m.view(torch.int32), want.view(torch.int32))  # -0 (code 8) and the subnormal 0.5 too
    assert torch.equal(out_m.view(torch.int32), out_p.view(torch.int32))
    _mx_word_kernel[(1,)](packed.reshape(-1), out_m, N=128, W4_MMA=1)  # packed words read as mma: wrong
    assert not torch.equal(out_m, want)


def test_int4_mma_bytes_are_the_packed_bytes():
    q = q8.pack_4bit(_codes(64, 1)).reshape(2, 4, 32)
    for quant in (QuantSpec.int4(32), QuantSpec.int4(64, True)):
        assert torch.equal(w4_layout.relayout(q, quant), q) and torch.equal(w4_layout.relayout_(q.clone(), quant), q)


def test_w4_mma_flag_by_layout_and_format():
    from types import SimpleNamespace as NS

    assert triton_quant4_gemv.w4_mma(NS(quant=mma(MX))) == 1 and triton_quant4_gemv.w4_mma(NS(quant=MX)) == 0
    assert triton_quant4_gemv.w4_mma(NS(quant=mma(QuantSpec.int4(32, True)))) == 0  # int4: the packed bytes
    with pytest.raises(ValueError, match="spec.quant.layout='tiled'"):
        triton_quant4_gemv.w4_mma(NS(quant=dataclasses.replace(MX, layout="tiled")))


# ------------------------------------------------------------------------------------------------ exact weights
MX_BYTES = (0, 1, 2, 30, 60, 90, 100, 110, 118, 120, 122, 124, 126, 127, 128, 129, 130, 132, 136, 140, 150, 170,
            200, 230, 251, 252)  # 253 and up overflow fp32 at code 6; 255 is NaN


def _one_expert(quant, N, K, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    packed, scale, zero = q8.quantize_4bit(torch.randn(1, N, K, generator=g), quant)
    if quant.weight == "mxfp4":
        pool = torch.tensor([b for b in MX_BYTES if dtype == torch.float32 or 110 <= b <= 140], dtype=torch.uint8)
        scale = pool[torch.arange(scale.numel()) % len(pool)].reshape(scale.shape).view(q8.E8M0)
    elif zero is not None:
        zero = torch.randint(0, 17, zero.shape, generator=g, dtype=torch.uint8)
    return packed, scale, zero


EXACT = {  # name: (quant, N, K, dtype, BLOCK_K)
    "mxfp4-fp32-bk32": (MX, 16, 64, torch.float32, 32),
    "mxfp4-fp16-bk64-K40": (MX, 16, 40, torch.float16, 64),  # K % 32 == 8: a partial group, unaligned masks
    "int4zp-g32-fp32-bk64": (QuantSpec.int4(32, True), 16, 64, torch.float32, 64),
}


@pytest.mark.parametrize("case", sorted(EXACT))
def test_down_on_identity_over_mma_weights_reproduces_dequantize(poison, case):
    """out[t] = h[t] . w^T with h = I [K, K], one slot of weight 1 a token, w held in the mma layout."""
    quant, N, K, dtype, bk = EXACT[case]
    packed, scale, zero = _one_expert(quant, N, K, len(case), dtype)
    want = q8.dequantize(packed[0], scale[0], quant, zero=None if zero is None else zero[0]).T  # [K, N] fp32
    held = w4_layout.relayout(packed, quant)
    spec = MoESpec(num_experts=1, top_k=1, hidden_size=N, intermediate_size=K, quant=mma(quant))
    q = triton_quant4.quant4_kwargs(quant, scale, zero, {})
    out = torch.empty(K, N, dtype=dtype)
    y = triton_quant4_gemv.decode_down(torch.eye(K, dtype=dtype), held, None, torch.zeros(K, dtype=torch.int32),
                                       torch.ones(K), spec, out, None, None, q, {"gemv2": dict(BLOCK_K=bk)})
    assert torch.equal(y, want.to(dtype)), f"{case}: {(y.float() - want).abs().max()}"


def test_gemm1_on_identity_over_mma_weights_reproduces_dequantize(poison):
    """gemm1, ungated relu, one expert, T = K pairs: x = I gives relu(w)^T, x = -I relu(-w)^T (mxfp4, fp32)."""
    K, N = 64, 16
    packed, scale, _ = _one_expert(MX, N, K, 3, torch.float32)
    want = q8.dequantize(packed[0], scale[0], MX).T  # [K, N]
    spec = MoESpec(num_experts=1, top_k=1, hidden_size=K, intermediate_size=N, gated=False, activation="relu",
                   quant=mma(MX))
    q = triton_quant4.quant4_kwargs(MX, scale, None, {})
    held, ids = w4_layout.relayout(packed, MX), torch.zeros(K, dtype=torch.int32)
    run = lambda x: triton_quant4_gemv.gemm1(x, held, None, spec, ids, 1, q, None, {"gemv1": {"BLOCK_K": 32}})  # noqa
    assert torch.equal(run(torch.eye(K)), want.clamp(min=0)) and torch.equal(run(-torch.eye(K)), (-want).clamp(min=0))


# ------------------------------------------------------------------------------------------------ the experts
def _spec(quant, gate_up="concat", E=4, k=2, H=64, I=32, **kw):
    oai = gate_up == "interleaved"
    return MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, gated=True, gate_up=gate_up,
                   activation="swiglu_oai" if oai else "silu", has_expert_bias=oai, quant=quant, **kw)


ROUTED = {  # name: (spec, dtype, T, tiles of gemv1 / gemv2)
    "mxfp4-oai-fp32-T1-k4": (_spec(MX, "interleaved", k=4), torch.float32, 1, {}),
    "mxfp4-oai-fp16-T3-k2-reduce_step": (_spec(MX, "interleaved"), torch.float16, 3, {"REDUCE_END": 0}),
    "mxfp4-concat-fp32-T3-k1-prefetch": (_spec(MX, k=1, H=96), torch.float32, 3, {"PREFETCH": 1, "BLOCK_K": 32}),
    "mxfp4-ungated-gelu-fp32-T3": (_spec(MX).replace(gated=False, activation="gelu"), torch.float32, 3, {}),
    "int4-g32-fp16-T1-k2": (_spec(QuantSpec.int4(32)), torch.float16, 1, {}),
    "int4zp-g64-oai-fp32-T3-k4-prefetch": (_spec(QuantSpec.int4(64, True), "interleaved", k=4), torch.float32, 3,
                                           {"PREFETCH": 1}),
}


def _packed_and_held(spec, T, dtype, seed):
    """(x, named packed tensors + scales, the same with w13 / w2 re-laid to the mma layout, ids [T, k], w [T, k])."""
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=seed))
    named = {**dict(zip(MOE_ARGS, args[1:])), **scales}
    held = dict(named, w13=w4_layout.relayout(named["w13"], spec.quant), w2=w4_layout.relayout(named["w2"], spec.quant))
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), 1)[:, :spec.top_k].to(torch.int32)
    return args[0], named, held, ids, torch.rand(T, spec.top_k, generator=g), scales


def _routed(spec, x, named, ids, w, tiles):
    q1, q2 = triton_quant4.expert_kwargs(spec.quant, named, None)
    out = torch.empty_like(x)
    dec = {"gemv1": tiles, "gemv2": tiles}
    got = triton_quant4_gemv.routed(x, ids.reshape(-1), w, named, spec, out, None, None, dec, q1, q2)
    assert got is out and torch.isfinite(out).all()
    return out


@pytest.mark.parametrize("case", sorted(ROUTED))
def test_routed_gemv_on_mma_layout_equals_packed_and_reference(triton_backend, poison, case):
    spec, dtype, T, tiles = ROUTED[case]
    x, named, held, ids, w, scales = _packed_and_held(spec, T, dtype, len(case))
    on_packed = _routed(spec, x, named, ids, w, tiles)
    on_mma = _routed(spec.replace(quant=mma(spec.quant)), x, held, ids, w, tiles)
    ref = reference.experts(x, ids, w, named["w13"], named["b13"], named["w2"], named["b2"], spec, **scales)
    assert torch.equal(on_mma, on_packed), f"{case}: mma vs packed {rel_err(on_mma, on_packed):.2e}"
    assert rel_err(on_mma, ref) < TOL[dtype], f"{case}: rel err {rel_err(on_mma, ref):.2e}"


def test_mma_bytes_read_as_packed_are_wrong(triton_backend, poison):
    """Mutation: W4_MMA forced to 0 on the mma bytes (the packed word decode): far off the reference."""
    spec, dtype, T, tiles = ROUTED["mxfp4-oai-fp32-T1-k4"]
    x, named, held, ids, w, scales = _packed_and_held(spec, T, dtype, 7)
    triton_backend.setattr(triton_quant4_gemv, "w4_mma", lambda spec: 0)
    out = _routed(spec.replace(quant=mma(spec.quant)), x, held, ids, w, tiles)
    ref = reference.experts(x, ids, w, named["w13"], named["b13"], named["w2"], named["b2"], spec, **scales)
    assert rel_err(out, ref) > 1e-2


def _count(monkeypatch):
    """Calls of the DIRECT dot launches and the GEMV ones, with the weight tensors' data_ptr the GEMV got."""
    calls = {"dot": 0, "gemv": [], "relaid": 0}
    for fn in ("gemm1", "decode_down"):
        real = getattr(triton_moe, fn)

        def dot(*a, _real=real, **kw):
            calls["dot"] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, dot)
    real_gemv, real_relaid = triton_quant4_gemv.routed, w4_layout.relaid

    def gemv(x, ids_flat, weights, args, *a, **kw):
        calls["gemv"].append((args["w13"].data_ptr(), args["w2"].data_ptr()))
        return real_gemv(x, ids_flat, weights, args, *a, **kw)

    def relaid(*a, **kw):
        calls["relaid"] += 1
        return real_relaid(*a, **kw)

    monkeypatch.setattr(triton_quant4_gemv, "routed", gemv)
    monkeypatch.setattr(w4_layout, "relaid", relaid)
    return calls


OP = {  # name: (spec, dtype, T)
    "mxfp4-oai-shared-gate-fp16-T2": (_spec(MX, "interleaved", shared=SharedExpertSpec(intermediate_size=32,
                                                                                      gate="sigmoid")),
                                      torch.float16, 2),
    "mxfp4-zero-experts-fp32-T3": (_spec(MX, zero_experts=2), torch.float32, 3),
    "mxfp4-weight-on-input-fp32-T3": (_spec(MX, k=1, weight_on_input=True), torch.float32, 3),
    "int4zp-oai-fp32-T1": (_spec(QuantSpec.int4(32, True), "interleaved"), torch.float32, 1),
}


@pytest.mark.parametrize("case", sorted(OP))
def test_moe_forward_on_mma_layout_takes_gemv(triton_backend, poison, case):
    """moe_forward end to end, the spec's layout "mma", MOECOMP_W4_DECODE=gemv: the GEMV on the held tensors."""
    spec, dtype, T = OP[case]
    triton_backend.setenv("MOECOMP_W4_DECODE", "gemv")
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=len(case)))
    i13, i2 = 1 + MOE_ARGS.index("w13"), 1 + MOE_ARGS.index("w2")
    held = list(args)
    held[i13], held[i2] = (w4_layout.relayout(args[i], spec.quant) for i in (i13, i2))
    mspec = spec.replace(quant=mma(spec.quant))
    calls = _count(triton_backend)
    out = torch.ops.moecomp.moe_forward(*held, mspec.key, **scales)
    assert calls == {"dot": 0, "gemv": [(held[i13].data_ptr(), held[i2].data_ptr())], "relaid": 0}, calls
    ref = reference.moe_forward(*held, mspec, **scales)  # the oracle's own decode of the mma bytes
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[dtype], f"{case}: {rel_err(out, ref):.2e}"
    assert torch.equal(out, torch.ops.moecomp.moe_forward(*args, spec.key, **scales))  # = the op on packed bytes


@pytest.mark.parametrize("label", ["w4 gemv", "w4 gemv mma", "w4 held mma"])
def test_diag_gemv_paths_run_what_they_are_named(triton_backend, poison, label):
    """benchmarks/diag_w4_mma.py's GEMV labels: the GEMV at T = 2 (the CPU decode limit is 8), on the packed tensors
    or on ``held_mma``'s (layout "mma"); "w4 held mma" sets no switch, so on the CPU (decode mode "dot" unless asked)
    it takes the DIRECT dot launches on the held tensors, the GEMV where MOECOMP_W4_DECODE says so."""
    import os

    triton_backend.syspath_prepend(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from diag_w4_mma import HELD_MMA, PATHS, held_mma

    for name, v in PATHS[label].items():
        triton_backend.setenv(name, v)
    spec = _spec(MX, "interleaved")
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 2, torch.float32, seed=3))
    t4 = dict(zip(MOE_ARGS, args[1:]))
    s, t = held_mma(spec, t4) if label in HELD_MMA else (spec, t4)
    assert (s.quant.layout == "mma") == (label in HELD_MMA)
    calls = _count(triton_backend)
    out = torch.ops.moecomp.moe_forward(args[0], *(t[n] for n in MOE_ARGS), s.key, **scales)
    assert rel_err(out, reference.moe_forward(args[0], *(t[n] for n in MOE_ARGS), s, **scales)) < TOL[torch.float32]
    gemv = label != "w4 held mma"
    assert calls["gemv"] == ([(t["w13"].data_ptr(), t["w2"].data_ptr())] if gemv else [])
    assert calls["dot"] == (0 if gemv else 2) and calls["relaid"] == 0
