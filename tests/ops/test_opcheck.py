"""torch.library.opcheck on both ops: schema, fake tensor, AOT dispatch (static and dynamic), on several inputs,
one with zero tokens, for the default CPU path and the Triton path (interpreter)."""

import pytest
import torch

from moecomp.core.spec import MoESpec, SharedExpertSpec
from moecomp.testing import random_moe_args

SPECS = [
    (MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24), 0),
    (MoESpec(num_experts=4, top_k=4, hidden_size=17, intermediate_size=9), 5),
    (MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24, scoring="sigmoid",
             has_correction_bias=True, n_group=2, topk_group=1, shared=SharedExpertSpec(16, gate="sigmoid")), 9),
    (MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, score_order="topk_then_score",
             renormalize=False, has_router_bias=True, activation="swiglu_oai", w_layout="in_out",
             gate_up="interleaved", has_expert_bias=True), 3),
    (MoESpec(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, activation_clamp_after=True,
             activation_limit=0.5, shared=SharedExpertSpec(8, activation_clamp_after=True, activation_limit=0.3)), 4),
]


@pytest.mark.parametrize("spec,T", SPECS, ids=lambda v: str(v) if isinstance(v, int) else v.describe())
def test_opcheck_moe_forward(cpu_backend, spec, T):
    args = random_moe_args(spec, T, seed=T)
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key))


@pytest.mark.parametrize("T", [0, 6])
def test_opcheck_moe_experts(cpu_backend, T):
    spec = SPECS[0][0]
    args = random_moe_args(spec, T, seed=1)
    ids = torch.randint(0, 8, (T, 2))
    w = torch.rand(T, 2)
    torch.library.opcheck(torch.ops.moecomp.moe_experts.default, (args[0], ids, w, args[4], None, args[6], None,
                                                                  spec.key))


@pytest.mark.parametrize("T", [0, 5])
def test_opcheck_moe_forward_hash(cpu_backend, T):
    """Hash routing's table and token ids, the op's last two arguments (``MoESpec.hash_routing``)."""
    from moecomp.testing import random_hash_args

    spec = MoESpec(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, scoring="sqrtsoftplus",
                   routed_scaling_factor=1.5, hash_routing=True)
    args = random_moe_args(spec, T, seed=T)
    h = random_hash_args(spec, T, vocab=11, seed=T)
    from moecomp.core.args import MOE_ARGS, OP_ARGS

    between = [None] * (OP_ARGS.index("hash_table") - len(MOE_ARGS))  # the scales and latent projections
    torch.library.opcheck(torch.ops.moecomp.moe_forward.default, (*args, spec.key, *between, h["hash_table"],
                                                                  h["token_ids"]))
