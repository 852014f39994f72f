"""Decode attention over a static KV cache (one query token per row), split over the cache length.

    q [B, Hq, Dk] (one token)   k [B, Hkv, L, Dk]   v [B, Hkv, L, Dv]   keep [B, L] (padding)   n = valid length
    read range [lo, n): lo = max(0, n - window) for a sliding-window layer (window > 0), else 0
    for each (row b, kv head h, split s):            G = Hq / Hkv query heads share kv head h (GQA)
        scores [G, N] = q[b, h*G : h*G+G] @ k[b, h, lo + chunk_s]^T * scale, masked by keep and lo <= position < n
        online softmax over the chunk -> partial out [G, Dv], running max m [G], sum l [G]
    combine (i = h*G + g):   m = max(max_s m_s, sink[i])          (sink only with sinks: one logit, no value)
        out[b, i] = sum_s exp(m_s - m) * out_s / (sum_s exp(m_s - m) * l_s + exp(sink[i] - m))

Only positions lo .. n - 1 are read (both bounds come from the valid length, read on the device: a sliding layer
reads its window, not the cache), and the kv head is read once for its G query heads, so no repeat of K / V for
GQA. Rows of the query tile beyond G are padding (tl.dot
needs 16 rows). fp32 softmax and accumulators; ``UPCAST`` turns 16-bit operands to fp32 before the dots (the Triton
interpreter's bf16 dot is wrong).

Two forms: ``decode_attn_split_kernel`` then ``decode_attn_combine_kernel`` (two launches), or
``decode_attn_one_kernel`` (one launch: the split programs, the last of each (row, kv head) to finish combines;
its docstring says how). Both share the split's body (``_attend``) and the combine's math (``_merge_splits``).
"""

import triton
import triton.language as tl


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, keep_ptr, n_ptr, pid, split, Hkv, L, scale, window,
            sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b,
            G: tl.constexpr, BLOCK_G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr, DV: tl.constexpr,
            BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, UPCAST: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """Split ``split`` of (row, kv head) ``pid``: the online softmax over its chunk of the read range ->
    (m [BLOCK_G], l [BLOCK_G], out [BLOCK_G, BLOCK_DV]) unnormalized (m = -inf, l = 0, out = 0 where nothing takes
    part)."""
    b = pid // Hkv
    h = pid % Hkv
    n = tl.minimum(tl.load(n_ptr).to(tl.int32), L)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    start = lo + split * CHUNK
    end = tl.minimum(start + CHUNK, n)

    offs_g = tl.arange(0, BLOCK_G)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    gmask = offs_g < G
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_dk[None, :],
                mask=gmask[:, None] & (offs_dk < DK)[None, :], other=0.0)  # [BLOCK_G, BLOCK_DK]
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        inside = offs_n < end
        keep = tl.load(keep_ptr + b.to(tl.int64) * skeep_b + offs_n, mask=inside, other=0).to(tl.int1)
        valid = inside & keep
        kt = tl.load(k_base + offs_n[:, None].to(tl.int64) * sk_l + offs_dk[None, :],
                     mask=inside[:, None] & (offs_dk < DK)[None, :], other=0.0)  # [BLOCK_N, BLOCK_DK]
        vt = tl.load(v_base + offs_n[:, None].to(tl.int64) * sv_l + offs_dv[None, :],
                     mask=inside[:, None] & (offs_dv < DV)[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_splits(po_ptr, pm_ptr, pl_ptr, sinks_ptr, pid, Hkv, g, gmask, offs_s,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr,
                  HAS_SINKS: tl.constexpr, CACHE: tl.constexpr):
    """The combine of (row, kv head) ``pid``'s SPLITS partials for its query heads ``g`` (of the group of kv head
    h = pid % Hkv): a scalar g with ``offs_s`` [S_PAD] (the combine kernel: one query head a program) -> out
    [BLOCK_DV]; a vector g [GS] with ``offs_s`` [S_PAD, 1] (the one-launch kernel's last program) -> out [GS,
    BLOCK_DV]. ``gmask``: which g are query heads (None with a scalar g); ``CACHE``: the partials' loads' cache
    modifier. fp32. (The combine kernel's code before this helper, line for line: its sm_90 PTX is unchanged.)"""
    offs_dv = tl.arange(0, BLOCK_DV)
    smask = offs_s < SPLITS
    row = (pid * SPLITS + offs_s) * BLOCK_G + g
    m = tl.load(pm_ptr + row, mask=smask, other=float("-inf"), cache_modifier=CACHE)
    ls = tl.load(pl_ptr + row, mask=smask, other=0.0, cache_modifier=CACHE)
    h = pid % Hkv
    m_max = tl.max(m, 0)
    sink = m_max
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h * G + g, mask=gmask).to(tl.float32)
        m_max = tl.maximum(m_max, sink)  # finite: no row is empty of logits
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)  # [S_PAD] / [S_PAD, GS]
    o = tl.load(po_ptr + tl.expand_dims(row, -1).to(tl.int64) * BLOCK_DV + offs_dv[None, :],
                mask=tl.expand_dims(smask, -1), other=0.0, cache_modifier=CACHE)
    num = tl.sum(o * tl.expand_dims(w, -1), 0)  # [BLOCK_DV] / [GS, BLOCK_DV]
    den = tl.sum(ls * w, 0)
    if HAS_SINKS:
        den += tl.exp(sink - m_max)  # the sink joins the denominator once, here, not per split
    return num / tl.expand_dims(tl.where(den == 0.0, 1.0, den), -1)


