"""The decode path's 4-bit "mma" form (W4_FORM 4: ``kernels/quant4_mma.mma_loop`` in the DIRECT gemm1 / gemm2 and the
fused down-combine ``kernels/decode.moe_down_combine_kernel``) compiled for Hopper (sm_90) on this CPU machine
(``triton.compile`` to PTX needs no GPU; ``test_sm90_compile.py`` says why). Each case must compile, issue its dot on
the tensor cores (``mma.sync`` or ``wgmma``) and load the weight words as 16-byte vectors (``ld.global.v4`` of
32-bit words: 4 words = 32 codes a load), with the strides, K and the pointers declared divisible by 16 as Triton
specializes them at run time (gpt-oss-120b: 1440-byte rows; Qwen3-30B-A3B int4: 1024 / 384). Cases: mxfp4, int4
and int4 with zero points; gemm1 gated (gpt-oss's interleaved swiglu_oai with biases) or ungated with weight on
input; the down-combine with a gated shared expert and zero experts, and unweighted. All in one child process (the
tests run under TRITON_INTERPRET=1, whose jit functions do not compile)."""

import json

from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import decode as dk
from moecomp.kernels import grouped_gemm as gk

''' + COMPILE_SM90 + r'''
def mma(case, stages):
    w4 = 1 if "mxfp4" in case else (3 if "zp" in case else 2)
    ptr = dict(x_ptr="*bf16", h_ptr="*bf16", w_ptr="*u8", b_ptr="*bf16", y_ptr="*bf16", out_ptr="*bf16",
               sorted_ptr="*i32", ids_ptr="*i32", topk_w_ptr="*fp32", alpha="fp32", limit="fp32",
               ws_ptr="*u8" if w4 == 1 else "*bf16")
    if w4 == 3:
        ptr["zp_ptr"] = "*u8"
    c = dict(HAS_BIAS=True, UPCAST=False, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_K=256 if "k256" in case else 128,
             USE_PDL=2, as_ptr=None, W_SCALE=0, A_QUANT=0, Q_BLOCK_N=1, Q_BLOCK_K=32 if w4 == 1 else 128,
             UE8M0=w4 == 1, EXACT_CAST=False, stride_am=None, FOLD=0, W4=w4, W4_FOLD=0, W4_FORM=4, stride_wk=1,
             stride_sk=1, W4_K32=int("k8" not in case))
    div16 = ["x_ptr", "h_ptr", "w_ptr", "stride_xm", "stride_hm", "stride_we", "stride_wn", "K"]
    if "gemm1" in case:
        fn, name = gk.moe_gemm1_kernel, "moe_gemm1_kernel"
        gated = "ungated" not in case
        c.update(GATE_STRIDE=2, GATED=gated, ACT=4 if gated else 1, CLAMP=False, BLOCK_N=32, GROUP_M=1,
                 TILE_N=64 if gated else 32, DIRECT=True, block_expert_ptr=None, num_padded_ptr=None, hs_ptr=None,
                 stride_hsm=None, Q_OUT=0, W_ON_INPUT=not gated, ZERO_EXPERTS=False, PAIR_LOAD=False)
        if gated:
            c["topk_w_ptr"] = None
    elif "gemm2" in case:
        fn, name = gk.moe_gemm2_kernel, "moe_gemm2_kernel"
        c.update(BLOCK_N=64, GROUP_M=1, DIRECT=True, block_expert_ptr=None, num_padded_ptr=None, WEIGHTED=True,
                 ZERO_EXPERTS=False)
    else:
        fn, name = dk.moe_down_combine_kernel, "moe_down_combine_kernel"
        sh, zero = "shared" in case, "zero" in case
        c.update(TOP_K=4, HAS_SHARED=sh, HAS_GATE=sh, BLOCK_N=16 if "n16" in case else 64,
                 WEIGHTED="unweighted" not in case, ZERO_EXPERTS=zero)
        if sh:
            ptr.update(shared_ptr="*bf16", gate_ptr="*bf16")
        else:
            c.update(shared_ptr=None, gate_ptr=None)
        if zero:
            ptr["x_ptr"] = "*bf16"
        else:
            c["x_ptr"] = None
    names = inspect.signature(fn.fn).parameters
    return compile_sm90(fn, ptr, c, [n for n in div16 if n in names], {"num_stages": stages}), name

def check(case, wide):
    """"ok" when the case compiles with its dot on the tensor cores and its weight words load as the case expects:
    ``wide`` 16-byte vectors (unpipelined: ld.global.v4.b32 and no v2; pipelined: 16-byte cp.async only), else
    8-byte ones (ld.global.v2.b32)."""
    flat, name = mma(case, 1)
    piped, _ = mma(case, 3)
    if f".entry {name}" not in flat or f".entry {name}" not in piped:
        return "no entry in the PTX"
    if not any(m in p for p in (flat, piped) for m in ("mma.sync", "wgmma")):
        return "no tensor-core instruction in the PTX"
    v2, v4 = "ld.global.v2.b32" in flat, "ld.global.v4.b32" in flat
    if wide and (v2 or not v4 or "cp.async.ca" in piped):
        return f"weight words not 16-byte loads (v2 {v2}, v4 {v4}, 8-byte cp.async {'cp.async.ca' in piped})"
    if not wide and not v2:
        return "expected 8-byte word loads (ld.global.v2.b32): none"
    return "ok"

out = {}
for case, wide in json.loads(sys.argv[1])["mma"].items():
    try:
        out[case] = check(case, wide)
    except Exception as e:
        out[case] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

# case -> whether its weight words must load as 16-byte vectors. "k8": the launcher could not promise K % 32 == 0
# (W4_K32 0): 8-byte loads, the check's negative case; "n16" at BLOCK_K 128: 16 rows x 16 words over 128 threads is
# 2 words a thread (8 bytes) whatever the mask, at BLOCK_K 256 ("k256") 4 words.
CASES = {"mma": {"gemm1 mxfp4": True, "gemm1 int4": True, "gemm1 ungated int4 zp": True, "gemm2 mxfp4": True,
                 "gemm2 int4 zp": True, "down mxfp4": True, "down mxfp4 n16 k256 shared zero": True,
                 "down int4 zp unweighted": True, "down int4 n16": False, "gemm2 mxfp4 k8": False}}


def test_decode_mma_form_compiles_for_sm90_with_vector_word_loads():
    res = compile_cases(CHILD, CASES)
    assert len(res) == len(CASES["mma"])
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
