"""``MoESpec.weight_on_input`` on the Triton path (Llama 4; vLLM's ``apply_router_weight_on_input``): each (token,
expert) pair's expert runs on ``weight * x`` and the combine sums the expert outputs unweighted.

The kernels take it as constexpr flags, off by default (so the plain form compiles to what it did before):

    gemm1 (moe_gemm1_kernel, moe_gemm1_tma_kernel)   W_ON_INPUT + topk_w_ptr: its fp32 accumulator rows times their
                                                     pair's weight, before the bias and the activation. gemm1 is
                                                     linear in A, so this is (weight * x) . w; it costs one multiply
                                                     per output element where scaling the A loads would cost one per
                                                     loaded element per K step, and it is the same for the FP8 K loops
    gemm2, fused decode down + combine               WEIGHTED off: no weight multiply
    (moe_gemm2_kernel, moe_gemm2_tma_kernel, moe_down_combine_kernel)

FP8 experts: with activation "dynamic" the activation scale follows each row (``quant.quantize_act``), so
quantizing ``weight * x`` and quantizing ``x`` then scaling the product by the weight agree (up to rounding), and
weight-only ("none") is plain linearity; "static" scales do not follow the weight, and ``MoESpec`` refuses
``weight_on_input`` with them (``SpecError``).
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec


def gemm1_kwargs(spec: MoESpec, weights: torch.Tensor | None) -> dict:
    """Extra launch arguments of a gemm1 kernel: {} unless ``spec.weight_on_input``; then the routing weights
    (fp32, pair order, contiguous: [T, k] or [P]) and W_ON_INPUT."""
    if not spec.weight_on_input:
        return {}
    if weights is None:
        raise ValueError("gemm1 of a weight_on_input spec needs the routing weights (weights=..., [T, k] fp32 in "
                         "pair order): the expert input is weight * x")
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.float().contiguous()
    return dict(topk_w_ptr=weights, W_ON_INPUT=True)


def gemm2_kwargs(spec: MoESpec) -> dict:
    """Extra launch arguments of a gemm2 / decode down-combine kernel: WEIGHTED off for ``spec.weight_on_input``, and
    for ``spec.expert_norm`` (the norm-combine applies the weights after the norm, ``ops/triton_norm.py``)."""
    return dict(WEIGHTED=False) if spec.weight_on_input or spec.expert_norm != "none" else {}
