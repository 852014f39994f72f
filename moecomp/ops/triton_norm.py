"""``MoESpec.expert_norm`` on the Triton path: the norm needs each pair's whole output row, so gemm2 writes the pairs'
rows unweighted (WEIGHTED off, ``gemm2_kwargs``) and ``norm_combine`` normalises, weighs and sums them per token
(``kernels/norm_combine.py``), the gated shared expert folded in. The decode path's fused down-combine is not used
for such specs (``triton_moe.routed`` takes the aligned path). The latent input's norm runs in torch
(``ops/norms.py``).
"""

from __future__ import annotations

import torch
import triton

from ..kernels import norm_combine as nc_k
from ..core.spec import PER_EXPERT_NORMS, MoESpec
from .common import flat_ids as _flat_ids


def norm_combine(y: torch.Tensor, weights: torch.Tensor, nw: torch.Tensor, spec: MoESpec, T: int, k: int,
                 out: torch.Tensor, shared=None, gate=None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """y [T * k, H] (unweighted pair rows, x's dtype), weights fp32 [T, k] -> out [T, H] = sum_k weight * norm(y)
    (+ shared * sigmoid(gate)); ``ids`` [T, k]: the pairs' experts, read for a per-expert weight ("rms_per_expert",
    nw [E, H])."""
    H = out.shape[1]
    if T == 0:
        return out
    per_expert = spec.expert_norm in PER_EXPERT_NORMS
    nw = nw if nw.stride(-1) == 1 else nw.contiguous()
    flat_ids = _flat_ids(ids) if per_expert else None
    w = weights.reshape(-1)
    w = w if w.dtype == torch.float32 and w.stride(0) == 1 else w.float().contiguous()
    block_h = triton.next_power_of_2(H)
    nc_k.norm_combine_kernel[(T,)](
        y, w, nw, flat_ids, shared, gate, out, H, float(spec.expert_norm_eps),
        y.stride(0), 0 if shared is None else shared.stride(0), 0 if gate is None else gate.stride(0), out.stride(0),
        nw.stride(0) if per_expert else 0, TOP_K=k, PER_EXPERT=per_expert, HAS_SHARED=shared is not None,
        HAS_GATE=gate is not None, BLOCK_H=block_h,
        num_warps=max(1, min(16, block_h // 256)),
    )
    return out
