"""``torch.ops.moecomp.linear_add_norm``: a skinny linear, the residual add after it and the RMSNorm of the sum, in
one launch at decode rows.

    a = linear(x, weight, bias)                  x [..., K], weight [N, K] (16-bit of x's dtype, or e4m3 weight-only)
    h = residual + a                             residual [..., N] of x's dtype: the next residual stream
    n = rmsnorm(h) * gw,  gw = norm_weight or 1 + norm_weight (``offset``, Gemma-style); ``round_unit`` below
    returns (h, n)

The generate engine's decode-step pass (``generate/fuse_oproj.py``) puts one call where a decoder layer's attention
output projection fed only the residual add before the post-attention RMSNorm (whose user is the MoE block, not a
linear: ``fuse_norm`` leaves it). ``weight`` / ``bias`` / ``weight_scale`` / ``quant`` are ``skinny_group``'s member
arguments ("" and no scale for 16-bit weights, else the e4m3 weight's QuantSpec key, no static activation scale).

Rounding (dt = x's dtype), as the unfused graph rounds: a = dt(x @ W^T + b), h = dt(residual + a), u = h32 * rs
with rs = rsqrt(mean(h32^2) + eps) in fp32, then ``round_unit`` True (transformers' Llama / Qwen norm: ``w *
(h32 * rsqrt).to(dt)``) n = dt(gw * dt(u)), False (Gemma's ``(h32 * rsqrt * (1 + w32)).to(dt)``, gpt-oss's ``(w *
h32 * rsqrt).to(dt)``) n = dt(u * gw); the pass reads which from the graph (a cast to dt between the rsqrt's
multiply and the weight's). The one launch (``kernels/linear_add_norm.py``) computes a with the skinny kernel's
tiles (``skinny.skinny_config``: the same K steps, so a and h are the unfused skinny linear's and add's bit for
bit); n may differ from torch's by the sum of squares' order (a unit in dt's last place on some elements).

One launch where the linear would take the skinny kernel on its own (``linear_group.one_launch``) at most
``fused_rows()`` rows (``MOECOMP_FUSE_OPROJ_ROWS``, default 4: the kernel's row slots) and the device's counter
exists; otherwise (CPU, more rows, a first call inside a CUDA graph capture, ``MOECOMP_SKINNY=0``) the unfused
computation in torch (the linear through its own op), each such call counted in ``moecomp.counters
["linear_add_norm"]`` under "unfused: <why>" ("fused" counts the launches). The counter follows the fused router's
rules (``ops/triton_router._counter``): one int32 per device, zero between launches, made outside captures on a
stream of its own; two launches on two streams of one device at once would race (nothing in moecomp does that).

No autograd: a decode-step op.
"""

from __future__ import annotations

import math
import os

import torch

from ..core.counters import counters
from ..core.spec import QuantSpec
from .linear_group import check_members, group_quant, one_launch, run_member

MAX_ROWS = 4  # the kernel's row slots
ROWS_ENV = "MOECOMP_FUSE_OPROJ_ROWS"


def fused_rows() -> int:
    """Rows up to which the op (and the pass, ``generate/fuse_oproj``) takes the one launch: MOECOMP_FUSE_OPROJ_ROWS,
    default MAX_ROWS (unmeasured: the lead limits the norm fold to 2 rows where 4 measured slower)."""
    v = int(os.environ.get(ROWS_ENV, MAX_ROWS))
    if not 0 <= v <= MAX_ROWS:
        raise ValueError(f"{ROWS_ENV} must be 0..{MAX_ROWS}, got {v}")
    return v


def quant_spec(quant: str) -> QuantSpec | None:
    try:
        return group_quant(quant)
    except ValueError as e:
        raise ValueError(f"linear_add_norm: {e}") from None


