"""The roofline floor of a cell (from the routing actually taken) and the rates a path achieved against it."""

from __future__ import annotations

import torch

from . import common


def floor_of(spec, T: int, ids: torch.Tensor, tensors: dict, ceilings: dict, scales: dict | None = None,
             rate_key: str = "matmul_flops_per_s") -> dict:
    """Roofline floor from the routing actually taken (distinct experts touched by this batch): bytes over the copy
    rate, FLOPs over ``ceilings[rate_key]``. Quantized (``spec.quant``, fp8 tensors): the experts touched at their
    stored element size plus their fp32 scales (``spec.bytes_per_expert``), the shared experts' weights likewise plus
    ``scales``' shared-expert scales; activations in the run's dtype."""
    H, I, E, k = spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k
    w_item = tensors["w13"].element_size()
    if spec.quant is not None and spec.quant.packed:
        w_item = 0.5  # two 4-bit codes a byte (bytes_per_expert counts the unpacked elements)
    distinct = int(torch.unique(ids).numel())
    nbytes = distinct * spec.bytes_per_expert(w_item)
    for b in ("b13", "b2"):  # expert biases (gpt-oss): the touched experts' rows
        if tensors.get(b) is not None:
            nbytes += distinct * tensors[b][0].numel() * tensors[b].element_size()
    flops = 2 * T * k * (spec.w13_rows + I) * H
    rw = tensors["router_w"]
    nbytes += rw.numel() * rw.element_size()
    flops += 2 * T * H * E
    if tensors.get("correction_bias") is not None:
        nbytes += tensors["correction_bias"].numel() * tensors["correction_bias"].element_size()
    if spec.shared is not None:
        for n in ("shared_w1", "shared_w3", "shared_w2", "shared_gate_w"):
            t = tensors.get(n)
            if t is not None:
                nbytes += t.numel() * t.element_size()
                flops += 2 * T * t.numel()
        for n, t in (scales or {}).items():
            if n.startswith("shared_") and t is not None:
                nbytes += t.numel() * t.element_size()
    act_item = torch.finfo(common.DTYPE).bits // 8
    nbytes += 2 * T * H * act_item  # x in, out
    bytes_ms = nbytes / ceilings["copy_bytes_per_s"] * 1e3
    flops_ms = flops / ceilings[rate_key] * 1e3
    fl = dict(floor_ms=max(bytes_ms, flops_ms), bytes=nbytes, flops=flops, bytes_ms=bytes_ms, flops_ms=flops_ms,
              bound="memory" if bytes_ms >= flops_ms else "compute", distinct_experts=distinct)
    if rate_key != "matmul_flops_per_s":
        fl["matmul_rate"] = rate_key
    return fl


def achieved_of(fl: dict, ms: float | None, ceilings: dict) -> dict | None:
    """What a path achieved in a cell: the floor's bytes and FLOPs over its time, and the share of the ceilings."""
    if not ms or ms <= 0 or not fl:
        return None
    tbs = fl["bytes"] / ms / 1e9  # bytes / (ms * 1e-3 s) / 1e12
    tfs = fl["flops"] / ms / 1e9
    rate = ceilings[fl.get("matmul_rate", "matmul_flops_per_s")]  # (the fp8 floor: the fp8 matmul ceiling)
    return dict(tb_per_s=tbs, tflop_per_s=tfs, copy_ceiling_frac=tbs * 1e12 / ceilings["copy_bytes_per_s"],
                matmul_ceiling_frac=tfs * 1e12 / rate)
