"""Decode kernels compiled for Hopper (sm_90) on this CPU machine: ``triton.compile`` to PTX needs no GPU, and
catches what the interpreter lets through (a ``None`` pointer in arithmetic on a branch the compiler keeps: the
first GPU run of the skinny experts of 58ebe4d failed so, and this test, written against them, failed on it). One
case per shape of the constexpr branches the op launches: the skinny linear (16-bit, e4m3 block / channel scales)
the fused decode down-combine (16-bit; e4m3 weight-only with zero experts, unweighted, a gated shared expert), and
gemm1 on weight rows of unit stride (the in_out layout: concatenated gate / up halves loaded apart, interleaved
ones), whose weight tiles must load as vectors (the gathered form ran Llama 4 Scout's layer at 0.5 TB/s), and the
4-bit K loops (kernels/quant4.py) in gemm1, gemm2 and the down-combine, and the dot-free 4-bit decode kernels
(kernels/quant4_gemv.py, their inline-PTX variant too: the interpreter cannot run it).
All compiled in one child process (the tests run under TRITON_INTERPRET=1, whose jit functions do not compile)."""

import json
import os
import subprocess
import sys

import pytest

# PTX of a @triton.jit function for sm_90 (part of the child scripts here and in test_sm90_compile_fused.py)
COMPILE_SM90 = r'''
W4_OFF = dict(zp_ptr=None, W4=0, W4_FOLD=0, W4_FORM=0)

def compile_sm90(fn, pointers, constexprs, div16=(), options=None):
    """PTX of fn; ``div16``: arguments declared divisible by 16, as Triton specializes aligned pointers and
    strides at run time (what lets it vectorize loads); ``options``: compile options (num_stages, num_warps)."""
    params = list(inspect.signature(fn.fn).parameters)
    # the 4-bit arguments' defaults unless the case sets them (zp_ptr: a pointer in "zp" cases)
    constexprs = {**{n: v for n, v in W4_OFF.items() if n not in pointers}, **constexprs}
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(params):
        if p in constexprs:
            sig[p] = "constexpr"
            const[(i,)] = constexprs[p]
        else:
            sig[p] = pointers.get(p, "i32")
            if p in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options).asm["ptx"]
'''

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import decode as dk
from moecomp.kernels import grouped_gemm as gk
from moecomp.kernels import skinny as sk
from moecomp.kernels import quant4_gemv as qg

