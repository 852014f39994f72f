"""Dense linear over 4-bit weights (GPTQ / AWQ int4, mxfp4; ``torch.ops.moecomp.linear_4bit``, ``formats/packed_linear.py``).

    y[m, n] = sum_k x[m, k] * w(n, k)  (+ bias[n])         x [M, K] (16-bit or fp32, unit stride along K)
              w(n, k) = E2M1[code] * 2 ** (s_byte - 127)              mxfp4 (W4 1; groups of 32, ue8m0 scales)
                      = (code - zero) * s[n, k // Q_BLOCK_K]           int4 (W4 2: zero 8; W4 3: zp[n, k // Q_BLOCK_K])
              q [N, K / 2] uint8: code of column 2j in the low nibble of byte j (``moecomp.core.quant``, the oracle)
              y [M, N] in x's dtype, fp32 accumulation

Two forms, as for the 16-bit / FP8 linears (``kernels/fp8_linear.py``, ``kernels/skinny.py``):

``linear4_kernel`` (MMA): one program per [BLOCK_M, BLOCK_N] output tile (grouped order: GROUP_M row blocks sweep
the columns together); the K loop is ``quant4.dot_loop4``, the routed experts' 4-bit loop (nibbles unpacked and
decoded in registers, int4's group scale multiplying each step's fp32 product, mxfp4's folded into the tile).

``skinny4_kernel`` (M <= 4, decode): no tensor cores; one program per BLOCK_N weight rows and every row of x. Each K
step loads a [BLOCK_N, BLOCK_K / 2] byte tile, decodes its low and high nibbles to fp32 weights once (the exact
``(code - zero) * scale`` / ``e2m1 * 2 ** e`` products the oracle forms) and multiplies them with the even and the
odd columns of each row of x::

    bytes [BN, BK / 2] ─┬─ & 15 ─► w_lo [BN, BK / 2] (columns k0 + 2j)     ─┐
                        └─ >> 4 ─► w_hi [BN, BK / 2] (columns k0 + 2j + 1) ─┴─► acc_m += w_lo * x_m[even] + w_hi *
                                                                                 x_m[odd]      for m < ROWS
    REDUCE_END 1: acc_m [BN, BK / 2], summed over K once at the end; 0: acc_m [BN], summed every step

A step lies in one scale group (BLOCK_K <= Q_BLOCK_K, a divisor of it) or covers whole groups (a multiple of it);
the launcher (``ops/triton_linear4.py``) picks such a BLOCK_K. Rows, columns and bytes past the ends load 0 (code 0
times a masked x column of 0).
"""

import triton
import triton.language as tl

from . import fp8, kloop, quant4


