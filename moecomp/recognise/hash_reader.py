"""The attribute reader's hash routing (``MoESpec.hash_routing``; DeepSeek-V4's ``hash_moe`` layers, whose router
looks the expert ids up in a frozen table ``tid2eid[input_ids]`` and weights them by its scores there).

Read (:func:`read`): the router module (else the block) holds a 2-D integer tensor ``[V, top_k]`` (the table) and
the block's forward takes a token-id argument (one of ``names.TOKEN_ID_NAMES``). The spec then says
``hash_routing`` (no correction bias, no groups: nothing to steer) and binds ``hash_table`` to the table's path and
``token_ids`` to that forward argument (``match.forward_arg``).

Measured (:func:`fit`, on the probe run with probe token ids): the ids the experts module received must be
the table's rows of the probe tokens on every token (as multisets: the order of a row does not matter to the sum);
the weights are then fitted over the scorings and renormalisation the spec knows, with those ids, up to one
constant (the routed scaling), as the top-k reader does. Anything else is refused with ``UNSUPPORTED_ROUTING``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core import policy
from ..oracle import reference
from ..core.match import arg_name, forward_arg
from ..core.reject import Refused, RejectCode
from ..core.spec import SpecError
from ..core import names
from ..bind.bind import forward_params
from ..core.parts import BlockParts
from ..core.derived import get_path


def _table_path(block: nn.Module, parts: BlockParts, top_k: int) -> str | None:
    """The path of a 2-D integer [V, top_k] tensor of the router module (or of the block itself), or None."""
    owners = ([parts.router_module] if parts.router_module else []) + [""]
    for owner in owners:
        mod = get_path(block, owner) if owner else block
        for n, t in list(mod.named_buffers(recurse=False)) + list(mod.named_parameters(recurse=False)):
            if t is not None and t.dim() == 2 and t.shape[1] == top_k and not t.is_floating_point() \
                    and t.dtype != torch.bool and t.shape[0] > 0:
                return f"{owner}.{n}" if owner else n
    return None


def read(block: nn.Module, parts: BlockParts, top_k: int) -> tuple[dict, dict] | None:
    """(spec fields, bindings) of hash routing when the block reads as hash-routed (see the module docstring), else
    None."""
    table = _table_path(block, parts, top_k)
    if table is None:
        return None
    params = forward_params(block)[1]
    tok = next((n for n in names.TOKEN_ID_NAMES if n in params), None)
    if tok is None:
        return None
    fields = dict(hash_routing=True, has_correction_bias=False, n_group=1, topk_group=1, bias_on_logits=False,
                  group_mask_zero=False, score_order="score_then_topk")
    return fields, {"hash_table": table, "token_ids": forward_arg(tok), "correction_bias": None}


def apply(block: nn.Module, parts: BlockParts, top_k: int, routing: dict, bindings: dict, notes: list) -> None:
    """The attribute reader's static guess, made hash-routed in place when :func:`read` says so."""
    found = read(block, parts, top_k)
    if found is not None:
        routing.update(found[0])
        bindings.update(found[1])
        notes.append(f"hash routing: {bindings['hash_table']}[{bindings['token_ids']}]")


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.sort(-1).values, b.to(a.dtype).sort(-1).values)


def fit(block: nn.Module, m, x2: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, call_args: dict,
        match_routing) -> dict:
    """The routing fields of Match ``m`` (and the routed scale, unsnapped) that reproduce what the experts received
    on the probe run called with ``call_args`` (the token ids): ids = the table's rows of the tokens, weights = scores
    at them (``match_routing``: the top-k reader's weight match). ``Refused`` (UNSUPPORTED_ROUTING) when none fits."""
    parts, spec = m.parts, m.spec
    table = get_path(block, m.bindings["hash_table"])
    token_ids = call_args[arg_name(m.bindings["token_ids"])]
    if not _same_rows(ids.long(), reference.hash_ids(table, token_ids)):
        raise Refused("the router's expert ids are not the table's rows of the token ids (hash routing expected)",
                      RejectCode.UNSUPPORTED_ROUTING)
    W = get_path(block, parts.router_weight)
    Rb = get_path(block, parts.router_bias) if parts.router_bias else None
    tol = policy.routing_match_tolerance(x2.dtype)
    scorings = list(dict.fromkeys([spec.scoring, "softmax", "sigmoid", "sqrtsoftplus", "none"]))
    for fp32 in ([spec.router_fp32, not spec.router_fp32] if x2.dtype != torch.float32 else [spec.router_fp32]):
        base = spec.replace(router_fp32=fp32, routed_scaling_factor=1.0, renorm_eps=0.0)
        logits = reference.router_logits(x2, W, Rb, base).float()
        for scoring in scorings:
            for norm in (spec.renormalize, not spec.renormalize):
                try:
                    cand = base.replace(scoring=scoring, renormalize=norm)
                except SpecError:
                    continue
                w_c, ids_c = reference.route(logits, None, cand, ids=ids)
                c = match_routing(ids, w, ids_c, w_c, tol)
                if c is not None and not math.isnan(c):
                    return dict(scoring=scoring, score_order="score_then_topk", renormalize=norm, n_group=1,
                                topk_group=1, group_score=spec.group_score, bias_on_logits=False,
                                group_mask_zero=False, top_k=ids.shape[1], router_fp32=fp32,
                                routed_scaling_factor=c)
    raise Refused("hash routing: no scoring / renormalisation the spec knows gives the weights this router gives "
                  "its table's experts", RejectCode.UNSUPPORTED_ROUTING)

