"""Offline (no GPU) checks of the Gluon FP8 GEMMs (``kernels/gluon_fp8.py``, ``gluon_fp8_gemm1.py``) for sm_90:
their PTX from ``triton.compile`` with an explicit target, and, where this Triton ships a ptxas that reads that
PTX, the SASS: the overlap the kernels are for exists only if ptxas keeps ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (one
wgmma in flight while the previous step's product is promoted) and reports no serialization (C7514: an in-flight
accumulator read by a non-wgmma instruction, e.g. a phi copy; C7512: too few registers). Run it without
TRITON_INTERPRET (the interpreter's jit functions do not compile)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

LOOP_WAIT = "wgmma.wait_group.sync.aligned 1"


def _desc(block):
    """The signature type of the descriptor the launcher (``ops/triton_fp8_gluon.tma_desc``) passes for a ``block``
    box: as the runtime types it (``mangle_type``, 3.6 and 3.9), else the descriptor's own ``__mangle__``."""
    import torch

    from ..ops.triton_fp8_gluon import tma_desc

    d = tma_desc(torch.empty(256, 256, dtype=torch.float8_e4m3fn), 256, block)
    try:
        from triton.runtime.jit import mangle_type
    except ImportError:  # pragma: no cover - a Triton without it
        return d.__mangle__()
    return mangle_type(d)


def ast_source():
    """Gluon's ASTSource class: exported by ``triton.experimental.gluon`` (3.9) or only in its ``_runtime`` (3.6)."""
    from triton.experimental import gluon

    if hasattr(gluon, "GluonASTSource"):
        return gluon.GluonASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource


def _compile(kernel, ptr: dict, const: dict, num_warps: int):
    """The Gluon ``kernel`` compiled for sm_90 (``.asm["ptx"]``, ``.metadata.shared``): pointer / descriptor types
    from ``ptr``, constexprs from ``const`` (None-valued ones too), every other argument an i32."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, cvals = {}, {}
    for i, p in enumerate(inspect.signature(kernel.fn).parameters):
        if p in const:
            sig[p], cvals[(i,)] = "constexpr", const[p]
        else:
            sig[p] = ptr.get(p, "i32")
    src = ast_source()(kernel, sig, cvals, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def compile_gemm2(bm: int = 64, bn: int = 128, stages: int = 4, chunk: int = 3, tail: int = 0, ue8m0: bool = False,
                  bias: bool = False, weighted: bool = True) -> str:
    """PTX of ``moe_gemm2_gluon_fp8_kernel`` for sm_90 at this tile (num_warps = bm // 16)."""
    from ..kernels import gluon_fp8 as gk

    ptr = dict(h_desc=_desc([bm, 128]), w_desc=_desc([bn, 128]), hs_ptr="*fp32", ws_ptr="*u8" if ue8m0 else "*fp32",
               b_ptr="*bf16", topk_w_ptr="*fp32", y_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
               num_padded_ptr="*i32")
    const = dict(Q_BLOCK_N=128, UE8M0=ue8m0, HAS_BIAS=bias, WEIGHTED=weighted, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
                 STAGES=stages, CHUNK=chunk, TAIL=tail)
    if not bias:
        const["b_ptr"] = None
    return _compile(gk.moe_gemm2_gluon_fp8_kernel, ptr, const, bm // 16).asm["ptx"]


def compile_gemm1(bm: int = 64, bn: int = 128, warps_n: int = 2, stages: int = 3, chunk: int = 2, tail: int = 0,
                  ue8m0: bool = False, bias: bool = False, q_out: int = 0, act: int = 0,
                  w_on_input: bool = False) -> tuple[str, int]:
    """(PTX, shared memory bytes) of ``moe_gemm1_gluon_fp8_kernel`` for sm_90 at this tile (num_warps = bm // 16 *
    warps_n)."""
    from ..kernels import gluon_fp8_gemm1 as gk

    ptr = dict(x_desc=_desc([bm, 128]), w_desc=_desc([bn, 128]), xs_ptr="*fp32", ws_ptr="*u8" if ue8m0 else "*fp32",
               b_ptr="*bf16", h_ptr="*fp8e4nv" if q_out else "*bf16", hs_ptr="*fp32", topk_w_ptr="*fp32",
               sorted_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32")
    const = dict(Q_BLOCK_N=128, UE8M0=ue8m0, HAS_BIAS=bias, ACT=act, Q_OUT=q_out, W_ON_INPUT=w_on_input, BLOCK_M=bm,
                 BLOCK_N=bn, BLOCK_K=128, WARPS_N=warps_n, STAGES=stages, CHUNK=chunk, TAIL=tail)
    const.update({name: None for name, on in (("b_ptr", bias), ("hs_ptr", q_out), ("topk_w_ptr", w_on_input))
                  if not on})
    k = _compile(gk.moe_gemm1_gluon_fp8_kernel, ptr, const, bm // 16 * warps_n)
    return k.asm["ptx"], k.metadata.shared


def loop_bodies(ptx: str) -> list[str]:
    """The PTX of each loop: from a loop header label (LLVM's "Loop Header" note on its line or the next) to the
    branch back to it."""
    out = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):(?:[^\n]*Loop Header[^\n]*\n|[^\n]*\n[^\n]*Loop Header[^\n]*\n)", ptx,
                         re.M):
        back = re.search(r"bra(?:\.uni)?\s+" + re.escape(m.group(1)) + ";", ptx[m.end():])
        if back:
            out.append(ptx[m.start():m.end() + back.end()])
    return out


def tool(name: str) -> str | None:
    import triton

    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    p = os.path.join(d, name)
    return p if os.path.exists(p) else None


def sass(ptx: str) -> tuple[str, str, str] | None:
    """cuobjdump -sass of ``ptx`` assembled for sm_90a by the first of this Triton's bundled ptxas that reads it:
    (SASS text, that ptxas's name, ptxas -v's notes: registers, spills); None where none reads this PTX. On 3.6
    ``ptxas`` (CUDA 12.8, the one that Triton uses for sm_90) reads its PTX 8.7; on 3.9 only ``ptxas-blackwell``
    reads PTX 9.x."""
    cuobjdump = tool("cuobjdump")
    for name in ("ptxas", "ptxas-blackwell"):
        ptxas = tool(name)
        if ptxas is None or cuobjdump is None:
            continue
        with tempfile.TemporaryDirectory() as d:
            src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True)
            if r.returncode != 0:
                continue  # e.g. a PTX version newer than this ptxas
            out = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
        return out, name, r.stderr
    return None


def sass_check(ptx: str) -> dict | None:
    """ptxas -v (sm_90a) on ``ptx`` and the SASS's wgmma waits: {"info": ptxas's notes, "depbar": {N: count of
    WARPGROUP.DEPBAR.LE gsb0, N}, "spill": spill store bytes, "ptxas": which (name and build)}; None where no
    shipped ptxas reads this PTX (``sass``)."""
    got = sass(ptx)
    if got is None:
        return None
    text, name, info = got
    depbar = {}
    for n in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)", text):
        depbar[int(n)] = depbar.get(int(n), 0) + 1
    spill = re.search(r"(\d+) bytes spill stores", info)
    version = subprocess.run([tool(name), "--version"], capture_output=True, text=True).stdout.strip()
    return dict(info=info, depbar=depbar, spill=int(spill.group(1)) if spill else 0,
                ptxas=f"{name} ({version.splitlines()[-1] if version else '?'})")
