"""Which transformers families have routed-experts MoE blocks, found by structure (issue 21): the coverage tool's
list is no longer only the families whose experts carry ``@use_experts_implementation``.

    source bound      the modeling file calls a top-k / argmax / max over a dim (what every router does; the cost
                      bound: 530 modeling files, about 205 pass), or its experts are decorated
    meta build        the family's model built from the coverage tool's tiny config on the meta device (no
                      weights, no forward)
    routed experts    a module owning, apart from each other,
                        a router:  one 2-D weight [E, H] (2 <= E <= 1024 outputs of the hidden width H; not an
                           embedding table), in a child or the module's own parameter, and
                        experts:   in the block's other children, or the block's own tensors besides the router:
                                   two or more 3-D weights [E', a, b] (a, b > 1, one of them H), E' = E for one
                                   of them or E / 2 < E' <= E for all (identity / zero-computation experts take
                                   the rest of the router's outputs); or >= 2 children of one class, each an MLP
                                   (2-4 matrices, all with H on one side), as many as the router has outputs or
                                   fewer; or, twice, E 2-D matrices of one shape (one per expert, a side of
                                   width H) held by one module (a ParameterList); or two or more 2-D weights in
                                   one module (without children that hold parameters; or the block itself) that
                                   hold E experts flat: one dim E * n, the other H (or n = H: [E * H, I], a down
                                   projection's rows), at least one with an H side (E >= 4)

No attribute or class name is read: only shapes and which module owns what. A family found here is then built
tiny for real and optimized by ``families.check_family`` like any other; one whose model cannot be built tiny is
listed with its error.
"""

from __future__ import annotations

import inspect
import os
import re
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..formats.packed_linear import Packed4Linear

# top-k, argmax, or a max over the last / a named dim (a top-1 router spelled ``torch.max(probs, dim=-1)``, as
# Switch Transformers' is in transformers 5.17)
_ROUTER_CALL = re.compile(r"\btopk\(|\.topk\(|\bargmax\(|\.argmax\(|\bmax\([^()\n]*\bdim\s*=|"
                          r"\bmax\([^()\n]*,\s*-1\s*[,)]|\.max\(\s*-1\s*[,)]")


def source_candidates(models_dir: str) -> list[str]:
    """Families whose modeling file calls a top-k, argmax or max over a dim, or uses ``@use_experts_implementation``."""
    out = []
    for fam in sorted(os.listdir(models_dir)):
        p = os.path.join(models_dir, fam, f"modeling_{fam}.py")
        if not os.path.exists(p):
            continue
        with open(p, encoding="utf-8") as f:
            src = f.read()
        if "@use_experts_implementation" in src or _ROUTER_CALL.search(src):
            out.append(fam)
    return out


def _own(m: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _own_named(m)]


def _stacked_ok(ts: list, E: int, H: int) -> bool:
    """Two or more 3-D weights [E', a, b] (a, b > 1, one of them H) whose expert counts fit a router of E outputs:
    one of them E, or all in (E / 2, E], or two different counts that add up to E (E' routed experts and S stacked
    shared experts whose gammas the router's last S rows give: ``MoESpec.shared_gamma``)."""
    ts = [t for t in ts if t.dim() == 3 and 1 <= t.shape[0] <= E and min(t.shape[1:]) > 1]
    many = [t for t in ts if t.shape[0] >= 2]
    if len(many) < 2 or not any(H in t.shape[1:] for t in many):
        return False
    lead = {t.shape[0] for t in many}
    if E in lead or min(lead) * 2 > E:
        return True
    return any(a + t.shape[0] == E and a != t.shape[0] for a in lead for t in ts)  # routed + stacked shared


def _expert_tensors(ms: list, E: int, H: int) -> bool:
    """The modules ``ms`` (a block's children other than the router) hold experts for a router of E outputs over
    width H (module docstring)."""
    if _stacked_ok([t for m in ms for sub in m.modules() for t in _own(sub)], E, H):
        return True
    lists = [n for m in ms for sub in m.modules()
             for n in Counter(tuple(t.shape) for t in _own(sub) if t.dim() == 2 and H in t.shape).values()]
    if lists.count(E) >= 2:
        return True  # one 2-D matrix per expert, E of one shape in a holder (ParameterList), for two projections
    for sub in (s for m in ms for s in m.modules()):
        if not any(True for c in sub.children() for _ in c.parameters()) and _flat_ok(_own(sub), E, H):
            return True  # [E * n, H]-like matrices side by side in one parameter holder: experts flattened
        kids = [c for c in sub.children() if any(True for _ in c.parameters())]
        if len(kids) >= 2 and len({type(c) for c in kids}) == 1 and len(kids) <= E and _is_mlp(kids[0], H):
            return True
    return False


def _flat_ok(ts: list, E: int, H: int) -> bool:
    """Two or more 2-D tensors that hold E experts flat (module docstring), at least one with a side of width H."""
    flat = [t for t in ts if t.dim() == 2 and any(t.shape[d] % E == 0 and t.shape[d] >= 2 * E and (
        t.shape[1 - d] == H or t.shape[d] == E * H) for d in (0, 1))]
    return E >= 4 and len(flat) >= 2 and any(H in t.shape for t in flat)


def own_experts(block: nn.Module, E: int, H: int, router=None) -> bool:
    """Does ``block`` own, as its own tensors (not its children's), experts for a router of E outputs over width H
    (3-D stacked or 2-D flat, module docstring)? ``router``: the router weight, when it is one of them. Only a module
    whose forward needs nothing but the hidden states can be a block, and a bare router Parameter among the block's
    own expert tensors must be its only [E, n] one: an experts module called with the routing (``forward(hidden,
    top_k_index, top_k_weights)``, gpt-oss's with defaults for them) owns stacked weights and per-expert biases, one
    of them [E, H], and is no block of its own."""
    ts = [t for t in _own(block) if t is not router]
    if router is not None and any(t.dim() == 2 and t.shape[0] == E for t in ts):
        return False  # the router one of several [E, n] tensors of the block (per-expert biases): which is unknown
    return (_stacked_ok(ts, E, H) or _flat_ok(ts, E, H)) and _one_input(block)


