"""Skinny linears with an RMSNorm prologue: the norm of a few decode rows folded into the GEMV that reads them.

    h = x (+ r)                                   x, r [M, K] (M <= 4); h rounded to x's dtype (the residual stream)
    y_i[m, n] = rsqrt(mean_k(h[m, k]^2) + eps) * sum_k h[m, k] * gw[k] * W_i[n, k] * s_i(n, k)  (+ b_i[n])
    gw = g (OFFSET 0) or 1 + g (OFFSET 1, Gemma-style), in fp32

Every program of a GEMV reads all K columns of every row anyway: it accumulates sum(h^2) in the same K loop as the
products with ``h * gw`` and scales each output row by the rsqrt at the end, so no normalized copy of h is ever
written or read. The program of global id 0 also writes h out (HAS_RES), once, as the new residual stream.
Everything between the loads of x / r and the store of y is fp32: unlike transformers' RMSNorm, the normalized h is
never rounded to the model dtype before the weight multiply or the linear (``ops/norm_group.py`` states the bound).

The weight tiles are ``kernels/skinny.py``'s (16-bit, or e4m3 with block / channel / tensor scales, dequantized by
``skinny.dequant``); members (1..4 linears of the one normalized input) split the programs as in
``skinny_group_kernel``. No ``tl.dot``: at M <= 4 the products are broadcasts and sums (as in the skinny kernel).
"""

import triton
import triton.language as tl

from . import pdl
from .skinny import dequant, tile_end, tile_start


@triton.jit
def _norm_step(acc, ss, wf, gw, x_row, r_row, h_row, write_h, k0, offs_k, k_ok, HAS_RES: tl.constexpr,
               REDUCE_END: tl.constexpr):
    """One row after K step k0: (acc, the running h^2 [BK]); h written out where ``write_h``."""
    h = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_row + k0 + offs_k, mask=k_ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h_row.dtype.element_ty)  # as x + r in the model dtype
        if write_h:
            tl.store(h_row + k0 + offs_k, h, mask=k_ok)
    hf = h.to(tl.float32)
    ss += hf * hf
    a = hf * gw
    if REDUCE_END:
        acc += wf * a[None, :]
    else:
        acc += tl.sum(wf * a[None, :], axis=1)
    return acc, ss


@triton.jit
def _norm_store(acc, ss, K, eps, y_row, offs_n, n_ok, s_fin, bias, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
                REDUCE_END: tl.constexpr):
    if REDUCE_END:
        v = tl.sum(acc, axis=1)
    else:
        v = acc
    v = v * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if W_SCALE >= 2:
        v = v * s_fin
    if HAS_BIAS:
        v = v + bias
    tl.store(y_row + offs_n, v.to(y_row.dtype.element_ty), mask=n_ok)


