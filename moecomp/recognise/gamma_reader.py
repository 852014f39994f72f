"""The attribute reader's shared-expert gammas, stacked shared experts and learned weight scale (``MoESpec.shared_gamma``
"joint_renorm", ``SharedExpertSpec.stacked``, ``MoESpec.has_weight_scale``; Inkling), as the block shows them:

* **gamma rows** (``BlockParts.gamma_rows`` = G, read from shapes: a router [E + G, H] beside G shared experts): the
  routing candidates are scored with the G extra rows renormalised together with the k chosen ones
  (``reference.route_with_gammas``); the fit keeps the one whose weights equal, up to one constant, those the
  experts module received (:func:`gamma_fields` gives the static part, the fit itself is ``fallback._fit_routing``).
  That the gammas then scale the shared experts is proven by verify on the whole block's output.
* **stacked shared experts** (3-D [S, I, H] gate / up / down Parameters of one module): that module takes its gammas
  as an argument, so it cannot be called alone on a probe; its activation is the one its ``act_fn`` computes
  (probed on [-12, 12]). A module that also holds a clamp limit (:func:`activations.clamp_limits`) is refused: whether
  the clamp applies is not something a call of ``act_fn`` shows.
* **weight scale** (:func:`find_weight_scale`): a one-element floating tensor of the router module (or the block
  itself) is the op's ``weight_scale`` when doubling it doubles the routing weights the experts receive, with the
  same experts chosen; measured on probe runs (the tensor restored after each), never read from a name. The
  routed scale is then the fitted constant over that tensor's value.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import policy
from ..probe.block import run_probe
from ..core.reject import RejectCode
from ..core.spec import SharedExpertSpec, SpecError
from ..probe.activations import clamp_limits as _limits, probe_activation
from .fallback_bind import FallbackError
from ..core.parts import BlockParts
from ..core.derived import get_path


def gamma_fields(parts: BlockParts) -> dict:
    """The static spec fields the gamma rows give: ``shared_gamma`` "joint_renorm" and ``renormalize`` (the joint
    renormalisation is what the rows mean; the fit confirms it or refuses)."""
    return {"shared_gamma": "joint_renorm", "renormalize": True} if parts.gamma_rows else {}


def stacked_shared_spec(block: nn.Module, parts: BlockParts) -> tuple[SharedExpertSpec, list[str]]:
    """The SharedExpertSpec of S stacked shared experts (``parts.shared.stacked`` = S): activation from ``act_fn``."""
    sp = parts.shared
    mod = get_path(block, sp.path)
    fn = next((getattr(mod, n) for n in ("act_fn", "act", "activation_fn", "activation")
               if callable(getattr(mod, n, None))), None)
    act = probe_activation(fn) if fn is not None else None
    if act is None:
        raise FallbackError(f"stacked shared experts {sp.path!r}: no activation module the spec knows (they take their "
                            "gammas as an argument, so they are not called alone on a probe)")
    alpha, limit = _limits([mod])
    if limit is not None or alpha is not None:
        raise FallbackError(f"stacked shared experts {sp.path!r} hold a clamp limit / alpha: whether and where it "
                            "applies is not shown by their act_fn, and they cannot be called alone on a probe",
                            RejectCode.NOT_RECOGNISED)
    try:
        spec = SharedExpertSpec(intermediate_size=sp.intermediate_size, activation=act, gated=sp.gated,
                                layout="concat" if sp.concat else "separate", stacked=sp.stacked)
    except SpecError as e:
        raise FallbackError(f"stacked shared experts: {e}") from None
    return spec, [f"{sp.stacked} stacked shared experts: activation {act} (act_fn probed; the block's output checks "
                  "the rest)"]


def _scale_candidates(block: nn.Module, parts: BlockParts) -> list[tuple[str, torch.Tensor]]:
    """(block-relative path, tensor) of the one-element floating tensors of the router module and of the block's own
    (not its children's) parameters and buffers."""
    out = []
    if parts.router_module:
        router = get_path(block, parts.router_module)
        out += [(f"{parts.router_module}.{n}", t) for n, t in list(router.named_parameters())
                + list(router.named_buffers())]
    out += list(block.named_parameters(recurse=False)) + list(block.named_buffers(recurse=False))
    seen, uniq = set(), []
    for path, t in out:
        if t.is_floating_point() and t.numel() == 1 and t.device.type != "meta" and id(t) not in seen \
                and float(t) != 0.0 and torch.isfinite(t).all():
            seen.add(id(t))
            uniq.append((path, t))
    return uniq


def find_weight_scale(block: nn.Module, parts: BlockParts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                      routing_seen, **kwargs) -> tuple[str, float] | None:
    """(path, value) of the tensor that scales the routing weights the experts receive, or None. ``ids`` / ``w``:
    what they received on the probe run with every candidate as it is; ``routing_seen(run)`` reads them from a run."""
    tol = policy.routing_match_tolerance(x.dtype)
    for path, t in _scale_candidates(block, parts):
        keep = t.detach().clone()
        try:
            with torch.no_grad():
                t.mul_(2.0)
            run = run_probe(block, parts, x, **kwargs)
        finally:
            with torch.no_grad():
                t.copy_(keep)
        if run.experts_args is None:
            continue
        ids2, w2 = routing_seen(run)
        if torch.equal(ids2, ids) and torch.allclose(w2.float(), 2.0 * w.float(), rtol=tol,
                                                     atol=tol * float(w.float().abs().max())):
            return path, float(keep)
    return None