@triton.jit
def linear4_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K / 2] uint8, unit stride along K
    ws_ptr,  # [N, ceil(K / Q_BLOCK_K)] group scales (fp32 / fp16 / bf16, or ue8m0 bytes: UE8M0)
    zp_ptr,  # int4 zero points (W4 3), uint8 of the scales' shape and strides; else unused
    b_ptr,  # [N] bias or None
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    W4: tl.constexpr,  # 1 mxfp4, 2 int4, 3 int4 with zero points
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FOLD: tl.constexpr = 0,
    FORM: tl.constexpr = 0,
):
    pid_m, pid_n = kloop.block_ids(tl.program_id(0), N, tl.cdiv(M, BLOCK_M), BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    n_ok = offs_n < N
    rows_n = offs_n.to(tl.int64)
    b_ptrs = w_ptr + rows_n[None, :] * stride_wn + tl.arange(0, BLOCK_K // 2)[:, None]  # [BK / 2, BN] bytes
    ws_ptrs = ws_ptr + rows_n * stride_sn
    zp_ptrs = (zp_ptr + rows_n * stride_sn) if W4 == 3 else ws_ptrs
    acc = quant4.dot_loop4(x_ptr + offs_m.to(tl.int64) * stride_xm, row_ok, b_ptrs, n_ok, K, 1, ws_ptrs, zp_ptrs,
                           stride_sk, W4, Q_BLOCK_K, UE8M0, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, FOLD,
                           FORM)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _group_vals(ws_row, zp_row, n_ok, k0, K, stride_sk, W4: tl.constexpr, Q_BLOCK_K: tl.constexpr,
                UE8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(s fp32, z) of K step k0: [BN, 1] when the step lies in one group, else [BN, BK / 2] (each byte column's
    group). z: the zero points (W4 3), else 8 (unused for mxfp4)."""
    z = 8
    if BLOCK_K <= Q_BLOCK_K:
        g = k0 // Q_BLOCK_K
        s = fp8.load_scale(ws_row + g * stride_sk, n_ok, UE8M0)[:, None]
        if W4 == 3:
            z = tl.load(zp_row + g * stride_sk, mask=n_ok, other=0).to(tl.int32)[:, None]
    else:
        NG: tl.constexpr = BLOCK_K // Q_BLOCK_K
        offs_g = k0 // Q_BLOCK_K + tl.arange(0, NG)
        ok = n_ok[:, None] & (offs_g * Q_BLOCK_K < K)[None, :]
        sg = fp8.load_scale(ws_row[:, None] + offs_g[None, :] * stride_sk, ok, UE8M0)  # [BN, NG]
        s = tl.reshape(tl.broadcast_to(sg[:, :, None], [BLOCK_N, NG, Q_BLOCK_K // 2]), [BLOCK_N, BLOCK_K // 2])
        if W4 == 3:
            zg = tl.load(zp_row[:, None] + offs_g[None, :] * stride_sk, mask=ok, other=0).to(tl.int32)
            z = tl.reshape(tl.broadcast_to(zg[:, :, None], [BLOCK_N, NG, Q_BLOCK_K // 2]), [BLOCK_N, BLOCK_K // 2])
    return s, z


@triton.jit
def _weights(c, s, z, W4: tl.constexpr):
    """int32 codes -> fp32 weights: mxfp4 e2m1(c) * s, int4 (c - z) * s (one fp32 product, as the oracle's)."""
    if W4 == 1:
        v = quant4.e2m1(c) * s
    else:
        v = (c - z).to(tl.float32) * s
    return v


@triton.jit
def _row_step4(acc, w_lo, w_hi, x_row, k0, offs_j, j_ok, REDUCE_END: tl.constexpr):
    """One row's accumulator after K step k0 (x_row: the row's first element)."""
    xe = tl.load(x_row + k0 + 2 * offs_j, mask=j_ok, other=0.0).to(tl.float32)  # [BK / 2] columns k0 + 2j
    xo = tl.load(x_row + k0 + 2 * offs_j + 1, mask=j_ok, other=0.0).to(tl.float32)  # columns k0 + 2j + 1
    p = w_lo * xe[None, :] + w_hi * xo[None, :]
    if REDUCE_END:
        acc += p
    else:
        acc += tl.sum(p, axis=1)
    return acc


@triton.jit
def _row_store4(acc, y_row, offs_n, n_ok, bias, HAS_BIAS: tl.constexpr, REDUCE_END: tl.constexpr):
    if REDUCE_END:
        r = tl.sum(acc, axis=1)
    else:
        r = acc
    if HAS_BIAS:
        r = r + bias
    tl.store(y_row + offs_n, r.to(y_row.dtype.element_ty), mask=n_ok)


@triton.jit
def skinny4_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K / 2] uint8, unit stride along K
    ws_ptr,  # group scales [N, ceil(K / Q_BLOCK_K)]
    zp_ptr,  # zero points (W4 3; the scales' strides), else unused
    b_ptr,  # [N] bias or None
    y_ptr,  # [M, N]
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_ym,
    ROWS: tl.constexpr,  # M, 1..4
    HAS_BIAS: tl.constexpr,
    W4: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = offs_n.to(tl.int64)
    offs_j = tl.arange(0, HALF)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_j[None, :]  # [BN, BK / 2] bytes
    ws_row = ws_ptr + rows_n * stride_sn
    zp_row = (zp_ptr + rows_n * stride_sn) if W4 == 3 else ws_row
    if REDUCE_END:
        acc0 = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in range(0, K, BLOCK_K):
        j_ok = offs_j < (K - k0) // 2
        p = tl.load(w_ptrs, mask=n_ok[:, None] & j_ok[None, :], other=0).to(tl.int32)
        s, z = _group_vals(ws_row, zp_row, n_ok, k0, K, stride_sk, W4, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K)
        w_lo = _weights(p & 15, s, z, W4)
        w_hi = _weights(p >> 4, s, z, W4)
        acc0 = _row_step4(acc0, w_lo, w_hi, x_ptr, k0, offs_j, j_ok, REDUCE_END)
        if ROWS > 1:
            acc1 = _row_step4(acc1, w_lo, w_hi, x_ptr + stride_xm, k0, offs_j, j_ok, REDUCE_END)
        if ROWS > 2:
            acc2 = _row_step4(acc2, w_lo, w_hi, x_ptr + 2 * stride_xm, k0, offs_j, j_ok, REDUCE_END)
        if ROWS > 3:
            acc3 = _row_step4(acc3, w_lo, w_hi, x_ptr + 3 * stride_xm, k0, offs_j, j_ok, REDUCE_END)
        w_ptrs += HALF
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    _row_store4(acc0, y_ptr, offs_n, n_ok, bias, HAS_BIAS, REDUCE_END)
    if ROWS > 1:
        _row_store4(acc1, y_ptr + stride_ym, offs_n, n_ok, bias, HAS_BIAS, REDUCE_END)
    if ROWS > 2:
        _row_store4(acc2, y_ptr + 2 * stride_ym, offs_n, n_ok, bias, HAS_BIAS, REDUCE_END)
    if ROWS > 3:
        _row_store4(acc3, y_ptr + 3 * stride_ym, offs_n, n_ok, bias, HAS_BIAS, REDUCE_END)
