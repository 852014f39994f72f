"""The dot-free (GEMV) decode path of 4-bit experts under the interpreter (CPU): ``kernels/quant4_gemv.py`` launched
by ``ops/triton_quant4_gemv.py``, chosen by ``triton_moe.routed`` when the decode config says mode "gemv". GPU
tests: tests/ops/test_quant4_gemv_gpu.py.

* The decode is exact: ``e2m1_x2m14`` of every code is E2M1 * 2^-14 bit for bit (-0 included); the word decoders
  give every code at every one of a word's 8 positions (mxfp4, and int4 code - zero for zeros 0, 7, 8, 15, 16);
  the down-combine on identity activations (one slot, weight 1) returns ``quant.dequantize``'s weights bit for bit
  (fp32; fp16 where the weight rounds once) for mxfp4 scale bytes from 0 to 252 (253 and up overflow fp32 at code 6,
  255 is NaN; the bytes' decode is ``fp8.ue8m0``, the dot path's), int4 with zero points 0..16 and scales over 2^21,
  groups 32 / 64, two groups in a step and two steps in a group, a partial last group with K % 32 != 0 (unaligned
  masks); gemm1 likewise (ungated relu on +-I). A mutation (the e2m1 sign dropped) fails it.
* ``triton_quant4_gemv.routed`` against ``reference.experts`` on the same packed tensors: mxfp4 and int4 (symmetric,
  zero points, groups 32 / 64), gate / up interleaved (swiglu_oai with its clamp, expert biases) and concatenated
  (silu), ungated gelu, T in {1, 3}, k in {1, 2, 4}, fp32 and fp16, REDUCE_END 0 and 1, PREFETCH 0 and 1, outputs
  NaN-poisoned. The whole op (``moe_forward``) with a gated shared expert, zero experts and weight_on_input.
* Dispatch: mode "gemv" (decode config or MOECOMP_W4_DECODE) runs the GEMV launches and not the DIRECT dot ones
  (counted), "dot" the reverse; layouts the words cannot read fall back to the dot path; ``tuning.quant4_config``'s
  CUDA heuristic says "gemv" up to ``QUANT4_GEMV_MAX_T`` tokens; the tile heuristic gives >= 2 programs per SM.

Tolerances (relative Frobenius error against the fp32 reference on the same packed tensors, which dequantizes
exactly): fp32 3e-5 (the same products, summed in another order; measured <= 3e-7), fp16 2e-3 (h and the output
rounded to fp16 as the reference rounds them; measured <= 1e-4). The quantization itself moves these outputs 13-17%
from the unquantized weights' (tests/kernels/test_quant4_gemm.py): four orders of magnitude above the bounds.
"""

import json

import pytest
import torch
import triton
import triton.language as tl

from moecomp.core import quant as q8
from moecomp.oracle import reference
from moecomp.kernels import quant4_gemv as qg
from moecomp.ops import triton_moe, triton_quant4, triton_quant4_gemv, tuning
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec, SharedExpertSpec
from moecomp.testing import quantize_moe_args, random_moe_args

TOL = {torch.float32: 3e-5, torch.float16: 2e-3}
MX = QuantSpec.mxfp4()
ENV = ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FOLD", "MOECOMP_W4_FORM", "MOECOMP_W4_DECODE",
       "MOECOMP_W4_GEMV", "MOECOMP_W4_ASM")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# ------------------------------------------------------------------------------------------------ exact decode
@triton.jit
def _codes_kernel(c_ptr, out_ptr):
    c = tl.load(c_ptr + tl.arange(0, 16)).to(tl.int32)
    tl.store(out_ptr + tl.arange(0, 16), qg.e2m1_x2m14(c))


def test_e2m1_helper_is_e2m1_times_2m14_bit_for_bit():
    out = torch.empty(16)
    _codes_kernel[(1,)](torch.arange(16, dtype=torch.uint8), out)
    want = torch.tensor(q8.E2M1) * 2.0 ** -14  # exact: a power of two
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # -0 (code 8) and the subnormal 0.5 too
    assert torch.equal(out * 2.0 ** 14, torch.tensor(q8.E2M1))


