"""The Gluon FP8 launchers (``ops/triton_fp8_gluon.gemm1`` / ``gemm2``) called as the op calls them, on CPU tensors,
through this Triton's own runtime (binder, argument specialization, descriptor typing, constexprs, num_warps) up to
the point where it would compile: the kernel it asks for is then compiled for sm_90 here (no GPU). That is the
launch path a GPU takes, checked offline on every Triton the project meets (3.6 on the GPU machine, 3.9 here), not a
hand-written signature. Run without TRITON_INTERPRET.

The runtime is held by two documented doors: ``triton.runtime.driver.set_active`` (a stand-in answering "device 0,
stream 0, target cuda sm_90") and ``triton.knobs.runtime.jit_cache_hook`` (called with the compile request before
the runtime compiles; returning True makes it skip compiling and launching)."""

from __future__ import annotations

import contextlib

import torch

SM90 = ("cuda", 90, 32)


class _OfflineDriver:
    """Just enough of a Triton driver for ``JITFunction.run`` to bind arguments: one sm_90 device, stream 0."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*SM90)


@contextlib.contextmanager
def offline_runtime():
    """Inside: kernel launches bind their arguments for an sm_90 stand-in and stop before compiling; yields the list
    the requests land in, each (JITFunction, its compile request: signature, constants, configs, num_warps, ...)."""
    from triton import knobs
    from triton.runtime import driver

    asked = []

    def hook(*, fn, compile, **_):
        asked.append((fn.jit_function, compile))
        return True  # the runtime skips compiling and launching

    old_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_OfflineDriver())
    knobs.runtime.jit_cache_hook = hook
    try:
        yield asked
    finally:
        knobs.runtime.jit_cache_hook = old_hook
        try:
            driver.reset_active()
        except RuntimeError:  # no GPU driver here: back to "not chosen yet", as before
            driver.set_active(None)


def compile_request(fn, req: dict):
    """The compiled kernel (``.asm["ptx"]``, ``.metadata.shared``) for one request ``offline_runtime`` caught."""
    import triton
    from triton.backends.compiler import GPUTarget

    from .gluon_sm90 import ast_source

    src = ast_source()(fn, req["signature"], req["constants"], req["configs"][0])
    opts = dict(num_warps=req["num_warps"], num_ctas=req["num_ctas"], num_stages=req["num_stages"])
    return triton.compile(src, target=GPUTarget(*SM90), options=opts)


def launch_gemm2(bm: int = 64, H: int = 256, I: int = 768, ue8m0: bool = False, bias: bool = False):
    """``triton_fp8_gluon.gemm2`` on a small CPU case (2 experts, every row aligned to ``bm``): the compiled kernel
    its launch asks for, and the request (signature, constants)."""
    from ..ops import triton_fp8_gluon as fg

    E, S, P = 2, 2 * bm, 2 * bm - 3
    hq = torch.zeros(S, I, dtype=torch.float8_e4m3fn)
    hs = torch.ones(S, I // 128)
    w2 = torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
    ws = torch.ones(E, H // 128, I // 128)
    if ue8m0:
        ws = torch.full(ws.shape, 127, dtype=torch.uint8)
    aligned = (torch.arange(S, dtype=torch.int32), torch.arange(E, dtype=torch.int32),
               torch.tensor([S], dtype=torch.int32), E)
    q = dict(ws_ptr=ws, stride_se=ws.stride(0), stride_sn=ws.stride(1), stride_sk=ws.stride(2), Q_BLOCK_N=128,
             UE8M0=ue8m0)
    b2 = torch.zeros(E, H, dtype=torch.bfloat16) if bias else None
    y = torch.empty(P, H, dtype=torch.bfloat16)
    with offline_runtime() as asked:
        fg.gemm2(hq, dict(as_ptr=hs, stride_am=hs.stride(0)), w2, b2, torch.ones(P), aligned, P, bm, q, y, {})
    return _one(asked)


def launch_gemm1(bm: int = 64, H: int = 256, I: int = 256, h_quant: bool = False, act: str = "silu",
                 bias: bool = False, w_on_input: bool = False):
    """``triton_fp8_gluon.gemm1`` on a small CPU case (``gluon_gemm1_case.make_case1``, x quantized in sorted
    order as ``triton_fp8_tma`` hands it over): the compiled kernel its launch asks for, and the request."""
    from ..ops import triton_fp8_gluon as fg
    from ..ops.triton_fp8 import QAct
    from ..ops.weight_on_input import gemm1_kwargs
    from .gluon_gemm1_case import make_case1

    c = make_case1(2, H, I, [bm - 5, bm + 3], bm, act=act, bias=bias, w_on_input=w_on_input, h_quant=h_quant,
                   device="cpu")
    S = c["aligned"][0].numel()
    xa = QAct(torch.zeros(S, H, dtype=torch.float8_e4m3fn), torch.ones(S, H // 128), torch.bfloat16)
    wk = gemm1_kwargs(c["spec"], c["weights"])
    with offline_runtime() as asked:
        fg.gemm1(xa, c["w13"], c["b13"], c["spec"], c["aligned"], c["P"], bm, c["q"], wk, torch.bfloat16)
    return _one(asked)


def _one(asked: list):
    if len(asked) != 1:
        raise RuntimeError(f"one kernel launch expected, the runtime was asked for {len(asked)}")
    fn, req = asked[0]
    return compile_request(fn, req), req
