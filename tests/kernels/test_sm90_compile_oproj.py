"""The o_proj + residual add + RMSNorm kernel (``kernels/linear_add_norm.py``) compiled for Hopper (sm_90) on this
CPU machine (``test_sm90_compile.py`` says why: it catches what the interpreter lets through): 1 and 4 rows, 16-bit
with a bias, e4m3 block / channel scales, Gemma's 1 + w, one program or split. The split form must count with an
acq_rel atomic add at gpu scope and read h back with ``.cg`` loads (L2, never L1); the weight tiles load as 16-byte
vectors as the skinny kernel's do; USE_PDL 2 waits at the start and releases after the K loop, 0 holds no grid
dependency control. In a child process (the tests run under TRITON_INTERPRET=1, whose jit functions do not
compile)."""

import json

from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import linear_add_norm as lk

''' + COMPILE_SM90 + r'''
def lan(case):
    fp8 = "fp8" in case
    ptr = dict(x_ptr="*bf16", w_ptr="*fp8e4nv" if fp8 else "*bf16", r_ptr="*bf16", h_ptr="*bf16", g_ptr="*bf16",
               n_ptr="*bf16", counter_ptr="*i32", eps="fp32")
    c = dict(ROWS=4 if "rows4" in case else 1, HAS_BIAS="bias" in case,
             W_SCALE=(1 if "block" in case else 2) if fp8 else 0, Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False,
             OFFSET="gemma" in case, ROUND_UNIT="gemma" not in case, BLOCK_N=4, BLOCK_K=1024, REDUCE_END=1,
             ROWS_PAD=4 if "rows4" in case else 1, BLOCK_D=1024 if "rows4" in case else 4096, SINGLE="one" in case,
             USE_PDL=2 if "pdl" in case else 0)
    if fp8:
        ptr["ws_ptr"] = "*fp32"
    else:
        c["ws_ptr"] = None
    if "bias" in case:
        ptr["b_ptr"] = "*bf16"
    else:
        c["b_ptr"] = None
    ptx = compile_sm90(lk.linear_add_norm_kernel, ptr, c, ("x_ptr", "w_ptr", "stride_wn", "K", "stride_xm"))
    n = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
    if not ((n[0] >= 1 and n[1] >= 1) if "pdl" in case else n == (0, 0)):
        return "griddepcontrol not as USE_PDL says"
    if not ("ld.global.v4.b32" in ptx or "ld.global.nc.v4.b32" in ptx):
        return "weight tiles not loaded as 16-byte vectors"
    if "one" not in case:
        if not ("atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx):
            return "no acq_rel atomic add on the counter"
        if "ld.global.cg" not in ptx:
            return "the last program's h loads are not .cg"
    elif "atom." in ptx:
        return "one program but an atomic on the counter"
    return "ok" if ".entry linear_add_norm_kernel" in ptx else "no entry in the PTX"

out = {}
for case in json.loads(sys.argv[1]).get("lan", []):
    try:
        out[case] = lan(case)
    except Exception as e:
        out[case] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"lan": ["split bf16 bias", "split rows4 bf16 gemma", "one bf16", "split fp8 block", "split fp8 channel bias",
                 "split bf16 pdl"]}


def test_linear_add_norm_kernel_compiles_for_sm90():
    res = compile_cases(CHILD, CASES)
    assert len(res) == len(CASES["lan"])
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
