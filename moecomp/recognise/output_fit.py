"""A numeric fit on the block's output, for blocks that keep their experts as stacked weights [E, ., .] run by the
block's own code (no experts module called with the routing, no module per expert to observe: a sorted dispatch over
``w13[e]`` slices that Dynamo cannot capture, say). What the weights and the router are, the attribute reader says
(their shapes); what is computed with them is found here: every activation the spec knows, gate / up split, weight
layout the shapes allow, and routing the spec knows, run through the op on a probe and compared with the block's own
output (the routed scale fitted as the verify stage fits it). The first candidate within the verify tolerance is the
answer; several that fit are not told apart here: verify then proves the first on its own probes.
"""

from __future__ import annotations

import dataclasses
import itertools
import types

import torch
from torch import nn

from ..core import policy
from ..core.match import Evidence, Match
from ..core.reject import Refused
from ..core.spec import SpecError
from ..core.spec_checks import ACTIVATIONS

_NO_FIT = ("swiglu_oai",)  # needs its alpha / limit, which no attribute named here


def _layouts(parts, H: int, I: int, w13: torch.Tensor, w2: torch.Tensor) -> list[str]:
    """The weight layouts the shapes allow: w13 [E, N, H] / w2 [E, H, I] out_in, [E, H, N] / [E, I, H] in_out."""
    s, s2 = tuple(w13.shape[1:]), tuple(w2.shape[1:])
    out = []
    if s[1] == H and s2 == (H, I):
        out.append("out_in")
    if s[0] == H and s2 == (I, H):
        out.append("in_out")
    return sorted(out, key=lambda v: v != parts.w_layout)


def fit(block: nn.Module, m: Match, x: torch.Tensor, candidates) -> Match | None:
    """``m`` with the activation, gate split, layout and routing that reproduce ``block(x)``, or None.

    ``candidates(guess, E, k, has_corr)``: the routings to try (``fallback.routing_candidates``)."""
    # (verify imports the binders)
    from ..verify.verify import check_spec as _verify, rel_err as _rel_err  # noqa: PLC0415

    parts, spec = m.parts, m.spec
    with torch.no_grad():
        out = block(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    run = types.SimpleNamespace(x=x, kwargs={}, output=out)
    w13 = block.get_parameter(parts.w13) if parts.w13 else None
    w2 = block.get_parameter(parts.w2) if parts.w2 else None
    if w13 is None or w2 is None or w13.dim() != 3 or w2.dim() != 3:
        return None
    layouts = _layouts(parts, spec.hidden_size, spec.intermediate_size, w13, w2)
    acts = [a for a in dict.fromkeys([spec.activation, *ACTIVATIONS]) if a not in _NO_FIT]
    splits = list(dict.fromkeys([spec.gate_up, "concat", "interleaved"])) if spec.gated else [spec.gate_up]
    guess = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    tol = policy.verify_tolerance(x.dtype, spec)
    routings = list(candidates(guess, spec.num_experts, spec.top_k, spec.has_correction_bias))
    for layout, act, split, route in itertools.product(layouts, acts, splits, routings):
        try:
            cand = spec.replace(w_layout=layout, activation=act, gate_up=split, **route)
        except SpecError:
            continue
        try:
            got, err = _verify(block, cand, m.bindings, m.derived, run, [])
        except (Refused, SpecError, ValueError, RuntimeError):  # a candidate the op's checks refuse: not this one
            continue
        if err <= tol:
            ev = Evidence("fallback", "activation, layout and routing fitted on the block's output",
                          notes=list(m.evidence.notes) + [
                              f"stacked experts run by the block's own code: fitted on the output of a probe "
                              f"({act}, {split}, {layout}; max rel err {_rel_err(_op(block, got, m, x), out):.1e})"])
            return m.replace(spec=got, evidence=ev)
    return None


def _op(block, spec, m: Match, x):
    from ..verify.verify import run_op  # noqa: PLC0415

    return run_op(block, spec, m.bindings, m.derived, x)
