"""Expert weights held flat: one 2-D matrix holding every expert's rows (or columns), which the block reads as E
matrices, and the op reads as a view of the same storage (no copy)::

    w [E * n, C] ─► view / reshape / unflatten ─► [E, n, C]                         (rows split, experts outer)
    w [R, E * n] ─► view / reshape ─► [R, E, n]        (the op reads it permuted: [E, R, n], a strided view)
    w [E * n, C] ─► w[e * n:(e + 1) * n] | w.narrow(0, e * n, n) | w.chunk(E)[e] | w.split(n)[e]  (e = 0 .. E-1)
    w [R, E * n] ─► w[:, e * n:(e + 1) * n] | w.narrow(1, e * n, n) | w.chunk(E, 1)[e]

Whatever the block then does with the E matrices (gathers ``w3[ids]``, a loop over ``w3[e]``, ``grouped_mm``) is
read by ``moe_experts`` as for a stacked 3-D weight; which of the two matrix dims is the input is read from the
shapes there (the layout), the GEMM's spelling not being needed. :class:`FlatView` says how the op's [E, a, b]
tensor is taken from the placeholder: ``w.view(shape).permute(perm)``; the binder builds exactly that
(``moecomp.core.derived.Derived`` kind "view"). The same record reads a 3-D weight transposed (``perm`` (0, 2, 1)): where
one stacked weight is stored [in, out] and the other [out, in], the second is read transposed to the first's layout.

The experts' axis is the one of size E that the split made (the router's E outputs); where two axes have that size
(E == n), the one the block indexes (``select`` / ``getitem`` position) is taken, else the outer one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import graph as _fx
from .graph import arg, op_name

_KEEP = frozenset({"contiguous", "detach", "clone", "alias"}) | _fx.CAST_OPS  # same values, same shape
_RESHAPE = frozenset({"view", "reshape", "unflatten", "_unsafe_view", "view_as", "reshape_as", "flatten"})


@dataclass(frozen=True)
class FlatView:
    """The op's tensor from the placeholder's: ``t.view(shape).permute(perm)`` (experts on dim 0)."""

    shape: tuple
    perm: tuple

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.shape).permute(self.perm)

    @property
    def out_shape(self) -> tuple:
        return tuple(self.shape[i] for i in self.perm)

    def transposed(self) -> FlatView:
        """The same experts with their two matrix dims swapped."""
        return FlatView(self.shape, (self.perm[0], self.perm[2], self.perm[1]))

    @staticmethod
    def identity(shape: tuple) -> FlatView:
        return FlatView(tuple(shape), tuple(range(len(shape))))


def flat_view(shape: tuple, p: fx.Node, E: int, nodes=None) -> FlatView | None:
    """How the 2-D placeholder ``p`` (of ``shape``) holds E experts, read from how the block (``nodes``; None: the whole
    graph) takes it apart; None when it does not."""
    if shape is None or len(shape) != 2 or E < 2:
        return None
    for v in _reshaped(p, nodes):
        fv = _split_view(shape, _fx.shape_of(v), E, v)
        if fv is not None:
            return fv
    return _tiling(shape, p, E, nodes)


def _first_rows_view(shape: tuple, vs: tuple, E: int) -> FlatView | None:
    """[R, C] reshaped to ``vs`` (2-D, or more than 3-D) with experts outer, each its rows: ``w.view(E, -1)``
    ([E, R / E * C]) or dims that multiply to R first, the first of them E (``w.view(E, 2, I, H)``, gate and up
    apart): the op's [E, R / E, C]. None otherwise."""
    R, C = shape
    if not vs or vs[0] != E or R % E or math.prod(vs) != R * C:
        return None
    heads = [math.prod(vs[:j]) for j in range(1, len(vs))]
    if R in heads or (len(vs) == 2 and vs[1] == R // E * C):
        return FlatView((E, R // E, C), (0, 1, 2))
    return None


def flat_view_1d(shape: tuple, p: fx.Node, E: int, nodes=None) -> FlatView | None:
    """A 1-D placeholder [E * n] (per-expert biases held flat) viewed [E, n] by the block."""
    if shape is None or len(shape) != 1 or E < 2 or shape[0] % E:
        return None
    for v in _reshaped(p, nodes, ndim=2):
        s = _static(_fx.shape_of(v))
        if s is not None and s[0] == E and s[0] * s[1] == shape[0]:
            return FlatView(s, (0, 1))
    return None


def _static(s) -> tuple | None:
    if s is None:
        return None
    out = tuple(_fx.static_int(d) for d in s)
    return None if any(d is None for d in out) else out


def _reshaped(p: fx.Node, nodes, ndim: int = 3):
    """The first nodes of ``ndim`` dims (3: of 3 or more; or of 2 with a shape other than ``p``'s) that ``p`` is
    reshaped into (no transpose on the way)."""
    todo, seen = [p], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if (nodes is not None and u not in nodes) or u in seen or arg(u, 0) is not n:
                continue
            seen.add(u)
            name = op_name(u)
            if name not in _KEEP and name not in _RESHAPE:
                continue
            s = _fx.shape_of(u)
            if s is not None and name in _RESHAPE and (len(s) == ndim or ndim == 3 and (
                    len(s) > 3 or len(s) == 2 and tuple(s) != tuple(_fx.shape_of(p) or ()))):
                yield u
            else:
                todo.append(u)


def _split_view(shape: tuple, vs, E: int, v: fx.Node) -> FlatView | None:
    """[R, C] viewed as ``vs`` (3-D): a split of R (into (d0, d1), C kept) or of C ((d1, d2), R kept), with an axis
    of the split of size E."""
    vs = _static(vs)
    if vs is None:
        return None
    if len(vs) != 3:
        return _first_rows_view(shape, vs, E)
    R, C = shape
    if vs[0] * vs[1] == R and vs[2] == C:
        axes = (0, 1)
    elif vs[0] == R and vs[1] * vs[2] == C:
        axes = (1, 2)
    else:
        return None
    cands = [a for a in axes if vs[a] == E]
    if not cands:
        return None
    idx = _indexed_axes(v)
    a = next((c for c in cands if c in idx), cands[0])
    return FlatView(vs, (a,) + tuple(i for i in range(3) if i != a))


def _indexed_axes(v: fx.Node) -> set:
    """Axes of ``v`` that the block indexes (select's dim, a getitem's first non-full entry), through casts."""
    out, todo = set(), [v]
    while todo:
        n = todo.pop()
        for u in n.users:
            name = op_name(u)
            if arg(u, 0) is not n:
                continue
            if name in _KEEP:
                todo.append(u)
            elif name == "select" and isinstance(arg(u, 1, "dim"), int):
                out.add(arg(u, 1, "dim") % 3)
            elif name == "getitem":
                idx = u.args[1] if len(u.args) > 1 else None
                items = idx if isinstance(idx, tuple) else (idx,)
                pos = next((i for i, s in enumerate(items) if s != slice(None)), None)
                if pos is not None and items[pos] is not Ellipsis:
                    out.add(pos)
    return out


def _tiling(shape: tuple, p: fx.Node, E: int, nodes) -> FlatView | None:
    """E equal consecutive ranges of one dim of ``p`` that the block takes (constant slices / narrows / chunks /
    splits), covering it exactly: the experts, in order."""
    ranges = {0: set(), 1: set()}
    todo, seen = [p], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if (nodes is not None and u not in nodes) or u in seen or arg(u, 0) is not n:
                continue
            seen.add(u)
            name = op_name(u)
            if name in _KEEP:
                todo.append(u)
            elif name == "getitem":
                r = _slice_range(u.args[1] if len(u.args) > 1 else None, shape)
                if r is not None:
                    ranges[r[0]].add(r[1:])
            elif name == "narrow":
                d, start, length = (arg(u, i) for i in (1, 2, 3))
                if all(isinstance(x, int) for x in (d, start, length)) and d % 2 in ranges:
                    ranges[d % 2].add((start, start + length))
            elif name in ("chunk", "split"):
                ranges_of = _pieces(u, shape)
                if ranges_of is not None:
                    ranges[ranges_of[0]] |= ranges_of[1]
    for d in (0, 1):
        n, rem = divmod(shape[d], E)
        if rem == 0 and n > 0 and ranges[d] == {(e * n, (e + 1) * n) for e in range(E)}:
            return FlatView((E, n, shape[1]), (0, 1, 2)) if d == 0 else FlatView((shape[0], E, n), (1, 0, 2))
    return None


def _slice_range(idx, shape: tuple):
    """(dim, start, stop) of a getitem index that slices one dim of a 2-D tensor by constants (step 1)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if len(items) > 2 or not all(isinstance(s, slice) for s in items):
        return None
    cut = [(d, s) for d, s in enumerate(items) if s != slice(None)]
    if len(cut) != 1:
        return None
    d, s = cut[0]
    start = 0 if s.start is None else s.start
    stop = shape[d] if s.stop is None else min(s.stop, shape[d])
    if not isinstance(start, int) or not isinstance(stop, int) or s.step not in (None, 1) or start < 0:
        return None
    return d, start, stop


def _pieces(u: fx.Node, shape: tuple):
    """(dim, {(start, stop)}) of a constant chunk / split of a 2-D tensor (the pieces its getitems take)."""
    d = arg(u, 2, "dim", 0)
    size = arg(u, 1)
    if not isinstance(d, int):
        return None
    d %= 2
    n = shape[d]
    if op_name(u) == "chunk":
        if not isinstance(size, int) or size <= 0:
            return None
        step = -(-n // size)
        bounds = [(s, min(s + step, n)) for s in range(0, n, step)]
    elif isinstance(size, int) and size > 0:
        bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
    elif isinstance(size, (list, tuple)) and all(isinstance(x, int) for x in size):
        starts = [sum(size[:i]) for i in range(len(size))]
        bounds = [(s, s + x) for s, x in zip(starts, size)]
    else:
        return None
    taken = {bounds[g.args[1]] for g in u.users if op_name(g) == "getitem" and isinstance(g.args[1], int)
             and 0 <= g.args[1] < len(bounds)}
    return d, taken
