"""What flows between the stages: a recogniser's :class:`Match`, the verify stage's :class:`Verified`.

    block ──► recogniser (FX pass | attribute reader) ──► Match | Reject
                                                              │
          Match = spec          what the block computes (MoESpec)
                  bindings      op argument (OP_ARGS) -> block-relative tensor path | a Derived's name | None
                                | forward_arg(name): the block forward's argument ``name`` (hash routing's
                                  token ids: ``token_ids`` -> ``forward_arg("input_ids")``)
                  derived       tensors built from the block's (stacked ModuleList experts, cat of split gate/up)
                  parts         the block's named modules (router, experts, shared expert): hooks, extra outputs
                  evidence      which recogniser, how it checked, which spec fields came from which attribute
                                                              │
    verify (op against the block on probes) ──► Verified(match, contract, error, ignored args, epilogue) | Reject
                                                              │
    bind (the block's forward becomes one op call) ◄──────────┘

Recognisers return a ``Match`` or a :class:`moecomp.core.reject.Reject` (a code and a message); stages that raise use
:class:`moecomp.core.reject.Refused`. Nothing here runs a block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .derived import Derived, get_path
from .args import OP_ARGS
from .spec import MoESpec


_ARG = ("<arg:", ">")


def forward_arg(name: str) -> str:
    """A binding to the block forward's argument ``name`` (read from each call, not from the block)."""
    return f"{_ARG[0]}{name}{_ARG[1]}"


def arg_name(binding) -> str | None:
    """The forward argument a binding names (:func:`forward_arg`), or None for a tensor path / Derived / None."""
    if isinstance(binding, str) and binding.startswith(_ARG[0]) and binding.endswith(_ARG[1]):
        return binding[len(_ARG[0]):-len(_ARG[1])]
    return None


def call_params(bindings: dict) -> dict[str, str]:
    """{op argument: forward argument name} of the bindings that name forward arguments."""
    return {a: n for a, p in bindings.items() if (n := arg_name(p)) is not None}


@dataclass
class Evidence:
    """How a Match was found and what backs it (for the report; control flow reads none of it)."""

    method: str  # "fx" (the FX pass over Dynamo's graph) | "fallback" (attribute reader) | "fallback (meta)"
    # | "dispatch" (the dispatch reader: the block run with its experts observed)
    checked: str = ""  # the recogniser's own check: the FX pass's numeric check, "routing measured", "read only"
    constants: dict[str, str] = field(default_factory=dict)  # spec field -> attribute path its value was read from
    notes: list[str] = field(default_factory=list)  # for the report


@dataclass(frozen=True)
class Contract:
    """How the original forward shaped its result (read from a probe run; the binder reproduces it).

    ``primary``: "same" (like the input), "flat2d" ([T, H]) or "flat1d" ([T*H]).
    ``extras``: for a tuple result, one entry per further element: ("router", j, shape_mode) = element j of the
    router module's output reshaped ("same" / "flat1d" / "rows"), or ("none",).
    """

    primary: str = "same"
    is_tuple: bool = False
    extras: tuple = ()
    router_call: str = "x2"  # the router was called with the flattened input ("x2") or the input as given ("x")


def shape_mode(t: torch.Tensor, ref: torch.Tensor) -> str | None:
    """How ``t`` is ``ref`` reshaped (a :class:`Contract` extras mode), or None."""
    if t.shape == ref.shape:
        return "same"
    if t.dim() == 1 and t.numel() == ref.numel():
        return "flat1d"
    if t.dim() == 2 and t.numel() == ref.numel() and ref.dim() >= 1 and t.shape[-1] == ref.shape[-1]:
        return "rows"
    return None


def reshape_to(t: torch.Tensor, mode: str, like: torch.Tensor | None = None):
    """``t`` reshaped by a :class:`Contract` extras mode (``like``'s shape for "same")."""
    if mode == "same":
        return t if like is None else t.reshape(like.shape)
    if mode == "flat1d":
        return t.reshape(-1)
    return t.reshape(-1, t.shape[-1])


