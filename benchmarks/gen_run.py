"""The timed generate calls of the generate benchmarks (transformers' loop with a per-step clock, moecomp's one-liner
engine): below ``bench_generate.py`` and ``gen_profile.py``, which both time through them."""

from __future__ import annotations

import time

import torch

from gen_optimize import require_generate


def run_hf_loop(model, ids, new: int, cuda: bool, **kw) -> tuple[torch.Tensor, float, float]:
    from transformers import StoppingCriteriaList

    from moecomp.testing import StepClock

    clock = StepClock(cuda)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([clock]), **kw)
    ts = clock.times
    prefill = ts[0] - t0
    decode = (ts[-1] - ts[0]) / max(1, len(ts) - 1)
    return out, prefill, decode


ONE_LINER_WARM = 3  # new tokens of each one-liner warm-up call: step 1 eager, step 2 captured


def run_one_liner(model, ids, new: int, cuda: bool) -> tuple[torch.Tensor, float, float, dict]:
    require_generate(model)
    model.generate.cpu = True  # CPU smoke runs: the engine (CPU models keep transformers' loop by default)
    if cuda:
        torch.cuda.synchronize()
    eng = getattr(model.generate, "engine", None)
    before = dict(eng.stats) if eng is not None else {}
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    last = dict(model.generate.last)
    if eng is not None:  # what the timed call paid besides replays (0 and 0 once warm)
        last.update(eager_steps=eng.stats["eager_steps"] - before.get("eager_steps", 0),
                    captures=eng.stats["captures"] - before.get("captures", 0))
    if last.get("path") != "moecomp":
        raise RuntimeError(f"one-liner fell back to transformers: {last}")
    return out, last["prefill_s"], last["decode_s"] / max(1, last["decode_steps"]), last
