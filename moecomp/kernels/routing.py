r"""Fused routing: scores -> (grouped) top-k -> renormalise -> scale, one launch.

    logits [T, E] --score--> s [T, E] --(+bias)--> choice --group mask--> top-k ids [T, k]
                                    \__________ s[ids] (renorm, *scale) ---------> weights [T, k] fp32
    (TOPK_THEN_SCORE: top-k of the logits, then softmax over the k chosen, or sigmoid of each (SCORING 1))
    (BIAS_ON_LOGITS: choice = logits + bias; MASK_ZERO: dropped groups get 0.0 in the choice, not -inf)
    (SPARSEMIXER, PhiMoE: ids = top-k of the logits; round j's weight = 1 / sum exp(logit - m_j) over the free
     logits with (m_j - logit) / max(|logit|, m_j) <= sm_thr, the ``moecomp.oracle.reference.sparsemixer`` formula)

One program owns BLOCK_T tokens and all E experts (padded to BLOCK_E). Top-k is k rounds of picking the largest value
among the experts not yet taken, ties going to the lower expert index (``moecomp.oracle.reference`` does the same).
Rows with NaN / inf logits follow the routing contract stated in ``moecomp.oracle.reference``: NaN logits read as -inf,
+inf as FLT_MAX; k distinct ids in [0, E) whatever the values (``_pick`` never returns a taken or padding index);
weights finite (NaN -> 0, clamped). Rows of finite logits route exactly as before. Group-limited selection keeps the TOPK_GROUP best of
N_GROUP contiguous groups, a group scored by its top-2 sum (or its max): on a [BLOCK_T, N_GROUP, GROUP_SIZE] view of
the tile when the experts fill it exactly (GROUP_3D), else by one masked pass per group.
N_GAMMA (``MoESpec.shared_gamma``, Inkling): the row holds N_GAMMA shared experts' logits after the E routed ones;
scored alike, they join the renormalisation's sum and are written, scaled and rounded like the weights, to
``gammas_ptr`` [T, N_GAMMA]. HAS_WSCALE: both times the [1] tensor at ``wscale_ptr`` after ``scaling``.
HASH (``MoESpec.hash_routing``, DeepSeek-V4): no selection; slot j's id is ``table[tok[t], j]`` and its weight the
score there (then renorm / scale / rounding as above). GIVEN (routing replay, ``ops/routes.py``): the same with slot
j's id read from ``given_ptr`` (clamped into [0, E - 1]); REC_IDS / REC_W: the ids and final weights also stored to
the caller's buffers (routing record), in this launch. HAS_ESCALE (``MoESpec.expert_scale``): each weight times
``escale[id]`` after the scaling, before the rounding. Memory safety without a host check: the token id is clamped
into [0, n_vocab - 1] and the table entry into [0, E - 1] before either indexes anything.
"""

import triton
import triton.language as tl

from . import pdl

# SCORING codes
SOFTMAX, SIGMOID, SQRTSOFTPLUS, IDENTITY = 0, 1, 2, 3


@triton.jit
def _softplus(x):
    # max(x, 0) + log1p(exp(-|x|)), with log1p by its series where exp(-|x|) is tiny
    u = tl.exp(-tl.abs(x))
    lp = tl.where(u < 1e-3, u * (1.0 - u * (0.5 - u / 3.0)), tl.log(1.0 + u))
    return tl.maximum(x, 0.0) + lp


FLT_MAX = tl.constexpr(3.4028234663852886e38)
BF16_MAX = tl.constexpr(3.3895313892515355e38)
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def _pick(v, free, offs, BLOCK: tl.constexpr, N):
    """[BT, BLOCK] values (no NaN), ``free`` mask -> [BT]: the lowest free index holding the largest free value. Never
    a taken or padding index, even when every free value is -inf (an argmax would give the lowest index overall
    there: a duplicate, or one past the last expert); clamped to N - 1 besides."""
    v = tl.where(free, v, float("-inf"))
    m = tl.max(v, axis=1)
    idx = tl.min(tl.where(free & (v == m[:, None]), offs[None, :], BLOCK), axis=1)
    return tl.minimum(idx, N - 1)