@triton.jit
def _word_kernel(w_ptr, z_ptr, out_ptr, N: tl.constexpr, MX: tl.constexpr):
    offs = tl.arange(0, N)
    r = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + offs)
    if MX:
        c0, c1, c2, c3, c4, c5, c6, c7 = qg._e2m1_word(r, 0)
    else:
        zh = (tl.load(z_ptr + offs).to(tl.float32) + 1024.0).to(tl.float16)
        c0, c1, c2, c3, c4, c5, c6, c7 = qg._int4_word(r, zh, 0)
    o = out_ptr + offs * 8
    tl.store(o + 0, c0)
    tl.store(o + 1, c1)
    tl.store(o + 2, c2)
    tl.store(o + 3, c3)
    tl.store(o + 4, c4)
    tl.store(o + 5, c5)
    tl.store(o + 6, c6)
    tl.store(o + 7, c7)


def test_word_decoders_every_code_at_every_position():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 8), generator=g, dtype=torch.uint8)
    codes[:16] = torch.arange(16, dtype=torch.uint8)[:, None]  # every code at every position
    codes[16:32] = (torch.arange(16, dtype=torch.uint8)[:, None] + torch.arange(8)) % 16  # every pair of neighbours
    words = q8.pack_4bit(codes).reshape(-1)  # 4 bytes (one int32 word) a row
    out = torch.empty(128, 8)
    _word_kernel[(1,)](words, words, out, N=128, MX=True)
    want = torch.tensor(q8.E2M1)[codes.long()] * 2.0 ** -14
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    zeros = torch.tensor([0, 7, 8, 15, 16], dtype=torch.uint8)[torch.arange(128) % 5]  # 16: a GPTQ v1 zero of 0
    _word_kernel[(1,)](words, zeros, out, N=128, MX=False)
    assert torch.equal(out, codes.float() - zeros.float()[:, None])


MX_BYTES = (0, 1, 2, 30, 60, 90, 100, 110, 115, 118, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131,
            132, 134, 136, 140, 150, 170, 200, 230, 251, 252)  # 253 and up overflow fp32 at code 6; 255 is NaN


def _one_expert(quant, N, K, seed, dtype=torch.float32):
    """A random [N, K] weight quantized as one expert: mxfp4 scale bytes from ``MX_BYTES`` (fp32; 110..140 for fp16,
    whose range is narrower), int4 scales spread over 2^-14 .. 2^7 times quantize_4bit's, zero points 0..16."""
    g = torch.Generator().manual_seed(seed)
    packed, scale, zero = q8.quantize_4bit(torch.randn(1, N, K, generator=g), quant)
    if quant.weight == "mxfp4":
        pool = torch.tensor([b for b in MX_BYTES if dtype == torch.float32 or 110 <= b <= 140], dtype=torch.uint8)
        scale = pool[torch.arange(scale.numel()) % len(pool)].reshape(scale.shape).view(q8.E8M0)
    else:
        scale = (scale.float() * torch.exp2(torch.randint(-14, 8, scale.shape, generator=g).float())).to(scale.dtype)
        if zero is not None:
            zero = torch.randint(0, 17, zero.shape, generator=g, dtype=torch.uint8)
    return packed, scale, zero


EXACT = {  # name: (quant, N, K, dtype, BLOCK_K): K tokens of one-hot rows, N / 16 programs each
    "mxfp4-fp32-bk32": (MX, 16, 64, torch.float32, 32),  # every byte of MX_BYTES, two K steps
    "mxfp4-fp16-bk64-K40": (MX, 16, 40, torch.float16, 64),  # K % 32 == 8: a partial group, unaligned masks
    "int4zp-g32-fp32-bk64": (QuantSpec.int4(32, True), 16, 64, torch.float32, 64),  # two groups in a step
    "int4zp-g64-bf16s-fp16-bk32-K40": (QuantSpec.int4(64, True, "bf16"), 16, 40, torch.float16, 32),  # steps < group
}


