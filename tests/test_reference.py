"""moecomp.oracle.reference helpers beyond the oracle itself."""

import torch

from moecomp.oracle import reference
from moecomp.core.spec import MoESpec


def test_near_tie_tokens_finds_exact_and_near_ties_only():
    spec = MoESpec(num_experts=4, top_k=2, hidden_size=4, intermediate_size=4)
    w = torch.eye(4)  # logits = x
    x = torch.tensor([
        [4.0, 3.0, 3.0, 0.0],  # exact tie between the 2nd and 3rd expert
        [4.0, 3.0, 2.99, 0.0],  # 0.01 apart, within rel 1e-2 * max|logit| = 0.04
        [4.0, 3.0, 1.0, 0.0],  # clear margin
    ])
    near = reference.near_tie_tokens(x, w, None, None, spec, rel=1e-2)
    assert near.tolist() == [True, True, False]
    grouped = MoESpec(num_experts=4, top_k=1, hidden_size=4, intermediate_size=4, n_group=2, topk_group=1,
                      group_score="max", scoring="none", renormalize=False)
    x = torch.tensor([[4.0, 0.0, 4.0, 3.0], [4.0, 0.0, 1.0, 0.5]])  # group maxima tie / not
    assert reference.near_tie_tokens(x, w, None, None, grouped, rel=1e-3).tolist() == [True, False]
