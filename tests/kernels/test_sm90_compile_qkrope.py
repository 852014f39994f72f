"""The q / k norm + rotary + cache-write kernel (``kernels/qk_rope.qk_norm_rope_cache_kernel``) compiled for Hopper
(sm_90) on this CPU machine (``triton.compile`` to PTX needs no GPU; ``test_sm90_compile.py`` says why): bf16,
Qwen3-30B-A3B's heads (D 128, q / k norms, cos / sin of D), gpt-oss's (D 64, no norms, cos / sin of D / 2), an fp16
case with Gemma's 1 + w, at the launcher's warps; each PTX has the kernel's entry, no local memory (no spills) and the three branches' stores
(q out, k cache, v cache: at least three ``st.global``). One child process (the tests run under TRITON_INTERPRET=1,
whose jit functions do not compile)."""

import json

from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import qk_rope as qk
from moecomp.ops.triton_qk_rope import warps

''' + COMPILE_SM90 + r'''
def one(case):
    dt, D, norms, half, offset = case.split()
    ty = {"bf16": "*bf16", "fp16": "*fp16"}[dt]
    ptrs = dict(q_ptr=ty, k_ptr=ty, v_ptr=ty, qw_ptr=ty, kw_ptr=ty, cos_ptr=ty, sin_ptr=ty, kc_ptr=ty, vc_ptr=ty,
                idx_ptr="*i64", out_ptr=ty, eps="fp32")
    c = dict(D=int(D), BLOCK_D=int(D), HAS_QN=norms == "norms", HAS_KN=norms == "norms", OFFSET=offset == "offset",
             CS_HALF=half == "half")
    ptx = compile_sm90(qk.qk_norm_rope_cache_kernel, ptrs, c, ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr",
                                                               "out_ptr", "s_kb", "s_kh", "s_kl", "s_vb", "s_vh",
                                                               "s_vl"), dict(num_warps=warps(int(D))))
    if ".entry qk_norm_rope_cache_kernel" not in ptx:
        return "no entry in the PTX"
    if ".local" in ptx:
        return "local memory (spills) in the PTX"
    if len(re.findall(r"st\.global", ptx)) < 3:
        return "fewer than three global stores"
    return "ok"

out = {}
for case in json.loads(sys.argv[1])["cases"]:
    try:
        out[case] = one(case)
    except Exception as e:
        out[case] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"cases": ["bf16 128 norms full plain", "bf16 256 norms full plain", "bf16 64 none half plain", "fp16 128 norms full offset"]}


def test_qk_rope_kernel_compiles_for_sm90():
    res = compile_cases(CHILD, CASES)
    assert len(res) == len(CASES["cases"])
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