def _down_on_identity(packed, scale, zero, quant, dtype, bk, prefetch=0):
    """out[t] = h[t] . w^T with h = I [K, K], one slot of weight 1 per token: w^T [K, N]."""
    E, N, K = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    spec = MoESpec(num_experts=E, top_k=1, hidden_size=N, intermediate_size=K, quant=quant)
    q = triton_quant4.quant4_kwargs(quant, scale, zero, {})
    out = torch.empty(K, N, dtype=dtype)
    dec = {"gemv2": dict(BLOCK_K=bk, PREFETCH=prefetch, BLOCK_N=16)}
    return triton_quant4_gemv.decode_down(torch.eye(K, dtype=dtype), packed, None, torch.zeros(K, dtype=torch.int32),
                                          torch.ones(K), spec, out, None, None, q, dec)


@pytest.mark.parametrize("case", sorted(EXACT))
def test_down_on_identity_reproduces_dequantize(poison, case):
    quant, N, K, dtype, bk = EXACT[case]
    packed, scale, zero = _one_expert(quant, N, K, len(case), dtype)
    want = q8.dequantize(packed[0], scale[0], quant, zero=None if zero is None else zero[0]).T  # [K, N] fp32
    assert torch.isfinite(want.to(dtype)).all()
    y = _down_on_identity(packed, scale, zero, quant, dtype, bk, prefetch=len(case) % 2)
    assert y.dtype == dtype and torch.equal(y, want.to(dtype)), f"{case}: {(y.float() - want).abs().max()}"


def test_gemm1_on_identity_reproduces_dequantize(poison):
    """gemm1, ungated relu, one expert, T = K pairs: x = I gives relu(w)^T, x = -I relu(-w)^T (mxfp4, fp32)."""
    K, N = 32, 16
    packed, scale, _ = _one_expert(MX, N, K, 3)
    want = q8.dequantize(packed[0], scale[0], MX).T  # [K, N]
    spec = MoESpec(num_experts=1, top_k=1, hidden_size=K, intermediate_size=N, gated=False, activation="relu",
                   quant=MX)
    q = triton_quant4.quant4_kwargs(MX, scale, None, {})
    ids = torch.zeros(K, dtype=torch.int32)
    run = lambda x: triton_quant4_gemv.gemm1(x, packed, None, spec, ids, 1, q, None, {"gemv1": {"BLOCK_K": 32}})  # noqa
    assert torch.equal(run(torch.eye(K)), want.clamp(min=0)) and torch.equal(run(-torch.eye(K)), (-want).clamp(min=0))


_E2M1_WORD = qg._e2m1_word


@triton.jit
def _unsigned_word(r, ASM: tl.constexpr, W4_MMA: tl.constexpr = 0):
    return _E2M1_WORD(r & 0x77777777, ASM, W4_MMA)


def test_dropping_the_sign_fails(monkeypatch, poison):
    monkeypatch.setattr(qg, "_e2m1_word", _unsigned_word)
    with pytest.raises(AssertionError):
        test_down_on_identity_reproduces_dequantize(None, "mxfp4-fp32-bk32")


# ------------------------------------------------------------------------------------------------ the experts
def _spec(quant, gate_up="concat", E=4, k=2, H=64, I=32, **kw):
    oai = gate_up == "interleaved"
    return MoESpec(num_experts=E, top_k=k, hidden_size=H, intermediate_size=I, gated=True, gate_up=gate_up,
                   activation="swiglu_oai" if oai else "silu", has_expert_bias=oai, quant=quant, **kw)


ROUTED = {  # name: (spec, dtype, T, tiles of gemv1 / gemv2)
    "mxfp4-oai-fp32-T1-k4": (_spec(MX, "interleaved", k=4), torch.float32, 1, {}),
    "mxfp4-oai-fp16-T3-k2-reduce_step": (_spec(MX, "interleaved"), torch.float16, 3, {"REDUCE_END": 0}),
    "mxfp4-concat-fp32-T3-k1-prefetch": (_spec(MX, k=1, H=96), torch.float32, 3, {"PREFETCH": 1, "BLOCK_K": 32}),
    "int4-g32-fp16-T1-k2": (_spec(QuantSpec.int4(32)), torch.float16, 1, {}),
    "int4zp-g64-fp32-T3-k4-prefetch": (_spec(QuantSpec.int4(64, True), k=4), torch.float32, 3, {"PREFETCH": 1}),
    "int4zp-g64-oai-fp16-T1-k1": (_spec(QuantSpec.int4(64, True), "interleaved", k=1), torch.float16, 1, {}),
    "int4zp-g32-fp32-T3-K72": (_spec(QuantSpec.int4(32, True), H=72, I=40), torch.float32, 3, {"BLOCK_K": 32}),
    "mxfp4-ungated-gelu-fp32-T3": (_spec(MX).replace(gated=False, activation="gelu"), torch.float32, 3, {}),
}


