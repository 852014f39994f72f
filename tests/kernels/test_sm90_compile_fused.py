"""The fused decode kernels of issue 41 compiled for Hopper (sm_90) on this CPU machine (``triton.compile`` to PTX needs
no GPU; ``test_sm90_compile.py`` says why: it catches what the interpreter lets through). The sibling-linear kernel
(``kernels/skinny.skinny_group_kernel``: 2, 3 and 4 members, 16-bit with mixed biases, e4m3 block / channel scales)
must load its weight tiles as 16-byte vectors, as the one-matrix kernel does; and ``skinny_kernel``, now a call of the
tile function the group kernel shares, still compiles; with USE_PDL 2 both wait at the start and release after the
K loop, with 0 they hold no grid dependency control. All in one child process (the tests run
under TRITON_INTERPRET=1, whose jit functions do not compile)."""

import json

import pytest
from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import skinny as sk

''' + COMPILE_SM90 + r'''
def group(case):
    G = int(case.split()[0][1])
    fp8 = "fp8" in case
    ptr, c = {"x_ptr": "*bf16"}, {}
    for i in range(4):
        if i < G:
            ptr.update({f"w{i}": "*fp8e4nv" if fp8 else "*bf16", f"y{i}": "*bf16"})
            if fp8:
                ptr[f"ws{i}"] = "*fp32"
            else:
                c[f"ws{i}"] = None
            bias = "bias" in case and i % 2 == 0
            if bias:
                ptr[f"b{i}"] = "*bf16"
            else:
                c[f"b{i}"] = None
            c[f"HB{i}"] = bias
        else:
            c.update({f"w{i}": None, f"ws{i}": None, f"b{i}": None, f"y{i}": None, f"HB{i}": False})
    c.update(G=G, ROWS=2 if "rows2" in case else 1, W_SCALE=(1 if "block" in case else 2) if fp8 else 0,
             Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False, BLOCK_N=8, BLOCK_K=1024, REDUCE_END=1,
             USE_PDL=2 if "pdl" in case else 0)
    div16 = ["x_ptr", "K", "stride_xm"] + [f"w{i}" for i in range(G)] + [f"swn{i}" for i in range(G)]
    ptx = compile_sm90(sk.skinny_group_kernel, ptr, c, div16)
    vec = "ld.global.v4.b32" in ptx or "ld.global.nc.v4.b32" in ptx
    return (ptx if vec else "weight tiles not loaded as 16-byte vectors") if _pdl_ok(ptx, case) else \
        "griddepcontrol not as USE_PDL says", "skinny_group_kernel"

def _pdl_ok(ptx, case):
    """USE_PDL 2: a wait at the start and a launch_dependents after the K loop; 0: neither."""
    n = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
    return n[0] >= 1 and n[1] >= 1 if "pdl" in case else n == (0, 0)

def single(case):
    ptr = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16")
    c = dict(ws_ptr=None, b_ptr=None, ROWS=1, HAS_BIAS=False, W_SCALE=0, Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False,
             BLOCK_N=8, BLOCK_K=1024, REDUCE_END=1, USE_PDL=2 if "pdl" in case else 0)
    ptx = compile_sm90(sk.skinny_kernel, ptr, c, ("x_ptr", "w_ptr", "stride_wn", "K"))
    return (ptx if _pdl_ok(ptx, case) else "griddepcontrol not as USE_PDL says"), "skinny_kernel"

out = {}
for kind, fn in (("group", group), ("single", single)):
    for case in json.loads(sys.argv[1]).get(kind, []):
        try:
            ptx, name = fn(case)
            out[f"{kind}: {case}"] = ("ok" if f".entry {name}" in ptx else
                                      ptx if len(ptx) < 200 else "no entry in the PTX")
        except Exception as e:
            out[f"{kind}: {case}"] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"group": ["G3 bf16 bias", "G2 bf16 rows2", "G4 bf16", "G2 fp8 block", "G3 fp8 channel bias rows2",
                   "G3 bf16 pdl"],
         "single": ["bf16", "bf16 pdl"]}


def test_fused_decode_kernels_compile_for_sm90():
    res = compile_cases(CHILD, CASES)
    assert len(res) == sum(len(v) for v in CASES.values())
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
