"""Per-head RMSNorm of q and k, rotary embedding, and the write of k / v into a static KV cache, in one launch.

One program per (row, head) of the Hq + 2 * Hkv heads of a row (row = b * T + t)::

    head h < Hq            q:  x = q[row, h*D : h*D+D]  -> norm (HAS_QN) -> rope -> out[b, h, t, :]
    Hq <= h < Hq + Hkv     k:  x = k[row, ...]          -> norm (HAS_KN) -> rope -> k_cache[b, h', idx[t], :]
    h >= Hq + Hkv          v:  v[row, ...]                                        -> v_cache[b, h'', idx[t], :]

    norm:  xn = round(x * rsqrt(mean(x^2) + eps));  n = round(xn * w)      (OFFSET 0: transformers' Llama / Qwen form)
           n = round(x * rsqrt(mean(x^2) + eps) * (1 + w))                 (OFFSET 1: Gemma's form)
    rope:  out[d] = round(round(n[d] * cos[d]) + round(rot[d] * sin[d])),  rot[d] = -n[d + D/2] (d < D/2), n[d - D/2]

(the half-split ``rotate_half`` form; round = to q's dtype, the model dtype, where each op of the unfused graph
rounds; everything between in fp32). The partner lane ``n[d +- D/2]`` is loaded and normalized a second time rather
than shuffled across lanes. cos / sin are [R, D] (one row per (b, t)) or [R, D / 2] (CS_HALF: gpt-oss's chunked form,
``x1 c - x2 s | x2 c + x1 s``, the same rotation), idx [T] the cache positions.
"""

import triton
import triton.language as tl


@triton.jit
def _normed(ptr, w_ptr, offs, ok, r, DT: tl.constexpr, HAS_N: tl.constexpr, OFFSET: tl.constexpr):
    """x[offs] normalized (scale ``r``) and weighted, rounded as the unfused norm rounds; fp32."""
    x = tl.load(ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_N:
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:
            x = (x * r * (1.0 + w)).to(DT).to(tl.float32)
        else:
            x = ((x * r).to(DT).to(tl.float32) * w).to(DT).to(tl.float32)
    return x


@triton.jit
def _rope_head(src, w_ptr, cos_row, sin_row, dst, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_N: tl.constexpr,
               OFFSET: tl.constexpr, DT: tl.constexpr, CS_HALF: tl.constexpr):
    """One head: D values at ``src`` normed (HAS_N), rotated, stored at ``dst`` (contiguous D); cos / sin rows of D
    values, or of D / 2 (CS_HALF: one value per rotated pair, gpt-oss's form)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    r = 1.0
    if HAS_N:
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    n = _normed(src, w_ptr, d, ok, r, DT, HAS_N, OFFSET)
    m = _normed(src, w_ptr, partner, ok, r, DT, HAS_N, OFFSET)
    rot = tl.where(d < HALF, -m, m)
    dc = d % HALF if CS_HALF else d
    c = tl.load(cos_row + dc, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_row + dc, mask=ok, other=0.0).to(tl.float32)
    y = ((n * c).to(DT).to(tl.float32) + (rot * s).to(DT).to(tl.float32)).to(DT)
    tl.store(dst + d, y.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def qk_norm_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, idx_ptr, out_ptr,
                              T, Hq, Hkv, eps, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_QN: tl.constexpr, HAS_KN: tl.constexpr,
                              OFFSET: tl.constexpr, CS_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    h = tl.program_id(1)
    b = row // T
    t = row % T
    pos = tl.load(idx_ptr + t).to(tl.int64)  # the cache position this row's k / v go to
    DT: tl.constexpr = q_ptr.dtype.element_ty  # the model dtype: every rounding step's
    DC: tl.constexpr = D // 2 if CS_HALF else D
    cos_row = cos_ptr + row * DC
    sin_row = sin_ptr + row * DC
    if h < Hq:  # a query head -> out [B, Hq, T, D]
        _rope_head(q_ptr + (row * Hq + h) * D, qw_ptr, cos_row, sin_row, out_ptr + ((b * Hq + h) * T + t) * D, eps,
                   D, BLOCK_D, HAS_QN, OFFSET, DT, CS_HALF)
    elif h < Hq + Hkv:  # a key head -> k_cache[b, hk, pos]
        hk = h - Hq
        _rope_head(k_ptr + (row * Hkv + hk) * D, kw_ptr, cos_row, sin_row, kc_ptr + b * s_kb + hk * s_kh + pos * s_kl,
                   eps, D, BLOCK_D, HAS_KN, OFFSET, DT, CS_HALF)
    else:  # a value head: copied -> v_cache[b, hv, pos]
        hv = h - Hq - Hkv
        d = tl.arange(0, BLOCK_D)
        x = tl.load(v_ptr + (row * Hkv + hv) * D + d, mask=d < D)
        tl.store(vc_ptr + b * s_vb + hv * s_vh + pos * s_vl + d, x.to(vc_ptr.dtype.element_ty), mask=d < D)
