"""MoESpec: the single description of a Mixture-of-Experts block.

Every entry point (module detection, the FX pass, the HF experts interface) produces a ``MoESpec``;
the op ``torch.ops.moecomp.moe_forward``, the plain-torch reference and the Triton kernels consume it.

What a block computes, in terms of the spec (T tokens, H hidden, E experts, k = top_k, I intermediate):

    logits   = x @ router_w.T (+ router_b)                     # [T, E]   (fp32 when router_fp32)
    scores   = score_fn(logits)                                # softmax | sigmoid | sqrtsoftplus | none
    choice   = scores (+ correction_bias)                      # bias only steers the selection
               (bias_on_logits: choice = logits + correction_bias)
    groups   : keep the topk_group best of n_group groups      # group score: sum of top-2, or max
               others set to -inf (group_mask_zero: to 0.0)
    ids      = topk(choice, k)                                 # [T, k]
    weights  = scores[ids]  (/ max(sum + renorm_eps, renorm_min))  * routed_scaling    # [T, k]
      (score_order == "topk_then_score": ids = topk(logits), weights = score_fn(logits[ids]): softmax over the k
       chosen, or sigmoid of each (Llama 4))
      (score_order == "sparsemixer", PhiMoE's eval-mode routing; scoring softmax, no bias / groups / zero experts:
       k rounds j = 1..k over the experts not taken yet, F_j:  m_j = max(logits[F_j]), ids[j] = its lowest index;
       kept_j = {e in F_j : (m_j - logits[e]) / max(|logits[e]|, m_j) <= 2 * jitter_eps}  (0 / 0 counts as kept);
       weights[j] = softmax(logits[kept_j])[ids[j]] = 1 / sum_{e in kept_j} exp(logits[e] - m_j); then the
       renormalisation / scaling steps above as the spec says (PhiMoE: neither). transformers runs two rounds
       whatever top_k says; other k generalise the rounds as written)
    per pair : h = act(g) * u, g = x @ w1_e.T, u = x @ w3_e.T  (gated) | act(x @ w13_e.T) (not gated)
               activation_clamp: g = min(g, limit), u = clamp(u, -limit, limit) first (DeepSeek-V4 style)
               activation_clamp_after: h = min(act(g), limit) * clamp(u, -limit, limit), the activation's output
                 clamped (upper only), not its input (Step-3.7-Flash's limit_after_act)
               swiglu_oai: (clamp(u) + 1) * g * sigmoid(alpha * g), g = min(g, limit) (gpt-oss)
               softcaps (gate_softcap = cg, up_softcap = cu; 0: that factor uncapped; gated silu only):
                 h = cap(g, cg) * sigmoid(g) * cap(u, cu),  cap(v, c) = c * tanh(v / c)
                 the sigmoid sees the raw gate; only silu's linear gate factor and up are capped (Inkling2's
                 softcapped SwiGLU, computed in fp32); with both 0 this is silu(g) * u
               y = h @ w2_e.T                                  # [H]
               weight_on_input: the pair's expert runs on weight * x instead (h from g, u of weight * x, biases
               added after the GEMMs as usual), and y is not scaled again (Llama 4; vLLM's
               apply_router_weight_on_input)
    out      = sum_k weights * y  (+ shared(x) * sigmoid(x @ shared_gate_w.T))      (weight_on_input: sum_k y)
    FSE      : with fused_shared_gate, router_w is [E + 1, H] (gate row last): one GEMM gives logits and gate
    zero experts (zero_experts = Z > 0, LongCat-Flash): the router has E + Z outputs (router_w [E + Z, H], its bias
               and the correction bias [E + Z]) and routes over all of them as above; an id e >= E is a
               zero-computation expert whose y is the token itself, so its pair adds weights * x:
               out = sum_{k: id < E} weights * y + sum_{k: id >= E} weights * x     (w13 / w2 hold the E real experts)
               (the same with weight_on_input: the identity of weight * x, summed unweighted)
    hash routing (hash_routing, DeepSeek-V4's ``hash_moe`` layers): no selection; a frozen table hash_table [V, k]
               (integer expert ids) indexed by each token's id token_ids [T] (integer, in [0, V)) gives the ids, and
               the weights are the scores at those ids, as above:
               ids      = hash_table[token_ids]                                    # [T, k]
               weights  = scores[ids]  (/ max(sum + renorm_eps, renorm_min))  * routed_scaling
               (score_then_topk only, no correction bias or groups: there is no choice to steer; ids may repeat in a row,
               each pair is its own term). The token ids reach the op as its ``token_ids`` argument: a bound block
               passes the ``input_ids`` its forward receives (a forward argument, not a block tensor: the binding
               names it, ``match.forward_arg``); a rewritten graph passes the graph input it read; under CUDA graphs
               the kernels read the ids from that input's memory at every replay (the op's own eager graphs copy them
               in like x). Ids outside [0, V) / table values outside [0, E) are a SpecError where the op can read
               them (CPU always; CUDA outside capture and compilation); the kernels clamp both into range, so they
               never read or write out of bounds (``ops/hash_routing.py``).
    expert capacity (capacity = C > 0, or capacity_factor = f > 0: C = ceil(f * n); Switch Transformers, NLLB-MoE):
               the tokens are counted in groups of n: the whole call (capacity_per "call", n = T) or each sequence
               (capacity_per "sequence": x [..., S, H], n = S; a 2-D x is one sequence). In a group the pairs are
               ranked per expert in slot-major order (every token's first choice in token order, then every
               token's second, ...); a pair whose rank is >= C is dropped: it adds nothing (no expert runs for it).
               weights  as above, then  weights[dropped] = 0                        (the renormalisation sees all k)
               renorm_after_drop: weights[dropped] = 0 before the renormalisation, so the kept pairs are
               renormalised among themselves (NLLB-MoE's default); a token with every pair dropped outputs 0
               (+ shared experts). Plain top-k routing only: no zero experts, hash routing, weight_on_input or
               latent projections with it.
    latent experts (latent_size = L > 0, NemotronH's moe_latent_size): the routed experts work in a projected
               space of width L; the router and the shared experts read x as above:
               xl     = x @ latent_in_w.T (+ latent_in_b)                     # [T, L]  latent_in_w [L, H]
               routed = sum_k weights * y(xl)  (everything above, xl for x)  # [T, L]  w13 / w2 / b2 use L for H
               out    = routed @ latent_out_w.T (+ latent_out_b) + shared(x) # [T, H]  latent_out_w [H, L]
               (latent_bias: both projections have biases.) The routed scaling is in the weights, so it applies
               before the output projection and its bias; zero experts add weights * xl, weight_on_input scales xl.
               xl (the experts' input) and routed (the output projection's) are rounded to x's dtype, as the
               model's linears return them.
    stacked shared experts (shared.stacked = S > 0, Inkling): S shared experts whose weights are stacked
               [S, ...] (shared_w1 [S, Is, H] ..., read in place); shared(x) = sum_s gamma_s * shared_s(x), gamma 1
               unless the router gives them:
    shared gammas (shared_gamma = "joint_renorm", Inkling): router_w is [E + G, H] (G = shared.count: S, or 1 with
               one 2-D shared expert), its last G rows the shared experts' logits, scored like the routed ones
               (sigmoid / sqrtsoftplus); the top-k runs over the E routed ones as above, then the k chosen scores and
               the G shared ones are renormalised TOGETHER:
               d        = max(sum_k scores[ids] + sum_g score(l_g) + renorm_eps, renorm_min)
               weights  = scores[ids] / d * routed_scaling       gamma_g = score(l_g) / d * routed_scaling
               out      = sum_k weights * y + sum_g gamma_g * shared_g(x)     (no sigmoid shared gate with it)
               (round_weights rounds the gammas too.)
    weight scale (has_weight_scale): the op's ``weight_scale`` tensor [1] (a learned scalar, read at every call)
               multiplies the routing weights (and gammas) after routed_scaling: weights * routed_scaling * ws.

    router logit scale (router_scale = c != 1, MuseSpark's output_multiplier): logits = c * (x @ router_w.T (+ b)),
               in the logits' dtype, before everything above (scoring, bias on logits, top-k); the FSE gate row is
               not scaled.
    norms (MuseSpark): rms(v) = v * rsqrt(mean(v ** 2, -1) + eps) over the last dim, in fp32; "1 + w" is formed in
               w's own dtype, then fp32 (as the models do), and "round" is a cast to x's dtype:
               latent_norm (latent_size only; weight latent_norm_w [L], eps latent_norm_eps), on xl after the input
               projection, before the experts:
                   "rms_1p":  xl = round(rms(xl) * (1 + w))      (Gemma / MuseSpark's CenteredRMSNorm)
                   "rms":     xl = round(rms(xl) * w)            (the plain-weight form, multiplied in fp32)
               expert_norm (weight expert_norm_w [expert_width], eps expert_norm_eps), on each pair's expert output
               y (rounded to x's dtype, as the model's down projection returns it), before its routing weight:
                   "scaled_rms_1p":  y = round(rms(round(y * (1 + w))))   (MuseSpark's InputScaledRMSNorm: the
                                     scale FIRST, rounded, then the normalisation), then out = sum_k weights * y
                   "rms_per_expert":  y = round(rms(y) * w[e])   (Ergo's ErgoExpertNorm: expert_norm_w [E,
                                     expert_width], the pair's expert e's row, multiplied in fp32)
               (not with quant, weight_on_input, zero_experts or a capacity: no block has both)
               shared expert norm (SharedExpertSpec.norm "rms", weight shared_norm_w [H], eps shared.norm_eps; Ergo):
               shared(x) = round(rms(round(down(...))) * w), before its scale and sigmoid gate

Quantized weights (``quant``, a ``QuantSpec``; ``SharedExpertSpec.quant`` for the shared experts): the op reads the
quantized tensors and their scales as they are stored; what a GEMM computes is

    w[n, k]  = q[n, k] * s_w                                   # s_w: scale[n // block_n, k // block_k] ("block"),
                                                               #      scale[n] ("channel"), scale ("tensor"), per expert
    x_q      = e4m3(clamp(x * (1 / s_a), +-448)) * s_a         # "dynamic": s_a = max|x| / 448 over each token's group of
                                                               #   act_group columns (act_group 0: the whole row, one
                                                               #   scale per token; 1e-10 at least); "static": s_a given
    y        = x_q @ w.T                                       # activation "none": y = x @ w.T (weight-only)

The router's own input (``router_input``, ``router_norm``, ``router_in_scale``, ``router_in_const``) and per-expert
weight multipliers (``expert_scale``; a Gemma-4 decoder layer's router and experts, which read different inputs):

    r        = router_x if router_input else x                 # [T, H], x's dtype (router_x: the op argument)
    r        = (r.float() * (mean(r.float()^2) + router_norm_eps) ** -0.5).to(x.dtype)     (router_norm)
    r        = r * router_in_scale  (router_in_scale, [H], in x's dtype)  * router_in_const  (in x's dtype)
    logits   = r @ router_w.T (+ router_b)                      # then the routing above
    weights  = weights * expert_scale[ids]                      (expert_scale [E (+ Z)]: after the renormalisation
                                                                 and routed scaling, before round_weights)
    The experts (and shared experts) read x. Not with a sigmoid-gated shared expert (its gate reads x, the fused
    router GEMM would read r) nor with hash routing's / sparsemixer's routing (no block known).

The op receives the spec as a string (``spec.key``) so that it is a plain schema argument; ``MoESpec.from_key``
parses it back (cached).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

from moecomp.core.spec_checks import (  # noqa: F401  (re-exported: the allowed values and SpecError)
    SCORINGS, SCORE_ORDERS, GROUP_SCORES, ACTIVATIONS, W_LAYOUTS, GATE_UP, QUANT_WEIGHTS, PACKED_WEIGHTS, QUANT_SCALES,
    SCALE_DTYPES,
    QUANT_ACTIVATIONS, CAPACITY_PER, EXPERT_BIASES, PER_EXPERT_NORMS, FP8_MAX, SpecError, expert_bias_fields,
    check_activation as _check_activation, check_softcaps as _check_softcaps, check_quant, check_shared_norm,
    validate_moe, fields_from_key, spec_key,
)
from moecomp.core import spec_describe
from moecomp.core.spec_parallel import ParallelSpec, check_parallel, parallel_from_dict  # the sharded experts' part


@dataclass(frozen=True)
class QuantSpec:
    """Quantized weights and how a GEMM's activations are quantized (the formula in the module docstring).

    ``weight``: the stored element type. ``scale``: weight-scale layout, per expert for the routed experts:
    "block" ``[E, rows // block_n, cols // block_k]`` (rounded up; a gated w13 holds gate and up blocks apart, so
    ``2 * ceil(I / block_n)`` rows: checkpoints quantize gate_proj and up_proj separately), "channel" ``[E, rows]``,
    "tensor" ``[E]`` (for a shared expert's 2-D weights the same without E). ``scale_dtype``: the scales' storage.
    ``activation``: "dynamic" (per token, per group of ``act_group`` columns, quantized on the fly), "static" (one
    given scale per expert and GEMM: ``a13_scale`` / ``a2_scale`` ``[E]``), or "none" (weight-only: 16-bit
    activations against dequantized weights). ``act_group`` (dynamic only): 128 (DeepSeek-style per-token-group
    scales), or 0: one group spanning the whole row, one scale per token (``per_token``; compressed-tensors'
    "token" strategy of FP8-dynamic checkpoints); other values are a ValueError. The op may run a "dynamic" spec
    weight-only where that is faster (the kernel table decides per token bucket; the Triton kernels quantize
    activations in 128-column groups only, so a per-token spec runs weight-only there): its error against the
    dequantized reference is then smaller."""

    weight: str = "fp8_e4m3"
    scale: str = "block"
    block_n: int = 128
    block_k: int = 128
    scale_dtype: str = "fp32"
    activation: str = "dynamic"
    act_group: int = 128
    zero_point: bool = False  # int4: w = (u - zero) * s with a zero per row and group (w13_zero / w2_zero); else u - 8
    layout: str = "packed"  # 4-bit codes: "packed" (two a byte) | "mma" (ops/w4_layout.py; docs/QUANT4.md)

    @property
    def per_token(self) -> bool:
        """Dynamic activations with one scale per token over the whole row (``act_group`` 0)."""
        return self.activation == "dynamic" and self.act_group == 0

    @property
    def packed(self) -> bool:
        """Two 4-bit codes a byte (mxfp4, int4)."""
        return self.weight in PACKED_WEIGHTS

    @staticmethod
    def mxfp4() -> "QuantSpec":
        """gpt-oss's MXFP4: e2m1 codes, one ue8m0 scale per 32 input columns, weight-only."""
        return QuantSpec(weight="mxfp4", scale="group", block_n=1, block_k=32, scale_dtype="ue8m0", activation="none")

    @staticmethod
    def int4(group: int = 128, zero_point: bool = False, scale_dtype: str = "fp16") -> "QuantSpec":
        """GPTQ / AWQ-style int4: one scale (and zero, ``zero_point``) per row and ``group`` input columns."""
        return QuantSpec(weight="int4", scale="group", block_n=1, block_k=group, scale_dtype=scale_dtype,
                         activation="none", zero_point=zero_point)

    def weight_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The stored shape of one [rows, cols] matrix: packed formats hold two columns a byte."""
        return (rows, cols // 2) if self.packed else (rows, cols)

    def validate(self, who: str = "") -> None:
        check_quant(self, who)

    @functools.cached_property
    def key(self) -> str:
        """A compact, canonical string (the ``fp8_linear`` op's ``quant`` argument; ``spec_checks.spec_key``)."""
        return spec_key(dataclasses.asdict(self))

    @staticmethod
    def from_key(key: str) -> "QuantSpec":
        if not isinstance(key, str):
            raise SpecError(f"quant must be a QuantSpec key string (QuantSpec.key), got {type(key).__name__}")
        return _quant_from_key(key)

    def scale_shape(self, rows: int, cols: int, halves: int = 1) -> tuple[int, ...]:
        """The weight-scale shape of one [rows, cols] matrix (``halves`` = 2: gate and up blocked apart)."""
        if self.scale == "block":
            return (halves * -(-(rows // halves) // self.block_n), -(-cols // self.block_k))
        if self.scale == "channel":
            return (rows,)
        if self.scale == "group":
            return (rows, -(-cols // self.block_k))
        return ()


@dataclass(frozen=True)
class SharedExpertSpec:
    """Shared (always-on) experts, run densely on every token.

    ``layout`` "separate": ``shared_w1`` = gate_proj [Is, H], ``shared_w3`` = up_proj [Is, H];
    "concat": ``shared_w1`` = [2*Is, H] (gate rows first) and no ``shared_w3``; not ``gated``: ``shared_w3`` only.
    ``gate`` "sigmoid": the output is scaled by sigmoid(x @ shared_gate_w.T) (Qwen2-MoE), "none": added as is.
    ``activation`` / ``activation_alpha`` / ``activation_limit`` / ``activation_clamp`` / ``activation_clamp_after``
    mean what they mean for the routed experts (``MoESpec``): a gpt-oss style shared expert is
    ``activation="swiglu_oai"``.
    ``scale``: the shared experts' output is multiplied by it before it is added (Cohere2-MoE's "average" strategy,
    ``(routed + shared) / 2``, is ``scale=0.5`` with ``routed_scaling_factor=0.5``).
    """

    intermediate_size: int
    activation: str = "silu"
    gated: bool = True
    layout: str = "separate"
    gate: str = "none"
    activation_alpha: float = 1.702  # swiglu_oai only
    activation_limit: float = 7.0  # swiglu_oai, or with activation_clamp
    activation_clamp: bool = False
    activation_clamp_after: bool = False  # min(act(gate), limit) * clamp(up, -limit, limit) (MoESpec)
    scale: float = 1.0
    quant: QuantSpec | None = None  # quantized shared-expert weights (layout "separate" or ungated)
    gate_softcap: float = 0.0  # gated silu: its linear gate factor capped, cg * tanh(g / cg) (MoESpec); 0: none
    up_softcap: float = 0.0  # gated silu: up capped, cu * tanh(u / cu); 0: none
    stacked: int = 0  # S > 0: S shared experts stored stacked [S, ...] (Inkling), their outputs summed; 0: one, 2-D
    norm: str = "none"  # "rms": the output RMS-normalised, times shared_norm_w [H] (Ergo; MoESpec's docstring)
    norm_eps: float = 1e-6

    @property
    def count(self) -> int:
        """How many shared experts: ``stacked`` (S), or 1 with 2-D weights."""
        return self.stacked or 1

    def weight_shapes(self, H: int) -> dict[str, tuple[int, ...]]:
        """{argument: shape} of the shared experts' weights (a leading [S] with ``stacked``)."""
        Is = self.intermediate_size
        if self.gated and self.layout == "concat":
            shapes = {"shared_w1": (2 * Is, H)}
        elif self.gated:
            shapes = {"shared_w1": (Is, H), "shared_w3": (Is, H)}
        else:
            shapes = {"shared_w3": (Is, H)}
        shapes["shared_w2"] = (H, Is)
        lead = (self.stacked,) if self.stacked else ()
        return {n: lead + s for n, s in shapes.items()}

    def validate(self) -> None:
        S = self.stacked
        if isinstance(S, bool) or not isinstance(S, int) or S < 0:
            raise SpecError(f"shared expert stacked must be an int >= 0 (0: one expert, 2-D weights), got {S!r}")
        if S and (self.quant is not None or self.gate != "none"):
            raise SpecError(f"stacked shared experts (stacked={S}) are not supported quantized or with a sigmoid "
                            "gate (no block is known to have them)")
        if self.quant is not None:
            self.quant.validate("shared expert ")
            if self.quant.packed:
                raise SpecError(f"4-bit shared experts ({self.quant.weight}) are not supported: 4-bit formats are for "
                                "the routed experts (quant)")
            if self.gated and self.layout != "separate":
                raise SpecError("quantized shared experts need layout 'separate' (gate_proj / up_proj apart)")
            if self.quant.activation == "static":
                raise SpecError("quantized shared experts with static activation scales are not supported")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise SpecError(f"shared expert scale must be finite and positive, got {self.scale}")
        if self.intermediate_size <= 0:
            raise SpecError(f"shared expert intermediate_size must be positive, got {self.intermediate_size}")
        if self.activation not in ACTIVATIONS:
            raise SpecError(f"unsupported shared-expert activation {self.activation!r}")
        _check_activation(self, "shared expert ")
        _check_softcaps(self, "shared expert ")
        if self.layout not in ("separate", "concat"):
            raise SpecError(f"unknown shared-expert layout {self.layout!r}")
        if self.gate not in ("none", "sigmoid"):
            raise SpecError(f"unknown shared-expert gate {self.gate!r}")
        check_shared_norm(self)


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    # --- routing ---
    scoring: str = "softmax"
    score_order: str = "score_then_topk"
    jitter_eps: float = 0.0  # sparsemixer only: an expert stays in a round's softmax within 2 * jitter_eps (relative)
    renormalize: bool = True
    renorm_eps: float = 0.0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    has_correction_bias: bool = False
    bias_on_logits: bool = False  # the correction bias is added to the logits, not the scores (Kolibri-1)
    group_mask_zero: bool = False  # experts of dropped groups get 0.0 in the choice, not -inf (Mistral-4)
    renorm_min: float = 0.0  # renormalise by max(sum + renorm_eps, renorm_min) (ERNIE-4.5: clamp(sum, min))
    has_router_bias: bool = False
    router_fp32: bool = False  # router GEMM in fp32 (DeepSeek-V3 style) instead of the model dtype
    round_weights: bool = False  # routing weights rounded to the model dtype before use (Qwen/OLMoE style)
    fused_shared_gate: bool = False  # FSE: router_w is [E + 1, H], its last row the shared-expert gate
    weight_on_input: bool = False  # each pair's expert runs on weight * x, the combine sums unweighted (Llama 4)
    zero_experts: int = 0  # router outputs past the E experts: ids >= E add weight * x (identity experts, LongCat)
    hash_routing: bool = False  # ids = hash_table[token_ids], weights = scores[ids] (DeepSeek-V4 hash_moe layers)
    # --- expert capacity (Switch / NLLB-MoE): pairs past an expert's capacity are dropped (the module docstring) ---
    capacity: int = 0  # a fixed capacity per expert and group of tokens; 0: none
    capacity_factor: float = 0.0  # capacity = ceil(capacity_factor * the group's tokens); 0: none
    capacity_per: str = "call"  # the group: "call" (every token of the call) | "sequence" (x [..., S, H]: each S)
    renorm_after_drop: bool = False  # the renormalisation runs over the pairs kept (NLLB-MoE), not before the drop
    # --- latent experts (NemotronH moe_latent_size): experts between latent_in [H -> L] and latent_out [L -> H] ---
    latent_size: int = 0  # L; 0: the experts read x itself (no projections)
    latent_bias: bool = False  # both projections have biases (latent_in_b [L], latent_out_b [H])
    # --- experts ---
    activation: str = "silu"
    gated: bool = True
    activation_alpha: float = 1.702  # swiglu_oai only
    activation_limit: float = 7.0  # swiglu_oai, or with activation_clamp
    activation_clamp: bool = False  # gated: gate clamped to <= limit, up to [-limit, limit] before act(gate) * up
    activation_clamp_after: bool = False  # gated: min(act(gate), limit) * clamp(up, -limit, limit) (Step-3.7)
    w_layout: str = "out_in"  # w13 [E, 2I, H] / w2 [E, H, I] ("out_in"), or [E, H, 2I] / [E, I, H] ("in_out")
    gate_up: str = "concat"  # gate rows then up rows, or interleaved gate0, up0, gate1, ...
    has_expert_bias: bool = False  # the routed experts' GEMMs add biases: b13 [E, 2I or I] and / or b2 [E, H]
    expert_bias: str = "both"  # which, with has_expert_bias: "both", "gemm1" (b13 only), "gemm2" (b2 only)
    # --- shared experts ---
    shared: SharedExpertSpec | None = None
    # --- quantized routed experts (w13 / w2 and their scales; see QuantSpec) ---
    quant: QuantSpec | None = None
    # --- softcapped gated silu (the module docstring): h = cap(g, cg) * sigmoid(g) * cap(u, cu) ---
    gate_softcap: float = 0.0  # cg: silu's linear gate factor -> cg * tanh(g / cg); 0: uncapped
    up_softcap: float = 0.0  # cu: up -> cu * tanh(u / cu); 0: uncapped
    # --- the router's own input and per-expert weight multipliers (Gemma-4 style decoder layers; module docstring) ---
    router_input: bool = False  # the router reads the op's router_x [..., H] (same leading dims as x), not x
    router_norm: bool = False  # the router's input is RMS-normalised first (no weight; fp32, rounded back)
    router_norm_eps: float = 1e-6  # router_norm's epsilon: r * (mean(r^2) + eps) ** -0.5
    router_in_scale: bool = False  # the router's input is multiplied by the op's router_in_scale [H]
    router_in_const: float = 1.0  # ... and by this constant (after the norm and the scale vector)
    expert_scale: bool = False  # routing weights times the op's expert_scale [E (+ Z)] at their ids
    # --- shared-expert gammas from the router (Inkling); a learned scale of the routing weights ---
    shared_gamma: str = "none"  # "joint_renorm": router_w has G = shared.count more rows, renormalised with the k
    has_weight_scale: bool = False  # routing weights (and gammas) times the op's weight_scale tensor [1]
    # --- router logit scale and norms around the experts (MuseSpark; the module docstring, "norms") ---
    router_scale: float = 1.0  # logits *= router_scale before the scoring (MuseSpark's output_multiplier)
    latent_norm: str = "none"  # RMSNorm of xl after the latent input projection: "none" | "rms" | "rms_1p"
    latent_norm_eps: float = 1e-6
    expert_norm: str = "none"  # RMSNorm of each pair's expert output before its weight: "none" | "scaled_rms_1p"
    expert_norm_eps: float = 1e-6
    # --- this rank's shard of the routed experts (expert / tensor parallelism; spec_parallel.py) ---
    parallel: ParallelSpec | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        validate_moe(self)
        if self.parallel is not None:
            check_parallel(self)

    # ------------------------------------------------------------ serialise
    @functools.cached_property
    def key(self) -> str:
        """A compact, canonical string: the op's ``spec`` argument (``spec_checks.spec_key``)."""
        return spec_key(dataclasses.asdict(self))

    @staticmethod
    def from_key(key: str) -> "MoESpec":
        if not isinstance(key, str):
            raise SpecError(f"spec must be a MoESpec key string (MoESpec.key), got {type(key).__name__}")
        return _spec_from_key(key)

    def replace(self, **changes) -> "MoESpec":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------- helpers
    @property
    def can_fuse_shared_gate(self) -> bool:
        """FSE applies: a sigmoid-gated shared expert, no router bias, not fused yet (the checks in __post_init__)."""
        return (self.shared is not None and self.shared.gate == "sigmoid" and not self.has_router_bias
                and not self.fused_shared_gate and not self.zero_experts)

    @property
    def router_prefix(self) -> bool:
        """The router reads something other than x itself: its own input (``router_input``) and / or a prefix
        (norm, scale vector, constant) before its GEMM."""
        return (self.router_input or self.router_norm or self.router_in_scale or self.router_in_const != 1.0)

    @property
    def has_capacity(self) -> bool:
        """Pairs may be dropped past an expert's capacity (``capacity`` or ``capacity_factor`` set)."""
        return bool(self.capacity or self.capacity_factor)

    def capacity_for(self, tokens: int) -> int:
        """The capacity of each expert in a group of ``tokens`` tokens (``has_capacity`` only)."""
        return self.capacity if self.capacity else math.ceil(self.capacity_factor * tokens)

    @property
    def gamma_rows(self) -> int:
        """Router rows past the routed ones that give the shared experts' gammas (``shared_gamma``): G or 0."""
        return self.shared.count if self.shared_gamma != "none" and self.shared is not None else 0

    @property
    def router_width(self) -> int:
        """The router's outputs (logits, ids' range): the E experts plus the zero-computation ones."""
        return self.num_experts + self.zero_experts

    @property
    def expert_width(self) -> int:
        """The width the routed experts read and write: latent_size with latent projections, else hidden_size."""
        return self.latent_size or self.hidden_size

    def latent_shapes(self) -> dict[str, tuple[int, ...]]:
        """{argument: shape} of the latent projections (empty without ``latent_size``)."""
        L, H = self.latent_size, self.hidden_size
        if not L:
            return {}
        shapes = {"latent_in_w": (L, H), "latent_out_w": (H, L)}
        if self.latent_bias:
            shapes.update(latent_in_b=(L,), latent_out_b=(H,))
        return shapes

    def norm_shapes(self) -> dict[str, tuple[int, ...]]:
        """{argument: shape} of the norms' weights (``latent_norm_w`` [L], ``expert_norm_w`` [(E,) expert_width],
        ``shared_norm_w`` [H]); empty without ``latent_norm`` / ``expert_norm`` / ``shared.norm``."""
        shapes = {}
        if self.latent_norm != "none":
            shapes["latent_norm_w"] = (self.latent_size,)
        if self.expert_norm != "none":
            per_expert = (self.num_experts,) if self.expert_norm in PER_EXPERT_NORMS else ()
            shapes["expert_norm_w"] = per_expert + (self.expert_width,)
        if self.shared is not None and self.shared.norm != "none":
            shapes["shared_norm_w"] = (self.hidden_size,)
        return shapes

    def experts_spec(self) -> "MoESpec":
        """The routed experts alone, in their own width: what a latent block computes between its projections
        (``hidden_size`` = L, no projections, no shared experts; routing fields kept). ``self`` without latent."""
        if not self.latent_size:
            return self
        return self.replace(hidden_size=self.latent_size, latent_size=0, latent_bias=False, shared=None,
                            fused_shared_gate=False, latent_norm="none", latent_norm_eps=1e-6)

    @property
    def has_b13(self) -> bool:
        """The first expert GEMM (gate / up) adds a bias b13 [E, w13_rows]."""
        return self.has_expert_bias and self.expert_bias != "gemm2"

    @property
    def has_b2(self) -> bool:
        """The second expert GEMM (down) adds a bias b2 [E, expert_width]."""
        return self.has_expert_bias and self.expert_bias != "gemm1"

    @property
    def w13_rows(self) -> int:
        """Output features of the first expert GEMM: 2I when gated, else I."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    def expert_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{argument: shape} of the routed experts' weights (and biases), in ``expert_width`` (H, or L when latent)."""
        E, H, I, N = self.num_experts, self.expert_width, self.intermediate_size, self.w13_rows
        if self.quant is not None and self.quant.packed:  # out_in, two columns a byte
            shapes = {"w13": (E, N, H // 2), "w2": (E, H, I // 2)}
        elif self.w_layout == "out_in":
            shapes = {"w13": (E, N, H), "w2": (E, H, I)}
        else:
            shapes = {"w13": (E, H, N), "w2": (E, I, H)}
        if self.has_b13:
            shapes["b13"] = (E, N)
        if self.has_b2:
            shapes["b2"] = (E, H)
        return shapes

    def quant_shapes(self) -> dict[str, tuple[int, ...]]:
        """{argument: shape} of the routed experts' scale tensors (empty without ``quant``)."""
        q = self.quant
        if q is None:
            return {}
        E, H, I, N = self.num_experts, self.expert_width, self.intermediate_size, self.w13_rows
        shapes = {"w13_scale": (E, *q.scale_shape(N, H, 2 if self.gated else 1)),
                  "w2_scale": (E, *q.scale_shape(H, I))}
        if q.zero_point:
            shapes.update(w13_zero=shapes["w13_scale"], w2_zero=shapes["w2_scale"])
        if q.activation == "static":
            shapes.update(a13_scale=(E,), a2_scale=(E,))
        return shapes

    def shared_quant_shapes(self) -> dict[str, tuple[int, ...]]:
        """{argument: shape} of the shared experts' scale tensors (empty unless ``shared.quant``)."""
        sh = self.shared
        if sh is None or sh.quant is None:
            return {}
        H, Is, q = self.hidden_size, sh.intermediate_size, sh.quant
        shapes = {"shared_w2_scale": q.scale_shape(H, Is), "shared_w3_scale": q.scale_shape(Is, H)}
        if sh.gated:
            shapes["shared_w1_scale"] = q.scale_shape(Is, H)
        return shapes

    def bytes_per_expert(self, itemsize: float | None = None) -> int:
        """Bytes of one expert's w13 + w2: ``itemsize`` per element (default 2, 1 for fp8 weights, 0.5 for 4-bit),
        plus the scales (and zeros) where quantized, at their stored size."""
        q = self.quant
        if itemsize is None:
            itemsize = 2 if q is None else 0.5 if q.packed else 1
        scale_bytes = 0 if q is None else {"fp32": 4, "ue8m0": 1, "fp16": 2, "bf16": 2}[q.scale_dtype]
        scales = sum((1 if n.endswith("_zero") else scale_bytes) * math.prod(s[1:])
                     for n, s in self.quant_shapes().items() if len(s) > 1)
        return int((self.w13_rows * self.expert_width + self.expert_width * self.intermediate_size) * itemsize) + scales

    def describe(self) -> str:
        return spec_describe.describe(self)


@functools.lru_cache(maxsize=256)
def _quant_from_key(key: str) -> QuantSpec:
    try:
        d = json.loads(key)
    except json.JSONDecodeError as e:
        raise SpecError(f"quant string {key[:80]!r} is not a QuantSpec key (JSON of the QuantSpec fields): {e}") from e
    q = QuantSpec(**fields_from_key(d, QuantSpec, key, "the quant spec"))
    q.validate()
    return q


@functools.lru_cache(maxsize=256)
def _spec_from_key(key: str) -> MoESpec:
    """Parse ``MoESpec.key``; anything that is not a valid key is a SpecError (never a TypeError / KeyError)."""
    try:
        d = json.loads(key)
    except json.JSONDecodeError as e:
        raise SpecError(f"spec string {key[:80]!r} is not a MoESpec key (JSON of the MoESpec fields): {e}") from e
    d = dict(fields_from_key(d, MoESpec, key, "the spec"))
    shared = d.pop("shared", None)
    if shared is not None:
        shared = dict(fields_from_key(shared, SharedExpertSpec, key, "'shared'"))
        sq = shared.pop("quant", None)
        sq = None if sq is None else QuantSpec(**fields_from_key(sq, QuantSpec, key, "'shared.quant'"))
        shared = SharedExpertSpec(**shared, quant=sq)
    quant = d.pop("quant", None)
    if quant is not None:
        quant = QuantSpec(**fields_from_key(quant, QuantSpec, key, "'quant'"))
    par = d.pop("parallel", None)
    if par is not None:
        par = parallel_from_dict(par, key, fields_from_key)
    return MoESpec(**d, shared=shared, quant=quant, parallel=par)
