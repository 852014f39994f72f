"""The FX numeric check's routing ties: check tokens whose 16-bit router logits tie exactly.

    x [T, H] ──► router logits (16-bit, as the block rounds them) ──► k-th and (k+1)-th equal?
                                                                      ──► [T] bool: left out of the token share

bf16 keeps 8 bits: at E = 128 the k-th and (k+1)-th logits of a token land in one bf16 value often enough that a
block of random weights ties on its check's crowd token (``numeric._make_inputs`` repeats one token a quarter of
the check), and ``torch.topk`` breaks such ties in no documented order. Only exact ties are left out here: the
cut-out graph and the reference round the same router GEMM alike (the verify stage, which runs the op's own router,
excuses a wider window: ``verify.err_with_ties``).
"""

from __future__ import annotations

import torch

from ...core import policy
from ...oracle import reference

TIE_NOTE = "at a 16-bit routing tie left out"  # in the check's message and the report's note


def tie_tokens(x2: torch.Tensor, t: dict, spec, dtype) -> torch.Tensor | None:
    """[T] bool: the check tokens whose k-th and (k+1)-th router logits are equal in the router's 16-bit rounding
    (the cut-out graph and the reference run the same router GEMM on the same values: they differ only there), when leaving them out is fair: a 16-bit router read
    from x itself, one group, no correction bias, and at most ``policy.max_tie_tokens`` distinct such tokens (the
    check's crowd repeats one token ``T / FX_CHECK_CROWD_DIVISOR`` times: a crowd token at a tie counts once).
    None otherwise."""
    if (dtype not in (torch.bfloat16, torch.float16) or t.get("router_w") is None or spec.hash_routing
            or spec.router_input or spec.router_norm or spec.router_in_scale or spec.router_in_const != 1.0
            or spec.latent_size or spec.n_group > 1 or spec.has_correction_bias or spec.fused_shared_gate
            or spec.gamma_rows or spec.top_k >= spec.num_experts):
        return None
    k = spec.top_k
    with torch.no_grad():
        logits = reference.router_logits(x2, t["router_w"], t.get("router_b"), spec).float()  # [T, E], rounded
        choice = logits if spec.score_order in ("topk_then_score", "sparsemixer") else reference.score(
            logits, spec.scoring)
        order = choice.topk(k + 1, dim=-1).indices  # [T, k + 1]
        last, first_out = logits.gather(-1, order[:, k - 1 : k]), logits.gather(-1, order[:, k : k + 1])
        near = (last == first_out).reshape(-1)  # [T]: an exact tie in the router's rounding
    if not bool(near.any()) or bool(near.all()):
        return None
    distinct = torch.unique(x2, dim=0).shape[0]
    if torch.unique(x2[near], dim=0).shape[0] > policy.max_tie_tokens(distinct):
        return None
    return near
