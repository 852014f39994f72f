"""Decode kernels compiled for Hopper (sm_90) on this CPU machine: ``triton.compile`` to PTX needs no GPU, and
catches what the interpreter lets through (a ``None`` pointer in arithmetic on a branch the compiler keeps: the
first GPU run of the skinny experts of 58ebe4d failed so, and this test, written against them, failed on it). One
case per shape of the constexpr branches the op launches: the skinny linear (16-bit, e4m3 block / channel scales)
and the fused decode down-combine (16-bit; e4m3 weight-only with zero experts, unweighted, a gated shared expert).
All compiled in one child process (the tests run under TRITON_INTERPRET=1, whose jit functions do not compile)."""

import json
import os
import subprocess
import sys

import pytest

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moecomp.kernels import decode as dk
from moecomp.kernels import skinny as sk

W = {"bf16": "*bf16", "fp8": "*fp8e4nv"}

def compile_sm90(fn, pointers, constexprs):
    params = list(inspect.signature(fn.fn).parameters)
    sig, const = {}, {}
    for i, p in enumerate(params):
        if p in constexprs:
            sig[p] = "constexpr"
            const[(i,)] = constexprs[p]
        else:
            sig[p] = pointers.get(p, "i32")
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32)).asm["ptx"]

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

out = {}
for kind, fn in (("skinny", skinny), ("down", down)):
    for case in json.loads(sys.argv[1])[kind]:
        try:
            ptx, name = fn(case)
            out[f"{kind}: {case}"] = "ok" if f".entry {name}" in ptx else "no entry in the PTX"
        except Exception as e:
            out[f"{kind}: {case}"] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"skinny": ["bf16 bias", "fp8 block rows4 reduce_step", "fp8 channel ue8m0"],
         "down": ["bf16 plain", "bf16 shared bias zero unweighted", "fp8 block fold shared zero"]}


def test_decode_kernels_compile_for_sm90():
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("this Triton has no NVIDIA backend")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == sum(len(v) for v in CASES.values())
    bad = {c: v for c, v in res.items() if v != "ok"}
    assert not bad, json.dumps(bad, indent=1)