@pytest.mark.parametrize("case", sorted(ROUTED))
def test_routed_gemv_matches_reference(triton_backend, poison, case):
    spec, dtype, T, tiles = ROUTED[case]
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=len(case)))
    named = {**dict(zip(MOE_ARGS, args[1:])), **scales}
    g = torch.Generator().manual_seed(len(case))
    ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), 1)[:, :spec.top_k].to(torch.int32)
    w = torch.rand(T, spec.top_k, generator=g)
    q1, q2 = triton_quant4.expert_kwargs(spec.quant, named, None)
    x = args[0]
    out = torch.empty_like(x)
    dec = {"gemv1": tiles, "gemv2": tiles}
    got = triton_quant4_gemv.routed(x, ids.reshape(-1), w, named, spec, out, None, None, dec, q1, q2)
    ref = reference.experts(x, ids, w, named["w13"], named["b13"], named["w2"], named["b2"], spec, **scales)
    assert got is out and out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype], f"{case}: rel err {rel_err(out, ref):.2e}"


def _count(monkeypatch):
    calls = dict.fromkeys(("dot gemm1", "dot decode_down", "gemv gemm1", "gemv decode_down"), 0)
    for mod, tag in ((triton_moe, "dot"), (triton_quant4_gemv, "gemv")):
        for fn in ("gemm1", "decode_down"):
            real = getattr(mod, fn)

            def counted(*a, _real=real, _key=f"{tag} {fn}", **kw):
                calls[_key] += 1
                return _real(*a, **kw)

            monkeypatch.setattr(mod, fn, counted)
    return calls


OP = {  # name: (spec, dtype, T)
    "mxfp4-oai-shared-gate-fp16-T2": (_spec(MX, "interleaved", shared=SharedExpertSpec(intermediate_size=32,
                                                                                      gate="sigmoid")),
                                      torch.float16, 2),
    "int4zp-zero-experts-fp32-T3": (_spec(QuantSpec.int4(32, True), zero_experts=2), torch.float32, 3),
    "mxfp4-weight-on-input-fp32-T3": (_spec(MX, k=1, weight_on_input=True), torch.float32, 3),
}


@pytest.mark.parametrize("case", sorted(OP))
def test_moe_forward_takes_gemv_when_configured(triton_backend, poison, case):
    """moe_forward end to end with MOECOMP_W4_DECODE=gemv: the GEMV launches (counted) and the reference."""
    spec, dtype, T = OP[case]
    triton_backend.setenv("MOECOMP_W4_DECODE", "gemv")
    calls = _count(triton_backend)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, T, dtype, seed=len(case)))
    out = torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    ref = reference.moe_forward(*args, spec, **scales)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[dtype], f"{case}: {rel_err(out, ref):.2e}"
    assert calls == {"dot gemm1": 0, "dot decode_down": 0, "gemv gemm1": 1, "gemv decode_down": 1}


