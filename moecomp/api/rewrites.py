"""The rewrites ``optimize`` / ``scan`` try on a candidate block, in order: :data:`REWRITES`.

    sharded       transformers' distributed loading sharded the block's experts (DTensors): recognised on the
                  sharded block, checked against its sharded forward, bound to the parallel op
                  (:mod:`moecomp.api.hf_distributed`); nothing else is tried on such a block
    whole         the block recognised, verified and bound as one moe_forward call (:mod:`moecomp.api.whole`)
    pair          router and experts sit beside other things in a parent (a decoder layer): the two children
                  rewritten together (:mod:`moecomp.api.pair`)
    experts_only  a standard experts module switched to moe_experts, routing left as it is
                  (:mod:`moecomp.api.experts_only`)

Each is a small :class:`Rewrite`: ``applies(ctx)`` says whether it is tried on the block (``ctx``: a
:class:`Candidate`), ``run(ctx)`` tries it and updates ``ctx.rep`` (the block's ``BlockReport``). :func:`run_rewrites`
walks the registry in order while the block's status is still "skipped": the first strategy that settles the block
(rewritten, supported, unverified, experts only) ends the walk, and each refusal is added to the report (its code,
its reason or a note) as the next one is tried. A strategy that rewrites a block (status "rewritten" or "experts
only") counts it in ``moecomp.counters["rewrite"][name]``.

Before the walk, ``optimize`` settles what needs no rewrite (``api/optimize.py``): a block bound before ("already"),
a candidate that is no block (``ctx.whole_possible`` False: only the experts-only rewrite may still apply), router
and experts next to attention (refused; the pair and experts-only rewrites may still apply).

``REWRITES.register(strategy, before="pair")`` adds one, ``REWRITES.unregister("pair")`` removes one
(:class:`moecomp.core.registry.Registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core import counters as _counters
from ..core.parts import BlockParts
from ..core.registry import Registry
from ..core.status import BlockStatus
from . import experts_only as _experts_only, hf_distributed as _hf_distributed, pair as _pair, whole as _whole
from .report import BlockReport

REWROTE = (BlockStatus.REWRITTEN, BlockStatus.EXPERTS_ONLY)  # the statuses a strategy counts


@dataclass
class Candidate:
    """One candidate block on its way through the rewrites: what ``optimize`` was asked, and the block's report."""

    name: str
    block: nn.Module
    parts: BlockParts | None  # None: structure.iter_blocks found no router / experts to name (``rep.reason``: why)
    rep: BlockReport
    use_fx: bool = True
    bind_it: bool = True  # optimize (True) or scan (False)
    cache: dict | None = None  # per-structure answers shared by the blocks of one optimize call
    trust_fallback: bool = False
    experts_only: bool = True  # optimize(experts_only=...)
    calls: _pair.ParentCalls | None = None  # the parents' recorded calls (the pair rewrite)
    whole_possible: bool = True  # False: the checks before the walk refused a whole-block rewrite


class Rewrite:
    """One way to rewrite a block. ``name``: its key in the registry and in ``moecomp.counters["rewrite"]``."""

    name = ""

    def applies(self, ctx: Candidate) -> bool:
        raise NotImplementedError

    def run(self, ctx: Candidate) -> None:
        """Try it; ``ctx.rep`` gets the result (status, spec) or why not (codes, reason, notes)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<rewrite {self.name!r}>"


class Sharded(Rewrite):
    name = "sharded"

    def applies(self, ctx: Candidate) -> bool:
        return ctx.whole_possible and _hf_distributed.sharded(ctx.block)

    def run(self, ctx: Candidate) -> None:
        _hf_distributed.process(ctx.name, ctx.block, ctx.parts, ctx.rep, ctx.bind_it)


class WholeBlock(Rewrite):
    name = "whole"

    def applies(self, ctx: Candidate) -> bool:
        # (a sharded block is the sharded rewrite's alone: every rewrite below needs the whole experts)
        return ctx.whole_possible and not _hf_distributed.sharded(ctx.block)

    def run(self, ctx: Candidate) -> None:
        _whole.rewrite(ctx.name, ctx.block, ctx.parts, ctx.rep, ctx.use_fx, ctx.bind_it, ctx.cache,
                       ctx.trust_fallback)


class Pair(Rewrite):
    name = "pair"

    def applies(self, ctx: Candidate) -> bool:
        # also after a structure refusal (router and experts beside attention): that is the pair's case
        return ctx.parts is not None and not _hf_distributed.sharded(ctx.block)

    def run(self, ctx: Candidate) -> None:
        _pair.try_pair(ctx.name, ctx.block, ctx.parts, ctx.rep, ctx.bind_it, ctx.calls)


class ExpertsOnly(Rewrite):
    name = "experts_only"

    def applies(self, ctx: Candidate) -> bool:
        # also for a candidate with no parts named (its experts child is found by structure)
        return ctx.experts_only and not _hf_distributed.sharded(ctx.block)

    def run(self, ctx: Candidate) -> None:
        _experts_only.try_experts_only(ctx.name, ctx.block, ctx.parts, ctx.rep, ctx.bind_it)


REWRITES = Registry("rewrite", (Sharded(), WholeBlock(), Pair(), ExpertsOnly()))


def run_rewrites(ctx: Candidate) -> None:
    """Try the registered rewrites in order until one settles the block (module docstring)."""
    for r in REWRITES:
        if ctx.rep.status != BlockStatus.SKIPPED:
            return
        if not r.applies(ctx):
            continue
        r.run(ctx)
        if ctx.rep.status in REWROTE:
            _counters.counters["rewrite"][r.name] += 1
