"""Skinny linear: a few rows (decode, M <= 4) against a wide weight, bound by the weight's bytes.

    y[m, n] = sum_k x[m, k] * w[n, k] * s_w(n, k)  (+ bias[n])     m < ROWS <= 4
              x [M, K] 16-bit or fp32 (unit stride along K); w [N, K] 16-bit (no scales) or e4m3 with block
              [ceil(N / Q_BLOCK_N), ceil(K / Q_BLOCK_K)], channel [N] or tensor [] scales; y [M, N] in x's dtype

One program per BLOCK_N weight rows, all rows of x (no tensor cores: at M <= 4 a 16-row MMA tile would be 3/4
padding). Each K step loads a [BLOCK_N, BLOCK_K] weight tile, dequantizes it once in fp32 (block scales multiply
each Q_BLOCK_K-column group; channel / tensor scales the final sums) and multiplies it with every row of x:

    K steps:   w_tile [BN, BK] ---> (* s [BN, BK / Q_BLOCK_K] per group) ---> * x[m, k0:k0+BK] for m < ROWS
    REDUCE_END 1: acc_m [BN, BK] += products, summed over K once at the end (no reduction in the loop; registers
                  grow with ROWS * BN * BK)
    REDUCE_END 0: acc_m [BN] += sum over the step's BK columns (a reduction every step, small accumulators)

Narrow BLOCK_N gives N / BLOCK_N programs, so that even a 512-row projection keeps the SMs streaming, where an MMA
form's tiles of 16 x 64 leave most of them idle. The launcher (``ops/skinny.py``) picks the tiles.

``skinny_group_kernel``: 2-4 sibling linears that read the same x (q / k / v, a dense MLP's gate / up) in one launch,
each weight by its own pointer; its programs split the members' row blocks among them, each running the tile above.
"""

import triton
import triton.language as tl

from . import fp8, pdl


@triton.jit
def dequant(w, ws_row, n_ok, k0, K, stride_sk, W_SCALE: tl.constexpr, Q_BLOCK_K: tl.constexpr,
             UE8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BN, BK] weight tile of K step k0 in fp32, its block scales applied (W_SCALE 1)."""
    wf = w.to(tl.float32)
    if W_SCALE == 1:
        if BLOCK_K <= Q_BLOCK_K:  # one scale column for the whole step
            s = fp8.load_scale(ws_row + (k0 // Q_BLOCK_K) * stride_sk, n_ok, UE8M0)  # [BN]
            wf = wf * s[:, None]
        else:
            G: tl.constexpr = BLOCK_K // Q_BLOCK_K
            cols = k0 // Q_BLOCK_K + tl.arange(0, G)
            s = fp8.load_scale(ws_row[:, None] + cols[None, :] * stride_sk,
                               n_ok[:, None] & (cols * Q_BLOCK_K < K)[None, :], UE8M0)  # [BN, G]
            wf = tl.reshape(tl.reshape(wf, [BLOCK_N, G, Q_BLOCK_K]) * s[:, :, None], [BLOCK_N, BLOCK_K])
    return wf


@triton.jit
def _row_step(acc, wf, x_row, k0, offs_k, k_ok, REDUCE_END: tl.constexpr):
    """One row's accumulator after K step k0: x_row points at the row's first element."""
    x = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    if REDUCE_END:
        acc += wf * x[None, :]
    else:
        acc += tl.sum(wf * x[None, :], axis=1)
    return acc


@triton.jit
def row_value(acc, s_fin, bias, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr, REDUCE_END: tl.constexpr):
    """One row's [BN] outputs in fp32 from its accumulator: summed (REDUCE_END), scaled, the bias added."""
    if REDUCE_END:
        r = tl.sum(acc, axis=1)
    else:
        r = acc
    if W_SCALE >= 2:
        r = r * s_fin
    if HAS_BIAS:
        r = r + bias
    return r


