"""Stacked shared experts and their router gammas on the Triton path (``SharedExpertSpec.stacked``,
``MoESpec.shared_gamma``, ``MoESpec.has_weight_scale``; Inkling).

    route_topk_kernel   N_GAMMA: the logits row [E + G] holds the G shared experts' logits after the E routed ones;
                        they join the renormalisation and come out as gammas [T, G] fp32 (scaled, rounded like the
                        weights); HAS_WSCALE: weights and gammas times the [1] weight_scale tensor, read on device
    shared experts      torch bmm over the stacked [S, ...] weights (read in place, no copy): ys [S, T, H] in x's
                        dtype, on the side stream beside the routed experts like a single shared expert
    before the combine  shared = sum_s gamma_s * ys[s] (* shared.scale), fp32 sum, into a [T, H] buffer the
                        combine reads as an ungated shared output (the join: after the routing and the side stream)

No host reads and sizes from shapes only: capturable in a CUDA graph like the rest of the op.
"""

from __future__ import annotations

import torch
import triton

from ..core.spec import MoESpec
from . import cpu_act


def stacked(spec: MoESpec) -> bool:
    """The shared experts take this module's path: stacked, or scaled by router gammas."""
    return spec.shared is not None and bool(spec.shared.stacked or spec.gamma_rows)


def gamma_buffer(spec: MoESpec, T: int, device) -> torch.Tensor | None:
    """The routing kernel's gamma output [T, G] fp32, or None without ``shared_gamma``."""
    return torch.empty(T, spec.gamma_rows, dtype=torch.float32, device=device) if spec.gamma_rows else None


def route_kwargs(spec: MoESpec, gammas: torch.Tensor | None, weight_scale: torch.Tensor | None) -> dict:
    """Extra launch arguments of route_topk_kernel: {} unless the spec has gammas or a weight scale."""
    kw = {}
    if spec.gamma_rows:
        if gammas is None:
            raise ValueError("routing a shared_gamma spec needs the gammas buffer (gamma_buffer)")
        kw.update(gammas_ptr=gammas, N_GAMMA=spec.gamma_rows, GAM_PAD=triton.next_power_of_2(spec.gamma_rows))
    if spec.has_weight_scale:
        if weight_scale is None:
            raise ValueError("routing a has_weight_scale spec needs the weight_scale tensor")
        kw.update(wscale_ptr=weight_scale, HAS_WSCALE=True)
    return kw


def shared_outputs(x: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    """Each shared expert's output, unscaled: x [T, H] -> ys [S, T, H] in x's dtype (torch bmm over the stacked
    weights; a 2-D expert is a stack of one). The activation in fp32, rounded to x's dtype for the down GEMM."""
    sh = spec.shared
    S, Is = sh.count, sh.intermediate_size
    w = {n: args.get(n) for n in ("shared_w1", "shared_w3", "shared_w2")}
    if not sh.stacked:
        w = {n: None if t is None else t[None] for n, t in w.items()}
    T, H = x.shape
    xs = x[None].expand(S, T, H)

    def lin(name):
        return torch.bmm(xs, w[name].transpose(1, 2))

    if not sh.gated:
        h = cpu_act.elementwise(lin("shared_w3").float(), sh.activation)
    else:
        if sh.layout == "concat":
            gu = lin("shared_w1")
            g, u = gu[..., :Is], gu[..., Is:]
        else:
            g, u = lin("shared_w1"), lin("shared_w3")
        h = cpu_act.gated(g.float(), u.float(), sh)
    return torch.bmm(h.to(x.dtype), w["shared_w2"].transpose(1, 2))


def weighted_sum(ys: torch.Tensor, gammas: torch.Tensor | None, spec: MoESpec, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum_s gammas[:, s] * ys[s] (gammas None: 1) * shared.scale, summed in fp32."""
    y = ys.float()
    if gammas is not None:
        y = y * gammas.t()[:, :, None]
    y = y.sum(0)
    if spec.shared.scale != 1.0:
        y = y * spec.shared.scale
    return out.copy_(y)
