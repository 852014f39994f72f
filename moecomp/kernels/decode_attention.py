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
"""

import triton
import triton.language as tl


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
    offs_s = tl.arange(0, S_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    smask = offs_s < SPLITS
    row = (pid * SPLITS + offs_s) * BLOCK_G + g
    m = tl.load(pm_ptr + row, mask=smask, other=float("-inf"))
    ls = tl.load(pl_ptr + row, mask=smask, other=0.0)
    b = pid // Hkv
    h = pid % Hkv
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h * G + g).to(tl.float32)
        m_max = tl.maximum(m_max, sink)  # finite: no row is empty of logits
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)  # [S_PAD]
    o = tl.load(po_ptr + row[:, None].to(tl.int64) * BLOCK_DV + offs_dv[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], 0)  # [BLOCK_DV]
    den = tl.sum(ls * w, 0)
    if HAS_SINKS:
        den += tl.exp(sink - m_max)  # the sink joins the denominator once, here, not per split
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + ((b * Hkv + h) * G + g).to(tl.int64) * DV + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < DV)
