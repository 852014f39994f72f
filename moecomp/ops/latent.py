"""``MoESpec.latent_size`` on the op's paths (NemotronH's ``moe_latent_size``): the routed experts run in a projected
space of width L, between two dense projections the op takes as ``latent_in_w`` / ``latent_out_w`` (+ biases).

    logits, ids, weights = router(x)                           # on x [T, H], as without projections
    xl  = x @ latent_in_w.T (+ latent_in_b)                    # [T, L], x's dtype (torch's GEMM)
    rl  = routed experts of spec.experts_spec() on xl          # [T, L], x's dtype: the grouped GEMMs and the combine
    y   = rl @ latent_out_w.T (+ latent_out_b)                 # [T, H]
    out = y (+ shared(x) * sigmoid(gate))                      # the shared experts read x: added after the projection

The routed scaling lives in the routing weights, so it is applied inside the combine, before the output projection
and its bias, as in the model. Both projections are plain dense GEMMs, torch's on every path (cuBLAS on CUDA): a
GEMM of T x H x L each, which the grouped GEMMs' T * k x I x L dwarf. Torch only (the Triton path imports it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import norms


def _bias(b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A projection's bias in the GEMM's dtype (the op takes biases of any floating dtype)."""
    return b if b is None or b.dtype == dtype else b.to(dtype)


def project_in(x2: torch.Tensor, args: dict, spec=None) -> torch.Tensor:
    """The experts' input: x [T, H] -> [T, L] in x's dtype; normalised as ``spec.latent_norm`` says when given
    (``ops/norms.py``)."""
    xl = F.linear(x2, args["latent_in_w"], _bias(args.get("latent_in_b"), x2.dtype))
    return xl if spec is None else norms.latent_norm(xl, args, spec)


def project_out(routed: torch.Tensor, args: dict) -> torch.Tensor:
    """The combined routed output back to the hidden width: [T, L] -> [T, H] in routed's dtype."""
    return F.linear(routed, args["latent_out_w"], _bias(args.get("latent_out_b"), routed.dtype))