W = {"bf16": "*bf16", "fp8": "*fp8e4nv"}
''' + COMPILE_SM90 + r'''
def skinny(case):
    w = "fp8" if "fp8" in case else "bf16"
    ptr = dict(x_ptr="*bf16", w_ptr=W[w], ws_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16")
    c = dict(ROWS=4 if "rows4" in case else 1, HAS_BIAS="bias" in case,
             W_SCALE=1 if "block" in case else (2 if "channel" in case else 0), Q_BLOCK_N=128, Q_BLOCK_K=128,
             UE8M0="ue8m0" in case, BLOCK_N=8, BLOCK_K=1024, REDUCE_END=0 if "reduce_step" in case else 1)
    if "ue8m0" in case:
        ptr["ws_ptr"] = "*u8"
    for name, on in (("b_ptr", "bias"), ("ws_ptr", "fp8")):
        if on not in case:
            c[name] = None
    return compile_sm90(sk.skinny_kernel, ptr, c), "skinny_kernel"

def down(case):
    w = "fp8" if "fp8" in case else "bf16"
    ptr = dict(h_ptr="*bf16", w_ptr=W[w], b_ptr="*bf16", ids_ptr="*i32", topk_w_ptr="*fp32", shared_ptr="*bf16",
               gate_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", as_ptr="*fp32", x_ptr="*bf16")
    c = dict(TOP_K=8, HAS_BIAS="bias" in case, HAS_SHARED="shared" in case, HAS_GATE="shared" in case,
             UPCAST=False, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_PDL=2,
             W_SCALE=1 if w == "fp8" else 0, A_QUANT=0, Q_BLOCK_N=128 if w == "fp8" else 1,
             Q_BLOCK_K=128 if w == "fp8" else 1, UE8M0=False, EXACT_CAST=False, FOLD=1 if "fold" in case else 0,
             WEIGHTED="unweighted" not in case, ZERO_EXPERTS="zero" in case, stride_am=None, as_ptr=None)
    for name, on in (("b_ptr", "bias"), ("shared_ptr", "shared"), ("gate_ptr", "shared"), ("x_ptr", "zero"),
                     ("ws_ptr", "fp8")):
        if on not in case:
            c[name] = None
    return compile_sm90(dk.moe_down_combine_kernel, ptr, c), "moe_down_combine_kernel"

def gemm1(case):
    ptr = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", h_ptr="*bf16", sorted_ptr="*i32",
               block_expert_ptr="*i32", num_padded_ptr="*i32", alpha="fp32", limit="fp32")
    c = dict(GATE_STRIDE=2 if "interleaved" in case else 1, GATED=True, ACT=0, CLAMP=False, HAS_BIAS="bias" in case,
             UPCAST=False, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, TILE_N=128,
             DIRECT="direct" in case, USE_PDL=0, ws_ptr=None, as_ptr=None, W_SCALE=0, A_QUANT=0, Q_BLOCK_N=1,
             Q_BLOCK_K=1, UE8M0=False, EXACT_CAST=False, stride_am=None, hs_ptr=None, stride_hsm=None, Q_OUT=0, FOLD=0,
             topk_w_ptr=None, W_ON_INPUT=False, ZERO_EXPERTS=False, PAIR_LOAD="pair" in case, stride_wn=1)
    if "bias" not in case:
        c["b_ptr"] = None
    if "direct" in case:
        c["block_expert_ptr"] = None
    div16 = ("x_ptr", "w_ptr", "h_ptr", "sorted_ptr", "stride_xm", "stride_we", "stride_wk", "stride_hm", "K", "N_OUT",
             "UP_OFFSET")
    ptx = compile_sm90(gk.moe_gemm1_kernel, ptr, c, div16)
    scalar = ptx.count("ld.global.b16")  # a weight tile gathered element by element (no bias in these cases)
    return (ptx if not scalar else f"{scalar} scalar 16-bit loads"), "moe_gemm1_kernel"

def quant4(case):
    """4-bit weights (kernels/quant4.py) in gemm1 / gemm2 / the down-combine: mxfp4 (ue8m0 bytes) or int4 (fp16
    scales, zero points with "zp"), the interleave, split, dot_scaled ("scaled") or inline-PTX ("asm") K step, DIRECT or
    aligned at BLOCK_M 64; the opt-in "mma" form (kernels/quant4_mma.py) aligned."""
    w4 = 1 if "mxfp4" in case else (3 if "zp" in case else 2)
    ptr = dict(x_ptr="*bf16", h_ptr="*bf16", w_ptr="*u8", b_ptr="*bf16", y_ptr="*bf16", out_ptr="*bf16",
               sorted_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32", ids_ptr="*i32", topk_w_ptr="*fp32",
               alpha="fp32", limit="fp32", ws_ptr="*u8" if w4 == 1 else "*fp16")
    if w4 == 3:
        ptr["zp_ptr"] = "*u8"
    direct = "direct" in case
    c = dict(HAS_BIAS=True, UPCAST=False, DOT_PRECISION="tf32", BLOCK_M=16 if direct else 64, BLOCK_K=128, USE_PDL=0,
             as_ptr=None, W_SCALE=0, A_QUANT=0, Q_BLOCK_N=1, Q_BLOCK_K=32 if w4 == 1 else 128, UE8M0=w4 == 1,
             EXACT_CAST=False, stride_am=None, FOLD=0, ZERO_EXPERTS=False, W4=w4, W4_FOLD=int("fold" in case),
             W4_FORM=1 if "split" in case else (2 if "scaled" in case else (3 if "asm" in case else (4 if "mma" in case else 0))),
             stride_wk=1,
             stride_sk=1)
    if "gemm1" in case:
        fn, name = gk.moe_gemm1_kernel, "moe_gemm1_kernel"
        c.update(GATE_STRIDE=2, GATED=True, ACT=4, CLAMP=False, BLOCK_N=32, GROUP_M=1, TILE_N=64, DIRECT=direct,
                 hs_ptr=None, stride_hsm=None, Q_OUT=0, topk_w_ptr=None, W_ON_INPUT=False, PAIR_LOAD=False)
    elif "gemm2" in case:
        fn, name = gk.moe_gemm2_kernel, "moe_gemm2_kernel"
        c.update(BLOCK_N=64, GROUP_M=1, DIRECT=direct, WEIGHTED=True)
    else:
        fn, name = dk.moe_down_combine_kernel, "moe_down_combine_kernel"
        c.update(TOP_K=4, HAS_SHARED=False, HAS_GATE=False, BLOCK_N=64, BLOCK_M=16, WEIGHTED=True, x_ptr=None,
                 shared_ptr=None, gate_ptr=None)
    if direct:
        c["block_expert_ptr"] = None
    return compile_sm90(fn, ptr, c), name

def quant4_gemv(case):
    """The dot-free 4-bit decode kernels (kernels/quant4_gemv.py): gemm1 (gated interleaved swiglu_oai, or ungated
    with weight_on_input and zero experts) and the down-combine (shared expert, zero experts, unweighted), mxfp4 or
    int4 ("zp": zero points), "asm": the inline-PTX conversions, "prefetch", "step": REDUCE_END 0, "mma": mxfp4
    words in the mma layout (W4_MMA). The int32 word loads must be 16-byte vectors (K % 32 == 0, 16-byte aligned
    rows)."""
    w4 = 1 if "mxfp4" in case else (3 if "zp" in case else 2)
    ptr = dict(x_ptr="*bf16", h_ptr="*bf16", w_ptr="*u8", b_ptr="*bf16", out_ptr="*bf16", ids_ptr="*i32",
               topk_w_ptr="*fp32", shared_ptr="*bf16", gate_ptr="*bf16", alpha="fp32", limit="fp32",
               ws_ptr="*u8" if w4 == 1 else "*fp16", zp_ptr="*u8")
    c = dict(HAS_BIAS=True, W4=w4, GROUP=32 if w4 == 1 else 128, REDUCE_END=0 if "step" in case else 1,
             K_ALIGNED=True, USE_PDL=2, ASM=int("asm" in case), PREFETCH=int("prefetch" in case),
             ZERO_EXPERTS="zero" in case, W4_MMA=int("mma" in case))
    if w4 != 3:
        c["zp_ptr"] = None
    zero = "zero" in case
    if "gemv1" in case:
        fn, name = qg.moe_gemv1_kernel, "moe_gemv1_kernel"
        gated = "ungated" not in case
        c.update(GATE_STRIDE=2, GATED=gated, ACT=4 if gated else 1, CLAMP=False, BLOCK_N=32, BLOCK_K=128,
                 W_ON_INPUT=not gated)
        if gated:
            c["topk_w_ptr"] = None
        div16 = ("x_ptr", "w_ptr", "stride_we", "stride_wn", "K")
    else:
        fn, name = qg.moe_gemv_down_kernel, "moe_gemv_down_kernel"
        sh = "shared" in case
        c.update(TOP_K=4, HAS_SHARED=sh, HAS_GATE=sh, BLOCK_N=8, BLOCK_K=1024, WEIGHTED="unweighted" not in case)
        for n in ("shared_ptr", "gate_ptr") if not sh else ():
            c[n] = None
        if zero:
            ptr["x_ptr"] = "*bf16"
        else:
            c["x_ptr"] = None
        div16 = ("h_ptr", "w_ptr", "stride_we", "stride_wn", "K")
    ptx = compile_sm90(fn, ptr, c, div16)
    return (ptx if "ld.global.v4.b32" in ptx else "packed words not loaded as 16-byte vectors"), name

out = {}
for kind, fn in (("skinny", skinny), ("down", down), ("gemm1", gemm1), ("quant4", quant4),
                 ("quant4_gemv", quant4_gemv)):
    for case in json.loads(sys.argv[1])[kind]:
        try:
            ptx, name = fn(case)
            out[f"{kind}: {case}"] = ("ok" if f".entry {name}" in ptx else
                                      ptx if " loads" in ptx else "no entry in the PTX")
        except Exception as e:
            out[f"{kind}: {case}"] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"skinny": ["bf16 bias", "fp8 block rows4 reduce_step", "fp8 channel ue8m0"],
         "down": ["bf16 plain", "bf16 shared bias zero unweighted", "fp8 block fold shared zero"],
         "gemm1": ["pair in_out", "pair in_out direct", "interleaved in_out"],
         "quant4": ["gemm1 mxfp4 direct", "gemm1 int4 zp fold", "gemm2 int4 split", "gemm2 mxfp4 direct",
                    "down mxfp4", "down int4 zp split", "gemm1 mxfp4 scaled", "down mxfp4 scaled",
                    "gemm1 mxfp4 asm", "down mxfp4 asm", "gemm1 mxfp4 mma", "gemm2 mxfp4 mma", "gemm2 int4 zp mma",
                    "gemm1 int4 mma"],
         "quant4_gemv": ["gemv1 mxfp4", "gemv1 int4 zp prefetch", "gemv1 ungated int4 zero step", "gemv1 mxfp4 asm",
                         "gemv1 int4 zp asm", "down mxfp4 prefetch", "down int4 zp shared zero unweighted asm",
                         "gemv1 mxfp4 mma asm", "down mxfp4 mma shared zero prefetch"]}


def compile_cases(child: str, cases: dict) -> dict:
    """Run ``child`` (a script printing {case: "ok" | why}) on ``cases`` without the interpreter."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("this Triton has no NVIDIA backend")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", child, json.dumps(cases)], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_decode_kernels_compile_for_sm90():
    res = compile_cases(CHILD, CASES)
    assert len(res) == sum(len(v) for v in CASES.values())
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
