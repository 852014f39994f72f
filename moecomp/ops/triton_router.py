"""The router at a few tokens, on CUDA (and the interpreter): its GEMV.

    router_logits    x [T, H] -> logits [T, E (+ G)], gate [T] | None      (router_gemv up to ROUTER_GEMV_MAX_T tokens,
                                                                            F.linear above)

The routing itself is the next launch (``kernels/routing.route_topk_kernel``). A form with the GEMV and the routing in
one launch (the router rows split over programs, the last program to count on a per-device counter routing every
token) was built and measured on the H100 (73ca285, 1c088c1): 1.27-1.68x the two launches' time at T = 1 and a B = 1
Qwen3-30B-A3B step 1.045x slower, so it was removed (docs/ARCHITECTURE.md, "Fewer launches per decoder layer").
"""

from __future__ import annotations

import os

import torch
import triton

from ..core.spec import MoESpec
from ..kernels import router as router_k
from .common import sm_count as _sm_count

ROUTER_GEMV_MAX_T = 4  # up to this many tokens the router GEMM is our GEMV kernel (MOECOMP_ROUTER_GEMV_MAX_T)


def launch_options(device: torch.device) -> dict:
    """The launch options (programmatic dependent launch) on ``device``: ``triton_moe`` sets this to its ``_pdl``
    when it imports this module (it imports this module, so this one cannot import it)."""
    return {}


def _unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 or t.numel() <= 1 else t.contiguous()


def _gemv_max_t() -> int:
    return int(os.environ.get("MOECOMP_ROUTER_GEMV_MAX_T", ROUTER_GEMV_MAX_T))

def router_logits(x: torch.Tensor, args: dict, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Router GEMM, fused with the shared-expert gate GEMM when there is one. Returns (logits [T, E], gate [T]).

    Up to ``ROUTER_GEMV_MAX_T`` tokens this is ``router_gemv`` (one launch, no converted or concatenated weight);
    above, ``torch.nn.functional.linear``, where weights are used as given: an fp32 router (``spec.router_fp32``)
    over 16-bit weights converts them here on every call, and a separate gate is concatenated here on every call.
    The op caches nothing derived from its inputs (a cached tensor made while compiled code runs inside Inductor's
    CUDA-graph trees would live in the tree's pool, untracked); callers that call often pass the fused / converted
    weights (the bound HF blocks keep them as buffers, the FSE pass concatenates in the graph)."""
    rw, rb, gw = args["router_w"], args["router_b"], args["shared_gate_w"]
    E = spec.router_width  # the experts (+ zero experts)
    want = torch.float32 if spec.router_fp32 else x.dtype
    if x.shape[0] <= _gemv_max_t():
        logits = router_gemv(x, rw, rb, gw, want)
    else:
        xs = x if x.dtype == want else x.to(want)
        if gw is not None:
            rw = torch.cat([rw, gw.to(rw.dtype)], 0)  # [E + 1, H]
            if rb is not None:
                rb = torch.cat([rb, rb.new_zeros(1)])
        rw = rw if rw.dtype == want else rw.to(want)
        if rb is not None and rb.dtype != want:
            rb = rb.to(want)
        logits = torch.nn.functional.linear(xs, rw, rb)  # [T, E] or [T, E + 1]
    if spec.fused_shared_gate or gw is not None:
        return _scaled(logits[:, :E], spec), logits[:, E]
    return _scaled(logits, spec), None


def _scaled(logits: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """``spec.router_scale`` times the logits, in their dtype (the gate's logit is not scaled)."""
    return logits * spec.router_scale if spec.router_scale != 1.0 else logits


def router_gemv(x, rw, rb, gw, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] . [rw; gw]^T (+ [rb; 0]) -> logits [T, R] in ``out_dtype`` (R = rw's rows, + 1 with a gate row gw
    [1, H]), as ``linear`` on the operands converted to out_dtype (``kernels/router.py``). One program per token and
    BLOCK_R rows, BLOCK_R chosen for about two programs per SM.

    Measured on an H200 against linear (``diag_kernels.py --parts router``, 3909dcb; CUDA-graph replays): the
    router alone 5.2-9.3 us against 8.7-20.2 at T=1 on all five presets, and the whole op at T=1 to 4 as fast or
    faster (Qwen3 T=1 38.5 against 41.5 us); from T=8 cuBLAS wins on Qwen3 and DeepSeek-V3 (10.7 against 9.0 us,
    46 against 34), hence ``ROUTER_GEMV_MAX_T`` = 4."""
    T, H = x.shape
    E = rw.shape[0]
    R = E + (gw is not None)
    if out is None:
        out = torch.empty(T, R, dtype=out_dtype, device=x.device)
    if T == 0:
        return out
    x, rw, rb = _unit_stride(x), _unit_stride(rw), _unit_stride(rb)
    gw = None if gw is None else _unit_stride(gw.reshape(-1))
    block_r = max(1, min(16, triton.next_power_of_2(triton.cdiv(T * R, 2 * _sm_count(x.device)))))
    block_h = min(1024 // block_r, triton.next_power_of_2(H))
    router_k.router_gemv_kernel[(T * triton.cdiv(R, block_r),)](
        x, rw, gw, rb, out, E, R, H, x.stride(0), rw.stride(0), out.stride(0),
        HAS_GATE=gw is not None, HAS_BIAS=rb is not None, BLOCK_R=block_r, BLOCK_H=max(16, block_h), num_warps=4,
        **launch_options(x.device),
    )
    return out
