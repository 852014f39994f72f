"""The router at a few tokens, on CUDA (and the interpreter): its GEMV, and the GEMV with the routing in one launch.

    router_logits    x [T, H] -> logits [T, E (+ G)], gate [T] | None      (router_gemv up to ROUTER_GEMV_MAX_T tokens,
                                                                            F.linear above)
    router_topk      x [T, H] -> logits and ids [T, k], weights [T, k] in ONE launch (``kernels/router.py:
                     router_topk_kernel``): T <= FUSED_MAX_T, the decode step's routing; the op's two-kernel path
                     (router_gemv, then route_topk) otherwise, and unless MOECOMP_FUSED_ROUTER=1 (opt-in until measured)

The fused kernel splits the router rows over its programs (each reads its W rows once for all T tokens); the program
that counts last on a per-device counter (``_counter``: zero between launches, so the launch is capturable and
replays as captured) routes all T tokens with ``route_topk_kernel``'s own body. Why this form and not one program per
token: a decode step's router is E * H = 0.26M (Qwen3-30B-A3B) to 1.8M (DeepSeek-V3) weights: one program streams
about 60-100 GB/s, 5-50 us for that, where the split reads it at the GEMV's speed (5-9 us measured for router_gemv on
the H200), and the counter costs one L2 atomic per program. What it saves is the routing kernel's launch and its own
prologue (about 3.5 us a layer in the gpt-oss profile, BENCHMARKS.md "4-bit experts, third pass"). The rows are
split as ``router_gemv`` splits them (about one program an SM; Mixtral's 8 rows: 8 programs); a router of at most
``FUSED_SINGLE_BYTES`` (a few K steps for one program) runs as one program, without the counter.

Every routing feature of ``route_topk_kernel`` runs in the fused launch (its arguments are passed through:
scorings, correction bias, groups, sparsemixer, hash routing, shared gammas, expert / weight scales, rounding,
routes replay (GIVEN) and record (REC_IDS / REC_W), and an expert capacity's kernel spec). Falls back to the two
kernels: ``spec.router_scale`` != 1 (the logits are scaled in torch between the two), more than FUSED_MAX_T tokens,
and a first call while a CUDA graph is being captured (the counter is made outside captures). Two fused launches must
not run at the same time on one device (on two streams): they would share the counter.
"""

from __future__ import annotations

import os

import torch
import triton

from ..core.spec import MoESpec
from ..kernels import router as router_k
from .common import sm_count as _sm_count

ROUTER_GEMV_MAX_T = 4  # up to this many tokens the router GEMM is our GEMV kernel (MOECOMP_ROUTER_GEMV_MAX_T)
FUSED_MAX_T = 4  # the fused kernel's token rows (one accumulator each)
FUSED_SINGLE_BYTES = 16 << 10  # routers up to this many weight bytes run as one program (no counter)


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




# --------------------------------------------------------------------------------------------- fused GEMV + routing
def fused_refusal(x: torch.Tensor, spec: MoESpec) -> str | None:
    """Why x [T, H]'s routing takes the two kernels (None: the fused launch takes it)."""
    if os.environ.get("MOECOMP_FUSED_ROUTER", "0") != "1":  # opt-in until measured on a GPU (ARCHITECTURE)
        return "off (MOECOMP_FUSED_ROUTER=1 turns it on)"
    T = x.shape[0]
    if not 1 <= T <= min(FUSED_MAX_T, _gemv_max_t()):
        return f"{T} tokens (the fused launch takes 1..{min(FUSED_MAX_T, _gemv_max_t())})"
    if spec.router_scale != 1.0:
        return "router_scale (the logits are scaled between the GEMV and the routing)"
    return None


_counters: dict = {}


def _counter(device: torch.device) -> torch.Tensor | None:
    """The device's launch counter (int32 [1], zero), made on first use; None while a CUDA graph is being captured
    and none exists yet (then the two kernels run). Made on a stream of its own, so that it never comes from a graph
    pool that owns the caller's stream (Inductor's CUDA-graph trees allocate from theirs while they warm up)."""
    key = (device.type, device.index)
    c = _counters.get(key)
    if c is not None:
        return c
    if device.type != "cuda":
        c = torch.zeros(1, dtype=torch.int32, device=device)
    elif torch.cuda.is_current_stream_capturing():
        return None
    else:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            c = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).wait_stream(side)
    _counters[key] = c
    return c


def logits_buffer(x: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor | None:
    """The [T, R] logits the fused launch will write (R = the router's rows, + 1 with a separate gate row), or None
    when its routing takes the two kernels (``fused_refusal``, no counter)."""
    if fused_refusal(x, spec) is not None or _counter(x.device) is None:
        return None
    R = args["router_w"].shape[0] + (args["shared_gate_w"] is not None)
    return torch.empty(x.shape[0], R, dtype=torch.float32 if spec.router_fp32 else x.dtype, device=x.device)


def router_topk(x: torch.Tensor, args: dict, spec: MoESpec, logits: torch.Tensor, route_args: tuple,
                route_kw: dict) -> torch.Tensor | None:
    """One launch: x [T, H] (T <= FUSED_MAX_T) -> ``logits`` (from ``logits_buffer``) and the routing of
    ``route_args`` / ``route_kw`` (``triton_moe.route_args`` on those logits: its ids / weights are written).
    Returns the shared-expert gate's logit [T] (None without a gate row), as ``router_logits`` does."""
    rw, rb, gw = _unit_stride(args["router_w"]), _unit_stride(args["router_b"]), args["shared_gate_w"]
    gw = None if gw is None else _unit_stride(gw.reshape(-1))
    x = _unit_stride(x)
    T, H = x.shape
    EW, R = rw.shape[0], logits.shape[1]
    single = R * H * rw.element_size() <= FUSED_SINGLE_BYTES
    block_r = triton.next_power_of_2(R) if single else \
        max(1, min(16, triton.next_power_of_2(triton.cdiv(R, _sm_count(x.device)))))
    block_h = max(16, min(max(16, (2048 if single else 1024) // block_r), triton.next_power_of_2(H)))
    kw = dict(route_kw, num_warps=4)
    route_t = triton.next_power_of_2(T)  # the last program routes every token
    kw.update(BLOCK_T=route_t)
    router_k.router_topk_kernel[(triton.cdiv(R, block_r),)](
        x, rw, gw, rb, _counter(x.device), EW, R, H, x.stride(0), rw.stride(0),
        T, gw is not None, rb is not None, block_r, block_h, single, *route_args, **kw)
    E = spec.router_width
    return logits[:, E] if spec.fused_shared_gate or gw is not None else None
