"""Tensors the op needs that a block does not hold as such, built from the block's own tensors.

A ModuleList of expert MLPs has per-expert ``[I, H]`` weights where the op reads one ``[E, 2I, H]`` tensor; a
router that runs in fp32 over 16-bit weights needs an fp32 copy; FSE reads ``[router; shared_gate]`` as one
tensor. A :class:`Derived` says how to build such a tensor from block-relative paths; the recognisers put them in a
:class:`moecomp.core.match.Match`, the binder builds them once (sharing the sources' storage where the layout allows:
:meth:`Derived.share_plan`) and keeps them current.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def get_path(root: nn.Module, path: str):
    """The object at a dotted attribute path below ``root`` (``""``: root itself)."""
    obj = root
    if not path:
        return obj
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Derived:
    """A tensor the op needs but the module does not hold, built from module tensors (``sources``).

    ``kind`` "stack": per expert, the listed paths are concatenated on dim 0, then stacked on a new dim 0 (a
    ModuleList of expert MLPs); "cat": the listed tensors are concatenated on ``dim`` (separate 3-D gate / up, or
    router and shared-expert gate rows); "rows": a view of the first ``rows`` rows of the one source, no copy
    (LongCat-Flash's gate_up_proj holds E + Z experts where the op reads E: ``MoESpec.zero_experts``); "view": the
    one source viewed as ``shape`` then permuted by ``perm``, no copy (every expert's rows in one 2-D matrix read as
    [E, ., .], or a 3-D weight read transposed: ``recognise/fx/moe_flat.py``).
    ``fp32``: the result is converted to fp32 (an fp32 router over 16-bit weights). ``inline``: small enough to build
    on every call inside a compiled graph (always fresh there).

    Sharing (:meth:`share_plan` / :meth:`build_shared`): where every source is a contiguous block of the result
    ("stack" of per-expert 1-D / 2-D tensors, "cat" on dim 0, same dtype, no fp32 conversion), the result is built
    once and each source Parameter / buffer is re-pointed at its block (``param.data = result[i, rows]``: the same
    object, so optimizers and references keep working). The weights are then held once, and every write to them,
    ``.data`` writes included, is a write to the op's tensor. Other kinds (separate 3-D gate / up: the sources
    would be strided views; fp32 copies) stay copies, rebuilt when a source's identity, storage, version, dtype or
    device changes (``.data`` writes do not bump the version: see :mod:`moecomp.bind.bind`).
    """

    name: str  # buffer name on the block
    sources: list[list[str]]
    kind: str = "stack"
    dim: int = 1
    fp32: bool = False
    inline: bool = False
    rows: int = 0  # kind "rows": how many leading rows of the source
    shape: tuple = ()  # kind "view": the source viewed as this shape,
    perm: tuple = ()  # then permuted so (experts first)

    @property
    def is_view(self) -> bool:
        """Does the result share the source's storage by construction (a view: "rows", "view")?"""
        return self.kind in ("rows", "view")

    def build(self, block: nn.Module) -> torch.Tensor:
        """A new tensor (a copy, "rows" a view: the sources are left as they are)."""
        with torch.no_grad():
            if self.kind == "rows":  # a view (it shares the source's storage: nothing is copied)
                out = get_path(block, self.sources[0][0]).detach()[: self.rows]
                return out.float() if self.fp32 else out
            if self.kind == "view":  # a view too (``Tensor.view`` never copies: it raises where it cannot view)
                out = get_path(block, self.sources[0][0]).detach().view(self.shape).permute(self.perm)
                return out.float() if self.fp32 else out
            if self.kind == "cat":
                ts = [get_path(block, p).detach() for p in self.sources[0]]
                out = torch.cat([t.to(ts[0].dtype) for t in ts], self.dim).contiguous()
            else:
                rows = [torch.cat([get_path(block, p).detach() for p in group], 0) for group in self.sources]
                out = torch.stack(rows, 0)
            return out.float() if self.fp32 else out

    def source_paths(self) -> list[str]:
        return [p for g in self.sources for p in g]

    def share_plan(self, block: nn.Module) -> SharePlan | None:
        """Where each source would sit in a shared result, or None when this tensor cannot share its sources'
        storage (layout, fp32 conversion, mixed dtypes / devices, tensor subclasses, computed or repeated sources).
        Reads only; :meth:`build_shared` applies the plan."""
        if self.fp32 or not (self.kind == "stack" or (self.kind == "cat" and self.dim == 0)):
            return None
        owners, names, slots, seen = [], [], [], set()
        tail = dtype = device = None
        rows = None
        for i, group in enumerate(self.sources if self.kind == "stack" else [self.source_paths()]):
            r = 0
            for p in group:
                mpath, _, name = p.rpartition(".")
                try:
                    owner = get_path(block, mpath) if mpath else block
                except AttributeError:
                    return None
                if not isinstance(owner, nn.Module):
                    return None
                t = owner._parameters.get(name) if name in owner._parameters else owner._buffers.get(name)
                if t is None or type(t) not in (torch.Tensor, nn.Parameter) or id(t) in seen or t.dim() not in (1, 2):
                    return None
                if t.is_sparse or t.is_quantized:
                    return None
                if tail is None:
                    tail, dtype, device = tuple(t.shape[1:]), t.dtype, t.device
                elif tuple(t.shape[1:]) != tail or t.dtype != dtype or t.device != device:
                    return None
                seen.add(id(t))
                owners.append(owner)
                names.append(name)
                slots.append((i if self.kind == "stack" else None, r, r + t.shape[0]))
                r += t.shape[0]
            if rows is None:
                rows = r
            elif r != rows:
                return None
        if not owners:
            return None
        shape = (len(self.sources), rows) + tail if self.kind == "stack" else (rows,) + tail
        return SharePlan(tuple(owners), tuple(names), tuple(slots), shape, dtype, device)

    def build_shared(self, block: nn.Module, plan: SharePlan) -> tuple[torch.Tensor, SharedLayout]:
        """Build the result and re-point every source at its block of it (see the class docstring). Sources are
        copied and re-pointed one at a time, so that their old storage can go as the new one fills: the peak is the
        result plus the sources' old storage, never a third copy."""
        with torch.no_grad():
            out = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
            for owner, name, (i, r0, r1) in zip(plan.owners, plan.names, plan.slots):
                t = owner._parameters[name] if name in owner._parameters else owner._buffers[name]
                view = out[r0:r1] if i is None else out[i, r0:r1]
                view.copy_(t.detach())
                t.data = view
            base = out.data_ptr()
            offsets = tuple(
                (owner._parameters[n] if n in owner._parameters else owner._buffers[n]).data_ptr() - base
                for owner, n in zip(plan.owners, plan.names))
        return out, SharedLayout(plan.owners, plan.names, offsets)


