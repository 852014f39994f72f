"""Random inputs for a MoESpec, shared by tests, benchmarks and the demo.

``random_moe_args(spec, T, ...)`` returns the op's positional arguments (x, then ``MOE_ARGS`` in order), drawn from
N(0, std) so that nothing is zero and routing is not degenerate.
"""

from __future__ import annotations

import torch

from .ops.moe_op import MOE_ARGS
from .spec import MoESpec, SharedExpertSpec


def random_moe_args(
    spec: MoESpec,
    T: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    std: float = 0.2,
    seed: int | None = None,
) -> tuple:
    device = torch.device(device)
    g = torch.Generator(device=device)  # drawn where they live: GPU-sized weights never pass through the CPU
    g.manual_seed(torch.seed() if seed is None else seed)

    def rnd(*shape, scale=std, dt=dtype):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

    E, H = spec.num_experts, spec.hidden_size
    shapes = spec.expert_weight_shapes()
    t = dict.fromkeys(MOE_ARGS)
    x = rnd(T, H, scale=1.0)
    t["router_w"] = rnd(E, H, scale=1.0 / H**0.5 * 2)
    if spec.has_router_bias:
        t["router_b"] = rnd(E, scale=0.5)
    if spec.has_correction_bias:
        t["correction_bias"] = rnd(E, scale=0.05, dt=torch.float32)
    for name in ("w13", "w2", "b13", "b2"):
        if name in shapes:
            t[name] = rnd(*shapes[name], scale=std if name.startswith("w") else 0.5)
    sh = spec.shared
    if sh is not None:
        Is = sh.intermediate_size
        if sh.gated and sh.layout == "concat":
            t["shared_w1"] = rnd(2 * Is, H)
        elif sh.gated:
            t["shared_w1"], t["shared_w3"] = rnd(Is, H), rnd(Is, H)
        else:
            t["shared_w3"] = rnd(Is, H)
        t["shared_w2"] = rnd(H, Is)
        if sh.gate == "sigmoid":
            t["shared_gate_w"] = rnd(1, H, scale=1.0 / H**0.5)
    return (x,) + tuple(t[n] for n in MOE_ARGS)


# Real layer sizes of the families the benchmarks and GPU tests use (bf16 on the GPU).
LAYER_PRESETS = {
    "mixtral_8x7b": MoESpec(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    "qwen3_30b_a3b": MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, round_weights=True),
    "qwen15_moe_a27b": MoESpec(num_experts=60, top_k=4, hidden_size=2048, intermediate_size=1408, renormalize=False,
                               round_weights=True, shared=SharedExpertSpec(5632, gate="sigmoid")),
    "olmoe_1b_7b": MoESpec(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=1024, renormalize=False,
                           round_weights=True),
    "deepseek_v3": MoESpec(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, scoring="sigmoid",
                           has_correction_bias=True, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                           renorm_eps=1e-20, router_fp32=True, shared=SharedExpertSpec(2048)),
}