@triton.jit
def decode_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, keep_ptr, n_ptr,  # q [B, Hq, Dk]; keep [B, L] bool; n: [] valid length (int64)
    po_ptr, pm_ptr, pl_ptr,  # partials: out [B*Hkv, S, BLOCK_G, Dv] fp32, max / sum [B*Hkv, S, BLOCK_G] fp32
    Hkv, L, scale, window,  # window: positions below n - window are not read (0: no window)
    sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b,
    G: tl.constexpr, BLOCK_G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no tf32), else "tf32"
):
    pid = tl.program_id(0)  # b * Hkv + h
    split = tl.program_id(1)
    m_i, l_i, acc = _attend(q_ptr, k_ptr, v_ptr, keep_ptr, n_ptr, pid, split, Hkv, L, scale, window,
                            sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b, G, BLOCK_G, DK, BLOCK_DK, DV,
                            BLOCK_DV, BLOCK_N, CHUNK, UPCAST, DOT_PRECISION)
    offs_g = tl.arange(0, BLOCK_G)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = (pid * SPLITS + split) * BLOCK_G + offs_g
    tl.store(pm_ptr + row, m_i)
    tl.store(pl_ptr + row, l_i)
    tl.store(po_ptr + row[:, None].to(tl.int64) * BLOCK_DV + offs_dv[None, :], acc)


@triton.jit
def decode_attn_combine_kernel(
    po_ptr, pm_ptr, pl_ptr, out_ptr,  # out [B, Hq, Dv] (contiguous), the query's dtype
    sinks_ptr,  # [Hq] one logit per query head (fp32 or 16-bit), read only when HAS_SINKS
    Hkv,
    G: tl.constexpr, BLOCK_G: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr,
    S_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)  # b * Hkv + h
    g = tl.program_id(1)
    out = _merge_splits(po_ptr, pm_ptr, pl_ptr, sinks_ptr, pid, Hkv, g, None, tl.arange(0, S_PAD), G, BLOCK_G,
                        BLOCK_DV, SPLITS, HAS_SINKS, "")
    b = pid // Hkv
    h = pid % Hkv
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + ((b * Hkv + h) * G + g).to(tl.int64) * DV + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < DV)


