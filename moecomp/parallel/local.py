"""This rank's routed experts on the existing ``moe_experts`` op (the same grouped-GEMM kernels as one GPU), and the
checks of the shard tensors a rank is given.

    kernel_spec(spec, k, sentinel)   the spec ``moe_experts`` runs with: the block's expert fields (activation,
                                     layout, biases, quantization, weight_on_input, ...), E / W experts (EP), I / W
                                     intermediate columns (TP) or every expert whole (replicated), no routing,
                                     shared experts or parallel part.
                                     ``sentinel``: ids >= the local expert count are skipped (the op's zero-expert
                                     flags: such a pair adds weight * x, and its weight is 0), so buffers of fixed
                                     size can hold pairs of other ranks (or none) without a host-side compaction
    run(xe, ids, weights, args, ks)  moe_experts(xe [N, width], ids [N, k] local, weights [N, k]) -> [N, width]
    check_shards(args, spec)         SpecError naming a shard tensor whose shape is not this rank's shard's
"""

from __future__ import annotations

import functools

import torch

from ..core.args import EXPERT_ARGS, EXPERT_QUANT_ARGS
from ..ops.moe_op import call_moe_experts
from ..core.spec import MoESpec, SpecError

SHARD_ARGS = EXPERT_ARGS + EXPERT_QUANT_ARGS  # the tensors a rank holds a shard of (everything else is whole)


@functools.lru_cache(maxsize=256)
def kernel_spec(spec: MoESpec, k: int, sentinel: bool) -> MoESpec:
    """The spec of this rank's ``moe_experts`` call (module docstring)."""
    es, p = spec.experts_spec(), spec.parallel
    inter = es.intermediate_size // p.world_size if p.mode == "tp" else es.intermediate_size
    zero = max(spec.zero_experts, k) if sentinel else spec.zero_experts  # (k <= E_local + zero: the op's check)
    return MoESpec(
        num_experts=p.experts_per_rank, top_k=k, hidden_size=es.hidden_size, intermediate_size=inter,
        activation=es.activation, gated=es.gated, activation_alpha=es.activation_alpha,
        activation_limit=es.activation_limit, activation_clamp=es.activation_clamp, w_layout=es.w_layout,
        gate_up=es.gate_up, has_expert_bias=es.has_expert_bias, expert_bias=es.expert_bias, quant=es.quant,
        gate_softcap=es.gate_softcap, up_softcap=es.up_softcap, weight_on_input=es.weight_on_input, zero_experts=zero,
        activation_clamp_after=es.activation_clamp_after)


def run(xe: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, args: dict, ks: MoESpec) -> torch.Tensor:
    """This rank's experts on rows xe [N, width]: sum_j weights[:, j] * expert_{ids[:, j]}(xe) -> [N, width] in xe's
    dtype (ids local, in range by construction: the CUDA range check's host read is skipped)."""
    if xe.shape[0] == 0:
        return xe.new_zeros(xe.shape)
    scales = {n: args[n] for n in EXPERT_QUANT_ARGS if args.get(n) is not None}
    return call_moe_experts(xe, ids, weights, args["w13"], args.get("b13"), args["w2"], args.get("b2"), ks,
                            ids_from_topk=True, **scales)


def shard_shapes(spec: MoESpec) -> dict:
    """{argument: shape} of this rank's shard tensors (``spec.parallel``)."""
    ks = kernel_spec(spec, 1, False)
    return {**ks.expert_weight_shapes(), **ks.quant_shapes()}


def check_shards(args: dict, spec: MoESpec) -> None:
    """SpecError naming the first shard tensor whose shape is not this rank's shard of the block's tensor."""
    p = spec.parallel
    want = shard_shapes(spec)
    whole = {**spec.expert_weight_shapes(), **spec.quant_shapes()}  # (in the experts' width: L with latent)
    held = (f"experts [{p.local_experts.start}, {p.local_experts.stop})" if p.mode == "ep" else
            "every expert whole" if p.mode == "replicated" else
            f"intermediate columns [{p.local_intermediate.start}, {p.local_intermediate.stop}) of every expert")
    for name, shape in want.items():
        t = args.get(name)
        if t is not None and tuple(t.shape) != tuple(shape):
            raise SpecError(f"{name} has shape {tuple(t.shape)}; rank {p.rank} of {p.world_size} ({p.mode}) holds "
                            f"{held}: expected its shard {tuple(shape)} of the block's {tuple(whole[name])}")