@triton.jit
def _sparsemixer_weight(logit, free, sel, thr):
    """[BT]: one sparsemixer round's weight, the softmax at the picked logit m (``sel``, the largest ``free`` one)
    over the free logits not dropped by (m - logit) / max(|logit|, m) > thr, in IEEE division like torch's (0 / 0 is
    NaN: kept). No finite free logit (m = -inf): NaN, made 0 by ``_finite``."""
    m = tl.max(tl.where(sel, logit, float("-inf")), axis=1)[:, None]  # [BT, 1]
    drop = tl.div_rn(m - logit, tl.maximum(tl.abs(logit), m)) > thr
    p = tl.where(free & ~drop, tl.exp(logit - m), 0.0)
    return 1.0 / tl.sum(p, axis=1)


@triton.jit
def _finite(w, limit):
    return tl.where(w != w, 0.0, tl.minimum(tl.maximum(w, -limit), limit))


@triton.jit
def route_tile(pid, logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, stride_lt, scaling, renorm_eps, renorm_min,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
               SCORING: tl.constexpr, TOPK_THEN_SCORE: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
               BIAS_ON_LOGITS: tl.constexpr, MASK_ZERO: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr,
               TOPK_GROUP: tl.constexpr, GROUP_BY_MAX: tl.constexpr, GROUP_3D: tl.constexpr,
               GROUP_SIZE: tl.constexpr, ROUND_TO: tl.constexpr, SPARSEMIXER: tl.constexpr, sm_thr, table_ptr,
               tok_ptr, n_vocab, stride_table, HASH: tl.constexpr, escale_ptr, HAS_ESCALE: tl.constexpr, gammas_ptr,
               wscale_ptr, N_GAMMA: tl.constexpr, GAM_PAD: tl.constexpr, HAS_WSCALE: tl.constexpr, given_ptr,
               stride_gt, stride_gk, GIVEN: tl.constexpr, rec_ids_ptr, stride_rt, stride_rk, REC_IDS: tl.constexpr,
               rec_w_ptr, stride_wt, stride_wk, REC_W: tl.constexpr):
    """Route tokens [pid * BLOCK_T, +BLOCK_T) of the logits (the module docstring): ``route_topk_kernel``'s body."""
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_e = tl.arange(0, BLOCK_E)  # [BE]
    t_ok = offs_t < T
    e_ok = offs_e < E
    neg = float("-inf")

    ptrs = logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :]
    logit = tl.load(ptrs, mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)  # [BT, BE]
    logit = tl.where(logit != logit, neg, tl.minimum(logit, FLT_MAX))  # NaN -> -inf, +inf -> FLT_MAX

    if SPARSEMIXER or TOPK_THEN_SCORE:
        score = logit
    elif SCORING == 0:
        m = tl.max(tl.where(e_ok[None, :], logit, neg), axis=1)
        p = tl.where(e_ok[None, :], tl.exp(logit - m[:, None]), 0.0)
        score = p / tl.sum(p, axis=1)[:, None]
    elif SCORING == 1:
        score = tl.sigmoid(logit)
    elif SCORING == 2:
        score = tl.sqrt(_softplus(logit))
    else:
        score = logit

    choice = score
    if HAS_BIAS:
        if BIAS_ON_LOGITS:
            choice = logit
        choice = choice + tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(e_ok[None, :] & (choice == choice), choice, neg)  # padding and NaN (no finite logit) -> -inf

    if N_GROUP > 1:
        offs_g = tl.arange(0, G_PAD)
        gid = offs_e // (E // N_GROUP)  # [BE] group of each expert
        if GROUP_3D:
            # E == BLOCK_E == N_GROUP * GROUP_SIZE (so G_PAD == N_GROUP): every group reduced at once on a 3-D view
            v3 = tl.reshape(choice, [BLOCK_T, N_GROUP, GROUP_SIZE])
            if GROUP_BY_MAX:
                gscore = tl.max(v3, axis=2)  # [BT, G]
            else:
                offs_s = tl.arange(0, GROUP_SIZE)
                i1 = tl.argmax(v3, axis=2, tie_break_left=True)
                m1 = tl.max(v3, axis=2)
                gscore = m1 + tl.max(tl.where(offs_s[None, None, :] == i1[:, :, None], neg, v3), axis=2)
        else:
            # one masked pass over the whole [BT, BE] tile per group
            gscore = tl.full([BLOCK_T, G_PAD], neg, tl.float32)
            for g in tl.static_range(N_GROUP):
                v = tl.where((gid == g)[None, :], choice, neg)
                if GROUP_BY_MAX:
                    s_g = tl.max(v, axis=1)
                else:
                    i1 = tl.argmax(v, axis=1, tie_break_left=True)
                    m1 = tl.max(v, axis=1)
                    s_g = m1 + tl.max(tl.where(offs_e[None, :] == i1[:, None], neg, v), axis=1)
                gscore = tl.where(offs_g[None, :] == g, s_g[:, None], gscore)
        keep_g = tl.zeros([BLOCK_T, G_PAD], tl.int32)
        g_free = tl.broadcast_to((offs_g < N_GROUP)[None, :], [BLOCK_T, G_PAD])
        for _ in tl.static_range(TOPK_GROUP):
            gi = _pick(gscore, g_free, offs_g, G_PAD, N_GROUP)
            hit = offs_g[None, :] == gi[:, None]
            keep_g = tl.where(hit, 1, keep_g)
            g_free = g_free & (offs_g[None, :] != gi[:, None])
        if GROUP_3D:
            keep_e = tl.reshape(tl.broadcast_to(keep_g[:, :, None], [BLOCK_T, N_GROUP, GROUP_SIZE]),
                                [BLOCK_T, BLOCK_E])
        else:
            keep_e = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
            for g in tl.static_range(N_GROUP):
                kg = tl.sum(tl.where(offs_g[None, :] == g, keep_g, 0), axis=1)  # [BT]
                keep_e = tl.where((gid == g)[None, :], kg[:, None], keep_e)
        if MASK_ZERO:
            choice = tl.where(keep_e > 0, choice, tl.where(e_ok[None, :], 0.0, neg))
        else:
            choice = tl.where(keep_e > 0, choice, neg)

    offs_k = tl.arange(0, K_PAD)
    top_ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    top_w = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    free = tl.broadcast_to(e_ok[None, :], [BLOCK_T, BLOCK_E])  # not yet taken, and a real expert
    if HASH:
        tok = tl.load(tok_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)  # [BT]
        row = tl.minimum(tl.maximum(tok, 0), n_vocab - 1) * stride_table
    for j in tl.static_range(TOP_K):
        if HASH:  # the table's entry, clamped to a real expert (never an index past the scores or the weights)
            e = tl.load(table_ptr + row + j, mask=t_ok, other=0).to(tl.int64)
            idx = tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int32)
        elif GIVEN:  # replay: the caller's id, clamped likewise (its range is checked on CPU only)
            e = tl.load(given_ptr + offs_t.to(tl.int64) * stride_gt + j * stride_gk, mask=t_ok, other=0).to(tl.int64)
            idx = tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int32)
        else:
            idx = _pick(choice, free, offs_e, BLOCK_E, E)  # [BT]
        sel = offs_e[None, :] == idx[:, None]
        w = tl.sum(tl.where(sel, score, 0.0), axis=1)
        if SPARSEMIXER:
            w = _sparsemixer_weight(logit, free, sel, sm_thr)
        if SCORING == 3 and not TOPK_THEN_SCORE:
            w = tl.where(w == neg, 0.0, w)  # a raw -inf score, taken only because no candidate was left
        free = free & ~sel
        top_ids = tl.where(offs_k[None, :] == j, idx[:, None], top_ids)
        top_w = tl.where(offs_k[None, :] == j, w[:, None], top_w)

    k_ok = offs_k < TOP_K
    if TOPK_THEN_SCORE:
        if SCORING == 1:  # sigmoid of each chosen logit (Llama 4)
            top_w = tl.sigmoid(top_w)
        else:  # softmax over the k chosen
            m = tl.max(tl.where(k_ok[None, :], top_w, neg), axis=1)
            p = tl.where(k_ok[None, :], tl.exp(top_w - m[:, None]), 0.0)
            top_w = p / tl.sum(p, axis=1)[:, None]
    if N_GAMMA > 0:  # the shared experts' logits after the E routed ones, scored alike (elementwise scorings)
        offs_s = tl.arange(0, GAM_PAD)
        s_ok = offs_s < N_GAMMA
        g_ptrs = logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + E + offs_s[None, :]
        gl = tl.load(g_ptrs, mask=t_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
        gl = tl.where(gl != gl, neg, tl.minimum(gl, FLT_MAX))
        if SCORING == 1:
            gam = tl.sigmoid(gl)
        else:
            gam = tl.sqrt(_softplus(gl))
        gam = tl.where(s_ok[None, :], gam, 0.0)
    if RENORM:
        denom = tl.sum(tl.where(k_ok[None, :], top_w, 0.0), axis=1)
        if N_GAMMA > 0:  # renormalised together with the k chosen (MoESpec.shared_gamma)
            denom = denom + tl.sum(gam, axis=1)
        denom = denom + renorm_eps
        denom = tl.where(renorm_min > 0, tl.maximum(denom, renorm_min), denom)
        top_w = top_w / denom[:, None]
        if N_GAMMA > 0:
            gam = gam / denom[:, None]
    top_w = top_w * scaling
    if HAS_ESCALE:  # weights times the per-expert multiplier at their ids (padding slots read expert 0, unused)
        top_w = top_w * tl.load(escale_ptr + top_ids, mask=k_ok[None, :], other=0.0).to(tl.float32)
    if N_GAMMA > 0:
        gam = gam * scaling
    if HAS_WSCALE:
        wsc = tl.load(wscale_ptr).to(tl.float32)
        top_w = top_w * wsc
        if N_GAMMA > 0:
            gam = gam * wsc
    # finite weights: NaN (0 / 0, a softmax over no finite logit) -> 0, +-inf -> +-the largest value of the dtype
    # the weights are rounded to (FLT_MAX, or bf16's / fp16's with ROUND_TO)
    if ROUND_TO == 1:
        top_w = _finite(top_w, BF16_MAX).to(tl.bfloat16).to(tl.float32)
    elif ROUND_TO == 2:
        top_w = _finite(top_w, FP16_MAX).to(tl.float16).to(tl.float32)
    else:
        top_w = _finite(top_w, FLT_MAX)

    if N_GAMMA > 0:
        if ROUND_TO == 1:
            gam = _finite(gam, BF16_MAX).to(tl.bfloat16).to(tl.float32)
        elif ROUND_TO == 2:
            gam = _finite(gam, FP16_MAX).to(tl.float16).to(tl.float32)
        else:
            gam = _finite(gam, FLT_MAX)
        g_out = offs_t[:, None].to(tl.int64) * N_GAMMA + offs_s[None, :]
        tl.store(gammas_ptr + g_out, gam, mask=t_ok[:, None] & s_ok[None, :])

    out = offs_t[:, None].to(tl.int64) * TOP_K + offs_k[None, :]
    m_out = t_ok[:, None] & k_ok[None, :]
    tl.store(ids_ptr + out, top_ids, mask=m_out)
    tl.store(weights_ptr + out, top_w, mask=m_out)
    if REC_IDS:
        tl.store(rec_ids_ptr + offs_t[:, None].to(tl.int64) * stride_rt + offs_k[None, :] * stride_rk, top_ids,
                 mask=m_out)
    if REC_W:
        tl.store(rec_w_ptr + offs_t[:, None].to(tl.int64) * stride_wt + offs_k[None, :] * stride_wk, top_w,
                 mask=m_out)


@triton.jit
def route_topk_kernel(
    logits_ptr,  # [T, E] any float dtype, row stride stride_lt
    bias_ptr,  # [E] correction bias (selection only)
    ids_ptr,  # [T, TOP_K] int32 out
    weights_ptr,  # [T, TOP_K] fp32 out
    T,
    E,
    stride_lt,
    scaling,
    renorm_eps,
    renorm_min,  # > 0: the renorm denominator is max(sum + renorm_eps, renorm_min)
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCORING: tl.constexpr,
    TOPK_THEN_SCORE: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_ON_LOGITS: tl.constexpr,
    MASK_ZERO: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_BY_MAX: tl.constexpr,
    GROUP_3D: tl.constexpr,  # E == BLOCK_E and GROUP_SIZE = E / N_GROUP: per-group reductions on a 3-D view
    GROUP_SIZE: tl.constexpr,
    ROUND_TO: tl.constexpr,  # 0 keep fp32, 1 round weights through bf16, 2 through fp16
    USE_PDL: tl.constexpr = 0,
    SPARSEMIXER: tl.constexpr = 0,  # PhiMoE's routing (module docstring); the scoring / bias / group flags unused
    sm_thr=0.0,  # SPARSEMIXER: 2 * jitter_eps
    table_ptr=None,  # HASH: [n_vocab, TOP_K] integer expert ids, row stride stride_table
    tok_ptr=None,  # HASH: [T] integer token ids
    n_vocab=1,
    stride_table=0,
    HASH: tl.constexpr = False,
    escale_ptr=None,  # HAS_ESCALE: [E] per-expert multipliers of the weights (MoESpec.expert_scale)
    HAS_ESCALE: tl.constexpr = False,
    gammas_ptr=None,  # N_GAMMA > 0: [T, N_GAMMA] fp32 out, the shared experts' gammas
    wscale_ptr=None,  # HAS_WSCALE: [1] the routing weights' learned scale (any float dtype)
    N_GAMMA: tl.constexpr = 0,  # shared_gamma "joint_renorm": the logits row holds N_GAMMA more after the E
    GAM_PAD: tl.constexpr = 1,
    HAS_WSCALE: tl.constexpr = False,
    given_ptr=None,  # GIVEN: [T, TOP_K] int32 / int64 replayed ids (strides stride_gt, stride_gk), no selection
    stride_gt=0,
    stride_gk=0,
    GIVEN: tl.constexpr = False,
    rec_ids_ptr=None,  # REC_IDS: [T, TOP_K] int32 out, the ids as routed (strides stride_rt, stride_rk)
    stride_rt=0,
    stride_rk=0,
    REC_IDS: tl.constexpr = False,
    rec_w_ptr=None,  # REC_W: [T, TOP_K] fp32 out, the final weights (strides stride_wt, stride_wk)
    stride_wt=0,
    stride_wk=0,
    REC_W: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    route_tile(pid, logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, stride_lt, scaling, renorm_eps, renorm_min,
               TOP_K, K_PAD, BLOCK_T, BLOCK_E, SCORING, TOPK_THEN_SCORE, RENORM, HAS_BIAS, BIAS_ON_LOGITS, MASK_ZERO,
               N_GROUP, G_PAD, TOPK_GROUP, GROUP_BY_MAX, GROUP_3D, GROUP_SIZE, ROUND_TO, SPARSEMIXER, sm_thr,
               table_ptr, tok_ptr, n_vocab, stride_table, HASH, escale_ptr, HAS_ESCALE, gammas_ptr, wscale_ptr,
               N_GAMMA, GAM_PAD, HAS_WSCALE, given_ptr, stride_gt, stride_gk, GIVEN, rec_ids_ptr, stride_rt,
               stride_rk, REC_IDS, rec_w_ptr, stride_wt, stride_wk, REC_W)
