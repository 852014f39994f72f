"""Why a block found by its experts has no router the spec can say, measured: the detail of the report's reason.

``structure.find_parts`` names a block's router by a 2-D [E, H] weight beside its experts (``MoESpec``: the routing
logits are one linear map of the block's input, ``x @ router_w.T (+ b)``, with at most a norm / scale prefix). A
block without one is reported as such; where it can run, :func:`explain` runs it once on the probe input and adds
what its routing reads instead, by what it does (no class or attribute names read):

* the linear maps the block calls outside its experts, in call order, and the last one whose outputs number E or a
  few more (E + z: z classes past the E experts): the routing logits are the end of a chain of maps (an MLP router)
  or of one map over something other than the block's input;
* a second tensor the block returns beside its output, and whether a second input of that shape changes the routing
  weights the experts module receives: a router state carried from layer to layer, which the op (one input, one
  output) has no argument for.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..core import policy
from .structure import experts_child
from ..core.derived import get_path


def _e_and_h(experts: nn.Module) -> tuple[int, int] | None:
    """(E, H) from the experts module's 3-D weights: E their common leading dim, H the one inner dim they all share
    ([E, 2I, H] and [E, H, I] share H); None when that is not one number."""
    ws = [p for p in experts.parameters() if p.dim() == 3]
    if not ws or len({w.shape[0] for w in ws}) != 1:
        return None
    common = set(ws[0].shape[1:])
    for w in ws[1:]:
        common &= set(w.shape[1:])
    return (int(ws[0].shape[0]), int(common.pop())) if len(common) == 1 else None


def _run(block: nn.Module, experts: nn.Module, linears: dict, args: tuple):
    """Run ``block(*args)``; (its output, [(path, weight shape, output)] of the linear maps called, in order)."""
    calls = []
    hooks = [m.register_forward_hook(lambda mod, a, o, _p=p: calls.append((_p, tuple(mod.weight.shape), o)))
             for p, m in linears.items()]
    try:
        with torch.no_grad():
            out = block(*args)
    finally:
        for h in hooks:
            h.remove()
    return out, calls


def explain(block: nn.Module, reason: str) -> str:
    """What the block's routing is measured to read instead of one [E, H] map, where it can run and calls none;
    ``reason`` as it is otherwise (with why, where the block does not run on a probe input alone)."""
    path = experts_child(block)
    if not path or any(p.device.type == "meta" for p in block.parameters()):
        return reason
    experts = get_path(block, path)
    eh = _e_and_h(experts)
    if eh is None:
        return reason
    E, H = eh
    w0 = next(experts.parameters())
    x = policy.probe_input(H, w0.device, w0.dtype)
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear) and n.split(".")[0] != path}
    try:
        out, calls = _run(block, experts, linears, (x,))
    except Exception as e:
        return f"{reason} (the block did not run on a probe input alone: {type(e).__name__})"
    if any(shape == (E, H) for _, shape, _ in calls):
        return reason  # a plain [E, H] router is called: nothing measured to add
    found = [i for i, (_, shape, _) in enumerate(calls) if E <= shape[0] <= 2 * E]
    if not found:
        return reason
    i = found[-1]
    p, (n_out, n_in), _ = calls[i]
    chain = [c[0] for c in calls[: i + 1] if c[0].split(".")[0] == p.split(".")[0]]
    extra = f" ({E} experts + {n_out - E})" if n_out > E else ""
    how = (f"after an MLP router ({' -> '.join(c.rsplit('.', 1)[-1] for c in chain)})" if len(chain) > 1
           else f"(a [{n_out}, {n_in}] map of something other than the block's input)")
    text = f"no router weight [{E}, H]: logits = {p}'s {n_out} outputs{extra} {how}"
    state = _carried_state(block, calls, out)
    return f"{text}{'; ' + state if state else ''}; MoESpec: one [E, H] router map, no state"


def _carried_state(block: nn.Module, calls: list, out) -> str:
    """The second tensor the block returns, where it is one of the linear maps' outputs (and whether the forward takes
    a second input); '' otherwise."""
    if not isinstance(out, (tuple, list)) or len(out) < 2 or not isinstance(out[1], torch.Tensor):
        return ""
    s = out[1]
    src = next((p for p, _, o in calls if isinstance(o, torch.Tensor) and o.shape == s.shape and torch.equal(o, s)),
               None)
    if src is None:
        return ""
    try:
        takes = len(inspect.signature(block.forward).parameters) >= 2
    except (TypeError, ValueError):
        takes = False
    return (f"the block returns {src}'s output as a 2nd tensor" + (" and takes a 2nd input" if takes else "")
            + " (a router state between layers)")
