r"""Router GEMV at a few tokens: logits = x . W^T (+ b), one program per (token, BLOCK_R router rows); and
``router_topk_kernel``, the same GEMV and the routing (``routing.route_tile``) in one launch.

    x [T, H] --.--> logits [T, R]          R = E router rows (+ 1: the shared-expert gate row, HAS_GATE)
    W [E, H] -/                            row E (HAS_GATE) is read from g [H], not from W

Every operand is rounded to the logits' dtype first (the gate row to W's dtype before that), then multiplied in
fp32 and summed in fp32, and the result is rounded once to the logits' dtype: what ``torch.nn.functional.linear``
computes on the converted operands (``moecomp.ops.triton_moe.router_logits``), without converting W on every call.
At one token cuBLAS runs this [1, H] x [H, E] product on a few SMs; a program per router row reads W on all of them.
"""

import triton
import triton.language as tl

from . import pdl, routing


@triton.jit
def router_gemv_kernel(
    x_ptr,  # [T, H], row stride stride_xt
    w_ptr,  # [E, H], row stride stride_w
    g_ptr,  # [H] shared-expert gate row (HAS_GATE) or None
    b_ptr,  # [E] router bias (HAS_BIAS) or None
    out_ptr,  # [T, R] logits, row stride stride_o
    E,
    R,  # E, or E + 1 with the gate row
    H,
    stride_xt,
    stride_w,
    stride_o,
    HAS_GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    pdl.enter(USE_PDL)
    num_r = tl.cdiv(R, BLOCK_R)
    t = (tl.program_id(0) // num_r).to(tl.int64)
    rows = (tl.program_id(0) % num_r) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    in_w = rows < E
    out_t = out_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)  # [BH]
        h_ok = offs_h < H
        xv = tl.load(x_ptr + t * stride_xt + offs_h, mask=h_ok, other=0.0).to(out_t).to(tl.float32)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_h[None, :]
        w = tl.load(w_ptrs, mask=in_w[:, None] & h_ok[None, :], other=0.0).to(out_t).to(tl.float32)  # [BR, BH]
        if HAS_GATE:
            g = tl.load(g_ptr + offs_h, mask=h_ok, other=0.0).to(w_ptr.dtype.element_ty).to(out_t).to(tl.float32)
            w = tl.where((rows == E)[:, None], g[None, :], w)
        acc += w * xv[None, :]
    logit = tl.sum(acc, axis=1)  # [BR]
    if HAS_BIAS:
        logit += tl.load(b_ptr + rows, mask=in_w, other=0.0).to(out_t).to(tl.float32)
    tl.store(out_ptr + t * stride_o + rows, logit.to(out_t), mask=rows < R)


@triton.jit
def _logit_step(acc, w, x_ptr, offs_h, h_ok, out_t: tl.constexpr):
    xv = tl.load(x_ptr + offs_h, mask=h_ok, other=0.0).to(out_t).to(tl.float32)
    return acc + w * xv[None, :]


@triton.jit
def _logit_store(acc, out_row, rows, in_w, b, R, HAS_BIAS: tl.constexpr):
    logit = tl.sum(acc, axis=1)  # [BR]
    if HAS_BIAS:
        logit += b
    tl.store(out_row + rows, logit.to(out_row.dtype.element_ty), mask=rows < R)


@triton.jit
def router_topk_kernel(
    x_ptr,  # [T, H], row stride stride_xt (T = ROWS <= 4)
    w_ptr,  # [E, H] router weight, row stride stride_w
    g_ptr,  # [H] shared-expert gate row (HAS_GATE) or None
    rb_ptr,  # [E] router bias (HAS_RBIAS) or None
    counter_ptr,  # [1] int32, 0 between launches (the last program puts it back); unused with one program
    EW,  # rows of W (the E routed + zero experts, + shared gammas' or an FSE gate's rows)
    R,  # EW (+ 1 with the gate row g)
    H,
    stride_xt,
    stride_w,
    ROWS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_RBIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SINGLE: tl.constexpr,  # one program: no counter
    # from here on route_topk_kernel's arguments (logits_ptr: the [T, R] logits this kernel writes, then routes)
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, stride_lt, scaling, renorm_eps, renorm_min,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
    TOPK_THEN_SCORE: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ON_LOGITS: tl.constexpr,
    MASK_ZERO: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_BY_MAX: tl.constexpr, GROUP_3D: tl.constexpr, GROUP_SIZE: tl.constexpr, ROUND_TO: tl.constexpr,
    USE_PDL: tl.constexpr = 0, SPARSEMIXER: tl.constexpr = 0, sm_thr=0.0, table_ptr=None, tok_ptr=None, n_vocab=1,
    stride_table=0, HASH: tl.constexpr = False, escale_ptr=None, HAS_ESCALE: tl.constexpr = False, gammas_ptr=None,
    wscale_ptr=None, N_GAMMA: tl.constexpr = 0, GAM_PAD: tl.constexpr = 1, HAS_WSCALE: tl.constexpr = False,
    given_ptr=None, stride_gt=0, stride_gk=0, GIVEN: tl.constexpr = False, rec_ids_ptr=None, stride_rt=0,
    stride_rk=0, REC_IDS: tl.constexpr = False, rec_w_ptr=None, stride_wt=0, stride_wk=0, REC_W: tl.constexpr = False,
):
    """Router GEMV and routing in one launch (decode, T = ROWS <= 4 tokens):

        program p:      logits[t, rows of block p] for every token t   (each W tile read once for all tokens)
        then:           atomic_add(counter, 1); the program that counts last (every other's logits are written)
        last program:   counter <- 0; route_topk's body over all T tokens (``routing.route_tile``)

    The logits are rounded as ``router_gemv_kernel`` rounds them and written to ``logits_ptr`` (the op reads the
    shared-expert gate's logit there too). One program (SINGLE, small E * H) needs no counter. The counter is a
    buffer the launcher keeps per device, zero between launches, so a CUDA graph replays the kernel as it was
    captured; two launches on one device must not run at the same time (on two streams)."""
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    in_w = rows < EW
    out_t = logits_ptr.dtype.element_ty
    acc0 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)  # [BH]
        h_ok = offs_h < H
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_h[None, :]
        w = tl.load(w_ptrs, mask=in_w[:, None] & h_ok[None, :], other=0.0).to(out_t).to(tl.float32)  # [BR, BH]
        if HAS_GATE:
            g = tl.load(g_ptr + offs_h, mask=h_ok, other=0.0).to(w_ptr.dtype.element_ty).to(out_t).to(tl.float32)
            w = tl.where((rows == EW)[:, None], g[None, :], w)
        acc0 = _logit_step(acc0, w, x_ptr, offs_h, h_ok, out_t)
        if ROWS > 1:
            acc1 = _logit_step(acc1, w, x_ptr + stride_xt, offs_h, h_ok, out_t)
        if ROWS > 2:
            acc2 = _logit_step(acc2, w, x_ptr + 2 * stride_xt, offs_h, h_ok, out_t)
        if ROWS > 3:
            acc3 = _logit_step(acc3, w, x_ptr + 3 * stride_xt, offs_h, h_ok, out_t)
    b = 0.0
    if HAS_RBIAS:
        b = tl.load(rb_ptr + rows, mask=in_w, other=0.0).to(out_t).to(tl.float32)
    _logit_store(acc0, logits_ptr, rows, in_w, b, R, HAS_RBIAS)
    if ROWS > 1:
        _logit_store(acc1, logits_ptr + stride_lt, rows, in_w, b, R, HAS_RBIAS)
    if ROWS > 2:
        _logit_store(acc2, logits_ptr + 2 * stride_lt, rows, in_w, b, R, HAS_RBIAS)
    if ROWS > 3:
        _logit_store(acc3, logits_ptr + 3 * stride_lt, rows, in_w, b, R, HAS_RBIAS)
    tl.debug_barrier()  # every thread's logits stored before the count (and, in one program, before the loads)
    if SINGLE:
        last = True
    else:
        last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1
    if last:
        if not SINGLE:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # every program has counted: reset
        routing.route_tile(0, logits_ptr, bias_ptr, ids_ptr, weights_ptr, T, E, stride_lt, scaling, renorm_eps,
                           renorm_min, TOP_K, K_PAD, BLOCK_T, BLOCK_E, SCORING, TOPK_THEN_SCORE, RENORM, HAS_BIAS,
                           BIAS_ON_LOGITS, MASK_ZERO, N_GROUP, G_PAD, TOPK_GROUP, GROUP_BY_MAX, GROUP_3D, GROUP_SIZE,
                           ROUND_TO, SPARSEMIXER, sm_thr, table_ptr, tok_ptr, n_vocab, stride_table, HASH, escale_ptr,
                           HAS_ESCALE, gammas_ptr, wscale_ptr, N_GAMMA, GAM_PAD, HAS_WSCALE, given_ptr, stride_gt,
                           stride_gk, GIVEN, rec_ids_ptr, stride_rt, stride_rk, REC_IDS, rec_w_ptr, stride_wt,
                           stride_wk, REC_W, not SINGLE)
