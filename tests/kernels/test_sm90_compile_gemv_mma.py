"""The GEMV decode kernels (``kernels/quant4_gemv.py``) on mxfp4 words in the mma layout (W4_MMA 1) compiled for
Hopper (sm_90) on this CPU machine, against the same kernels on packed words: ``triton.compile`` to PTX (no GPU),
then this Triton's bundled ptxas for sm_90a and cuobjdump (``moecomp/testing/sass_loops.py``). At gpt-oss's decode
tiles (gemm1: gated interleaved swiglu_oai with biases, 32 columns = 64 weight rows x BLOCK_K 128; the down-combine:
8 columns x BLOCK_K 1024, top-4), 4 warps, 64 codes a thread a K step, PREFETCH 0 and 1:

* each compiles, loads its weight words as 16-byte vectors (``ld.global.v4.b32``) and spills nothing;
* the K loop's SASS (the innermost loop) of the mma decode has no more instructions than the packed decode's (the
  same fp16 bits from as many masks, with one shift fewer: slot 0's sign and slot 3's magnitude sit in place).

Measured (Triton 3.9, ptxas-blackwell for sm_90a, 2026-12-08), instructions in the K loop (a code: / 64):
gemm1 packed 358 (5.59), mma 343 (5.36); PREFETCH 1: 363 / 347; the down-combine 428 (6.69) / 413 (6.45);
PREFETCH 1: 426 / 410. Registers: gemm1 79 packed, 92 mma (PREFETCH 1: 95 / 96); the down-combine 96 / 96 (128 /
128). int4 needs no flag (its mma bytes are the packed bytes: the same kernel).
"""

import json

import pytest

from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import quant4_gemv as qg
from moecomp.testing import sass_loops

''' + COMPILE_SM90 + r'''
def gemv(case):
    ptr = dict(x_ptr="*bf16", h_ptr="*bf16", w_ptr="*u8", b_ptr="*bf16", out_ptr="*bf16", ids_ptr="*i32",
               topk_w_ptr="*fp32", alpha="fp32", limit="fp32", ws_ptr="*u8")
    c = dict(HAS_BIAS=True, W4=1, GROUP=32, REDUCE_END=1, K_ALIGNED=True, USE_PDL=2, ASM=0,
             PREFETCH=int("prefetch" in case), ZERO_EXPERTS=False, W4_MMA=int("mma" in case), zp_ptr=None)
    if "gemv1" in case:
        fn = qg.moe_gemv1_kernel
        c.update(GATE_STRIDE=2, GATED=True, ACT=4, CLAMP=False, BLOCK_N=32, BLOCK_K=128, W_ON_INPUT=False,
                 topk_w_ptr=None)
        div16 = ("x_ptr", "w_ptr", "stride_we", "stride_wn", "K")
    else:
        fn = qg.moe_gemv_down_kernel
        c.update(TOP_K=4, HAS_SHARED=False, HAS_GATE=False, BLOCK_N=8, BLOCK_K=1024, WEIGHTED=True, shared_ptr=None,
                 gate_ptr=None, x_ptr=None)
        div16 = ("h_ptr", "w_ptr", "stride_we", "stride_wn", "K")
    ptx = compile_sm90(fn, ptr, c, div16, {"num_warps": 4, "num_stages": 3})
    got = sass_loops.sass(ptx)
    if got is None:
        return {"skip": "no bundled ptxas reads this PTX"}
    text, name, info = got
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return {"loop": sass_loops.inner_loops(text), "regs": int(regs.group(1)) if regs else None,
            "spill": int(spill.group(1)) if spill else 0, "v4": "ld.global.v4.b32" in ptx, "ptxas": name}

out = {}
for case in json.loads(sys.argv[1])["gemv"]:
    try:
        out[case] = gemv(case)
    except Exception as e:
        out[case] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
print(json.dumps(out))
'''

PAIRS = [("gemv1", "gemv1 mma"), ("gemv1 prefetch", "gemv1 mma prefetch"), ("down", "down mma"),
         ("down prefetch", "down mma prefetch")]
CASES = {"gemv": [c for pair in PAIRS for c in pair]}


def test_gemv_mma_decode_sass_no_longer_than_packed():
    res = compile_cases(CHILD, CASES)
    if any("skip" in r for r in res.values()):
        pytest.skip(next(r["skip"] for r in res.values() if "skip" in r))
    bad = {c: r for c, r in res.items() if "error" in r or not r["v4"] or r["spill"] or len(r["loop"]) != 1}
    assert not bad, json.dumps(bad, indent=1)
    counts = {c: r["loop"][0] for c, r in res.items()}
    print(json.dumps({c: (n, round(n / 64, 2), res[c]["regs"]) for c, n in counts.items()}))  # (-s shows them)
    for packed, mma in PAIRS:
        assert counts[mma] <= counts[packed], f"{mma}: {counts[mma]} SASS instructions a step, packed {counts[packed]}"
