"""The op's argument names: every tensor ``moe_forward`` / ``moe_experts`` take after ``x``, in order, and the
groups of them the stages bind (``Match.bindings`` maps each ``OP_ARGS`` name to a block-relative path). Data only:
the ops (``ops/moe_op.py``), the recognisers, verify and the binder all read these names, so they sit in core, below
every one of them."""

# Argument order of moe_forward after x; every entry point binds tensors by these names.
MOE_ARGS = (
    "router_w",
    "router_b",
    "correction_bias",
    "w13",
    "b13",
    "w2",
    "b2",
    "shared_w1",
    "shared_w3",
    "shared_w2",
    "shared_gate_w",
)
EXPERT_ARGS = ("w13", "b13", "w2", "b2")
# Scales of quantized weights (MoESpec.quant / SharedExpertSpec.quant): the ops take them after ``spec``, each
# defaulting to None, so unquantized callers pass nothing new. a13 / a2: static activation scales [E].
QUANT_ARGS = ("w13_scale", "w2_scale", "a13_scale", "a2_scale", "shared_w1_scale", "shared_w3_scale",
              "shared_w2_scale")
# int4 zero points (QuantSpec.zero_point): uint8 [E, rows, groups], the shape of the weight's scales; moe_forward takes
# them last (after the norms' weights), moe_experts after a2_scale.
ZERO_ARGS = ("w13_zero", "w2_zero")
EXPERT_QUANT_ARGS = QUANT_ARGS[:4] + ZERO_ARGS
# The latent projections around the routed experts (MoESpec.latent_size): after the scales, each defaulting to None.
# latent_in_w [L, H] (+ latent_in_b [L]) before the experts, latent_out_w [H, L] (+ latent_out_b [H]) after the combine.
LATENT_ARGS = ("latent_in_w", "latent_in_b", "latent_out_w", "latent_out_b")
# Hash routing (MoESpec.hash_routing): the [V, k] table of expert ids and the tokens' ids [T]; moe_forward takes them
# after the latent projections, each defaulting to None.
HASH_ARGS = ("hash_table", "token_ids")
# The router's own input and per-expert weight multipliers (MoESpec.router_input / router_in_scale / expert_scale):
# router_x [..., H] (a per-call input like x), router_in_scale [H], expert_scale [E (+ Z)]; after the hash-routing
# arguments, each defaulting to None.
ROUTER_IN_ARGS = ("router_x", "router_in_scale", "expert_scale")
# A learned scale of the routing weights (MoESpec.has_weight_scale, Inkling's global_scale): a [1] tensor after the
# router-input arguments, default None.
SCALE_ARGS = ("weight_scale",)
# The norms' weights (MoESpec.latent_norm: latent_norm_w [L]; MoESpec.expert_norm: expert_norm_w [expert width]);
# after weight_scale, each defaulting to None.
NORM_ARGS = ("latent_norm_w", "expert_norm_w")
# The shared expert's output norm (SharedExpertSpec.norm: shared_norm_w [H]); moe_forward's last argument, default None.
SHARED_NORM_ARGS = ("shared_norm_w",)
OP_ARGS = (MOE_ARGS + QUANT_ARGS + LATENT_ARGS + HASH_ARGS + ROUTER_IN_ARGS + SCALE_ARGS
           + NORM_ARGS + ZERO_ARGS + SHARED_NORM_ARGS)  # every tensor a bound block may pass, in order
# The attribute a block tensor carries while ``epilogue.Peeled`` has zeroed it (an output bias bound after the op;
# read by the FX numeric check and the capture's tail check).
PEELED = "_moecomp_peeled"