@dataclass
class SharePlan:
    """:meth:`Derived.share_plan`'s answer: per source, its owner module, tensor name and (expert, rows) slot."""

    owners: tuple
    names: tuple
    slots: tuple  # (expert index or None for "cat", first row, end row)
    shape: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass
class SharedLayout:
    """A shared derived tensor as built: per source, its owner module, name and byte offset into the result.

    The sources are current while each one's ``data_ptr()`` is the result's plus its offset (it is then a view of
    the result's storage: only that storage holds those addresses while the result lives). Owner modules are kept
    by reference; the binder checks first that the block's module tree is unchanged (attribute snapshot), so they
    are the modules at those paths. Offsets are relative, so a model pickled whole (``torch.save(model)``) loads
    still shared.
    """

    owners: tuple
    names: tuple
    offsets: tuple

    def current(self, buf: torch.Tensor | None) -> bool:
        if buf is None:
            return False
        base = buf.data_ptr()
        try:
            for owner, n, off in zip(self.owners, self.names, self.offsets):
                t = owner._parameters.get(n)
                if t is None:
                    t = owner._buffers[n]
                if t.data_ptr() - base != off:
                    return False
        except (KeyError, AttributeError):
            return False
        return True

    def sources(self):
        for owner, n in zip(self.owners, self.names):
            t = owner._parameters.get(n)
            yield t if t is not None else owner._buffers.get(n)