@dataclass
class Match:
    """One MoE block as a recogniser describes it (see the module docstring)."""

    spec: MoESpec
    bindings: dict[str, str | None]
    derived: list[Derived] = field(default_factory=list)
    parts: object = None  # moecomp.core.parts.BlockParts (router / experts / shared module paths), or None
    evidence: Evidence = field(default_factory=lambda: Evidence("fx"))
    max_tokens: int = 0  # > 0: the recogniser proved the op for calls of up to this many tokens only (longer calls
    # run the block's original forward: the dispatch reader saw no capacity drop up to it, one beyond is possible)

    def __post_init__(self):
        unknown = set(self.bindings) - set(OP_ARGS)
        if unknown:
            raise ValueError(f"bindings: expected keys among moecomp.ops.OP_ARGS, got {sorted(unknown)}")
        self.bindings = {a: self.bindings.get(a) for a in OP_ARGS}
        names = {d.name for d in self.derived}
        for a, p in self.bindings.items():
            if a in ("router_w", "w13", "w2") and p is None:
                raise ValueError(f"bindings[{a!r}]: expected a tensor path or a derived tensor's name, got None")
            if arg_name(p) is not None and a != "token_ids":
                raise ValueError(f"bindings[{a!r}] = {p!r}: only token_ids may be a forward argument")
        dup = len(names) != len(self.derived)
        if dup:
            raise ValueError("derived: expected distinct names")

    @property
    def method(self) -> str:
        return self.evidence.method

    def replace(self, **kw) -> Match:
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        bound = ", ".join(f"{k}={v}" for k, v in self.bindings.items() if v is not None)
        return f"{self.spec.describe()} [{bound}] ({self.evidence.method}; {self.evidence.checked})"


@dataclass
class Verified:
    """A Match the verify stage proved on probes, with what the binder needs besides it."""

    match: Match  # spec as verified (a routed scale fitted on the probe is folded in)
    contract: Contract
    max_rel_err: float
    ignored_params: frozenset = frozenset()  # extra forward arguments checked to make no difference
    epilogue: tuple = ()  # what the block applies to the MoE output, in order: child module paths (called), its own
    # [H] (or [1, .., 1, H]) tensors (added: an output bias); ``apply_epilogue``


# ``PEELED`` (``core/args.py``): the attribute ``epilogue.Peeled`` sets on a block tensor it zeroed
# for a capture (an output bias bound after the op): the capture's tail check (``capture._adds_zero``) takes the add
# of such a tensor as the identity it then is, and the FX numeric check leaves it zero.


def is_tensor_entry(block, name: str) -> bool:
    """Whether ``Verified.epilogue`` entry ``name`` is an output bias (a tensor of the block), not a child module."""
    return name in block._parameters or name in block._buffers


def apply_epilogue(block, names, y):
    """``y`` with a ``Verified.epilogue`` applied: children called in order, an output bias added."""
    for n in names:
        y = y + getattr(block, n) if is_tensor_entry(block, n) else get_path(block, n)(y)
    return y


# -------------------------------------------------------------------- the pair rewrite (api/pair.py; issue 21)
# A decoder layer whose router and experts are sibling children: read by ``recognise/pair_reader.py``, checked by
# ``verify/pair_verify.py``, bound by ``bind/bind_pair.py`` (two stand-ins). Here, below all three.
@dataclass
class PairLayout:
    """Where the parent's call puts things: the router's tensor argument (index among ``r_nargs`` positional
    arguments), the ids / weights slots of its output tuple (of ``r_nout``), and the experts' positional arguments
    (hidden states, ids, weights; of ``x_nargs``)."""

    r_arg: int = 0
    r_nargs: int = 1
    r_nout: int = 3
    r_ids: int = 2
    r_w: int = 1
    x_nargs: int = 3
    x_h: int = 0
    x_ids: int = 1
    x_w: int = 2


@dataclass
class PairMatch:
    spec: MoESpec
    bindings: dict  # OP_ARGS name -> path relative to the parent (router_x: None, the router's input at run time)
    router: str
    experts: str
    layout: PairLayout
    perturb: list = field(default_factory=list)  # parent-relative paths of constant vectors to randomise in checks
    notes: list = field(default_factory=list)
    method: str = "pair"
