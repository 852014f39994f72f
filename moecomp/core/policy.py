"""moecomp's numeric policy: every tolerance, near-tie rule and probe input the recognisers and checks use.

Each value is defined here once, with why it has that value; the modules that apply it import it from here
(``tests/test_policy.py`` checks that no copy of these literals is left in them). Changing a value here changes
what ``moecomp.optimize`` accepts: regenerate ``docs/coverage.md`` (``python -m moecomp coverage``) and compare.

Three groups:

* the *verify check* (``moecomp.optimize``, ``moecomp.hf.experts_interface``): the block's own forward and the
  op on the same probe input must agree within :data:`VERIFY_TOLERANCE` of the output's largest value;
* the *near-tie rule*: which tokens may legitimately take another expert (16-bit router logits within a rounding
  of a tie). What "near a tie" means is the oracle's (``moecomp.oracle.reference.near_tie_tokens``); *when* it excuses
  tokens (window per dtype, largest share of tokens) is decided here;
* the *probe inputs*: how many tokens, which distribution, which seed, for each check that runs a module.

The FX pass's own numeric check (``moecomp.recognise.fx.numeric``) reads its token budget and agreement rule from the
section at the end of this module. The whole-model checks (``moecomp.coverage.families.TOL``, ``moecomp.cli.demo``,
``benchmarks/hf_gpu_check.py``) are separate rules with their own owners.
"""

from __future__ import annotations

import torch

# ------------------------------------------------------------------------------------------------ verify check
# max |op - block| / max |block| on the probe input, per dtype of the block. fp32: both sides compute the same
# math in a different order (GEMM blocking, expert summation order): a few ulps of fp32 grown over two GEMMs and a
# weighted sum stay well under 1e-4, while any wrong spec field (a missed scale, renormalisation, activation) is
# off by far more. fp64: the same argument with ~9 more decimal digits. bf16 keeps 8 significant bits (~4e-3 per
# rounding) and the op rounds in other places than the block (fused gate/up, fp32 accumulation): 3e-2. fp16 keeps
# 11 bits: 1e-2.
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# dtypes not listed above (other 8/16-bit floats): the fp16 value, the tightest 16-bit one we can justify
VERIFY_TOLERANCE_DEFAULT = 1e-2


# FP8 weights (``MoESpec.quant`` / ``SharedExpertSpec.quant``): the block (its plain-PyTorch FP8 forward,
# ``formats/fp8.py``: each GEMM's output in the model dtype, like the FP8 kernels) and the op (the dequantized reference:
# fp32 between the GEMMs on the CPU path; on CUDA the kernel table may run a "dynamic" spec weight-only) quantize
# activations to e4m3, which keeps 3 mantissa bits: one rounding moves a value by up to 2^-4 (6.25%). Two correct
# implementations whose 16-bit intermediates differ by one rounding put about 1/16 of the activations on the other
# side of an e4m3 rounding boundary (2^-8 / 2^-4), and a weight-only run differs from w8a8 by the whole activation
# rounding error; both stay within about 3e-2 of the output's largest value on the tiny test models (measured), so
# 6e-2. A wrong quantization field (block size, scale layout, gate / up halves, a missing scale) is off by far more
# (a scale read from the wrong block changes whole outputs by factors); the activation scheme itself ("dynamic" vs
# weight-only) is not told apart by this tolerance, and does not need to be (the op may run either).
VERIFY_TOLERANCE_FP8 = 6e-2


# 4-bit weights (``QuantSpec.packed``: mxfp4, int4) get the 16-bit tolerance of the block's dtype, not the FP8 one.
# They are weight-only: the block (``formats/packed.py``'s ``PackedExperts``: each weight dequantized exactly in fp32,
# fp32 GEMMs, h rounded to the model dtype between them) and the op (the same dequantization on the CPU path; the
# w4a16 kernels convert each dequantized weight to the activation dtype in registers, exact for mxfp4's e2m1 times
# a power of two, one 16-bit rounding of int4's (code - zero) * scale, like a 16-bit checkpoint's own weights) keep
# 16-bit activations, so they differ only where two 16-bit implementations do. No e4m3 rounding amplifies anything.
# A wrong 4-bit reading changes whole outputs: on the tiny gpt-oss of tests/hf/test_mxfp4.py (measured, relative
# to the output's max) swapped nibbles 1.5, gate / up read as concat 1.35, another row's scales 1.8, scales one
# exponent off 1.6 (the test checks each is over 10x the bf16 tolerance).


