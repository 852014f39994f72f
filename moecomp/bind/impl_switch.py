"""``model.set_experts_implementation(name)`` after ``moecomp.optimize(model)``: the bound blocks run ``name``.

transformers dispatches an ``@use_experts_implementation`` experts module by its config's
``_experts_implementation`` (an internal field, not saved with the config). A bound block never reaches that
dispatch: it runs moecomp's op. So binding marks the experts' config "moecomp" (``claim``), which is what then runs,
and a bound block (whole, or experts only) runs its original forward whenever the config names anything else
(``requested``): transformers' own forward, which dispatches to the implementation asked for.

    optimize(model)                          config "moecomp"   bound blocks: moecomp's op
    model.set_experts_implementation("eager")  config "eager"   bound blocks: transformers' forward -> "eager"
                                                                (one warning per name, saying how to come back)
    model.set_experts_implementation("moecomp") or optimize(model)   moecomp's op again
    unoptimize(model)                        config back to the name it had before optimize

Claiming happens only where "moecomp" is registered in the experts' interface (so the dispatch can resolve it if
transformers' forward runs anyway, e.g. with gradients: it then reaches moecomp's experts-only forward, which is
checked equal and falls back itself when gradients are needed). Models without such a config are untouched.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

NAME = "moecomp"
_FIELD = "_experts_implementation_internal"  # the storage behind config._experts_implementation
_warned: set = set()
# config -> the name ``claim`` replaced: one model config is shared by every layer's experts, so once the first block
# is bound, the blocks optimize has not reached yet would dispatch their experts to moecomp too (``as_claimed``)
# (configs are unhashable: keyed by id, each entry holding a weak reference to its config, dropped with it)
_claimed: dict = {}


def experts_config(modules) -> tuple:
    """(config, fp8) of the experts module among ``modules`` that transformers dispatches by name (an
    ``@use_experts_implementation`` one, or ``FP8Experts``); (None, False) if there is none."""
    from ..formats import fp8 as _fp8
    from ..hf.experts_interface import is_hf_experts

    for m in modules:
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(cfg, _FIELD):
            continue
        if is_hf_experts(m):
            return cfg, False
        if _fp8.fp8_kind(m) == "experts":
            return cfg, True
    return None, False


def _registered(fp8: bool) -> bool:
    from ..hf import experts_interface as ei

    if fp8:
        return ei.FP8_REGISTERED or (ei.register_fp8() and ei.FP8_REGISTERED)
    return ei.ensure_registered()


def claim(config, fp8: bool = False) -> str | None:
    """Mark ``config`` "moecomp"; returns the name it had (None: it said "moecomp" already, or nothing claimed)."""
    if config is None or not _registered(fp8):
        return None
    prev = getattr(config, _FIELD, None)
    if prev == NAME:
        return None
    setattr(config, _FIELD, NAME)
    try:
        key = id(config)
        _claimed[key] = (weakref.ref(config, lambda _, k=key: _claimed.pop(k, None)), prev)
    except TypeError:  # a config that takes no weak reference: ``unclaimed`` then changes nothing for it
        pass
    return prev


def _claimed_prev(config) -> str | None:
    """The name ``claim`` replaced in ``config`` (None: never claimed)."""
    entry = _claimed.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


def release(config, prev: str | None) -> None:
    """Put back the name ``claim`` replaced, unless the user has named another implementation since."""
    if config is not None and prev is not None and getattr(config, _FIELD, None) == NAME:
        setattr(config, _FIELD, prev)


@contextlib.contextmanager
def as_before(config, prev: str | None):
    """While a bound block runs its original forward (gradients, hooks, ...): the config names the implementation
    it had before binding, so that forward dispatches as it did before ``optimize`` (not to "moecomp"). Nothing
    changes under torch.compile (no config writes in traced code), when the user named an implementation since, or
    when the config said "moecomp" before binding."""
    if (config is None or prev is None or getattr(config, _FIELD, None) != NAME
            or torch.compiler.is_compiling()):
        yield
        return
    setattr(config, _FIELD, prev)
    try:
        yield
    finally:
        if getattr(config, _FIELD, None) == prev:
            setattr(config, _FIELD, NAME)


@contextlib.contextmanager
def unclaimed(modules):
    """While a block that is not bound yet is recognised and verified: if its experts' config was marked "moecomp"
    by the binding of another block (layers share one config), it names the implementation it had before, so the
    block's original forward runs transformers' experts path, not moecomp's (an independent reference, and no
    experts-only check of every layer's experts on the way: 54-68 s of ``optimize`` on a 48-layer Qwen3-30B-A3B on
    an H200). Nothing changes when nothing was claimed or the user named an implementation since."""
    config, _ = experts_config(modules)
    prev = _claimed_prev(config) if config is not None else None
    if prev is None or getattr(config, _FIELD, None) != NAME or torch.compiler.is_compiling():
        yield
        return
    setattr(config, _FIELD, prev)
    try:
        yield
    finally:
        if getattr(config, _FIELD, None) == prev:
            setattr(config, _FIELD, NAME)


def requested(config) -> str | None:
    """The implementation the user asked transformers for, when it is not moecomp's; None to run moecomp's op.
    Cheap and traceable (one attribute read: Dynamo guards on it)."""
    if config is None:
        return None
    name = getattr(config, _FIELD, NAME)
    return None if name == NAME or not isinstance(name, str) else name


def warn_once(name: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(
        f"moecomp: the experts implementation is now {name!r} (set_experts_implementation): the MoE blocks that "
        f"moecomp.optimize rewrote run transformers' forward with {name!r}. "
        f"model.set_experts_implementation('moecomp') or moecomp.optimize(model) runs them on moecomp's op again. "
        f"(Warned once per name.)", UserWarning, stacklevel=5)