@triton.jit
def decode_attn_one_kernel(
    q_ptr, k_ptr, v_ptr, keep_ptr, n_ptr,  # as decode_attn_split_kernel's
    po_ptr, pm_ptr, pl_ptr,  # partials as decode_attn_split_kernel's (not touched with SPLITS == 1)
    out_ptr, sinks_ptr,  # as decode_attn_combine_kernel's
    counter_ptr,  # [>= B*Hkv] int32, 0 between launches (each last program puts its own back); unused, SPLITS == 1
    Hkv, L, scale, window,
    sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b,
    G: tl.constexpr, BLOCK_G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
    S_PAD: tl.constexpr, G_STEP: tl.constexpr,  # query heads merged at a time by the last program (power of 2)
    HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Split and combine in one launch, grid (B*Hkv, SPLITS) as the split kernel's:

        program (pid, s):  _attend -> partials of split s, stored as the split kernel stores them
                           barrier; c = atomic_add(counter[pid], 1)      (acq_rel, gpu scope)
        c == SPLITS - 1:   (every split of pid has stored and counted) counter[pid] <- 0; merge the SPLITS partials
                           with the combine's code (``_merge_splits``), G_STEP query heads at a time; store out
        SPLITS == 1:       no partials, no counter: the one program normalizes its own (m, l, out) with the same
                           merge math (a sink, an empty row) and stores out

    Ordering: ``tl.debug_barrier()`` (bar.sync) puts every thread's partial stores before the count, and the count's
    release (at gpu scope, cumulative over what the CTA barrier ordered before it) publishes them; the last program's
    acquire orders its reads after every other program's release. The reads are ``.cg`` loads (cached in L2 only,
    the GPU's point of coherence, never in L1): under the PTX memory model the acquire alone already makes weak
    loads see the released stores (an acquire at gpu scope invalidates the SM's L1), but only the one thread that
    ran the atomic holds the acquire, and the others are ordered behind it by the CTA barrier of the atomic's
    result broadcast; ``.cg`` keeps a stale L1 line from ever being read regardless, costs nothing here (each
    partial is read once, so L1 could not help) and, unlike ``volatile``, leaves the loads free to be vectorized
    and reordered among themselves. Each (pid) counter is reset by its last program, after every split of pid has
    counted, so the counters are zero between launches: a CUDA graph replays the kernel as captured. Two launches
    that share the counters must not run at the same time (two streams of one device)."""
    pid = tl.program_id(0)  # b * Hkv + h
    split = tl.program_id(1)
    m_i, l_i, acc = _attend(q_ptr, k_ptr, v_ptr, keep_ptr, n_ptr, pid, split, Hkv, L, scale, window,
                            sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b, G, BLOCK_G, DK, BLOCK_DK, DV,
                            BLOCK_DV, BLOCK_N, CHUNK, UPCAST, DOT_PRECISION)
    h = pid % Hkv
    offs_g = tl.arange(0, BLOCK_G)
    offs_dv = tl.arange(0, BLOCK_DV)
    out_base = out_ptr + (pid * G).to(tl.int64) * DV  # out[b, h*G : h*G + G] (pid * G = (b * Hkv + h) * G)
    if SPLITS == 1:
        gmask = offs_g < G
        m = m_i
        sink = m_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h * G + offs_g, mask=gmask, other=0.0).to(tl.float32)
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)  # the combine's math with one split
        w = tl.exp(m_i - m)
        den = l_i * w
        if HAS_SINKS:
            den += tl.exp(sink - m)
        out = acc * w[:, None] / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(out_base + offs_g[:, None] * DV + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=gmask[:, None] & (offs_dv < DV)[None, :])
    else:
        row = (pid * SPLITS + split) * BLOCK_G + offs_g
        tl.store(pm_ptr + row, m_i)
        tl.store(pl_ptr + row, l_i)
        tl.store(po_ptr + row[:, None].to(tl.int64) * BLOCK_DV + offs_dv[None, :], acc)
        tl.debug_barrier()  # every thread's partials stored before the count
        last = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
        if last:
            tl.atomic_xchg(counter_ptr + pid, 0, sem="relaxed", scope="gpu")  # every split of pid has counted
            offs_s = tl.arange(0, S_PAD)[:, None]
            for g0 in range(0, G, G_STEP):
                g = g0 + tl.arange(0, G_STEP)
                gmask = g < G
                out = _merge_splits(po_ptr, pm_ptr, pl_ptr, sinks_ptr, pid, Hkv, g, gmask, offs_s, G, BLOCK_G,
                                    BLOCK_DV, SPLITS, HAS_SINKS, ".cg")  # [G_STEP, BLOCK_DV]
                tl.store(out_base + g[:, None] * DV + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
                         mask=gmask[:, None] & (offs_dv < DV)[None, :])
