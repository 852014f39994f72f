"""MoESpec's checks: which field values and combinations the op computes (``MoESpec.validate`` calls
``validate_moe``). SpecError and the allowed values of the string fields live here too; ``moecomp.core.spec``
re-exports them."""

from __future__ import annotations

import dataclasses
import json
import math


SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus", "none")
SCORE_ORDERS = ("score_then_topk", "topk_then_score", "sparsemixer")
GROUP_SCORES = ("top2_sum", "max")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2", "swiglu_oai")  # relu2 = relu(x)**2
W_LAYOUTS = ("out_in", "in_out")  # per-expert matrix stored [out, in] (nn.Linear style) or [in, out]
GATE_UP = ("concat", "interleaved")
# fp8_e4m3: one byte a weight. mxfp4 (OCP microscaling, gpt-oss): e2m1 codes, int4: unsigned 4-bit integers, both
# packed two a byte along the input dim (low nibble first) with "group" scales (one per row and block_k columns).
QUANT_WEIGHTS = ("fp8_e4m3", "mxfp4", "int4")
PACKED_WEIGHTS = ("mxfp4", "int4")  # two codes a byte
W4_LAYOUTS = ("packed", "mma")  # QuantSpec.layout of 4-bit codes: as stored, or ops/w4_layout.py's re-encoding
QUANT_SCALES = ("block", "channel", "tensor", "group")
# ue8m0: powers of two stored as a biased exponent byte (torch.float8_e8m0fnu); fp16 / bf16: int4 checkpoints' scales
SCALE_DTYPES = ("fp32", "ue8m0", "fp16", "bf16")
QUANT_ACTIVATIONS = ("dynamic", "static", "none")
CAPACITY_PER = ("call", "sequence")
SHARED_GAMMAS = ("none", "joint_renorm")  # where the shared experts' output scales come from (MoESpec.shared_gamma)
LATENT_NORMS = ("none", "rms", "rms_1p")  # MoESpec.latent_norm: none, rms(v) * w, rms(v) * (1 + w)
# MoESpec.expert_norm: none, rms(round(v * (1 + w))), rms(v) * w[e] (a weight row per expert)
EXPERT_NORMS = ("none", "scaled_rms_1p", "rms_per_expert")
PER_EXPERT_NORMS = ("rms_per_expert",)  # expert_norm_w [E, width]
SHARED_NORMS = ("none", "rms")  # SharedExpertSpec.norm: none, rms(v) * w
EXPERT_BIASES = ("both", "gemm1", "gemm2")  # MoESpec.expert_bias: b13 and b2, b13 only, b2 only
FP8_MAX = 448.0  # largest finite e4m3 (float8_e4m3fn) value


class SpecError(ValueError):
    """A MoESpec (or the tensors given with it) describes something moecomp cannot compute."""


def expert_bias_fields(b13: bool, b2: bool) -> dict:
    """The MoESpec fields of routed experts whose first GEMM has a bias (``b13``) and / or whose second has one
    (``b2``): ``has_expert_bias`` and ``expert_bias``."""
    if b13 and b2 or not (b13 or b2):
        return dict(has_expert_bias=bool(b13), expert_bias="both")
    return dict(has_expert_bias=True, expert_bias="gemm1" if b13 else "gemm2")


def _check_expert_bias(spec) -> None:
    """``has_expert_bias`` a bool; ``expert_bias`` one of EXPERT_BIASES, and "both" (its default) without biases."""
    if not isinstance(spec.has_expert_bias, bool):
        raise SpecError(f"has_expert_bias must be a bool, got {spec.has_expert_bias!r}")
    if spec.expert_bias not in EXPERT_BIASES:
        raise SpecError(f"expert_bias={spec.expert_bias!r} is not one of {EXPERT_BIASES}")
    if spec.expert_bias != "both" and not spec.has_expert_bias:
        raise SpecError(f"expert_bias={spec.expert_bias!r} says which expert GEMM has a bias, but has_expert_bias is "
                        "False; expected expert_bias 'both' (the default) without biases")


