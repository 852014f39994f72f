"""The attribute reader's measurement of sparsemixer routing (PhiMoE's eval-mode router), tried by
``fallback._fit_routing`` when no top-k routing explains what the experts module received.

A candidate ``jitter_eps`` is any number among the block's / router's / config's scalar attributes (``0 <= v < 1``,
in the order ``fallback.attr_sources`` reads them) and 0; none is taken for its name. A candidate is kept when

1. the routing the block gave the experts on the probe run (ids, weights) is ``reference.route`` with score_order
   "sparsemixer" on the router's logits, up to one constant (the routed scale, fitted like the other routings'), and
2. the block, run on inputs whose router logits are ``policy.sparsemixer_probe_logits`` (rows straddling the
   candidate's threshold in every round; the inputs solved by least squares through the router weight, so this
   needs E <= H and a router of full rank), gives the experts what the reference gives on the logits the router
   computes from those inputs (16-bit blocks: rows within a rounding of the threshold left out).

Random inputs alone cannot tell thresholds apart (at jitter_eps 0.01 about 4% of the weights differ from 1), hence 2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core import policy
from ..oracle import reference
from ..probe.block import run_probe
from ..core.spec import MoESpec, SpecError
from ..core.parts import BlockParts
from ..core.derived import get_path
from ..core.reject import raise_if_oom


def eps_candidates(sources) -> list[float]:
    """Numbers among the scalar attributes of ``sources`` that could be a jitter_eps, then 0 (duplicates dropped)."""
    out = []
    for src in sources:
        for name, v in (vars(src).items() if hasattr(src, "__dict__") else ()):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1 and math.isfinite(v):
                out.append(float(v))
    return list(dict.fromkeys(out + [0.0]))


def fit(block: nn.Module, parts: BlockParts, spec: MoESpec, x2: torch.Tensor, ids, w, sources, match, fp32s):
    """The routing fields of sparsemixer routing if the block routes so (see the module docstring), else None.
    ``match(ids_ref, w_ref, ids, w, tol)``: the fallback's comparison (None: other experts; nan: no constant fits;
    else the constant); ``fp32s``: the router precisions to try."""
    if parts.correction_bias is not None:
        return None
    E, k = parts.num_experts, ids.shape[1]
    W = get_path(block, parts.router_weight)
    b = get_path(block, parts.router_bias) if parts.router_bias else None
    tol = policy.routing_match_tolerance(x2.dtype)
    for fp32 in fp32s:
        for eps in eps_candidates(sources):
            try:
                cs = spec.replace(top_k=k, router_fp32=fp32, routed_scaling_factor=1.0, renorm_eps=0.0,
                                  renorm_min=0.0, scoring="softmax", score_order="sparsemixer", jitter_eps=eps,
                                  renormalize=False, n_group=1, topk_group=1, group_score="top2_sum",
                                  bias_on_logits=False, group_mask_zero=False)
            except SpecError:
                continue
            w_c, ids_c = reference.route(reference.router_logits(x2, W, b, cs).float(), None, cs)
            c = match(ids, w, ids_c, w_c, tol)
            if c is None or math.isnan(c) or not _probes_agree(block, parts, cs, W, b, c, match, tol, x2.dtype):
                continue
            return dict(scoring="softmax", score_order="sparsemixer", jitter_eps=eps, renormalize=False, n_group=1,
                        topk_group=1, group_score="top2_sum", bias_on_logits=False, group_mask_zero=False, top_k=k,
                        router_fp32=fp32, routed_scaling_factor=c)
    return None


def _probes_agree(block, parts: BlockParts, spec: MoESpec, W, b, c: float, match, tol: float, dtype) -> bool:
    """Step 2 of the module docstring: the block on inputs that put its logits at the probe rows."""
    E, H = W.shape
    if E > H:
        return False
    target = policy.sparsemixer_probe_logits(E, spec.top_k, spec.jitter_eps).to(W.device)  # [P, E]
    if b is not None:
        target = target - b.float()
    sol = torch.linalg.lstsq(W.float(), target.T)  # W x = target, least squares: [H, P]
    x = sol.solution.T.to(dtype)
    x = x.reshape(1, *x.shape)  # [1, P, H]: the block's [batch, tokens, hidden] input
    try:
        run = run_probe(block, parts, x)
    except Exception as e:  # noqa: BLE001 (the verify stage reports a block that fails on its own probe)
        raise_if_oom(e)
        return False
    if run.experts_args is None:
        return False
    _, ids, w = run.experts_args[:3]
    x2 = x.reshape(-1, H)
    if not (isinstance(ids, torch.Tensor) and ids.shape == (x2.shape[0], spec.top_k)):
        return False
    logits = reference.router_logits(x2, W, b, spec)  # what the block's router computed from x
    ref_w, ref_ids = reference.route(logits.float(), None, spec)
    keep = torch.ones(x2.shape[0], dtype=torch.bool, device=x2.device)
    rel = policy.SPARSEMIXER_MASK_REL.get(logits.dtype)
    if rel:
        keep = ~reference.sparsemixer_contested(logits, spec, rel=rel)
    got = match(ids[keep], w[keep], ref_ids[keep], ref_w[keep], tol)
    return got is not None and not math.isnan(got) and abs(got - c) <= tol * max(1.0, abs(c))