def _check(x, weight, bias, weight_scale, q, residual, norm_weight, eps) -> None:
    if x.dim() < 1 or not x.dtype.is_floating_point:
        raise ValueError(f"linear_add_norm: x must be a floating tensor [..., K], got {tuple(x.shape)} of {x.dtype}")
    check_members("linear_add_norm", 1, x, [weight], [bias], [weight_scale], q)
    N = weight.shape[0]
    want = (*x.shape[:-1], N)
    if tuple(residual.shape) != want or residual.dtype != x.dtype:
        raise ValueError(f"linear_add_norm: residual must be {list(want)} (x's rows, the weight's {N} outputs) of "
                         f"{x.dtype}, got {tuple(residual.shape)} of {residual.dtype}")
    if norm_weight.shape != (N,) or not norm_weight.dtype.is_floating_point:
        raise ValueError(f"linear_add_norm: norm_weight must be a floating [{N}] (the weight's outputs), got "
                         f"{tuple(norm_weight.shape)} of {norm_weight.dtype}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"linear_add_norm: eps must be a finite number >= 0, got {eps}")


def normalized(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: bool,
               round_unit: bool) -> torch.Tensor:
    """The norm in torch with the kernel's rounding (module docstring)."""
    hf = h.float()
    unit = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
    if round_unit:
        unit = unit.to(h.dtype).float()
    return (unit * (norm_weight.float() + 1.0 if offset else norm_weight.float())).to(h.dtype)


def refusal(x: torch.Tensor, weight: torch.Tensor, q: QuantSpec | None) -> str | None:
    """Why the call takes the unfused computation (None: the one launch), decided on shapes, dtypes and the device."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= fused_rows():
        return f"{rows} rows (one launch takes 1..{fused_rows()}, {ROWS_ENV})"
    if not one_launch(x, [weight], q):
        return "the linear does not take the skinny kernel (CPU, these rows, MOECOMP_SKINNY=0)"
    return None


_counters: dict = {}


def _counter(device: torch.device) -> torch.Tensor | None:
    """The device's launch counter (int32 [1], zero), made on first use; None while a CUDA graph is being captured
    and none exists yet. Made on a stream of its own, so that it never comes from a graph pool that owns the
    caller's stream."""
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


def launch(x2, weight, bias, weight_scale, q, r2, norm_weight, eps: float, offset: bool, round_unit: bool,
           counter=None, cfg: dict | None = None, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one launch on x2 [M, K] (M <= MAX_ROWS) and r2 [M, N] (unit stride along K / N): (h, n) [M, N]. ``cfg``:
    explicit tiles (a benchmark's), else the skinny linear's (``skinny_config``) and the last program's BLOCK_D
    columns (4096 / M rounded up to a power of two, at most N rounded so: 32 fp32 registers a thread for its h
    tile at 4 warps, not to raise the kernel's register count above the K loop's; one step a pass up to N = 4096 at
    one row, 2048 at two);
    ``counter``: an int32 [1] zero (else the device's); ``out``: (h, n) buffers [M, N] of unit column stride."""
    import triton

    from ..kernels import linear_add_norm as lan_k
    from . import skinny
    from .common import sm_count

    M, K = x2.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"linear_add_norm: x must have 1..{MAX_ROWS} rows, got {M}")
    if weight.stride(-1) != 1:
        raise ValueError(f"linear_add_norm: weight must have unit stride along K, got strides {weight.stride()}")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    bias = bias if bias is None or bias.stride(-1) == 1 else bias.contiguous()
    g = norm_weight if norm_weight.stride(-1) == 1 else norm_weight.contiguous()
    if cfg is None:
        cfg = skinny.skinny_config(M, N, K, weight.element_size(), x2.device, sm_count(x2.device))
        cfg = dict(cfg, BLOCK_D=min((4096 if x2.is_cuda else 64) // triton.next_power_of_2(M),
                                    triton.next_power_of_2(N)))
    ws, s_n, s_k, meta = skinny.weight_args("linear_add_norm", weight_scale, q, cfg)
    grid = triton.cdiv(N, cfg["BLOCK_N"])
    if grid > 1 and counter is None:
        counter = _counter(x2.device)
        if counter is None:
            raise ValueError("linear_add_norm: no counter on this device yet (a first call inside a capture)")
    h, n = out if out is not None else (torch.empty(M, N, dtype=x2.dtype, device=x2.device), None)
    n = torch.empty_like(h) if n is None else n
    if any(tuple(t.shape) != (M, N) or t.dtype != x2.dtype or t.stride(-1) != 1 for t in (h, n)):
        raise ValueError(f"linear_add_norm: out must be two [{M}, {N}] buffers of {x2.dtype}, unit column stride")
    lan_k.linear_add_norm_kernel[(grid,)](
        x2, weight, ws, bias, r2, h, g, n, counter, float(eps), N, K, x2.stride(0), weight.stride(0), s_n, s_k,
        r2.stride(0), h.stride(0), n.stride(0), ROWS=M, HAS_BIAS=bias is not None, OFFSET=bool(offset),
        ROUND_UNIT=bool(round_unit), ROWS_PAD=triton.next_power_of_2(M), BLOCK_D=cfg["BLOCK_D"],
        SINGLE=grid == 1, **meta, **skinny.launch_options(x2.device))
    return h, n


@torch.library.custom_op("moecomp::linear_add_norm", mutates_args=())
def linear_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_scale: torch.Tensor | None, quant: str, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, offset: bool, round_unit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q = quant_spec(quant)
    _check(x, weight, bias, weight_scale, q, residual, norm_weight, eps)
    why = refusal(x, weight, q)
    if why is None and x.is_cuda and _counter(x.device) is None:
        why = "a first call inside a CUDA graph capture (no counter yet)"
    c = counters["linear_add_norm"]
    if why is not None:
        c[f"unfused: {why}"] += 1
        h = residual + run_member(x, weight, bias, weight_scale, q)
        return h, normalized(h, norm_weight, eps, offset, round_unit)
    c["fused"] += 1
    K, N = x.shape[-1], weight.shape[0]
    h, n = launch(x.reshape(-1, K), weight, bias, weight_scale, q, residual.reshape(-1, N), norm_weight, eps,
                  offset, round_unit)
    return h.reshape(residual.shape), n.reshape(residual.shape)


@linear_add_norm.register_fake
def _(x, weight, bias, weight_scale, quant, residual, norm_weight, eps, offset, round_unit):
    _check(x, weight, bias, weight_scale, quant_spec(quant), residual, norm_weight, eps)
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)