def check_quant(q, who: str = "") -> None:
    """QuantSpec's rules (``QuantSpec.validate``)."""
    for name, value, allowed in (("weight", q.weight, QUANT_WEIGHTS), ("scale", q.scale, QUANT_SCALES),
                                 ("scale_dtype", q.scale_dtype, SCALE_DTYPES),
                                 ("activation", q.activation, QUANT_ACTIVATIONS)):
        if value not in allowed:
            raise SpecError(f"{who}quant.{name}={value!r} is not one of {allowed}")
    if not isinstance(q.zero_point, bool):
        raise SpecError(f"{who}quant.zero_point must be a bool, got {q.zero_point!r}")
    if q.block_n <= 0 or q.block_k <= 0:
        raise SpecError(f"{who}quant block sizes must be positive: block_n={q.block_n}, block_k={q.block_k}")
    if not isinstance(q.act_group, int) or isinstance(q.act_group, bool) or q.act_group < 0:
        raise SpecError(f"{who}quant.act_group={q.act_group!r}: expected a positive int, or 0 (dynamic per token)")
    if q.act_group == 0 and q.activation != "dynamic":
        raise SpecError(f"{who}quant.act_group=0 (one scale per token over the whole row) needs activation "
                        f"'dynamic', got activation={q.activation!r}")
    if q.layout not in W4_LAYOUTS or (q.layout != "packed" and q.weight not in PACKED_WEIGHTS):
        raise SpecError(f"{who}quant.layout={q.layout!r}: expected one of {W4_LAYOUTS} ('mma' for 4-bit weights "
                        f"only: mxfp4, int4), weight={q.weight!r}")
    if q.weight in PACKED_WEIGHTS:
        _check_4bit(q, who)
        return
    if q.scale == "group" or q.zero_point or q.scale_dtype not in ("fp32", "ue8m0"):
        raise SpecError(f"{who}quant: fp8 weights take block / channel / tensor scales in fp32 or ue8m0 and no zero "
                        f"points, got scale={q.scale!r}, scale_dtype={q.scale_dtype!r}, zero_point={q.zero_point}")
    if q.activation == "dynamic" and q.act_group not in (128, 0):
        raise SpecError(f"{who}quant.act_group={q.act_group}: dynamic activations are quantized in groups of "
                        f"128 (the kernels' K step) or per token over the whole row (act_group 0)")
    if q.scale == "block" and (q.block_k % 16 or 128 % q.block_k and q.block_k % 128):
        raise SpecError(f"{who}quant.block_k={q.block_k}: expected a multiple of 128 or a divisor of 128 "
                        f"that is a multiple of 16")


def _check_4bit(q, who: str) -> None:
    """mxfp4: e2m1 codes, one ue8m0 scale per 32 columns; int4: unsigned codes, one fp32 / fp16 / bf16 scale (and a
    zero with ``zero_point``; else 8) per row and group of ``block_k`` columns (a multiple of 32: the kernels' K
    step divides it). Both weight-only."""
    if q.scale != "group" or q.activation != "none":
        raise SpecError(f"{who}quant.weight={q.weight!r} takes scale 'group' and activation 'none' (weight-only), "
                        f"got scale={q.scale!r}, activation={q.activation!r}")
    if q.weight == "mxfp4" and (q.block_k != 32 or q.scale_dtype != "ue8m0" or q.zero_point):
        raise SpecError(f"{who}quant.weight='mxfp4' takes block_k=32, scale_dtype='ue8m0' and no zero points, got "
                        f"block_k={q.block_k}, scale_dtype={q.scale_dtype!r}, zero_point={q.zero_point}")
    if q.weight == "int4" and (q.block_k % 32 or q.scale_dtype == "ue8m0"):
        raise SpecError(f"{who}quant.weight='int4' takes a group (block_k) that is a multiple of 32 and fp32 / fp16 / "
                        f"bf16 scales, got block_k={q.block_k}, scale_dtype={q.scale_dtype!r}")