def quantized(spec) -> bool:
    """Does ``spec`` (a MoESpec, or None) hold quantized weights (routed or shared experts)?"""
    if spec is None:
        return False
    return spec.quant is not None or (spec.shared is not None and spec.shared.quant is not None)


def fp8_quantized(spec) -> bool:
    """Does ``spec`` hold FP8 weights (routed or shared experts), whose checks take ``VERIFY_TOLERANCE_FP8``? 4-bit
    weights do not (the note above ``quantized``)."""
    if spec is None:
        return False
    return any(q is not None and not q.packed for q in (spec.quant, spec.shared.quant if spec.shared else None))


def verify_tolerance(dtype: torch.dtype, spec=None) -> float:
    """The verify check's tolerance for a block (or experts module) of ``dtype``; ``spec`` with FP8 weights: at
    least ``VERIFY_TOLERANCE_FP8`` (4-bit weights: the dtype's own)."""
    tol = VERIFY_TOLERANCE.get(dtype, VERIFY_TOLERANCE_DEFAULT)
    return max(tol, VERIFY_TOLERANCE_FP8) if fp8_quantized(spec) else tol


# ------------------------------------------------------------------------------------------------ near-tie rule
# 16-bit routers: the logits of two correct implementations may differ by a rounding; tokens whose choice is that
# close to a tie may take the other expert (bf16 keeps 8 bits: exact ties are common). The window is one rounding
# of the dtype relative to the token's max |logit| (bf16: 2^-7 ~ one ulp at 8 significant bits; fp16: 2^-10, 11
# bits). fp32 / fp64 routers get no window: their logits agree far below any expert gap the probe input produces.
TIE_REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# at most this share of the probe tokens may differ by a tie (a wrong spec hits every token, a tie a few: with 32
# probe tokens, up to 4)
MAX_TIE_FRACTION = 0.125


def tie_window(dtype: torch.dtype) -> float | None:
    """The near-tie window (relative to the token's max |logit|) for routers of ``dtype``; None: ties not excused."""
    return TIE_REL.get(dtype)


# The pair verify (verify/pair_verify.py) draws its probes of a parent layer from these seeds; a 16-bit probe with more
# near-tie tokens than max_tie_tokens proves nothing either way and is skipped; this many usable probes are needed.
PAIR_PROBE_SEEDS = (11, 12, 13, 14, 15, 16)
PAIR_PROBES_NEEDED = 2


def max_tie_tokens(n_tokens: int) -> int:
    """How many of ``n_tokens`` probe tokens may be excused as near ties (at least one)."""
    return max(1, int(MAX_TIE_FRACTION * n_tokens))


# The decode step's RMSNorm fold (generate/fuse_norm.py) checks a matched norm on probes against h / rms(h) * w (or
# * (1 + w)): within NORM_PROBE_EPS of the output dtype's eps relative to each value (2x the unit roundoff: transformers
# rounds the normalized row up to twice, with headroom), plus NORM_PROBE_ABS of the largest value.
NORM_PROBE_EPS = 2.5
NORM_PROBE_ABS = 1e-6


# ------------------------------------------------------------------------------------------------ probe inputs
# The verify check's input: [batch, tokens] = 2 x 16 = 32 tokens of N(0, 1) hidden states (the block's dtype and
# device), from a fixed seed so that reports are reproducible. 32 tokens with top-k routing over <= 128 experts hit
# most experts and both batch rows; a second batch row catches blocks that mix tokens across the batch. Small enough
# to run in milliseconds on CPU test models.
PROBE_SHAPE = (2, 16)
PROBE_SEED = 0
# the epilogue check (``op`` followed by a peeled post-MoE norm) repeats on a second, independent input
EPILOGUE_PROBE_SEED = 7
# the FX pass traces on [1, 3, H]: any token count does (dynamic shapes); 3 is not 1 (no size-1 specialisation)
# and differs from every other size in a test model (no accidental shape coincidences)
CAPTURE_PROBE_SHAPE = (1, 3)
# A block whose capture fails on a data-dependent branch (a per-expert loop's ``if tok.numel():``) is traced again
# with real values, following the example's branches: the example must then reach every expert. With
# REAL_TRACE_TOKENS_PER_EXPERT tokens per expert (at least REAL_TRACE_MIN_TOKENS) and top-k >= 1, an expert a
# random router sends 1/E of the choices misses all of them with probability about exp(-8) (0.03%); a missed expert
# makes the FX pass refuse the trace (the attribute reader then tries), never a wrong match.
REAL_TRACE_TOKENS_PER_EXPERT = 8
REAL_TRACE_MIN_TOKENS = 64