@triton.jit
def _norm_tile(pid, write_h, x_ptr, r_ptr, h_ptr, g_ptr, eps, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_xm,
               stride_rm, stride_hm, stride_wn, stride_sn, stride_sk, stride_ym, ROWS: tl.constexpr,
               HAS_RES: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
               Q_BLOCK_N: tl.constexpr, Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """Weight rows [pid * BLOCK_N, +BLOCK_N) of one member against every normalized row."""
    offs_n, n_ok, rows_n, offs_k, w_ptrs, ws_row, acc0 = tile_start(pid, w_ptr, ws_ptr, N, stride_wn, stride_sn,
                                                                     W_SCALE, Q_BLOCK_N, BLOCK_N, BLOCK_K, REDUCE_END)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    ss0 = tl.zeros([BLOCK_K], dtype=tl.float32)
    ss1 = ss0
    ss2 = ss0
    ss3 = ss0
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wf = dequant(w, ws_row, n_ok, k0, K, stride_sk, W_SCALE, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K)
        gw = tl.load(g_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if OFFSET:
            gw = gw + 1.0
        acc0, ss0 = _norm_step(acc0, ss0, wf, gw, x_ptr, r_ptr, h_ptr, write_h, k0, offs_k, k_ok, HAS_RES,
                               REDUCE_END)
        if ROWS > 1:
            acc1, ss1 = _norm_step(acc1, ss1, wf, gw, x_ptr + stride_xm, r_ptr + stride_rm, h_ptr + stride_hm,
                                   write_h, k0, offs_k, k_ok, HAS_RES, REDUCE_END)
        if ROWS > 2:
            acc2, ss2 = _norm_step(acc2, ss2, wf, gw, x_ptr + 2 * stride_xm, r_ptr + 2 * stride_rm,
                                   h_ptr + 2 * stride_hm, write_h, k0, offs_k, k_ok, HAS_RES, REDUCE_END)
        if ROWS > 3:
            acc3, ss3 = _norm_step(acc3, ss3, wf, gw, x_ptr + 3 * stride_xm, r_ptr + 3 * stride_rm,
                                   h_ptr + 3 * stride_hm, write_h, k0, offs_k, k_ok, HAS_RES, REDUCE_END)
        w_ptrs += BLOCK_K
    pdl.release(USE_PDL)
    s_fin, bias = tile_end(ws_ptr, b_ptr, rows_n, offs_n, n_ok, stride_sn, HAS_BIAS, W_SCALE, UE8M0)
    _norm_store(acc0, ss0, K, eps, y_ptr, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 1:
        _norm_store(acc1, ss1, K, eps, y_ptr + stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 2:
        _norm_store(acc2, ss2, K, eps, y_ptr + 2 * stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE,
                    REDUCE_END)
    if ROWS > 3:
        _norm_store(acc3, ss3, K, eps, y_ptr + 3 * stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE,
                    REDUCE_END)


@triton.jit
def skinny_norm_group_kernel(
    x_ptr,  # [M, K] pre-norm rows, unit stride along K
    r_ptr,  # [M, K] residual (HAS_RES) or None
    h_ptr,  # [M, K] out: x + r in x's dtype (HAS_RES; written by program 0) or None
    g_ptr,  # [K] norm weight
    eps,
    w0, w1, w2, w3,  # members' [N_i, K] weights; unused members None
    ws0, ws1, ws2, ws3,  # their scales (W_SCALE 1-3) or None
    b0, b1, b2, b3,  # their biases or None
    y0, y1, y2, y3,  # their [M, N_i] outputs
    N0, N1, N2, N3,
    K,
    stride_xm, stride_rm, stride_hm,
    swn0, swn1, swn2, swn3,
    ssn0, ssn1, ssn2, ssn3,
    ssk0, ssk1, ssk2, ssk3,
    sym0, sym1, sym2, sym3,
    G: tl.constexpr,  # members, 1..4
    ROWS: tl.constexpr,
    HAS_RES: tl.constexpr,
    OFFSET: tl.constexpr,  # 0: * g, 1: * (1 + g)
    HB0: tl.constexpr, HB1: tl.constexpr, HB2: tl.constexpr, HB3: tl.constexpr,
    W_SCALE: tl.constexpr,
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Programs [0, cdiv(N0, BLOCK_N)) run member 0's tiles, the next cdiv(N1, BLOCK_N) member 1's, and so on."""
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    write_h = pid == 0
    nb0 = tl.cdiv(N0, BLOCK_N)
    if pid < nb0:
        _norm_tile(pid, write_h, x_ptr, r_ptr, h_ptr, g_ptr, eps, w0, ws0, b0, y0, N0, K, stride_xm, stride_rm,
                   stride_hm, swn0, ssn0, ssk0, sym0, ROWS, HAS_RES, OFFSET, HB0, W_SCALE, Q_BLOCK_N, Q_BLOCK_K,
                   UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
    else:
        if G > 1:
            nb1 = tl.cdiv(N1, BLOCK_N)
            p1 = pid - nb0
            if p1 < nb1:
                _norm_tile(p1, write_h, x_ptr, r_ptr, h_ptr, g_ptr, eps, w1, ws1, b1, y1, N1, K, stride_xm,
                           stride_rm, stride_hm, swn1, ssn1, ssk1, sym1, ROWS, HAS_RES, OFFSET, HB1, W_SCALE,
                           Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
            else:
                if G > 2:
                    nb2 = tl.cdiv(N2, BLOCK_N)
                    p2 = p1 - nb1
                    if p2 < nb2:
                        _norm_tile(p2, write_h, x_ptr, r_ptr, h_ptr, g_ptr, eps, w2, ws2, b2, y2, N2, K, stride_xm,
                                   stride_rm, stride_hm, swn2, ssn2, ssk2, sym2, ROWS, HAS_RES, OFFSET, HB2,
                                   W_SCALE, Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
                    else:
                        if G > 3:
                            _norm_tile(p2 - nb2, write_h, x_ptr, r_ptr, h_ptr, g_ptr, eps, w3, ws3, b3, y3, N3, K,
                                       stride_xm, stride_rm, stride_hm, swn3, ssn3, ssk3, sym3, ROWS, HAS_RES,
                                       OFFSET, HB3, W_SCALE, Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K,
                                       REDUCE_END, USE_PDL)