def _check_packed(spec) -> None:
    """4-bit routed experts: [out, in] matrices packed along the input dim, so both widths must be even; gate / up
    concatenated or interleaved (gpt-oss), expert biases allowed; weight_on_input alone of the routing variants that
    change the experts' input (no block with 4-bit experts is known to have the others)."""
    spec.quant.validate()
    if spec.w_layout != "out_in":
        raise SpecError(f"4-bit experts ({spec.quant.weight}) need w_layout 'out_in' ([out, in] packed along in), "
                        f"got {spec.w_layout!r}")
    if spec.expert_width % 2 or spec.intermediate_size % 2:
        raise SpecError(f"4-bit experts pack two input columns a byte: expert width {spec.expert_width} and "
                        f"intermediate_size {spec.intermediate_size} must be even")


def validate_moe(spec: MoESpec) -> None:
    """Every MoESpec rule: a SpecError naming the field and what was expected."""
    E, k = spec.num_experts, spec.top_k
    if E <= 0 or spec.hidden_size <= 0 or spec.intermediate_size <= 0:
        raise SpecError(f"sizes must be positive: E={E}, H={spec.hidden_size}, I={spec.intermediate_size}")
    _check_expert_bias(spec)
    _check_zero_experts(spec)
    _check_hash_routing(spec)
    _check_capacity(spec)
    _check_latent(spec)
    _check_router_input(spec)
    _check_shared_gamma(spec)
    _check_norms(spec)
    if not 1 <= k <= spec.router_width:
        raise SpecError(f"top_k must be in [1, num_experts={E}"
                        + (f" + zero_experts={spec.zero_experts}" if spec.zero_experts else "") + f"], got {k}")
    for name, value, allowed in (
        ("scoring", spec.scoring, SCORINGS),
        ("score_order", spec.score_order, SCORE_ORDERS),
        ("group_score", spec.group_score, GROUP_SCORES),
        ("activation", spec.activation, ACTIVATIONS),
        ("w_layout", spec.w_layout, W_LAYOUTS),
        ("gate_up", spec.gate_up, GATE_UP),
    ):
        if value not in allowed:
            raise SpecError(f"{name}={value!r} is not one of {allowed}")
    if spec.n_group < 1 or E % spec.n_group:
        raise SpecError(f"num_experts={E} is not divisible by n_group={spec.n_group}")
    if not 1 <= spec.topk_group <= spec.n_group:
        raise SpecError(f"topk_group={spec.topk_group} must be in [1, n_group={spec.n_group}]")
    if spec.n_group > 1 and k > spec.topk_group * (E // spec.n_group):
        raise SpecError(f"top_k={k} exceeds the experts left by group selection")
    if spec.n_group > 1 and spec.group_score == "top2_sum" and E // spec.n_group < 2:
        raise SpecError("group_score 'top2_sum' needs at least 2 experts per group")
    if spec.score_order == "topk_then_score" and spec.scoring not in ("softmax", "sigmoid"):
        raise SpecError("score_order 'topk_then_score' is defined for softmax and sigmoid only")
    _check_sparsemixer(spec)
    check_activation(spec, "")
    check_softcaps(spec, "")
    if spec.bias_on_logits and not spec.has_correction_bias:
        raise SpecError("bias_on_logits needs a correction bias (has_correction_bias)")
    if spec.bias_on_logits and spec.score_order != "score_then_topk":
        raise SpecError("bias_on_logits is defined for score_order 'score_then_topk' only")
    if spec.group_mask_zero and spec.n_group == 1:
        raise SpecError("group_mask_zero needs group-limited routing (n_group > 1)")
    if spec.renorm_min < 0 or spec.renorm_eps < 0:
        raise SpecError(f"renorm_eps={spec.renorm_eps} and renorm_min={spec.renorm_min} must be >= 0")
    if spec.shared is not None:
        spec.shared.validate()
    if spec.fused_shared_gate and (spec.shared is None or spec.shared.gate != "sigmoid"):
        raise SpecError("fused_shared_gate needs a sigmoid-gated shared expert")
    if spec.fused_shared_gate and spec.has_router_bias:
        raise SpecError("fused_shared_gate with a router bias is not supported")
    if spec.quant is not None and spec.quant.packed:
        _check_packed(spec)
    elif spec.quant is not None:
        spec.quant.validate()
        if spec.w_layout != "out_in" or (spec.gated and spec.gate_up != "concat"):
            raise SpecError("quantized experts need w_layout 'out_in' and gate_up 'concat' (the checkpoints' "
                            f"layout), got {spec.w_layout!r} / {spec.gate_up!r}")
        if spec.has_expert_bias:
            which = {"both": "b13 and b2", "gemm1": "b13 (gate / up) only", "gemm2": "b2 (down) only"}
            raise SpecError(f"fp8 experts with expert biases (expert_bias={spec.expert_bias!r}: "
                            f"{which[spec.expert_bias]}) are not supported; 4-bit experts take them")
        if spec.weight_on_input and spec.quant.activation == "static":
            raise SpecError("weight_on_input with static activation scales is not supported: the kernels scale "
                            "the GEMM's result by the routing weight, which equals quantizing weight * x only "
                            "when the activation scale follows x (\"dynamic\") or there is none (\"none\")")



def _check_sparsemixer(spec: MoESpec) -> None:
    """``jitter_eps``: finite and >= 0, and only with score_order "sparsemixer", which routes the plain logits (softmax
    multipliers; no correction bias, groups or zero experts take part)."""
    eps = spec.jitter_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise SpecError(f"jitter_eps must be a finite number >= 0, got {eps!r}")
    if spec.score_order != "sparsemixer":
        if eps:
            raise SpecError(f"jitter_eps={eps} is read by score_order 'sparsemixer' only (got {spec.score_order!r})")
        return
    if spec.scoring != "softmax":
        raise SpecError(f"score_order 'sparsemixer' takes softmax multipliers: scoring must be 'softmax', got "
                        f"{spec.scoring!r}")
    if spec.has_correction_bias or spec.n_group > 1 or spec.zero_experts:
        raise SpecError("score_order 'sparsemixer' routes the plain logits: no correction bias, group-limited "
                        "routing (n_group > 1) or zero experts")


def _check_zero_experts(spec: MoESpec) -> None:
    """``zero_experts``: a non-negative int, and not with what would route over a width other than E + Z."""
    Z = spec.zero_experts
    if isinstance(Z, bool) or not isinstance(Z, int) or Z < 0:
        raise SpecError(f"zero_experts must be an int >= 0, got {Z!r}")
    if not Z:
        return
    if spec.n_group > 1:
        raise SpecError("zero_experts with group-limited routing (n_group > 1) is not supported: the groups would "
                        "split the E + zero_experts router outputs, which no block is known to do")
    if spec.fused_shared_gate:
        raise SpecError("zero_experts with fused_shared_gate is not supported: router_w would be "
                        "[E + zero_experts + 1, H], a layout the op does not read")


def _check_hash_routing(spec: MoESpec) -> None:
    """``hash_routing``: a bool, and nothing that steers a selection (there is none: the table gives the ids)."""
    if not isinstance(spec.hash_routing, bool):
        raise SpecError(f"hash_routing must be a bool, got {spec.hash_routing!r}")
    if not spec.hash_routing:
        return
    for name, bad in ((f"score_order {spec.score_order!r}", spec.score_order != "score_then_topk"),
                      ("a correction bias (has_correction_bias)", spec.has_correction_bias),
                      ("group-limited routing (n_group > 1)", spec.n_group > 1),
                      ("zero_experts", spec.zero_experts > 0)):
        if bad:
            raise SpecError(f"hash_routing with {name} is not supported: the ids come from the table "
                            "hash_table[token_ids], there is no top-k for it to act on")


def _check_capacity(spec: MoESpec) -> None:
    """``capacity`` (int >= 0) or ``capacity_factor`` (finite, >= 0), not both; ``capacity_per`` / ``renorm_after_drop``
    only with one of them; nothing whose pairs are not plain top-k picks of the E experts."""
    C, f = spec.capacity, spec.capacity_factor
    if isinstance(C, bool) or not isinstance(C, int) or C < 0:
        raise SpecError(f"capacity must be an int >= 0 (0: no capacity), got {C!r}")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 0:
        raise SpecError(f"capacity_factor must be a finite number >= 0 (0: no capacity), got {f!r}")
    if C and f:
        raise SpecError(f"capacity={C} and capacity_factor={f}: give one (a fixed capacity or one proportional to "
                        "the group's tokens)")
    if spec.capacity_per not in CAPACITY_PER:
        raise SpecError(f"capacity_per={spec.capacity_per!r} is not one of {CAPACITY_PER}")
    if not spec.has_capacity:
        if spec.capacity_per != "call" or spec.renorm_after_drop:
            raise SpecError("capacity_per / renorm_after_drop need an expert capacity (capacity or capacity_factor)")
        return
    if spec.renorm_after_drop and not spec.renormalize:
        raise SpecError("renorm_after_drop needs renormalize (it moves the renormalisation after the drop)")
    for name, bad in (("zero_experts", spec.zero_experts > 0), ("hash_routing", spec.hash_routing),
                      ("weight_on_input", spec.weight_on_input), ("latent experts (latent_size)", spec.latent_size)):
        if bad:
            raise SpecError(f"an expert capacity with {name} is not supported (no block is known to have both)")


def _check_shared_gamma(spec: MoESpec) -> None:
    """``shared_gamma`` "joint_renorm" (Inkling): G = shared.count router rows after the routed ones, scored like
    them (an elementwise scoring), renormalised together with the k chosen; only with plain renormalised top-k
    routing and ungated shared experts. ``has_weight_scale``: a bool, not with an expert capacity (its drop
    renormalises apart)."""
    if not isinstance(spec.has_weight_scale, bool):
        raise SpecError(f"has_weight_scale must be a bool, got {spec.has_weight_scale!r}")
    if spec.has_weight_scale and spec.has_capacity:
        raise SpecError("has_weight_scale with an expert capacity is not supported (no block is known to have both)")
    g = spec.shared_gamma
    if g not in SHARED_GAMMAS:
        raise SpecError(f"shared_gamma={g!r} is not one of {SHARED_GAMMAS}")
    if g == "none":
        return
    if spec.shared is None or spec.shared.gate != "none":
        raise SpecError(f"shared_gamma={g!r} needs shared experts without a sigmoid gate (the gammas scale them)")
    if spec.scoring not in ("sigmoid", "sqrtsoftplus") or spec.score_order != "score_then_topk":
        raise SpecError(f"shared_gamma={g!r} needs an elementwise scoring (sigmoid, sqrtsoftplus) with "
                        f"score_order 'score_then_topk', got {spec.scoring!r} / {spec.score_order!r}")
    if not spec.renormalize:
        raise SpecError(f"shared_gamma={g!r} renormalises the gammas with the routing weights: needs renormalize")
    for name, bad in (("fused_shared_gate", spec.fused_shared_gate), ("a router bias", spec.has_router_bias),
                      ("a shared expert norm (shared.norm)", spec.shared.norm != "none"),
                      ("zero_experts", spec.zero_experts > 0), ("hash_routing", spec.hash_routing),
                      ("an expert capacity", spec.has_capacity), ("latent experts", spec.latent_size > 0),
                      ("weight_on_input", spec.weight_on_input), ("per-expert weight scales (expert_scale)",
                                                                  spec.expert_scale),
                      ("a router prefix (router_input / router_norm / router_in_scale / router_in_const)",
                       spec.router_prefix)):
        if bad:
            raise SpecError(f"shared_gamma={g!r} with {name} is not supported (no block is known to have both)")


def _check_latent(spec: MoESpec) -> None:
    """``latent_size``: an int >= 0; ``latent_bias`` only with it."""
    L = spec.latent_size
    if isinstance(L, bool) or not isinstance(L, int) or L < 0:
        raise SpecError(f"latent_size must be an int >= 0 (0: no latent projections), got {L!r}")
    if spec.latent_bias and not L:
        raise SpecError("latent_bias needs latent projections (latent_size > 0)")


def _check_router_input(spec: MoESpec) -> None:
    """The router's own input / input prefix and the per-expert weight multipliers (``moecomp.core.spec``)."""
    prefix = spec.router_input or spec.router_norm or spec.router_in_scale or spec.router_in_const != 1.0
    c, eps = spec.router_in_const, spec.router_norm_eps
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and c > 0):
        raise SpecError(f"router_in_const must be finite and positive, got {c!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise SpecError(f"router_norm_eps must be finite and >= 0, got {eps!r}")
    if not (prefix or spec.expert_scale):
        return
    if prefix and (spec.fused_shared_gate or (spec.shared is not None and spec.shared.gate == "sigmoid")):
        raise SpecError("a router reading its own input (router_input / router_norm / router_in_scale / "
                        "router_in_const) with a sigmoid-gated shared expert is not supported: the gate reads x")
    for name, bad in (("hash_routing", spec.hash_routing), ("sparsemixer routing", spec.score_order == "sparsemixer"),
                      ("an expert capacity", spec.has_capacity)):
        if bad:
            raise SpecError(f"the router input prefix / expert_scale with {name} is not supported (no block is known "
                            f"to have both)")
def _finite(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_norms(spec: MoESpec) -> None:
    """``router_scale``: finite and > 0 (it keeps the logits' order); ``latent_norm`` only with latent projections;
    ``expert_norm`` not with what changes what an expert's output is (no block has both); eps finite and >= 0."""
    if not _finite(spec.router_scale) or spec.router_scale <= 0:
        raise SpecError(f"router_scale must be a finite number > 0, got {spec.router_scale!r}")
    for name, value, allowed in (("latent_norm", spec.latent_norm, LATENT_NORMS),
                                 ("expert_norm", spec.expert_norm, EXPERT_NORMS)):
        if value not in allowed:
            raise SpecError(f"{name}={value!r} is not one of {allowed}")
    for name in ("latent_norm_eps", "expert_norm_eps"):
        v = getattr(spec, name)
        if not _finite(v) or v < 0:
            raise SpecError(f"{name} must be a finite number >= 0, got {v!r}")
    if spec.router_scale != 1.0 and spec.shared_gamma != "none":
        raise SpecError("router_scale with shared-expert gammas (shared_gamma) is not supported (no block is known "
                        "to have both)")
    if spec.latent_norm != "none" and not spec.latent_size:
        raise SpecError(f"latent_norm={spec.latent_norm!r} needs latent projections (latent_size > 0)")
    if spec.expert_norm != "none":
        for name, bad in (("quantized experts (quant)", spec.quant is not None),
                          ("weight_on_input", spec.weight_on_input), ("zero_experts", spec.zero_experts > 0),
                          ("an expert capacity", spec.has_capacity),
                          ("shared-expert gammas (shared_gamma)", spec.shared_gamma != "none")):
            if bad:
                raise SpecError(f"expert_norm={spec.expert_norm!r} with {name} is not supported (no block is "
                                "known to have both)")


def check_shared_norm(sh) -> None:
    """``SharedExpertSpec.norm``: one of SHARED_NORMS, eps finite and >= 0; not on stacked shared experts (no block
    has both: the weight would be per expert)."""
    if sh.norm not in SHARED_NORMS:
        raise SpecError(f"shared expert norm={sh.norm!r} is not one of {SHARED_NORMS}")
    if not _finite(sh.norm_eps) or sh.norm_eps < 0:
        raise SpecError(f"shared expert norm_eps must be a finite number >= 0, got {sh.norm_eps!r}")
    if sh.norm != "none" and sh.stacked:
        raise SpecError(f"shared expert norm={sh.norm!r} with stacked shared experts is not supported (no block is "
                        "known to have both)")


def check_activation(s, who: str) -> None:
    """The activation fields of a MoESpec or SharedExpertSpec: swiglu_oai gated; at most one of the clamps
    (``activation_clamp`` before the activation, ``activation_clamp_after`` after it), on a gated act(gate) * up; a
    positive limit wherever one is used."""
    activation, gated, clamp, after, limit = (s.activation, s.gated, s.activation_clamp, s.activation_clamp_after,
                                              s.activation_limit)
    if activation == "swiglu_oai" and not gated:
        raise SpecError(f"{who}activation 'swiglu_oai' needs gated experts")
    if not isinstance(after, bool):
        raise SpecError(f"{who}activation_clamp_after must be a bool, got {after!r}")
    for name, on in (("activation_clamp", clamp), ("activation_clamp_after", after)):
        if on and (not gated or activation == "swiglu_oai"):
            raise SpecError(f"{who}{name} is for gated act(gate) * up experts (swiglu_oai clamps anyway)")
    if clamp and after:
        raise SpecError(f"{who}activation_clamp (the gate clamped before its activation) and activation_clamp_after "
                        "(the activation's output clamped) exclude each other")
    if (clamp or after or activation == "swiglu_oai") and not limit > 0:
        raise SpecError(f"{who}activation_limit must be positive, got {limit}")


def check_softcaps(s, who: str) -> None:
    """``gate_softcap`` / ``up_softcap`` (MoESpec or SharedExpertSpec): finite floats >= 0 (0: none), for gated silu
    without clamps (h = cap(g, cg) * sigmoid(g) * cap(u, cu); the spec docstring)."""
    caps = (("gate_softcap", s.gate_softcap), ("up_softcap", s.up_softcap))
    for name, c in caps:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise SpecError(f"{who}{name} must be a finite float >= 0 (0: no cap), got {c!r}")
    clamped = s.activation_clamp or s.activation_clamp_after
    if any(c for _, c in caps) and (not s.gated or s.activation != "silu" or clamped):
        raise SpecError(f"{who}gate_softcap / up_softcap cap a gated silu's linear gate factor and up: they need "
                        f"gated experts with activation 'silu' and no activation_clamp / activation_clamp_after (got "
                        f"activation={s.activation!r}, gated={s.gated}, activation_clamp={s.activation_clamp}, "
                        f"activation_clamp_after={s.activation_clamp_after})")


FIELD_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def fields_from_key(d, cls, key: str, where: str) -> dict:
    """The JSON object ``d`` checked against ``cls``'s fields: SpecError naming a missing, unknown or mistyped one."""
    if not isinstance(d, dict):
        raise SpecError(f"spec string {key[:80]!r}: {where} must be a JSON object of {cls.__name__} fields, "
                        f"got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise SpecError(f"spec string {key[:80]!r}: unknown {cls.__name__} field(s) {unknown}; expected only "
                        f"{sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING]
    if missing:
        raise SpecError(f"spec string {key[:80]!r}: missing required {cls.__name__} field(s) {missing}")
    for name, value in d.items():
        ok = FIELD_TYPES.get(fields[name].type)
        if ok is not None and (not isinstance(value, ok) or (bool not in ok and isinstance(value, bool))):
            raise SpecError(f"spec string {key[:80]!r}: {cls.__name__} field {name}={value!r} should be "
                            f"{fields[name].type}")
    return d


def spec_key(d: dict) -> str:
    """A spec's fields ``d`` (``dataclasses.asdict``) as its key: canonical JSON, with a QuantSpec's ``layout`` left
    out where it is "packed" (the default), so that every key reads as it did before that field."""
    def drop(v):
        if not isinstance(v, dict):
            return v
        quant = "weight" in v and v.get("layout") == "packed"  # a QuantSpec's fields (SharedExpertSpec has no weight)
        return {k: drop(x) for k, x in v.items() if not (quant and k == "layout")}

    return json.dumps(drop(d), sort_keys=True, separators=(",", ":"))
