"""The norms of ``MoESpec`` (``latent_norm``, ``expert_norm``; MuseSpark; ``SharedExpertSpec.norm``, Ergo) on the op's
torch-level steps: the latent input's norm (every path: a [T, L] row norm next to the input projection's GEMM, which
it does not pay to fuse), the torch path's per-pair expert-output norm and the shared experts' output norm (the torch
path, and the Triton path's torch step after the shared GEMMs). The Triton path normalises the pairs' rows in its
combine (``kernels/norm_combine.py``, launched by ``triton_norm.norm_combine``). Torch only; the forms
(``moecomp.core.spec``):

    "rms"             round(v / rms(v) * w)
    "rms_1p"          round(v / rms(v) * (1 + w))              1 + w formed in w's dtype
    "scaled_rms_1p"   round(u / rms(u)), u = round(v * (1 + w))
    "rms_per_expert"  "rms", w the pair's expert's row of [E, width]
    rms(v) = sqrt(mean(v^2) + eps), the products in fp32, round = a cast to the output dtype
"""

from __future__ import annotations

import torch

from ..core.spec import PER_EXPERT_NORMS, MoESpec


def _unit_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """v [n, d] fp32 divided by its rows' root mean square (with eps)."""
    return v * torch.rsqrt(v.square().mean(dim=-1, keepdim=True) + eps)


def rms_norm(v: torch.Tensor, w: torch.Tensor, form: str, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows v [n, d] (any dtype) normalised in ``form`` with weight w [d] (or [n, d], a row per v row) -> [n, d] in
    ``dtype``."""
    if form in ("rms", "rms_per_expert"):
        return (_unit_rms(v.float(), eps) * w.float()).to(dtype)
    if form not in ("rms_1p", "scaled_rms_1p"):
        raise ValueError(f"norm form {form!r}; expected one of rms, rms_1p, scaled_rms_1p, rms_per_expert")
    one_plus = (w + 1).float()
    if form == "rms_1p":
        return (_unit_rms(v.float(), eps) * one_plus).to(dtype)
    return _unit_rms((v.float() * one_plus).to(dtype).float(), eps).to(dtype)


def latent_norm(xl: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    """xl [T, L] (x's dtype) normalised as ``spec.latent_norm`` says, in xl's dtype; xl itself without one."""
    if spec.latent_norm == "none":
        return xl
    return rms_norm(xl, args["latent_norm_w"], spec.latent_norm, spec.latent_norm_eps, xl.dtype)


def expert_norm(y: torch.Tensor, args: dict, spec: MoESpec, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """The pairs' expert outputs y [P, width] (fp32) of experts ``ids`` [P] normalised as ``spec.expert_norm`` says
    (rounded to ``dtype`` first, as the model's down projection returns them; "rms_per_expert": each row with its
    expert's weight row), fp32; y itself without one."""
    if spec.expert_norm == "none":
        return y
    w = args["expert_norm_w"]
    w = w[ids] if spec.expert_norm in PER_EXPERT_NORMS else w
    return rms_norm(y.to(dtype), w, spec.expert_norm, spec.expert_norm_eps, dtype).float()


def shared_norm(y: torch.Tensor, args: dict, sh) -> torch.Tensor:
    """The shared experts' output y [T, H] normalised as ``sh.norm`` (a SharedExpertSpec) says, in y's dtype; y itself
    without one."""
    if sh.norm == "none":
        return y
    return rms_norm(y, args["shared_norm_w"], sh.norm, sh.norm_eps, y.dtype)