def test_dispatch_modes_and_fallback(triton_backend):
    """The decode config's mode picks the kernels; MOECOMP_W4_DECODE wins over it; H % 8 != 0 falls back to dot."""
    spec = _spec(MX, H=64)
    args, scales = quantize_moe_args(spec, random_moe_args(spec, 1, torch.float32, seed=1))
    cfg = tuning.get_config(4, spec.intermediate_size, spec.hidden_size, 1, 2, torch.float32, torch.device("cpu"), MX)
    assert "mode" not in cfg["decode"]  # CPU: dot unless asked for
    calls = _count(triton_backend)
    triton_backend.setenv("MOECOMP_CONFIG", json.dumps(dict(cfg, decode=dict(cfg["decode"], mode="gemv"))))
    torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert calls["gemv gemm1"] == 1 and calls["dot gemm1"] == 0
    triton_backend.setenv("MOECOMP_W4_DECODE", "dot")
    torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    assert calls["gemv gemm1"] == 1 and calls["dot gemm1"] == 1 and calls["dot decode_down"] == 1
    triton_backend.setenv("MOECOMP_W4_DECODE", "bogus")
    with pytest.raises(ValueError, match="MOECOMP_W4_DECODE"):
        torch.ops.moecomp.moe_forward(*args, spec.key, **scales)
    u8 = dict(dtype=torch.uint8)
    w13, w2 = torch.zeros(4, 64, 32, **u8), torch.zeros(4, 64, 16, **u8)
    assert triton_quant4_gemv.layout_ok(torch.zeros(1, 64), w13, w2)
    assert not triton_quant4_gemv.layout_ok(torch.zeros(1, 68), torch.zeros(4, 64, 34, **u8),
                                            torch.zeros(4, 68, 16, **u8))  # H = 68: rows of 34 bytes
    shifted = torch.zeros(w13.numel() + 1, **u8)[1:].view(w13.shape)  # base one byte off a word
    assert not triton_quant4_gemv.layout_ok(torch.zeros(1, 64), shifted, w2)
    assert not triton_quant4_gemv.layout_ok(torch.zeros(1, 64), w13, w2.transpose(1, 2))  # bytes not along K


def test_cuda_heuristic_and_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "device_key", lambda device: "no-table")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    near = tuning.quant4_config(128, 2880, 2880, 1, 4, torch.device("cuda"), MX)  # a GPU without a table: the
    h100 = tuning._table("NVIDIA_H100_80GB_HBM3")[tuning.shape_key(128, 2880, 2880, "mxfp4")]  # shipped entry
    assert near == tuning._bucket(h100, 1)
    monkeypatch.setattr(tuning, "_nearest", lambda *a: None)  # (no shipped table's entry near either: the heuristic)
    for T in range(1, 17):
        cfg = tuning.quant4_config(128, 2880, 2880, T, 4, torch.device("cuda"), MX)
        assert cfg["decode"].get("mode") == ("gemv" if T <= tuning.QUANT4_GEMV_MAX_T else None)
    monkeypatch.setattr(triton_quant4_gemv, "_sm_count", lambda device: 132)
    dev = torch.device("cuda")
    for T, k, H, I in ((1, 4, 2880, 2880), (2, 4, 2880, 2880), (1, 8, 2048, 768), (4, 8, 7168, 2048)):
        c1 = triton_quant4_gemv.tiles("gemv1", 2, T * k, I, H, dev)
        c2 = triton_quant4_gemv.tiles("gemv2", 1, T, H, I, dev)
        assert T * k * triton.cdiv(I, c1["BLOCK_N"]) >= 2 * 132 or c1["BLOCK_N"] == 4
        assert T * triton.cdiv(H, c2["BLOCK_N"]) >= 2 * 132 or c2["BLOCK_N"] == 4
        assert 4 <= c2["BLOCK_N"] <= 64 and 32 <= c2["BLOCK_K"] <= triton_quant4_gemv.MAX_BLOCK_K
    assert triton_quant4_gemv.tiles("gemv2", 1, 1, 2880, 2880, dev)["BLOCK_N"] == 8  # 360 programs
    assert triton_quant4_gemv.tiles("gemv2", 1, 1, 2880, 2880, dev)["BLOCK_K"] == 1024  # 3 steps, 6.7% masked
    assert triton_quant4_gemv.tiles("gemv2", 1, 1, 2048, 768, dev)["BLOCK_K"] == 256  # 1024 would mask a third
    assert triton_quant4_gemv._block_k(256, 96) == 32 and triton_quant4_gemv._block_k(64, 128) == 64
    monkeypatch.setenv("MOECOMP_W4_GEMV", json.dumps({"gemv2": {"BLOCK_N": 16, "REDUCE_END": 0}}))
    c2 = triton_quant4_gemv.tiles("gemv2", 1, 1, 2880, 2880, dev)
    assert c2["BLOCK_N"] == 16 and c2["REDUCE_END"] == 0
    monkeypatch.setenv("MOECOMP_W4_GEMV", json.dumps({"gemv2": {"BLOCK_Q": 16}}))
    with pytest.raises(ValueError, match="BLOCK_Q"):
        triton_quant4_gemv.tiles("gemv2", 1, 1, 2880, 2880, dev)
