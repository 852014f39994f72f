"""Token selection inside a decode step: transformers' own logits processors, then greedy or sampled choice.

    logits [B, V] fp32 -> min-length eos mask -> HF warpers (temperature, top-k, top-p, min-p) -> argmax | sample
                       -> finished rows get the pad token -> out[:, step] ; unfinished &= next not in eos

Everything is device arithmetic on tensors that live in the step's static state (``StepState``), so the same code
runs eagerly (CPU, warm-up) and inside a captured CUDA graph. Which processors are allowed is decided by
``Sampler.from_hf``: the warpers transformers builds for the call are applied as they are (they are pure tensor
functions of the scores); the two min-length processors read the current length from the host in transformers, so
they are re-expressed here with the step counter as a tensor; anything else is refused (the caller then uses
transformers' own loop).

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` per entry: the exponential race, which picks token ``i`` with
probability ``p_i`` exactly like ``torch.multinomial(p, 1)``, but without the host-side checks that keep
``multinomial`` out of CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
_MIN_LENGTH = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")
_STOPPING = ("MaxLengthCriteria", "EosTokenCriteria")


class Unsupported(Exception):
    """The call needs something the graphed loop does not do (the caller falls back to transformers' loop)."""


@dataclass
class MinLength:
    """Mask the eos tokens while fewer than ``min_new`` tokens were generated (``min_new`` is set per call)."""

    eos: tuple[int, ...]
    banned: torch.Tensor | None = None  # [V] bool, built by Sampler.prepare (no host-to-device copy in a graph)


def _signature(p) -> tuple:
    items = []
    for k, v in sorted(vars(p).items()):
        if isinstance(v, torch.Tensor):
            v = ("tensor", tuple(v.reshape(-1).tolist()))
        elif not isinstance(v, (int, float, bool, str, type(None))):
            raise Unsupported(f"{type(p).__name__}.{k} is a {type(v).__name__}")
        items.append((k, v))
    return (type(p).__name__, tuple(items))


@dataclass
class Sampler:
    do_sample: bool
    processors: list  # HF warpers and MinLength, in transformers' order
    eos: tuple[int, ...]  # empty: no eos stopping
    pad: int
    min_new: int = 0  # per call (min-length processors), not part of the signature
    signature: tuple = field(default=())
    eos_t: torch.Tensor | None = None  # [n_eos] long, built by prepare

    def prepare(self, device, vocab: int) -> "Sampler":
        """Build the constant tensors the step reads, before any capture (a capture must not copy from the host)."""
        if self.eos:
            self.eos_t = torch.tensor(self.eos, dtype=torch.long, device=device)
        for p in self.processors:
            if isinstance(p, MinLength):
                p.banned = torch.zeros(vocab, dtype=torch.bool, device=device)
                p.banned[list(p.eos)] = True
        return self

    @classmethod
    def from_hf(cls, logits_processor, stopping_criteria, generation_config, prompt_len: int) -> tuple["Sampler",
                                                                                                       int]:
        """(sampler, max_length) for a call, or ``Unsupported`` naming what the graphed loop does not do."""
        procs, sig, min_new = [], [], 0
        for p in logits_processor or []:
            name = type(p).__name__
            if name in _WARPERS:
                procs.append(p)
                sig.append(_signature(p))
            elif name in _MIN_LENGTH:
                eos = tuple(int(t) for t in torch.as_tensor(p.eos_token_id).reshape(-1).tolist())
                if name == "MinLengthLogitsProcessor":
                    need = int(p.min_length) - prompt_len
                else:
                    need = int(p.min_new_tokens) - (prompt_len - int(p.prompt_length_to_skip))
                min_new = max(min_new, need)
                procs.append(MinLength(eos))
                sig.append(("MinLength", eos))
            else:
                raise Unsupported(f"logits processor {name}")
        max_length, eos = None, ()
        for c in stopping_criteria or []:
            name = type(c).__name__
            if name not in _STOPPING:
                raise Unsupported(f"stopping criterion {name}")
            if name == "MaxLengthCriteria":
                max_length = int(c.max_length) if max_length is None else min(max_length, int(c.max_length))
            else:
                eos = tuple(sorted(set(eos) | {int(t) for t in torch.as_tensor(c.eos_token_id).reshape(-1).tolist()}))
        if max_length is None:
            raise Unsupported("no max_length")
        pad = generation_config._pad_token_tensor
        if eos and pad is None:
            raise Unsupported("eos stopping without a pad token")
        pad = -1 if pad is None else int(torch.as_tensor(pad).reshape(-1)[0])
        do_sample = bool(generation_config.do_sample)
        procs, sig = _canonical_min_length(procs, sig, eos)
        s = cls(do_sample, procs, eos, pad, max(0, min_new))
        s.signature = (do_sample, tuple(sig), eos, pad)
        return s, max_length


def _canonical_min_length(procs: list, sig: list, eos: tuple) -> tuple[list, list]:
    """With eos stopping, one MinLength on the stopping eos first, whether or not the call asked for a minimum
    (``min_new`` 0 masks nothing): a call with ``min_new_tokens`` (``moecomp.warmup``'s) and one without then share
    a captured step. Kept as transformers ordered them where a min-length processor names other tokens or comes
    after a warper."""
    if not eos:
        return procs, sig
    ml = [i for i, p in enumerate(procs) if isinstance(p, MinLength)]
    if any(tuple(sorted(set(procs[i].eos))) != eos for i in ml) or ml != list(range(len(ml))):
        return procs, sig
    rest = [(p, g) for p, g in zip(procs, sig) if not isinstance(p, MinLength)]
    return [MinLength(eos)] + [p for p, _ in rest], [("MinLength", eos)] + [g for _, g in rest]


class StepState:
    """The tensors one decode step reads and writes, allocated once per (batch, length) slot."""

    def __init__(self, batch: int, length: int, device):
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.out = z(batch, length)  # generated tokens, column t = step t
        self.step = z(())  # tokens generated so far
        self.ncols = z(())  # steps taken while some real row was unfinished (the columns generate() returns)
        self.unfinished = z(batch, dt=torch.bool)
        self.min_new = z(())
        self.dummy_ids = z(batch, 1)  # the input_ids argument of HF warpers (they do not read it)

    def start(self, real_rows: int, min_new: int) -> None:
        self.out.zero_()
        self.step.zero_()
        self.ncols.zero_()
        self.unfinished.zero_()
        self.unfinished[:real_rows] = True
        self.min_new.fill_(min_new)


def select(logits: torch.Tensor, st: StepState, s: Sampler) -> torch.Tensor:
    """logits [B, V] -> next tokens [B] (long); records them and the stop state in ``st`` (device ops only)."""
    scores = logits.float()
    for p in s.processors:
        if isinstance(p, MinLength):
            scores = scores.masked_fill(p.banned & (st.step < st.min_new), float("-inf"))
        else:
            scores = p(st.dummy_ids, scores)
    if s.do_sample:
        probs = torch.softmax(scores, dim=-1)
        q = torch.empty_like(probs).exponential_()
        nxt = torch.argmax(probs / q, dim=-1)
    else:
        nxt = torch.argmax(scores, dim=-1)
    st.ncols.add_(st.unfinished.any().long())
    if s.eos:
        nxt = torch.where(st.unfinished, nxt, torch.full_like(nxt, s.pad))
        st.unfinished.logical_and_(~torch.isin(nxt, s.eos_t))
    st.out.index_copy_(1, st.step.reshape(1), nxt[:, None])
    st.step.add_(1)
    return nxt
