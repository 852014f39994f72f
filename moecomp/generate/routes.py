"""``generate(..., return_routed_experts=True)`` on the engine's path: each MoE block's expert ids recorded inside the
compiled, captured steps (issue 43).

Every block the engine records is bound whole by ``moecomp.optimize``; its ``BoundState.route_sink`` names a static
int32 buffer that the op's routing kernel writes its [T, k] ids into (``moe_forward_routes``: no extra launch in the
block). The sinks are rows of one slot-owned buffer, so a step adds two small launches in all:

    prefill   sinks = rows of pre [L, Bb*S, k] (filled with -1)  -> model(prompt)  -> hist[:, :, :S] = pre
              (the captured prefill, ``prefill.py``: S = the prompt bucket, pre kept per bucket; columns past the
              prompt hold its padding's ids until the decode steps overwrite them, before they are returned)
    step      step.fill_(-1) -> sinks = rows of step [L, Bb, k]  -> model(tok)     -> hist[:, :, slot] = step
              (both captured in the step's CUDA graph; ``slot`` is the device-side cache index)
    result    hist[:, :B, :cols]  ->  [L, B, cols] int64

A block that ran its original forward instead of the op (a fallback) leaves its rows at -1: :func:`missing` counts
those among the tokens the model was fed, and the caller says so rather than return them as routes.
"""

from __future__ import annotations

import torch


class SlotRoutes:
    """The routes of one engine slot (``batch`` rows, cache ``length``) for ``blocks`` (module order)."""

    def __init__(self, blocks: list, batch: int, length: int, device):
        self.blocks = list(blocks)
        ks = {_state(b).spec.top_k for b in self.blocks}
        if len(ks) != 1:
            raise ValueError(f"blocks: expected one top_k across the recorded blocks, got {sorted(ks)}")
        self.k = ks.pop()
        L = len(self.blocks)
        self.step = torch.full((L, batch, self.k), -1, dtype=torch.int32, device=device)  # [L, Bb, k]
        self.hist = torch.full((L, batch, length, self.k), -1, dtype=torch.int32, device=device)  # [L, Bb, Lc, k]
        self.pre = None  # [L, Bb*S, k] during a prefill
        self.pres: dict = {}  # tokens -> the buffer of a captured prefill of that many tokens (its graph writes it)

    def same(self, blocks: list) -> bool:
        return len(blocks) == len(self.blocks) and all(a is b for a, b in zip(blocks, self.blocks))

    def _attach(self, rows: torch.Tensor) -> None:
        for b, r in zip(self.blocks, rows):
            _state(b).route_sink = r

    def detach(self) -> None:
        for b in self.blocks:
            _state(b).route_sink = None

    def prefill_begin(self, tokens: int, keep: bool = False) -> None:
        """Before the prefill of ``tokens`` = Bb * S rows: every block writes a row of a -1 buffer, a fresh one, or
        with ``keep`` the one kept for that many tokens (made on first use, outside any capture)."""
        self.hist.fill_(-1)
        pre = self.pres.get(tokens) if keep else None
        if pre is None:
            pre = torch.empty((len(self.blocks), tokens, self.k), dtype=torch.int32, device=self.step.device)
            if keep:
                self.pres[tokens] = pre
        pre.fill_(-1)
        self.pre = pre
        self._attach(self.pre)

    def prefill_end(self, S: int) -> None:
        L, Bb = self.step.shape[:2]
        self.hist[:, :, :S] = self.pre.view(L, Bb, S, self.k)
        self.record_steps()

    def record_steps(self) -> None:
        """The blocks record into the step buffer (after a prefill, also one replayed or abandoned)."""
        self.pre = None
        self._attach(self.step)

    def step_begin(self) -> None:
        self.step.fill_(-1)

    def step_end(self, slot: torch.Tensor) -> None:
        """After a step's forward: its ids into column ``slot`` (a 0-d device tensor: no host read)."""
        self.hist.index_copy_(2, slot.view(1), self.step.unsqueeze(2))

    def result(self, batch: int, cols: int) -> torch.Tensor:
        """[L, batch, cols] int64 ids of the first ``batch`` rows and ``cols`` cache columns."""
        return self.hist[:, :batch, :cols].long()


def missing(routes: torch.Tensor, fed: torch.Tensor) -> int:
    """How many (layer, row, token) triples the model was fed (``fed`` [B, cols] bool) but have no recorded ids."""
    return int(((routes < 0).all(-1) & fed[None].to(routes.device)).sum())


def _state(block):
    return block.__dict__["_moecomp"]
