"""The experts-only rewrite: an ``@use_experts_implementation`` experts module whose block cannot be rewritten
whole gets its forward switched to ``moe_experts`` (routing stays transformers'), when a probe showed them equal
(``api/experts_only.py`` decides; this module binds and unbinds).

    experts.forward = ExpertsForward(experts)
      (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])  ->  moecomp_experts_forward (moe_experts)
      gradients needed, another call form, or another experts implementation named (bind/impl_switch.py)
                                                                 ->  the original forward
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.spec import MoESpec
from .bind_common import BindError, restore_forward as _restore_forward, warn_grad as _warn_grad, claim
from .impl_switch import as_before as _as_before, release as _release_impl, requested as _requested_impl
from .impl_switch import warn_once as _warn_impl
from ..core.snapshot import Snapshot, snapshot_changed, snapshot_diff, take_snapshot


@dataclass
class ExpertsState:
    """An experts module switched to ``moe_experts`` by ``optimize`` (its block's routing stays HF's)."""

    name: str
    spec: MoESpec
    reason: str  # why the whole block was not rewritten
    original: object  # the instance-level forward we replaced, or None (class forward)
    calls: int = 0
    fallbacks: int = 0
    snapshot: Snapshot | None = None  # the module's attributes when ``spec`` was checked (for optimize's report)
    impl_config: object = None  # as in BoundState
    impl_prev: str | None = None


def experts_block_forward(m: nn.Module, *args, **kwargs):
    """Replacement forward of an experts module bound by :func:`bind_experts`.

    The standard call ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` runs ``moe_experts``, except
    with gradients to compute (grad mode on, and the module is training or an input / expert weight requires grad):
    then, like anything else, the original forward (exact gradients; warned once per process in eval mode).
    Attribute changes (``act_fn`` replaced, ...) are followed: the spec is re-derived and checked again
    (``experts_interface._spec_cached``)."""
    from ..hf.experts_interface import experts_grad_needed, moecomp_experts_forward

    st: ExpertsState = m._moecomp_experts
    compiling = torch.compiler.is_compiling()
    a = list(args) + list(kwargs.values())
    impl = _requested_impl(getattr(st, "impl_config", None))
    if impl is not None and not compiling:
        _warn_impl(impl)
    if impl is None and len(a) == 3 and all(isinstance(t, torch.Tensor) for t in a) and a[0].dim() == 2 and a[1].dim() == 2 \
            and not a[1].is_floating_point() and a[2].shape == a[1].shape:
        grad = ""
        if torch.is_grad_enabled():
            grad = "training" if m.training else experts_grad_needed(m, a[0], a[2])
        if not grad:
            if not compiling:  # (compiled code must not mutate state Dynamo guards on)
                st.calls += 1
            return moecomp_experts_forward(m, *a)
        if grad != "training" and not compiling:
            _warn_grad(grad)
    if not compiling:
        st.fallbacks += 1
    from ..formats.fp8 import plain_experts_call

    plain = plain_experts_call(m)
    with _as_before(getattr(st, "impl_config", None), getattr(st, "impl_prev", None)):
        if plain is not None:  # FP8 experts: transformers' forward needs the hub's kernel
            return plain(*args, **kwargs)
        if st.original is not None:
            return st.original(*args, **kwargs)
        return type(m).forward(m, *args, **kwargs)


class ExpertsForward:
    """``experts.forward`` after an experts-only rewrite: ``moecomp_experts_forward`` for the standard call
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``, the original forward for anything else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return experts_block_forward(self.module, *args, **kwargs)

    def __getstate__(self):
        return {"module": self.module}

    def __setstate__(self, state):
        self.module = state["module"]


def bind_experts(experts: nn.Module, name: str, spec: MoESpec, reason: str) -> ExpertsState:
    if getattr(experts, "_moecomp_experts", None) is not None:
        raise BindError("experts already bound")
    st = ExpertsState(name=name, spec=spec, reason=reason, original=experts.__dict__.get("forward"))
    st.snapshot = take_snapshot(experts)
    experts._moecomp_experts = st
    claim(st, [experts])
    experts.forward = ExpertsForward(experts)
    return st


def experts_stale(experts: nn.Module) -> str:
    """Why an experts-only binding's spec no longer fits the module ("" when it does). Calls follow such changes by
    themselves (the spec is derived and checked again, ``experts_interface._spec_cached``); ``optimize`` asks this to
    bind afresh, with a report of the new spec."""
    st = experts.__dict__.get("_moecomp_experts")
    snap = getattr(st, "snapshot", None)
    if snap is None or not snapshot_changed(snap):
        return ""
    return snapshot_diff(snap) or "module tree changed"


def unbind_experts(experts: nn.Module) -> bool:
    st = experts.__dict__.get("_moecomp_experts")
    if st is None:
        return False
    _restore_forward(experts, st.original)
    _release_impl(getattr(st, "impl_config", None), getattr(st, "impl_prev", None))
    del experts._moecomp_experts
    experts.__dict__.pop("_moecomp_experts_specs", None)
    experts.__dict__.pop("_moecomp_experts_snap", None)
    return True

