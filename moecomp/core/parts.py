"""What a candidate MoE block owns, as paths relative to the block: ``BlockParts`` (router, experts, shared
experts, latent projections, norms) and ``MLPParts`` (one dense MLP). Filled by the finders (``recognise/structure.py``:
by part names, or by shapes alone), read by every later stage (probes, verify, the binder, the report): data only,
so it sits in core, below all of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from .derived import get_path


@dataclass
class MLPParts:
    """A dense (shared or per-expert) MLP: paths of its Linear weights, relative to the block."""

    path: str
    gated: bool
    concat: bool  # gate and up in one Linear ([2I, H], gate rows first)
    gate: str | None  # weight paths
    up: str | None
    down: str
    gate_bias: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None
    intermediate_size: int = 0
    stacked: int = 0  # S > 0: S experts' weights stacked [S, out, in] (3-D Parameters of one module, Inkling)


@dataclass
class BlockParts:
    """What a candidate MoE block owns; every path is relative to the block module."""

    experts: str  # path of the experts module / ModuleList
    kind: str  # "fused" (3-D weights), "modulelist", or "structural" (found by shapes: router and experts only)
    num_experts: int
    hidden_size: int
    intermediate_size: int
    router_weight: str
    router_module: str  # the module owning router_weight ("" when the block itself)
    router_bias: str | None = None
    correction_bias: str | None = None
    # fused experts
    w13: str | None = None  # gate_up (or up when not gated)
    w2: str | None = None
    b13: str | None = None
    b2: str | None = None
    gated: bool = True
    w_layout: str = "out_in"
    split_gate_up: tuple[str, str] | None = None  # separate 3-D gate and up weights (stacked once)
    # ModuleList experts
    expert_mlps: list[MLPParts] = field(default_factory=list)
    # shared experts
    shared: MLPParts | None = None
    shared_gate: str | None = None
    # latent projections around the experts (weights [L, H] in, [H, L] out; biases [L] / [H] or None)
    latent_size: int = 0
    latent_in: str | None = None
    latent_in_bias: str | None = None
    latent_out: str | None = None
    latent_out_bias: str | None = None
    # norms around the experts (MoESpec.latent_norm / expert_norm): module paths, each module's one 1-D weight
    latent_norm: str | None = None  # a child of the block normalising the latent projection's output [L]
    expert_norm: str | None = None  # a child of the experts module normalising each expert's output [width]
    extra_modules: list[str] = field(default_factory=list)  # parameterised children nothing above explains
    gamma_rows: int = 0  # router rows past the E experts: the shared experts' gammas (router [E + G, H], Inkling)
    # router rows past the E experts that no expert weight holds, Z < E (router [E + Z, H]): zero / identity experts
    # (LongCat-Flash on transformers >= 5.25: ``MoESpec.zero_experts``), what they compute left to the FX pass
    extra_rows: int = 0

    def submodule_paths(self, block: nn.Module | None = None) -> list[str]:
        """Modules the original forward calls and whose hooks must keep firing: router, experts, shared experts
        (with everything inside them when ``block`` is given)."""
        out = [self.router_module, self.experts]
        if self.shared is not None:
            out.append(self.shared.path)
        if self.shared_gate is not None:
            out.append(self.shared_gate.rsplit(".", 1)[0])
        out += [w.rsplit(".", 1)[0] for w in (self.latent_in, self.latent_out) if w is not None]
        out += [p for p in (self.latent_norm,) if p is not None]
        out = [p for p in dict.fromkeys(out) if p]
        if block is not None:
            full = []
            for p in out:
                full += [f"{p}.{n}" if n else p for n, _ in get_path(block, p).named_modules()]
            out = list(dict.fromkeys(full))
        return out

    def latent_bindings(self) -> dict[str, str | None]:
        """The latent projections' op arguments (``latent_in_w`` ...) -> paths; {} without them."""
        if not self.latent_size:
            return {}
        return dict(latent_in_w=self.latent_in, latent_in_b=self.latent_in_bias, latent_out_w=self.latent_out,
                    latent_out_b=self.latent_out_bias)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
