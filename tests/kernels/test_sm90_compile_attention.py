"""The decode attention kernels compiled for Hopper (sm_90) on this CPU machine (``triton.compile`` to PTX needs no
GPU; ``test_sm90_compile.py`` says why). The one-launch kernel (``kernels/decode_attention.decode_attn_one_kernel``)
with several splits: a CTA barrier before the count, the count an acq_rel atomic add at gpu scope on the counter,
the reset an atomic exchange, the last program's partials read with ``.cg`` loads (L2, never L1), vectorized where
the pointers are 16-byte aligned as Triton specializes them at run time; with one split: no atomic, no ``.cg``
load (no partials). (The barrier check guards the ordering, not the ``tl.debug_barrier()`` call: Triton places a
bar.sync there anyway today, for the count's shared-memory broadcast.) The two-launch kernels (split, combine;
their code is now the shared ``_attend`` / ``_merge_splits``) still compile, the combine with ordinary (cached)
loads. bf16 operands, Qwen3-30B-A3B / gpt-oss sizes (G 8, head dim 128 / 64), with and without sinks. One child
process (the tests run under TRITON_INTERPRET=1, whose jit functions do not compile)."""

import json

from test_sm90_compile import COMPILE_SM90, compile_cases  # (this directory)

CHILD = r'''
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import decode_attention as ak

''' + COMPILE_SM90 + r'''
PTRS = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", keep_ptr="*i1", n_ptr="*i64", po_ptr="*fp32",
            pm_ptr="*fp32", pl_ptr="*fp32", out_ptr="*bf16", sinks_ptr="*bf16", counter_ptr="*i32", scale="fp32")
ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "po_ptr", "pm_ptr", "pl_ptr", "out_ptr", "sq_b", "sq_h", "sk_b", "sk_h",
           "sk_l", "sv_b", "sv_h", "sv_l")

def _sizes(case):
    d = 64 if "d64" in case else 128
    S = int(case.split()[0][1:])
    return dict(G=8, BLOCK_G=16, DK=d, BLOCK_DK=d, DV=d, BLOCK_DV=d, BLOCK_N=64, CHUNK=64, SPLITS=S,
                UPCAST=False, DOT_PRECISION="tf32"), S

def one(case):
    c, S = _sizes(case)
    c.update(S_PAD=max(2, triton.next_power_of_2(S)), G_STEP=1 if S > 16 else 4, HAS_SINKS="sinks" in case)
    ptr = dict(PTRS)
    if "sinks" not in case:
        c["sinks_ptr"] = None
    if S == 1:
        c.update(po_ptr=None, pm_ptr=None, pl_ptr=None, counter_ptr=None)
    ptx = compile_sm90(ak.decode_attn_one_kernel, ptr, c, ALIGNED)
    atom = re.findall(r"atom\.[\w.:]+", ptx)
    if S == 1:
        return (ptx if not atom and "ld.global.cg" not in ptx else f"one split holds {atom} / .cg loads"), \
            "decode_attn_one_kernel"
    add = [a for a in atom if ".add" in a]
    if len(add) != 1 or ".acq_rel" not in add[0] or ".gpu" not in add[0]:
        return f"the count is not one acq_rel add at gpu scope: {atom}", "decode_attn_one_kernel"
    if not any(".exch" in a for a in atom):
        return f"no atomic reset of the counter: {atom}", "decode_attn_one_kernel"
    before = ptx[:ptx.index(add[0])]
    if "bar.sync" not in before[before.rindex("st.global"):]:
        return "no CTA barrier between the partials' stores and the count", "decode_attn_one_kernel"
    after = ptx[ptx.index(add[0]):]
    if not re.search(r"ld\.global\.cg\.v[24]\.b32", after):
        return "the last program's partials not read with vectorized .cg loads", "decode_attn_one_kernel"
    if re.search(r"ld\.global(\.v\d)?\.b32", after.split("ret;")[0]) or "ld.volatile" in after:
        return "a partial read through L1 (not .cg) after the count", "decode_attn_one_kernel"
    return ptx, "decode_attn_one_kernel"

def split(case):
    c, S = _sizes(case)
    return compile_sm90(ak.decode_attn_split_kernel, dict(PTRS), c, ALIGNED), "decode_attn_split_kernel"

def combine(case):
    c, S = _sizes(case)
    c = dict(G=8, BLOCK_G=16, DV=c["DV"], BLOCK_DV=c["BLOCK_DV"], SPLITS=S, S_PAD=max(2, triton.next_power_of_2(S)),
             HAS_SINKS="sinks" in case)
    ptx = compile_sm90(ak.decode_attn_combine_kernel, dict(PTRS), c, ("po_ptr", "pm_ptr", "pl_ptr", "out_ptr"))
    return (ptx if "ld.global.cg" not in ptx and "atom." not in ptx else "the combine changed its loads"), \
        "decode_attn_combine_kernel"

out = {}
for kind, fn in (("one", one), ("split", split), ("combine", combine)):
    for case in json.loads(sys.argv[1]).get(kind, []):
        try:
            ptx, name = fn(case)
            out[f"{kind}: {case}"] = ("ok" if f".entry {name}" in ptx else
                                      ptx if len(ptx) < 300 else "no entry in the PTX")
        except Exception as e:
            out[f"{kind}: {case}"] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"one": ["S9", "S9 sinks", "S33 sinks d64", "S3", "S1 sinks", "S1"],
         "split": ["S9", "S1 d64"],
         "combine": ["S9", "S33 sinks"]}


def test_decode_attention_kernels_compile_for_sm90():
    res = compile_cases(CHILD, CASES)
    assert len(res) == sum(len(v) for v in CASES.values())
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
