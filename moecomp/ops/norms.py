"""The norms of ``MoESpec`` (``latent_norm``, ``expert_norm``; MuseSpark) on the op's torch-level steps: the latent
input's norm (every path: a [T, L] row norm next to the input projection's GEMM, which it does not pay to fuse) and
the torch path's per-pair expert-output norm. The Triton path normalises the pairs' rows in its combine
(``kernels/norm_combine.py``, launched by ``triton_norm.norm_combine``). Torch only; the formulas are the reference's
(``moecomp.reference.rms_norm``).
"""

from __future__ import annotations

import torch

from .. import reference
from ..spec import PER_EXPERT_NORMS, MoESpec


def latent_norm(xl: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    """xl [T, L] (x's dtype) normalised as ``spec.latent_norm`` says, in xl's dtype; xl itself without one."""
    if spec.latent_norm == "none":
        return xl
    return reference.rms_norm(xl, args["latent_norm_w"], spec.latent_norm, spec.latent_norm_eps, xl.dtype)


def expert_norm(y: torch.Tensor, args: dict, spec: MoESpec, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """The pairs' expert outputs y [P, width] (fp32) of experts ``ids`` [P] normalised as ``spec.expert_norm`` says
    (rounded to ``dtype`` first, as the model's down projection returns them; "rms_per_expert": each row with its
    expert's weight row), fp32; y itself without one."""
    if spec.expert_norm == "none":
        return y
    w = args["expert_norm_w"]
    w = w[ids] if spec.expert_norm in PER_EXPERT_NORMS else w
    return reference.rms_norm(y.to(dtype), w, spec.expert_norm, spec.expert_norm_eps, dtype).float()
