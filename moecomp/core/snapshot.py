"""What a bound module's spec was derived from, and whether it changed since (``bind/bind.py`` docstring,
"Attributes"): the plain scalar attributes, the callables and the child modules of the module and everything under
it. Used by the binder (whole blocks) and the experts-only path (``experts_interface``); below both of them."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import nn

from .names import JITTER_NAMES
from .derived import get_path

_SCALAR_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)
_NO_SCALARS = (nn.Linear, nn.Identity)  # torch modules whose forward reads no scalar attribute
_SKIP_ATTRS = frozenset({"training", "_compiled_call_impl"}) | frozenset(JITTER_NAMES)
_DICT = operator.attrgetter("__dict__")
_MODULES = operator.attrgetter("_modules")
_call = getattr(operator, "call", None) or (lambda f, *a: f(*a))  # operator.call: Python 3.11+
_MISSING = object()


def _watched(key: str, v, scalars: bool, keep: frozenset = frozenset()) -> bool:
    if key in keep and isinstance(v, _SCALAR_TYPES):
        return True
    if key in _SKIP_ATTRS or key.startswith("_moecomp") or isinstance(v, (nn.Module, torch.Tensor)):
        return False
    if isinstance(v, _SCALAR_TYPES):
        return scalars and not key.startswith("_")
    return callable(v)


@dataclass
class Snapshot:
    """What a bound module's spec was derived from (see the module docstring, "Attributes").

    Per watched module (pre-order, so a parent is compared before its children): the names of its watched
    ``__dict__`` entries and their values, as ``operator.itemgetter`` returns them (one value, or a tuple); per module
    with children: a copy of its ``_modules``. Module references stay valid while every parent's ``_modules``
    compares equal, which the eager check tests first.
    """

    paths: tuple  # per watched module: its path ("" = the root)
    mods: tuple
    keys: tuple  # per watched module: the watched names
    getters: tuple  # per watched module: operator.itemgetter(*keys)
    values: tuple
    kid_paths: tuple
    kid_mods: tuple
    kids: tuple  # per module with children: dict(m._modules) at snapshot time


def take_snapshot(root: nn.Module, skip_root_forward: bool = True, keep: frozenset = frozenset()) -> Snapshot:
    """The snapshot of ``root`` and every module under it. ``skip_root_forward``: the root's instance ``forward``
    is ours (the binder's), not a watched callable. ``keep``: scalar names watched in every module all the same
    (the jitter attributes of a sparsemixer block, whose eval-mode threshold is one of them)."""
    paths, mods, keys, getters, values, kpaths, kmods, kids = [], [], [], [], [], [], [], []
    for path, m in root.named_modules():
        scalars = not isinstance(m, _NO_SCALARS)
        ks = tuple(k for k, v in m.__dict__.items()
                   if _watched(k, v, scalars, keep) and not (skip_root_forward and m is root and k == "forward"))
        if ks:
            g = operator.itemgetter(*ks)
            paths.append(path)
            mods.append(m)
            keys.append(ks)
            getters.append(g)
            values.append(g(m.__dict__))
        if m._modules or not isinstance(m, _NO_SCALARS):
            kpaths.append(path)
            kmods.append(m)
            kids.append(dict(m._modules))
    return Snapshot(tuple(paths), tuple(mods), tuple(keys), tuple(getters), tuple(values), tuple(kpaths),
                    tuple(kmods), tuple(kids))


def snapshot_changed(snap: Snapshot) -> bool:
    """Eager check: has anything in the snapshot changed? (C-level compares; a few hundred ns per module)"""
    try:
        if tuple(map(_MODULES, snap.kid_mods)) != snap.kids:
            return True
        return tuple(map(_call, snap.getters, map(_DICT, snap.mods))) != snap.values
    except Exception:  # a watched name left __dict__ (KeyError), or an odd __eq__
        return True


def snapshot_diff(snap: Snapshot) -> str:
    """What changed, for the warning ("" when nothing did)."""
    def full(path, k):
        return f"{path}.{k}" if path else k

    for path, m, saved in zip(snap.kid_paths, snap.kid_mods, snap.kids):
        cur = m._modules
        for k in list(saved) + [k for k in cur if k not in saved]:
            a, b = saved.get(k, _MISSING), cur.get(k, _MISSING)
            if a is not b:
                what = "added" if a is _MISSING else "removed" if b is _MISSING else (
                    f"replaced ({type(a).__name__} -> {type(b).__name__})")
                return f"child module {full(path, k)!r} {what}"
    for path, m, ks, vals in zip(snap.paths, snap.mods, snap.keys, snap.values):
        vals = vals if len(ks) > 1 else (vals,)
        for k, v in zip(ks, vals):
            cur = m.__dict__.get(k, _MISSING)
            if cur is _MISSING or not (cur is v or (type(cur) is type(v) and cur == v)):
                now = "no longer a plain attribute" if cur is _MISSING else _short(cur)
                return f"attribute {full(path, k)!r} ({_short(v)} -> {now})"
    return ""


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def snapshot_changed_traced(root: nn.Module, snap: Snapshot) -> bool:
    """The same comparison, written for Dynamo: attributes read with getattr and compared with constants, so that
    Dynamo guards on each of them (a change recompiles, and the new trace takes the original forward)."""
    for path, saved in zip(snap.kid_paths, snap.kids):
        m = get_path(root, path)
        for k, child in saved.items():
            if getattr(m, k, None) is not child:
                return True
    for path, ks, vals in zip(snap.paths, snap.keys, snap.values):
        m = get_path(root, path)
        vals = vals if len(ks) > 1 else (vals,)
        for k, v in zip(ks, vals):
            cur = getattr(m, k, _MISSING)
            if isinstance(v, _SCALAR_TYPES):
                # No ``is`` on ``cur`` here: under dynamic shapes (the prefill) Dynamo may hold an int attribute as a
                # symbolic int, and torch 2.11's Dynamo cannot trace ``symint is object`` (it raised
                # InternalTorchDynamoError, so gpt-oss's prefill ran eagerly). isinstance and == trace (and guard).
                if not isinstance(cur, type(v)) or (isinstance(cur, bool) and not isinstance(v, bool)) or cur != v:
                    return True
            elif cur is not v:
                return True
    return False
