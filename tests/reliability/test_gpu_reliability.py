"""The GPU part of the reliability suite (H200 class; skipped without CUDA):

* 64-bit offsets where the expert intermediate ``[T * k, 2 I]`` passes 2**31 elements (Mixtral-8x7B layer sizes);
* 100 CUDA-graph replays of the op with new inputs each time, equal to plain launches of the same call;
* a capture under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync on the captured path);
* 1,000+ decode steps of the one-liner ``generate()`` with changing batch sizes and lengths: memory stops growing
  (slots and graph pools bounded); the peak is reported.

Tolerances: bf16 against the fp32 reference 2e-2 relative Frobenius (as tests/ops/test_gpu.py); a replay against a
plain launch of the same kernels 1e-3 (the same kernels; only the order of atomic adds may differ).
Figures go to ``$MOECOMP_RELIABILITY_JSON`` when set (RELIABILITY.md quotes them).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from moecomp.oracle import reference
from moecomp.core.spec import MoESpec
from moecomp.testing import LAYER_PRESETS, capture_moe_forward, random_moe_args

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

FIGURES: dict = {}


def _record(key, value):
    FIGURES[key] = value
    path = os.environ.get("MOECOMP_RELIABILITY_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_intermediate_past_2_31_elements():
    """Mixtral-8x7B layer sizes, T = 40,000: [T * k, 2 I] = 2.29e9 elements (> 2**31) in the first GEMM's output."""
    spec = LAYER_PRESETS["mixtral_8x7b"]
    T = 40_000
    assert T * spec.top_k * 2 * spec.intermediate_size > 2**31
    args = random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=4)
    out = torch.ops.moecomp.moe_forward(*args, spec.key)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    rows = torch.tensor([0, 1, 777, T // 2, T - 2, T - 1], device="cuda")
    err = rel_err(out[rows], reference.moe_forward(args[0][rows], *args[1:], spec))
    _record("intermediate_past_2_31", {"T": T, "elements": T * spec.top_k * 2 * spec.intermediate_size,
                                       "rel_err_sampled_rows": err})
    assert err < 2e-2
    del args, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name,T", [("qwen3_30b_a3b", 1), ("qwen3_30b_a3b", 16), ("qwen15_moe_a27b", 8),
                                    ("qwen15_moe_a27b", 200)])
def test_100_replays_with_new_inputs_equal_plain_launches(name, T):
    spec = LAYER_PRESETS[name]
    args = list(random_moe_args(spec, T, torch.bfloat16, "cuda", std=0.02, seed=T))
    static_x = args[0].clone()
    g, static_out = capture_moe_forward(static_x, args[1:], spec, sync_check=True)  # a host sync there raises
    gen = torch.Generator("cuda").manual_seed(100 + T)
    worst_plain, worst_ref, same = 0.0, 0.0, 0
    for i in range(100):
        static_x.copy_(torch.randn(T, spec.hidden_size, device="cuda", generator=gen).to(torch.bfloat16))
        static_out.fill_(float("nan"))
        g.replay()
        plain = torch.ops.moecomp.moe_forward(static_x.clone(), *args[1:], spec.key)  # dispatcher: plain launches
        assert torch.isfinite(static_out).all(), i
        same += int(torch.equal(static_out, plain))
        worst_plain = max(worst_plain, rel_err(static_out, plain))
        if i % 10 == 0:
            worst_ref = max(worst_ref, rel_err(static_out, reference.moe_forward(static_x, *args[1:], spec)))
    _record(f"replays_{name}_T{T}", {"replays": 100, "bitwise_equal": same, "max_rel_err_vs_plain": worst_plain,
                                     "max_rel_err_vs_reference": worst_ref})
    assert worst_plain < 1e-3 and worst_ref < 2e-2


def test_thousand_decode_steps_with_changing_batches_memory_bounded():
    """The one-liner generate() over changing batch sizes / lengths (more than the engine's slot count): after the
    first round has created every kind of slot, later rounds' peaks stay within 5% (+1 MiB) of it."""
    import copy

    import moecomp
    from tests.generate.models import build, prompts

    ref = build("qwen3_moe", "cuda", torch.bfloat16, layers=2, hidden_size=256, moe_intermediate_size=128,
                intermediate_size=256)
    opt = moecomp.optimize(copy.deepcopy(ref))
    steps, peaks, graphs = 0, [], set()
    for rnd in range(4):
        torch.cuda.reset_peak_memory_stats()
        for B, S, n in ((1, 5, 40), (3, 9, 33), (17, 20, 50), (5, 300, 30), (33, 7, 60), (2, 11, 45)):
            ids, mask = prompts(opt.config.vocab_size, B, S, seed=B + rnd)
            opt.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            last = opt.generate.last
            assert last["path"] == "moecomp", last
            graphs.add(last["graphs"])
            steps += last["decode_steps"]
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    _record("decode_memory", {"decode_steps": steps, "peak_bytes_per_round": peaks,
                              "slots": len(opt.generate.engine.slots), "graphs": sorted(graphs)})
    assert steps >= 1000 and graphs == {"replayed"}
    assert len(opt.generate.engine.slots) <= 3
    assert max(peaks[1:]) <= peaks[0] * 1.05 + 2**20, peaks
