"""Bind a verified router / experts pair (``moecomp.api.pair``): two sibling modules, called one after the other by a
parent whose forward we do not replace, become one ``torch.ops.moecomp.moe_forward`` call.

The parent calls ``router(r)`` and passes two of its outputs, the top-k ids and weights, unchanged to
``experts(h, ids, weights)`` (what the pair reader saw at run time and verify proved on the parent's own output).
Two cooperating stand-ins replace the siblings' ``forward`` (instance attributes; ``unoptimize`` restores them):

* the router's returns, in the slots of its output tuple where the parent reads the ids and the weights, a marker
  (an empty integer tensor [T, 0]: no top-k has 0 columns) and the router's input itself; its other slots are None;
* the experts' sees the marker and calls ``moe_forward(h, ..., router_x=r)``: routing and experts in one op call
  (``MoESpec.router_input``; the router's prefix and per-expert multipliers are spec fields too).

Nothing is kept between the two calls (no Python state: compiled code traces both). Either stand-in runs the
original forward when the op cannot stand in: a forward hook on the router or experts (transformers records
``output_router_logits`` that way), gradients needed (grad mode on and the input or a tensor the op reads requires
grad), or, in eager mode, an attribute of either module changed since binding (``moecomp.optimize`` re-binds). An
experts call that gets real ids runs its original forward; one that gets the marker when the op cannot run computes
the router's real outputs from the input it carries first: never the marker into code that would misread it.

State lives in ``parent._moecomp`` (a ``PairState``), so the parent counts as a rewritten block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops.moe_op import OP_ARGS, call_moe_forward
from ..core.match import PairLayout
from ..core.spec import MoESpec
from .bind import BindError, hooks_active
from .bind_common import restore_forward as _restore_forward
from .bind_experts import unbind_experts
from ..core.snapshot import Snapshot, snapshot_changed, take_snapshot
from ..core.derived import get_path

_RX = OP_ARGS.index("router_x")


@dataclass
class PairState:
    name: str
    spec: MoESpec
    bindings: dict  # OP_ARGS name -> path relative to the parent (router_x: the router's input, None here)
    router_path: str
    experts_path: str
    layout: PairLayout
    method: str = "pair"
    paths: tuple = ()  # per OP_ARGS: attribute names from the parent, or None
    router_original: object = None
    experts_original: object = None
    watch_mods: tuple = ()  # router and experts with everything under them (hooks force the original)
    snapshot: Snapshot | None = None  # the router's attributes (``bind.stale`` reads it)
    experts_snapshot: Snapshot | None = None
    epilogue: tuple = ()
    derived: list = field(default_factory=list)
    impl_config: object = None
    impl_prev: str | None = None
    calls: int = 0  # eager fused calls (op) / fallbacks (original forwards)
    fallbacks: int = 0

    def unbind(self, parent: nn.Module) -> None:
        router, experts = get_path(parent, self.router_path), get_path(parent, self.experts_path)
        _restore_forward(router, self.router_original)
        _restore_forward(experts, self.experts_original)


def _tensors(parent: nn.Module, st: PairState) -> list:
    out = []
    for p in st.paths:
        if p is None:
            out.append(None)
            continue
        t = parent
        for a in p:
            t = getattr(t, a)
        out.append(t)
    return out


def _can_fuse(parent: nn.Module, st: PairState, x: torch.Tensor) -> bool:
    """May the op stand in for this call? Hooks and attribute changes are checked in eager mode only (under
    torch.compile, as for bound blocks: Dynamo guards on what it traced); gradients always."""
    if torch.is_grad_enabled():
        if x.requires_grad or any(isinstance(t, torch.Tensor) and t.requires_grad for t in _tensors(parent, st)):
            return False
    if not torch.compiler.is_compiling():
        if hooks_active(st.watch_mods):
            return False
        if snapshot_changed(st.snapshot) or snapshot_changed(st.experts_snapshot):
            return False
    return True


def _is_marker(ids, w, h, H: int) -> bool:
    return (isinstance(ids, torch.Tensor) and isinstance(w, torch.Tensor) and ids.dim() >= 1 and ids.shape[-1] == 0
            and not ids.is_floating_point() and w.is_floating_point() and w.shape[-1] == H
            and isinstance(h, torch.Tensor) and w.numel() == h.numel())


class RouterStandIn:
    """The router's forward while bound: the marker and its input, for the experts' stand-in (module docstring)."""

    def __init__(self, parent: nn.Module, router: nn.Module):
        self.parent, self.router = parent, router

    def original(self, *args, **kwargs):
        st: PairState = self.parent._moecomp
        if st.router_original is not None:
            return st.router_original(*args, **kwargs)
        return type(self.router).forward(self.router, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        st: PairState = self.parent._moecomp
        L = st.layout
        r = args[L.r_arg] if len(args) == L.r_nargs and not kwargs else None
        if not isinstance(r, torch.Tensor) or r.shape[-1] != st.spec.hidden_size or not _can_fuse(self.parent, st, r):
            if not torch.compiler.is_compiling():
                st.fallbacks += 1
            return self.original(*args, **kwargs)
        out = [None] * L.r_nout
        out[L.r_ids] = r.new_empty((*r.shape[:-1], 0), dtype=torch.long)
        out[L.r_w] = r
        return tuple(out)


class ExpertsStandIn:
    """The experts' forward while bound: one ``moe_forward`` when handed the router stand-in's marker."""

    def __init__(self, parent: nn.Module, experts: nn.Module):
        self.parent, self.experts = parent, experts

    def original(self, *args, **kwargs):
        st: PairState = self.parent._moecomp
        if st.experts_original is not None:
            return st.experts_original(*args, **kwargs)
        return type(self.experts).forward(self.experts, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        st: PairState = self.parent._moecomp
        L = st.layout
        if kwargs or len(args) != L.x_nargs:
            return self.original(*args, **kwargs)
        h, ids, r = args[L.x_h], args[L.x_ids], args[L.x_w]
        if not _is_marker(ids, r, h, st.spec.hidden_size):
            return self.original(*args, **kwargs)
        if not _can_fuse(self.parent, st, h):  # the router took the op's path, the experts cannot: route for real
            router = get_path(self.parent, st.router_path)
            ro = router.__dict__["forward"].original(*_router_args(st, r))
            a = list(args)
            a[L.x_ids], a[L.x_w] = ro[L.r_ids], ro[L.r_w]
            if not torch.compiler.is_compiling():
                st.fallbacks += 1
            return self.original(*a)
        tensors = _tensors(self.parent, st)
        tensors[_RX] = r.reshape(h.shape)
        if not torch.compiler.is_compiling():
            st.calls += 1
        return call_moe_forward(h, tensors, st.spec)


def _router_args(st: PairState, r: torch.Tensor) -> list:
    a = [None] * st.layout.r_nargs
    a[st.layout.r_arg] = r
    return a


def bind_pair(parent: nn.Module, name: str, spec: MoESpec, bindings: dict, router_path: str, experts_path: str,
              layout: PairLayout) -> PairState:
    """Install the two stand-ins (module docstring); the parent's own forward stays."""
    if getattr(parent, "_moecomp", None) is not None:
        raise BindError("already bound")
    missing = [a for a in OP_ARGS if a not in bindings]
    if missing:
        raise BindError(f"bindings lack {missing}")
    router, experts = get_path(parent, router_path), get_path(parent, experts_path)
    unbind_experts(experts)  # an experts-only binding of an earlier optimize: the pair replaces it
    paths = tuple(None if bindings[a] is None else tuple(bindings[a].split(".")) for a in OP_ARGS)
    watch = tuple(dict.fromkeys([*router.modules(), *experts.modules()]))
    st = PairState(name=name, spec=spec, bindings=dict(bindings), router_path=router_path, experts_path=experts_path,
                   layout=layout, paths=paths, router_original=router.__dict__.get("forward"),
                   experts_original=experts.__dict__.get("forward"), watch_mods=watch)
    parent._moecomp = st
    router.forward = RouterStandIn(parent, router)
    experts.forward = ExpertsStandIn(parent, experts)
    st.snapshot = take_snapshot(router)
    st.experts_snapshot = take_snapshot(experts)
    return st


def unbind_pair(parent: nn.Module) -> bool:
    st = parent.__dict__.get("_moecomp")
    if not isinstance(st, PairState):
        return False
    st.unbind(parent)
    del parent._moecomp
    return True