def _one_input(m: nn.Module) -> bool:
    """Does ``m``'s forward need at most one argument (the others have defaults)?"""
    try:
        sig = inspect.signature(m.forward)
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return sum(p.default is p.empty and p.kind in kinds for p in sig.parameters.values()) <= 1


def _is_mlp(m: nn.Module, H: int) -> bool:
    """A per-expert MLP: 2-4 matrices, each with the hidden width on one side (a decoder layer has more)."""
    mats = [p for p in m.parameters() if p.dim() == 2]
    return 2 <= len(mats) <= 4 and all(H in p.shape for p in mats)


def block_router(block: nn.Module, H: int | None) -> tuple[str, str, int] | None:
    """(router child name, its [E, H] weight's path, E) when ``block`` owns a router and, in its other children,
    experts for it (module docstring); None otherwise."""
    kids = dict(block.named_children())
    own = [(n, t) for n, t in _own_named(block) if t.dim() == 2]  # a bare router Parameter of the block itself
    if not kids and not own:
        return None
    owns = any(t.dim() in (2, 3) for _, t in _own_named(block))  # experts maybe the block's own tensors
    cands = [("", own, list(kids.values()))] if own else []
    for rname, r in kids.items():
        if isinstance(r, nn.Embedding) or (len(kids) < 2 and not owns):
            continue
        ws = [(n, t) for n, t in _own_named(r) if t.dim() == 2]
        ws += [(f"{c}.{n}", t) for c, m in r.named_children() if not isinstance(m, nn.Embedding)
               for n, t in _own_named(m) if t.dim() == 2]
        cands.append((rname, ws, [c for n, c in kids.items() if n != rname]))
    for rname, ws, others in cands:
        for wname, w in ws:
            E, W = int(w.shape[0]), int(w.shape[1])
            if (H is None or W == H) and 2 <= E <= 1024 and (_expert_tensors(others, E, W) or (
                    owns and own_experts(block, E, W, w))):
                return rname, f"{rname}.{wname}" if rname else wname, E
    return None


def experts_holder(block: nn.Module, router: str, E: int, H: int) -> str | None:
    """The child (other than the router) that holds the experts of a ``block_router`` block; "" when they are
    spread over several children (JetMoE's ``input_linear`` / ``output_linear``: 3-D weights one per child) or are
    the block's own tensors."""
    kids = [(n, c) for n, c in block.named_children() if n != router]
    one = next((n for n, c in kids if _expert_tensors([c], E, H)), None)
    if one is not None:
        return one
    if _expert_tensors([c for _, c in kids], E, H):
        return ""
    rw = get_router_weight(block, router, E, H)
    return "" if own_experts(block, E, H, rw) else None


def get_router_weight(block: nn.Module, router: str, E: int, H: int):
    """The [E, H] router weight of a bare-Parameter router (``router`` ""), for ``own_experts`` to leave out."""
    if router:
        return None
    return next((t for _, t in _own_named(block) if tuple(t.shape) == (E, H)), None)


def holds_expert_weights(m: nn.Module) -> bool:
    """``m`` or a module below it owns a 3-D tensor (stacked expert weights)."""
    return any(t.dim() == 3 for sub in m.modules() for t in _own(sub))


def _own_named(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``m``'s own tensors; none for a 4-bit dense linear (``Packed4Linear``: its packed codes [out, in / 2] and
    group scales [out, in / g] are 2-D tensors of no router's or expert's meaning, and neither a router nor experts
    can be 4-bit linears)."""
    if isinstance(m, Packed4Linear):
        return []
    return [(n, t) for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
            if t is not None]


def routed_blocks(model: nn.Module, hidden: int | None = None) -> dict[str, int]:
    """{path: router width E} of the smallest modules that own a router [E, H] and, in their other children,
    experts for it."""
    H = hidden or getattr(getattr(model, "config", None), "hidden_size", None)
    found = {}
    for name, block in model.named_modules():
        if not name:
            continue
        r = block_router(block, H)
        if r is not None:
            found[name] = r[2]
    # keep the innermost: a decoder layer that owns an MoE block also "owns" its router and experts
    return {n: e for n, e in found.items() if not any(o != n and o.startswith(n + ".") for o in found)}


class RoutingProbe(TorchDispatchMode):
    """Records the widths (last dims) of every top-k / argmax / max-over-a-dim input while active: a router's E
    outputs feed one of them."""

    OPS = ("topk", "argmax", "max", "sort", "argsort")

    def __init__(self):
        super().__init__()
        self.widths: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__
        if op in self.OPS and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1 and \
                (op != "max" or len(args) > 1 or kwargs):
            self.widths.add(int(args[0].shape[-1]))
        return func(*args, **(kwargs or {}))


def structural_families(models_dir: str, build_meta, hidden_of) -> dict[str, str]:
    """{family: model class} of the source candidates whose tiny model, built on the meta device by
    ``build_meta(family) -> (model, config) | None``, has routed blocks (``routed_blocks``)."""
    out = {}
    for fam in source_candidates(models_dir):
        try:
            built = build_meta(fam)
        except Exception:  # a family that cannot be built tiny is not discovered here (the decorated ones still are)
            continue
        if built is not None and routed_blocks(built[0], hidden_of(built[1])):
            out[fam] = type(built[0]).__name__
    return out