@triton.jit
def _row_store(acc, y_row, offs_n, n_ok, s_fin, bias, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
               REDUCE_END: tl.constexpr):
    r = row_value(acc, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    tl.store(y_row + offs_n, r.to(y_row.dtype.element_ty), mask=n_ok)


@triton.jit
def tile_start(pid, w_ptr, ws_ptr, N, stride_wn, stride_sn, W_SCALE: tl.constexpr, Q_BLOCK_N: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr):
    """A skinny tile's set-up (here and in ``skinny_norm``): its weight rows, their mask, the K offsets, the first K
    step's weight pointers, the block-scale rows (W_SCALE 1) and a zero accumulator ([BN, BK] with REDUCE_END)."""
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    ws_row = 0  # (read by ``dequant`` with W_SCALE 1 only; a jit function cannot return the None ws_ptr may be)
    if W_SCALE == 1:
        ws_row = ws_ptr + (rows_n // Q_BLOCK_N) * stride_sn  # [BN]
    if REDUCE_END:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    return offs_n, n_ok, rows_n, offs_k, w_ptrs, ws_row, acc


@triton.jit
def tile_end(ws_ptr, b_ptr, rows_n, offs_n, n_ok, stride_sn, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
             UE8M0: tl.constexpr):
    """After the K loop: (the per-row scale a channel / tensor-scaled weight applies at the end, else 1.0; the fp32
    bias, else 0.0)."""
    s_fin = 1.0
    if W_SCALE == 2:
        s_fin = fp8.load_scale(ws_ptr + rows_n * stride_sn, n_ok, UE8M0)
    elif W_SCALE == 3:
        s_fin = fp8.load_scale(ws_ptr + rows_n * 0, n_ok, UE8M0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return s_fin, bias


@triton.jit
def tile_sums(pid, x_ptr, w_ptr, ws_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_sk, ROWS: tl.constexpr,
              W_SCALE: tl.constexpr, Q_BLOCK_N: tl.constexpr, Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_END: tl.constexpr):
    """The K loop of one program's tile (here and in ``linear_add_norm``): weight rows [pid * BLOCK_N, +BLOCK_N) of
    one [N, K] weight against every row of x; (offs_n, n_ok, rows_n, acc0..acc3: one accumulator per row of x)."""
    offs_n, n_ok, rows_n, offs_k, w_ptrs, ws_row, acc0 = tile_start(pid, w_ptr, ws_ptr, N, stride_wn, stride_sn,
                                                                     W_SCALE, Q_BLOCK_N, BLOCK_N, BLOCK_K, REDUCE_END)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        wf = dequant(w, ws_row, n_ok, k0, K, stride_sk, W_SCALE, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K)
        acc0 = _row_step(acc0, wf, x_ptr, k0, offs_k, k_ok, REDUCE_END)
        if ROWS > 1:
            acc1 = _row_step(acc1, wf, x_ptr + stride_xm, k0, offs_k, k_ok, REDUCE_END)
        if ROWS > 2:
            acc2 = _row_step(acc2, wf, x_ptr + 2 * stride_xm, k0, offs_k, k_ok, REDUCE_END)
        if ROWS > 3:
            acc3 = _row_step(acc3, wf, x_ptr + 3 * stride_xm, k0, offs_k, k_ok, REDUCE_END)
        w_ptrs += BLOCK_K
    return offs_n, n_ok, rows_n, acc0, acc1, acc2, acc3


@triton.jit
def _tile(pid, x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
          ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr, Q_BLOCK_N: tl.constexpr,
          Q_BLOCK_K: tl.constexpr, UE8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          REDUCE_END: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """Weight rows [pid * BLOCK_N, +BLOCK_N) of one [N, K] weight against every row of x: one program's work (USE_PDL
    2: the next launch may start once every program is past its K loop, ``kernels/pdl.py``)."""
    offs_n, n_ok, rows_n, acc0, acc1, acc2, acc3 = tile_sums(pid, x_ptr, w_ptr, ws_ptr, N, K, stride_xm, stride_wn,
                                                             stride_sn, stride_sk, ROWS, W_SCALE, Q_BLOCK_N,
                                                             Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END)
    pdl.release(USE_PDL)
    s_fin, bias = tile_end(ws_ptr, b_ptr, rows_n, offs_n, n_ok, stride_sn, HAS_BIAS, W_SCALE, UE8M0)
    _row_store(acc0, y_ptr, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 1:
        _row_store(acc1, y_ptr + stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 2:
        _row_store(acc2, y_ptr + 2 * stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)
    if ROWS > 3:
        _row_store(acc3, y_ptr + 3 * stride_ym, offs_n, n_ok, s_fin, bias, HAS_BIAS, W_SCALE, REDUCE_END)


@triton.jit
def skinny_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    ws_ptr,  # weight scales (W_SCALE 1-3; see the module docstring) or None
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
    W_SCALE: tl.constexpr,  # 0 none (16-bit weights), 1 block, 2 channel, 3 tensor
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
    USE_PDL: tl.constexpr = 0,  # programmatic dependent launch (kernels/pdl.py): 0 off, 2 wait, release after K
):
    pdl.enter(USE_PDL)
    _tile(tl.program_id(0), x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
          stride_ym, ROWS, HAS_BIAS, W_SCALE, Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)


@triton.jit
def skinny_group_kernel(
    x_ptr,  # [M, K], unit stride along K: the one input every member reads
    w0, w1, w2, w3,  # members' [N_i, K] weights (unit stride along K); unused members None
    ws0, ws1, ws2, ws3,  # their scales (W_SCALE 1-3) or None
    b0, b1, b2, b3,  # their [N_i] biases or None
    y0, y1, y2, y3,  # their [M, N_i] outputs
    N0, N1, N2, N3,
    K,
    stride_xm,
    swn0, swn1, swn2, swn3,  # weight row strides
    ssn0, ssn1, ssn2, ssn3,  # scale strides (rows)
    ssk0, ssk1, ssk2, ssk3,  # scale strides (K groups)
    sym0, sym1, sym2, sym3,  # output row strides
    G: tl.constexpr,  # members, 2..4
    ROWS: tl.constexpr,
    HB0: tl.constexpr, HB1: tl.constexpr, HB2: tl.constexpr, HB3: tl.constexpr,  # member i has a bias
    W_SCALE: tl.constexpr,  # one format for every member (the QuantSpec of the group)
    Q_BLOCK_N: tl.constexpr,
    Q_BLOCK_K: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_END: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    """Sibling linears of one input in one launch: programs [0, cdiv(N0, BLOCK_N)) run member 0's tiles, the next
    cdiv(N1, BLOCK_N) member 1's, and so on; each program runs exactly the tile ``skinny_kernel`` would (``_tile``),
    on its member's own weight pointer (nothing concatenated)."""
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    nb0 = tl.cdiv(N0, BLOCK_N)
    nb1 = tl.cdiv(N1, BLOCK_N)
    if pid < nb0:
        _tile(pid, x_ptr, w0, ws0, b0, y0, N0, K, stride_xm, swn0, ssn0, ssk0, sym0, ROWS, HB0, W_SCALE, Q_BLOCK_N,
              Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
    elif pid < nb0 + nb1:
        _tile(pid - nb0, x_ptr, w1, ws1, b1, y1, N1, K, stride_xm, swn1, ssn1, ssk1, sym1, ROWS, HB1, W_SCALE,
              Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
    else:
        if G > 2:
            nb2 = tl.cdiv(N2, BLOCK_N)
            p2 = pid - nb0 - nb1
            if p2 < nb2:
                _tile(p2, x_ptr, w2, ws2, b2, y2, N2, K, stride_xm, swn2, ssn2, ssk2, sym2, ROWS, HB2, W_SCALE,
                      Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
            else:
                if G > 3:
                    _tile(p2 - nb2, x_ptr, w3, ws3, b3, y3, N3, K, stride_xm, swn3, ssn3, ssk3, sym3, ROWS, HB3,
                          W_SCALE, Q_BLOCK_N, Q_BLOCK_K, UE8M0, BLOCK_N, BLOCK_K, REDUCE_END, USE_PDL)
