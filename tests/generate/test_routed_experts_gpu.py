"""``generate(..., return_routed_experts=True)`` on CUDA (issue 43): the routes recorded inside the engine's compiled,
captured decode steps (``generate/routes.py``).

Reference: ``moecomp.record_routing`` over one teacher-forced forward of the generated sequence (the same tokens),
on the op's eager path. fp32 models: the captured, Inductor-compiled step and the eager forward agree to rounding, so
the ids agree except at near-ties of the router's scores; the test counts disagreements and allows at most 0.5% of
the entries (none expected). A replay of the routes over the sequence gives its logits to 1e-4 relative (fp32).
"""

import pytest
import torch

import moecomp
from moecomp.api.routing import moe_blocks

from .models import build, prompts

pytestmark = pytest.mark.gpu
AGREE = 0.995
REPLAY_TOL = 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_engine_records_in_captured_steps(family):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = moecomp.optimize(build(family, "cuda", torch.float32, layers=3, seed=0))
    ids, mask = prompts(m.config.vocab_size, 3, 9, seed=1, left_pad=(0, 3, 5))
    ids, mask = ids.cuda(), mask.cuda()
    out = m.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                     return_dict_in_generate=True, return_routed_experts=True)
    last = m.generate.last
    assert last["path"] == "moecomp" and last["graphs"] == "replayed", last
    assert last["routes"] == "recorded in the engine's steps" and last["routes_missing"] == 0, last
    seq, routes = out.sequences, out.routed_experts
    L, k = len(moe_blocks(m)), moe_blocks(m)[0][1]._moecomp.spec.top_k
    assert routes.shape == (L, 3, seq.shape[1], k)
    full = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1], dtype=mask.dtype, device="cuda")], 1)
    with torch.no_grad(), moecomp.record_routing(m) as rec:
        want = m(input_ids=seq, attention_mask=full).logits
    ref = rec.routes  # [L, 3, cols, k]
    live = full.bool().clone()
    live[:, -1] = False
    assert bool((routes[:, ~live] == -1).all()) and bool((routes[:, live] >= 0).all())
    same = (routes[:, live].sort(-1).values == ref[:, live].sort(-1).values).all(-1).float().mean()
    assert float(same) >= AGREE, float(same)
    with torch.no_grad(), moecomp.replay_routing(routes, m):
        got = m(input_ids=seq, attention_mask=full).logits
    keep = full.bool()
    assert float((got - want)[keep].abs().max() / want[keep].abs().max()) <= REPLAY_TOL
    again = m.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                       return_dict_in_generate=True, return_routed_experts=True)
    assert m.generate.last["graphs"] == "replayed" and torch.equal(again.routed_experts, routes)
    plain = m.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(plain, seq)  # recording changes no token
