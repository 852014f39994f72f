"""The skinny experts' kernels compiled for Hopper (sm_90) on this CPU machine: ``triton.compile`` to PTX needs no
GPU, and catches what the interpreter lets through (a ``None`` pointer in arithmetic on a branch the compiler
keeps, as the first GPU run of these kernels found). One case per shape of the constexpr branches the op launches;
all compiled in one child process (the tests run under TRITON_INTERPRET=1, whose jit functions do not compile)."""

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
from moecomp.kernels import skinny_moe as k

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

def gemm1(case):
    w = "fp8" if "fp8" in case else "bf16"
    ptr = dict(x_ptr="*bf16", w_ptr=W[w], b_ptr="*bf16", h_ptr="*bf16", ids_ptr="*i32", ws_ptr="*fp32",
               topk_w_ptr="*fp32")
    c = dict(TOP_K=8, GATE_STRIDE=1, GATED="ungated" not in case, ACT=0, CLAMP=False, HAS_BIAS="bias" in case,
             W_SCALE=1 if "block" in case else (2 if "channel" in case else 0), Q_BLOCK_N=128, Q_BLOCK_K=128,
             UE8M0=False, BLOCK_N=8, BLOCK_K=512, REDUCE_END=1, USE_PDL=2, W_ON_INPUT="on_input" in case,
             ZERO_EXPERTS="zero" in case)
    for name, on in (("b_ptr", "bias"), ("topk_w_ptr", "on_input"), ("ws_ptr", "fp8")):
        if on not in case:
            c[name] = None
    return compile_sm90(k.skinny_gemm1_kernel, ptr, c)

def down(case):
    w = "fp8" if "fp8" in case else "bf16"
    ptr = dict(h_ptr="*bf16", w_ptr=W[w], b_ptr="*bf16", ids_ptr="*i32", topk_w_ptr="*fp32", shared_ptr="*bf16",
               gate_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", x_ptr="*bf16")
    c = dict(TOP_K=8, HAS_BIAS="bias" in case, HAS_SHARED="shared" in case, HAS_GATE="gate" in case,
             W_SCALE=1 if w == "fp8" else 0, Q_BLOCK_N=128, Q_BLOCK_K=128, UE8M0=False, BLOCK_N=8, BLOCK_K=512,
             REDUCE_END=0, USE_PDL=2, WEIGHTED="unweighted" not in case, ZERO_EXPERTS="zero" in case)
    for name, on in (("b_ptr", "bias"), ("shared_ptr", "shared"), ("gate_ptr", "gate"), ("x_ptr", "zero"),
                     ("ws_ptr", "fp8")):
        if on not in case:
            c[name] = None
    return compile_sm90(k.skinny_down_kernel, ptr, c)

out = {}
for kind, fn in (("gemm1", gemm1), ("down", down)):
    for case in json.loads(sys.argv[1])[kind]:
        try:
            out[f"{kind}: {case}"] = "ok" if ".entry skinny_" in fn(case) else "no entry in the PTX"
        except Exception as e:
            out[f"{kind}: {case}"] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(out))
'''

CASES = {"gemm1": ["bf16 gated bias zero on_input", "fp8 block", "fp8 channel ungated"],
         "down": ["bf16 plain", "bf16 shared gate bias zero unweighted", "fp8 block shared"]}


def test_skinny_experts_compile_for_sm90():
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