def real_trace_shape(num_experts: int) -> tuple[int, int]:
    """[batch, tokens] of the example for a trace that follows the example's branches (see above)."""
    return (1, max(REAL_TRACE_MIN_TOKENS, REAL_TRACE_TOKENS_PER_EXPERT * int(num_experts)))


def probe_input(hidden: int, device, dtype, shape=PROBE_SHAPE, seed: int = PROBE_SEED) -> torch.Tensor:
    """The verify check's input: N(0, 1) of ``shape + (hidden,)``, drawn on the CPU (same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, hidden, generator=g).to(device=device, dtype=dtype)


# Hash routing (MoESpec.hash_routing): the token ids given with the probe / capture inputs, uniform in [0, V) (V the
# table's rows) from their own seed, one per token: with 32 probe tokens and a random table most experts are reached;
# any ids in range prove the lookup (the check compares with the block's own forward on the same ids).
TOKEN_PROBE_SEED = 11
# forward parameters tried for the token ids when capturing a block that holds a 2-D integer tensor (a table), in
# signature order: the first few only (each try is one Dynamo capture)
TOKEN_PARAM_TRIES = 3


def probe_token_ids(shape, vocab: int, device, seed: int = TOKEN_PROBE_SEED) -> torch.Tensor:
    """Token ids of ``shape`` (the probe's leading dims), uniform in [0, vocab), int64, drawn on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, int(vocab)), tuple(shape), generator=g).to(device)


# Inputs that reach activation clamps. Clamped SwiGLU variants clamp at 7-10; N(0, 1) hidden states rarely reach
# that, so the probes below are scaled so that the first GEMM's outputs have std 8 (reaching about +-25).
CLAMP_REACH_STD = 8.0
# dense MLP modules (shared experts, ModuleList expert 0) are called on this many tokens, fixed seed
MLP_PROBE_TOKENS = 48
MLP_PROBE_SEED = 4321
# experts modules (``moe_experts`` against the module's own eager forward): tokens, fixed seed
EXPERTS_PROBE_TOKENS = 24
EXPERTS_PROBE_SEED = 2024
# ``experts._apply_gate``: [tokens, 2 * width] gate/up values of N(0, 6^2) (about +-20: clamps at 7-10 are hit)
GATE_PROBE_TOKENS = 64
GATE_PROBE_WIDTH = 16
GATE_PROBE_STD = 6.0
GATE_PROBE_SEED = 1234
# elementwise activations (``act_fn``): a grid over [-12, 12], step 0.1 (covers the clamps and both tails)
ACTIVATION_PROBE_RANGE = 12.0
ACTIVATION_PROBE_POINTS = 241


def gate_probe_input() -> torch.Tensor:
    """[GATE_PROBE_TOKENS, 2 * GATE_PROBE_WIDTH] fp32 gate/up values for ``_apply_gate`` probes."""
    g = torch.Generator().manual_seed(GATE_PROBE_SEED)
    return torch.randn(GATE_PROBE_TOKENS, 2 * GATE_PROBE_WIDTH, generator=g) * GATE_PROBE_STD


def activation_probe_input() -> torch.Tensor:
    """The fp32 grid elementwise activations are told apart on."""
    return torch.linspace(-ACTIVATION_PROBE_RANGE, ACTIVATION_PROBE_RANGE, ACTIVATION_PROBE_POINTS,
                          dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ recognition
# An activation / gate function matches a reference when allclose(rtol, atol) holds on the probes above; both
# sides run in fp32 on the same values, so only the last bits may differ (1e-5 relative).
ACT_MATCH_RTOL = 1e-5
ACT_MATCH_ATOL = 1e-5  # gate probes: values of order 1-20
ACT_MATCH_ATOL_REL = 1e-6  # elementwise probes: atol relative to the reference's largest value
# a dense MLP module against the reference MLP, max |diff| / max |ref|: fp32 / fp64 the same math (1e-5); 16-bit
# modules round their GEMMs and activations (2e-2; a wrong activation or clamp is off by far more on the probe)
MLP_MATCH_TOL_FULL = 1e-5
MLP_MATCH_TOL_LOW = 2e-2


def mlp_match_tolerance(dtype: torch.dtype, quantized: bool = False) -> float:
    """``quantized`` (FP8 linears: each quantizes its input to e4m3; a one-ulp difference in an fp32 GEMM output can
    flip one e4m3 rounding, 2^-4 of that value): the 16-bit tolerance, which still tells activations apart."""
    if quantized:
        return MLP_MATCH_TOL_LOW
    return MLP_MATCH_TOL_FULL if dtype in (torch.float32, torch.float64) else MLP_MATCH_TOL_LOW


# The routing the block measurably takes (``moecomp.recognise.fallback``) against a candidate routing: the routing weights
# must agree up to one constant within this rtol (atol relative to the largest weight). fp32 blocks: fp32 softmax /
# sigmoid of the same logits (2e-5). Other dtypes (fp64 included, as measured so far): 16-bit weights are rounded
# (2e-2 covers one bf16 rounding of weights near 1).
ROUTING_MATCH_TOL_FP32 = 2e-5
ROUTING_MATCH_TOL_LOW = 2e-2


def routing_match_tolerance(dtype: torch.dtype) -> float:
    return ROUTING_MATCH_TOL_FP32 if dtype == torch.float32 else ROUTING_MATCH_TOL_LOW


# A fitted constant (routed scaling factor) is snapped to 1 or to a scalar attribute of the block when within this
# relative distance: a least-squares fit over 32 fp32 tokens lands within ~1e-6 of the true value; 1e-4 still tells
# apart any two constants a config would hold.
SNAP_REL = 1e-4


def snap_constant(c: float, consts, rel: float = SNAP_REL) -> float:
    """``c`` snapped to 1 or to the first of ``consts`` within ``rel`` (default ``SNAP_REL``) of it (else ``c`` as
    fitted). The dispatch reader fits its scale from a 16-bit block's outputs: ``TIE_REL`` of the dtype there."""
    if abs(c - 1.0) < rel:
        return 1.0
    for v in consts:
        if v and abs(c - v) <= rel * abs(v):
            return float(v)
    return c

# ------------------------------------------------------------------------------------------- sparsemixer probes
# Sparsemixer routing (PhiMoE) keeps an expert in a round's softmax while its logit is within 2 * jitter_eps
# (relative) of the round's max. Random router inputs seldom put a logit near that line (jitter_eps 0.01: 2% of the
# max; about 4% of the weights differ from 1), so both recognisers also probe rows built to straddle it: in each
# round, for positive and negative maxima, one logit inside the threshold and one outside it by each of
# SPARSEMIXER_PROBE_MARGINS (relative to the threshold: a quarter, beyond a bf16 rounding of the logits, 2^-9, at
# thresholds of 0.02 and up; and 1/32, which tells a jitter_eps from one 3% away), beside exact ties, zeros and
# random rows. A jitter_eps of 0 has no inside: ties, and SPARSEMIXER_PROBE_GAP0 times each margin outside.
SPARSEMIXER_PROBE_MARGINS = (0.25, 1 / 32)
SPARSEMIXER_PROBE_GAP0 = 0.1
SPARSEMIXER_PROBE_SEED = 11
# A 16-bit block computes the threshold test in its dtype: the gap, its ratio and 2 * jitter_eps each rounded once
# (bf16: 2^-9 relative each), so rows whose ratio is within this share of the threshold may fall on either side
# and are left out of the probe comparison (``reference.sparsemixer_contested``).
SPARSEMIXER_MASK_REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}


def sparsemixer_probe_logits(num_experts: int, top_k: int, jitter_eps: float) -> torch.Tensor:
    """[P, num_experts] fp32 router logits that tell sparsemixer thresholds apart (see above): per round j < top_k,
    maximum and side, a row whose j-th largest logit m has a free logit s at relative gap thr * (1 -+ margin) of it
    (the j larger ones above it, the rest well below); plus ties, all-equal, zero and random rows."""
    g = torch.Generator().manual_seed(SPARSEMIXER_PROBE_SEED)
    E, thr = num_experts, 2 * jitter_eps
    rows = [torch.randn(E, generator=g) * s for s in (0.3, 1.0, 3.0, 10.0)]
    tie = torch.randn(E, generator=g)
    tie[torch.randperm(E, generator=g)[:3]] = tie.max() + 1.0  # three equal maxima (ties to the lower index)
    rows += [tie, torch.full((E,), 0.7), torch.zeros(E), -torch.rand(E, generator=g).round()]
    sides = [thr * (1 + s * d) for d in SPARSEMIXER_PROBE_MARGINS for s in (-1, 1)] if thr else [
        0.0] + [SPARSEMIXER_PROBE_GAP0 * d for d in SPARSEMIXER_PROBE_MARGINS]
    for j in range(min(top_k, E - 1)):
        for m in (1.5, -0.75, 4.0, -3.0):
            for q in sides:
                if (m > 0 and q >= 2) or (m < 0 and q >= 1):
                    continue  # (m - s) / max(|s|, m) stays below 2 (m > 0) or 1 (m < 0): no such logit
                s = m * (1 - q) if m > 0 else m / (1 - q)
                r = m - abs(m) * (1.5 + torch.rand(E, generator=g))  # the rest, well below
                order = torch.randperm(E, generator=g)
                r[order[:j]] = m + abs(m) * torch.arange(j, 0, -1, dtype=torch.float32)  # earlier rounds' picks
                r[order[j]], r[order[j + 1]] = m, s
                rows.append(r)
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------------ benchmarks
# ``benchmarks/bench_moe.py``: moecomp vs the HF block in bf16 at real sizes, ||diff|| / ||ref|| over all tokens
# that are not near a tie. Whole-tensor norms average the per-element bf16 roundings (~4e-3 each): 2e-2.
BENCH_TOLERANCE = 2e-2
# CUDA-graph replay against a plain call on a fresh input: same kernels, only the input differs; bf16 noise of a
# different input through the same code stays under 1e-2
BENCH_GRAPH_CONSISTENCY_TOL = 1e-2
# a token counts as "bad" (routing flip) when its own ||diff|| / ||ref|| is above this (a flip changes ~1/k of it)
BENCH_BAD_TOKEN_REL = 0.05
# The benchmark's near-tie window is per logit (it has the logits, not the router weights): fp32 routers, two GEMMs
# summing H terms in different orders land ~1e-6 apart: 2e-5 * (1 + |logit|); bf16 routers: half an ulp of the
# logit each side (exact ties and 1-ulp gaps, one rounding apart), i.e. 2^(exponent - bits) with bf16's 8 bits.
BENCH_TIE_FP32_REL = 2e-5
BENCH_TIE_SIGNIFICAND_BITS = 8


def bench_tie_window(logits: torch.Tensor, fp32_router: bool) -> torch.Tensor:
    """Per-logit half-width of the benchmark's near-tie interval (``bench_moe.routing_ambiguous``)."""
    if fp32_router:
        return BENCH_TIE_FP32_REL * (1.0 + logits.abs())
    _, e = torch.frexp(logits)
    return 0.5 * torch.pow(2.0, (e - BENCH_TIE_SIGNIFICAND_BITS).float()) + 1e-30


# ------------------------------------------------------------------------------------------------ working memory
# The most memory moecomp's own work on one block may take at once beyond one plain forward of that block:
# recognition (the FX pass's numeric check, the readers' probes), the verify stage, the compile backend's check, and
# the op's CPU path (which dequantizes the experts a call routes to in chunks of at most this). Expert weights are
# never dequantized (or converted to fp32) all at once: per expert, or per chunk of experts that fits here, freed as
# they go. 1 GiB: what a device that holds a whole model still has spare (gpt-oss-120b, 36 layers packed MXFP4, left
# 18.9 GB of an 80 GB H100, where the FX pass's check of one layer used to ask for 15.8 GiB at once), and a few of
# the largest experts at a time (a DeepSeek-V3 expert is 117 MB in fp32, a gpt-oss-120b one 100 MB); small enough
# that a model filling a device to within a few GB still recognises. Measured per format at real layer sizes by
# ``benchmarks/mem_optimize.py`` (``moecomp.testing.PeakMemory``); tests set it lower to make small blocks count.
WORKING_MEMORY_BYTES = 1 << 30
# A probe that still runs out of device memory is tried again on this smaller probe ([batch, tokens]), then on CPU
# copies of the block's tensors (the report says which): 8 tokens still reach a few experts per block and every
# batch-independent path; the FX pass's numeric check retries with FX_CHECK_MIN_TOKENS tokens, then on the CPU.
RETRY_PROBE_SHAPE = (1, 8)


def working_bytes() -> int:
    """``WORKING_MEMORY_BYTES`` as set now (read at each use, so that a test or a user may lower it)."""
    return int(WORKING_MEMORY_BYTES)


def expert_chunks(num_experts: int, bytes_per_expert: int, budget: int | None = None) -> list[tuple[int, int]]:
    """[(e0, e1)] covering ``num_experts`` experts in order, each chunk at most ``budget`` bytes (default: half the
    working memory, the other half for what is computed from the chunk) at ``bytes_per_expert``, one expert at
    least."""
    budget = working_bytes() // 2 if budget is None else budget
    n = max(1, int(budget) // max(1, int(bytes_per_expert)))
    return [(e0, min(num_experts, e0 + n)) for e0 in range(0, num_experts, n)]


# ------------------------------------------------------------------------------------------------ FX pass check
# (moved here from ``moecomp.recognise.fx.numeric``, the FX pass's numeric check: the cut-out block graph against
# ``moecomp.oracle.reference.moe_forward`` with the derived spec.) A rule of its own, not the verify check's: it compares
# every token of a block it cut out of Dynamo's graph, in the block's dtype.
#
# fp32 and fp64 blocks: max |graph - reference| / max |reference| within the fp32 verify tolerance (1e-4, the same
# argument: one computation in two summation orders). fp64 blocks get the fp32 value too (as before the move: the
# reference's result is compared in fp32).
FX_CHECK_TOL_FULL = VERIFY_TOLERANCE[torch.float32]
# 16-bit blocks: per token, max |diff| / max |reference| of that token within the bf16 verify tolerance (3e-2) ...
FX_CHECK_TOL_TOKEN_LOW = VERIFY_TOLERANCE[torch.bfloat16]
# ... on at least 90% of the tokens (a near tie of 16-bit router logits may send a token to another expert; a wrong
# spec misses on most tokens)
FX_CHECK_MIN_TOKEN_SHARE = 0.9
# candidate specs with FP8 weights, any dtype: per token within the FP8 verify tolerance (its reasons: the block's
# plain FP8 forward rounds between its GEMMs as the FP8 kernels do, the reference does not, and e4m3 activation
# roundings amplify that), on the same share of tokens (4-bit weights: the 16-bit rules above, ``fp8_quantized``)
FX_CHECK_TOL_TOKEN_FP8 = VERIFY_TOLERANCE_FP8
# floors of the denominators: the output's max (an all-zero output compares absolutely; also the floor of the clamp
# stress quantile below), and a token's max relative to the output's (a near-zero token is compared against the
# output's scale instead)
FX_CHECK_SCALE_FLOOR = 1e-6
FX_CHECK_TOKEN_SCALE_FLOOR = 1e-3
# tokens the check aims for when the graph's token count is symbolic (the traced sizes are the fallback): enough for
# top-k over tens of experts to hit most of them, small enough to run in milliseconds on CPU
FX_CHECK_TOKENS = 48
# A block that gathers whole expert matrices per (token, slot) (``w13[ids]``, batched_mm style; FP8 and 4-bit
# experts dequantize each gathered matrix in fp32) materialises T * k of them in the check: the tokens are cut so that
# they take at most ``WORKING_MEMORY_BYTES`` (below), down to FX_CHECK_MIN_TOKENS (fewer would not crowd an expert,
# see below); where even those do not fit, as many as fit (at least one; the report says how many), and where not
# even one token fits, the match rests on the structure alone and says so.
FX_CHECK_MIN_TOKENS = 4
# the first 1/4 of the tokens are copies of one token: one expert gets crowded, so capacity limits (dropped tokens)
# show up
FX_CHECK_CROWD_DIVISOR = 4
FX_CHECK_SEED = 0x6D6F65
# A spec that clamps is checked again with the clamped projections scaled so that the pre-activations' 70th
# percentile of |value| sits at 1.5 x the limit (about a third of them clamped); the quantile is read from at most
# 100000 values
FX_CLAMP_STRESS_QUANTILE = 0.7
FX_CLAMP_STRESS_OVERSHOOT = 1.5
FX_CLAMP_STRESS_SAMPLE = 100_000

# ----------------------------------------------------------------------------------------------- capacity probes
# Expert capacity (MoESpec.capacity / capacity_factor: Switch Transformers, NLLB-MoE) shows only when an expert gets
# more pairs than its capacity. The dispatch reader (recognise/dispatch_reader.py) and the verify stage use *crowd probes*:
# [batch, seq] hidden states whose first CROWD_SHARE of every sequence has one expert's router logit raised to
# CROWD_LOGIT above the token's largest other logit (through the router's pseudo-inverse: the other logits stay),
# every CROWD_FAR_EVERY-th of them to CROWD_LOGIT_FAR above, its second choice lifted first (the other experts in
# turn, so that it is seldom dropped too; its score falls below fp32's epsilon: a floor on the renormalisation,
# NLLB-MoE's clamp to eps, shows when its first pair is dropped); the rest are N(0, 1).
# The reader tries sequences of CAPACITY_PROBE_SEQS tokens (CAPACITY_PROBE_BATCH of them) until pairs are dropped:
# a block that drops none up to the last is bound for calls of at most that many tokens; longer calls run its
# original forward.
CROWD_SHARE = 0.5
# ... and the share of every sequence crowded where the reader looks for a capacity: all of it, so that a capacity
# below the sequence's (or the call's) tokens always drops pairs, a factor below 1 included; no drop then proves the
# op for calls of at most that many tokens
CAPACITY_CROWD_SHARE = 1.0
CROWD_LOGIT = 4.0
CROWD_LOGIT_FAR = 20.0
CROWD_FAR_EVERY = 4
CAPACITY_PROBE_SEQS = (16, 128, 1024)
CAPACITY_PROBE_BATCH = 2
CAPACITY_PROBE_SEED = 99


def crowd_probe(router_w: torch.Tensor, router_b, shape, expert: int, dtype, seed: int = CAPACITY_PROBE_SEED,
                share: float = CROWD_SHARE):
    """Hidden states of ``shape + (H,)`` (``router_w``: [E, H]; ``dtype``, router_w's device) whose first ``share``
    of every sequence (the second-to-last dim) pick ``expert`` first (see above)."""
    W = router_w.detach().float().cpu()
    E, H = W.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, H, generator=g)
    S = shape[-1]
    n = int(S * share)
    crowd = x[..., :n, :]
    logits = crowd @ W.T + (0 if router_b is None else router_b.detach().float().cpu())
    delta = torch.zeros_like(logits)
    far = torch.zeros(n, dtype=torch.bool)
    far[::CROWD_FAR_EVERY] = True
    if E > 2:  # a far token's second choice: the others in turn (spread, so that it is seldom dropped too)
        second = torch.tensor([e for e in range(E) if e != expert])[torch.arange(n) % (E - 1)]
        lift = logits.amax(-1) + 1.0 - logits.gather(-1, second.expand(logits.shape[:-1])[..., None])[..., 0]
        delta.scatter_(-1, second.expand(logits.shape[:-1])[..., None], (lift * far)[..., None])
    others = (logits + delta).clone()
    others[..., expert] = float("-inf")
    gap = torch.where(far, CROWD_LOGIT_FAR, CROWD_LOGIT)
    delta[..., expert] = others.amax(-1) + gap - logits[..., expert]
    x[..., :n, :] = crowd + delta @ torch.linalg.pinv(W).T
    return x.to(device=router_w.device, dtype=dtype)
