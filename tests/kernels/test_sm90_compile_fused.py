"""The fused decode kernels of issue 41 compiled for Hopper (sm_90) on this CPU machine (``triton.compile`` to PTX needs
no GPU; ``test_sm90_compile.py`` says why: it catches what the interpreter lets through). The sibling-linear kernel
(``kernels/skinny.skinny_group_kernel``: 2, 3 and 4 members, 16-bit with mixed biases, e4m3 block / channel scales)
must load its weight tiles as 16-byte vectors, as the one-matrix kernel does; and ``skinny_kernel``, now a call of the
tile function the group kernel shares, still compiles; with USE_PDL 2 both wait at the start and release after the
K loop, with 0 they hold no grid dependency control. The fused router GEMV + routing
(``kernels/router.router_topk_kernel``): one program or split (an acq_rel atomic on the counter, the last program's
logits read with volatile loads past L1), with gate rows, groups, record / replay. All in one child process (the
tests run under TRITON_INTERPRET=1, whose jit functions do not compile)."""

import json

import pytest
from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import router as rk
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

def router(case):
    """The fused router GEMV + routing: split (counter) or one program, 1 or 4 tokens, a gate row and router bias,
    groups with a correction bias, record / replay pointers."""
    split = "split" in case
    ptr = dict(x_ptr="*bf16", w_ptr="*bf16", g_ptr="*bf16", rb_ptr="*bf16", counter_ptr="*i32", logits_ptr="*bf16",
               bias_ptr="*fp32", ids_ptr="*i32", weights_ptr="*fp32", scaling="fp32", renorm_eps="fp32",
               renorm_min="fp32", sm_thr="fp32", rec_ids_ptr="*i32", rec_w_ptr="*fp32", given_ptr="*i64")
    grp = "groups" in case
    c = dict(ROWS=4 if "rows4" in case else 1, HAS_GATE="gate" in case, HAS_RBIAS="gate" in case,
             BLOCK_R=1 if split else 128, BLOCK_H=1024 if split else 16, SINGLE=not split,
             TOP_K=8, K_PAD=8, BLOCK_T=4 if "rows4" in case else 1, BLOCK_E=256 if grp else 128,
             SCORING=1 if grp else 0, TOPK_THEN_SCORE=False, RENORM=True, HAS_BIAS=grp, BIAS_ON_LOGITS=False,
             MASK_ZERO=False, N_GROUP=8 if grp else 1, G_PAD=8 if grp else 1, TOPK_GROUP=4 if grp else 1,
             GROUP_BY_MAX=False, GROUP_3D=grp, GROUP_SIZE=32 if grp else 1, ROUND_TO=1, USE_PDL=1, SPARSEMIXER=0,
             table_ptr=None, tok_ptr=None, HASH=False, escale_ptr=None, HAS_ESCALE=False, gammas_ptr=None,
             wscale_ptr=None, N_GAMMA=0, GAM_PAD=1, HAS_WSCALE=False, GIVEN="replay" in case,
             REC_IDS="record" in case, REC_W="record" in case)
    for name, on in (("g_ptr", "gate"), ("rb_ptr", "gate"), ("bias_ptr", "groups"), ("rec_ids_ptr", "record"),
                     ("rec_w_ptr", "record"), ("given_ptr", "replay")):
        if on not in case:
            c[name] = None
    ptx = compile_sm90(rk.router_topk_kernel, ptr, c, ("x_ptr", "w_ptr", "stride_w", "H"))
    if split and not ("atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx):
        return "no acq_rel atomic add on the counter", "router_topk_kernel"
    if split and "ld.volatile.global" not in ptx:
        return "the last program's logits loads are not volatile", "router_topk_kernel"
    return ptx, "router_topk_kernel"

out = {}
for kind, fn in (("group", group), ("single", single), ("router", router)):
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
         "single": ["bf16", "bf16 pdl"],
         "router": ["split", "split rows4 gate groups record", "one rows4 gate", "split replay record",
                    "one groups replay"]}


def test_fused_decode_kernels_compile_for_sm90():
    res = compile_cases(CHILD, CASES)
    assert len(res) == sum(len(v) for v in CASES.values())
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
