"""``MoESpec.zero_experts`` on the Triton path (LongCat-Flash): the router has E + Z outputs, and a (token, slot)
pair whose id is >= E is a zero-computation expert: it adds ``weight * x`` to its token and reads no weights.

    route_topk_kernel                 over the E + Z logits (``spec.router_width``): ids in [0, E + Z)
    align kernels                     pairs whose id is outside [0, E) are left out (always, no flag): the aligned
                                      gemm1 / gemm2 never read an expert past the weights, their h / y rows for such
                                      pairs are never written
    moe_gemm1 / moe_gemm2, DIRECT     ZERO_EXPERTS + n_experts: such a pair's programs return at once
    combine_kernel                    ZERO_EXPERTS: those slots' y rows are not read; sum_j [id_j >= E] w_j * x[t]
                                      joins the same fp32 sum (one store)
    moe_down_combine_kernel           ZERO_EXPERTS: such a slot adds w_j * x[t] instead of its dot (a uniform branch)

Pairs an expert capacity dropped take the same way (``ops/capacity.py``: id E, weight 0).
Nothing reads the ids on the host and every buffer keeps its worst-case size (as if no pair were a zero expert's),
so the op stays capturable in a CUDA graph. With ``weight_on_input`` the term is the same (identity of w * x,
summed unweighted). The flags default off, so launches of other specs compile as before.

The torch path (``ops/torch_moe.py``) and the parallel path's exchange (``parallel/ep.py``) add the same term in torch:
``zero_term``.
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec


def zero_term(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """fp32 [T, H]: what the zero experts add to each token of x [T, H], ``(sum of its pairs' weights with id >= E)
    * x``. The weights of the other pairs are not read (a NaN there stays out)."""
    z = weights.float().masked_fill(ids < spec.num_experts, 0.0)  # [T, k]: the zero experts' weights
    return x.float() * z.sum(dim=1, keepdim=True)


def _skips(spec: MoESpec) -> bool:
    """Some pairs have ids outside [0, E): zero experts', or those an expert capacity dropped (``ops/capacity.py``
    gives them id E and weight 0: the combine adds 0 * x)."""
    return bool(spec.zero_experts) or spec.has_capacity


def gemm_kwargs(spec: MoESpec) -> dict:
    """Extra launch arguments of moe_gemm1_kernel / moe_gemm2_kernel: {} unless ``spec.zero_experts`` (read in
    DIRECT mode only; the aligned mode never sees such pairs)."""
    return dict(ZERO_EXPERTS=True, n_experts=spec.num_experts) if _skips(spec) else {}


def combine_kwargs(spec: MoESpec, x: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor) -> dict:
    """Extra launch arguments of combine_kernel: {} unless ``spec.zero_experts``; then x [T, H] (unit column
    stride), the flat ids [T * k] and their fp32 weights."""
    if not _skips(spec):
        return {}
    x = _need_x(x, "the combine")
    ids, weights = _flat(ids), _flat(weights.float())
    return dict(x_ptr=x, ids_ptr=ids, w_ptr=weights, stride_x=x.stride(0), n_experts=spec.num_experts,
                ZERO_EXPERTS=True)


def down_kwargs(spec: MoESpec, x: torch.Tensor | None) -> dict:
    """Extra launch arguments of moe_down_combine_kernel: {} unless ``spec.zero_experts``."""
    if not _skips(spec):
        return {}
    x = _need_x(x, "the decode down-combine")
    return dict(x_ptr=x, stride_xm=x.stride(0), n_experts=spec.num_experts, ZERO_EXPERTS=True)


def _need_x(x: torch.Tensor | None, who: str) -> torch.Tensor:
    if x is None:
        raise ValueError(f"{who} of a zero_experts spec needs the routed input (x=..., [T, H]): a zero expert's "
                         "output is its token")
    return x if x.stride(-1) == 1 else x.contiguous()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T * k] with unit stride."""
    flat = t.reshape(-1)
    return flat.contiguous() if flat.numel() > 1 and flat.stride(0) != 1 else flat
