"""The graph facts the FX pass's stages (``detect_moe`` and its ``moe_*`` modules) and its numeric check
(``numeric``) share: one layer below all of them, so none imports another's module for them."""

from __future__ import annotations

import torch
import torch.fx as fx

from . import graph as _fx
from .graph import arg, op_name
from .moe_flat import flat_view


class Context:
    """Graph facts of one ``detect_moe`` call, shared by the matcher's stages and its numeric check (``numeric``):
    placeholders, their values, which of them are weights, linear forms, the top-k candidates of stacked experts
    (those of per-expert modules: ``moe_per_expert.selector_topks``)."""

    def __init__(self, gm, example_inputs, *, verify):
        self.gm = gm
        self.graph = gm.graph
        self.verify = verify
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.values: dict = {}
        if example_inputs is not None and len(example_inputs) == len(self.placeholders):
            for p, v in zip(self.placeholders, example_inputs):
                self.values[p] = v
        else:
            for p in self.placeholders:
                self.values[p] = _fx.meta_val(p)
        # weight-like placeholders: SymInts, and tensors of static shape that are state, not call arguments
        # (parameters, buffers, 0-d scalar attributes). Static shape alone is not enough: under static shapes the
        # token ids / hidden states the model is called with are static too, and taking them for weights makes
        # every later layer "computable from the block input plus weights" (one region swallowing all blocks).
        self.static_ph = set()
        self._flat: dict = {}
        for p in self.placeholders:
            v = _fx.meta_val(p)
            if v is None:
                v = self.values.get(p)
            if isinstance(v, (torch.SymInt, int, float, torch.SymFloat)):
                self.static_ph.add(p)
            elif isinstance(v, torch.Tensor) and all(_fx.static_int(d) is not None for d in v.shape):
                if not _fx.is_call_input(p, self.values.get(p)):
                    self.static_ph.add(p)

    def pshape(self, n) -> tuple | None:
        if isinstance(n, fx.Node) and n.op == "placeholder":
            v = _fx.meta_val(n)
            if v is None:
                v = self.values.get(n)
            if isinstance(v, torch.Tensor):
                return tuple(v.shape)
        return None

    def weight_ph(self, n, ndim: int | None = None):
        """``n`` (through casts / views that keep it whole) as a static-shape tensor placeholder, else None."""
        base = _fx.strip_views_casts(n, views=False)
        if isinstance(base, fx.Node) and op_name(base) == "dequant_fp8":  # a quantized weight (recognise/fx/moe_quant.py)
            base = _fx.strip_views_casts(arg(base, 0), views=False)
        if isinstance(base, fx.Node) and base.op == "placeholder" and base in self.static_ph:
            s = self.pshape(base)
            if s is not None and (ndim is None or len(s) == ndim):
                return base
        return None

    def flat_view(self, p, E: int, nodes=None):
        """``moe_flat.flat_view`` of 2-D placeholder ``p`` for E experts (cached per p and E over the whole graph)."""
        if nodes is not None:
            return flat_view(self.pshape(p), p, E, nodes)
        key = (p, E)
        if key not in self._flat:
            self._flat[key] = flat_view(self.pshape(p), p, E)
        return self._flat[key]

    def as_linear(self, n: fx.Node):
        """``n`` as y = a @ W.T (+ b) with W a 2-D weight placeholder [out, in]: (a, W, b) or None.

        Spellings: ``F.linear`` / ``nn.Linear``, ``a @ W.t()`` / ``W.T`` / ``W.mT`` / ``W.transpose(0, 1)`` /
        ``W.permute(1, 0)`` (``matmul`` or ``mm``)."""
        name = op_name(n)
        if name == "linear":
            w = self.weight_ph(arg(n, 1), 2)
            b = arg(n, 2)
            bp = self.weight_ph(b, 1) if isinstance(b, fx.Node) else None
            if w is None or (b is not None and bp is None):
                return None
            return arg(n, 0), w, bp
        if name in ("matmul", "mm"):
            rhs = arg(n, 1)
            if isinstance(rhs, fx.Node) and _is_2d_transpose(rhs):
                w = self.weight_ph(arg(rhs, 0), 2)
                if w is not None:
                    return arg(n, 0), w, None
        return None

    def final_topks(self) -> list[fx.Node]:
        """Top-k nodes whose indices select slices of 3-D weights with as many experts as the top-k input, or, where
        no 3-D weight has that many, with fewer but more than half as many (zero experts: the router scores E + Z
        outputs, Z < E, the stacked weights hold E; ``moe_experts._zero_experts``)."""
        ph3 = {}
        flat = []  # 2-D weights that may hold the experts flat (moe_flat): their expert count depends on E
        for p in self.static_ph:
            s = self.pshape(p)
            if s is not None and len(s) == 3:
                ph3[p] = s[0]
            elif s is not None and len(s) == 2:
                flat.append(p)
        out = []
        for n in self.graph.nodes:
            if op_name(n) != "topk":
                continue
            s = _fx.shape_of(arg(n, 0))
            if not s:
                continue
            E = _fx.static_int(s[-1])
            if E is None:
                continue
            counts = {E} if E in ph3.values() else {e for e in ph3.values() if 2 * e > E and e < E}
            w3 = {p for p, e in ph3.items() if e in counts} | {p for p in flat if self.flat_view(p, E) is not None}
            if not w3:
                continue
            # indices must reach a 3-D weight's consumer
            idx = [u for u in n.users if op_name(u) == "getitem" and u.args[1] == 1]
            if not idx:
                continue
            reach = _fx.descendants(idx[0])
            if any(_fx.weight_base(a) in w3 for r in reach for a in r.all_input_nodes):
                out.append(n)
        # (group top-k's read [T, G] / [T, G, E/G] and were skipped by the expert-count check above)
        return out


def _is_2d_transpose(n: fx.Node) -> bool:
    name = op_name(n)
    if name == "t" or (name == "getattr" and len(n.args) > 1 and n.args[1] in ("T", "mT")):
        return True
    if name == "transpose":
        return sorted(int(d) % 2 for d in n.args[1:3]) == [0, 1]
    return name == "permute" and list(n.args[1:]) in ([1, 0], [[1, 0]], [(1, 0)])
