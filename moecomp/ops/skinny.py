"""The skinny linear (``kernels/skinny.py``): y = x @ w.T (+ bias) for a few rows of x (decode, M <= 4), with w in
16 bits or e4m3 with its scales (weight-only: x stays 16-bit).

``skinny_linear`` launches the kernel on CUDA tensors (the interpreter runs it on CPU under ``TRITON_INTERPRET=1``);
``skinny_config`` chooses its tiles: narrow BLOCK_N for enough programs to keep every SM streaming weight rows, and
BLOCK_K so that each program has a few KiB of weight in flight per step.
"""

from __future__ import annotations

import torch
import triton

from ..kernels import skinny as skinny_k
from ..kernels import skinny_norm as skinny_norm_k
from .common import sm_count as _sm_count

MAX_ROWS = 4
_W_SCALE = {None: 0, "block": 1, "channel": 2, "tensor": 3}


def launch_options(device: torch.device) -> dict:
    """The skinny launches' programmatic dependent launch options on ``device`` (``kernels/pdl.py``: wait for the
    previous kernel at the start, let the next one launch after the K loop): ``triton_moe`` sets this to its ``_pdl``
    (gemm form) when it imports this module (it imports this module, so this one cannot import it); until then, and
    with MOECOMP_PDL=0, plain launches."""
    return {}


def use_skinny(M: int, N: int, K: int, quantized: bool) -> bool:
    """Whether M rows against an [N, K] weight go faster through the skinny kernel than through the alternative
    (cuBLAS for 16-bit weights, fp8_linear's MMA form for e4m3), by the H200 sweep of 2026-12-01
    (``benchmarks/diag_skinny.py``, results ``nvidia-h200-2026-12-01-b3f2b14-diag-skinny.json``): one row always
    (0.41-0.93x cuBLAS, 0.19-0.61x the MMA form); two rows up to 32M weight elements (16-bit: 0.47-0.96x; 1.02-1.05x
    above) and always in e4m3 (0.26-0.95x); four rows only in e4m3 up to 8M elements (0.47-1.01x; 1.3-3x above)."""
    if M <= 1:
        return M == 1
    if M == 2:
        return quantized or N * K <= (32 << 20)
    return quantized and M <= MAX_ROWS and N * K <= (8 << 20)


# rows -> ((N below which, (BLOCK_N, BLOCK_K for 16-bit weights, BLOCK_K for e4m3, REDUCE_END)), ...): the sweep's
# winners by shape class (the last entry: every N above)
_TILES = {
    1: ((4096, (4, 2048, 2048, 1)), (7168, (8, 1024, 1024, 1)), (None, (8, 512, 1024, 0))),
    2: ((4096, (4, 1024, 1024, 1)), (16384, (8, 512, 512, 1)), (None, (16, 256, 512, 0))),
    4: ((None, (4, 1024, 1024, 1)),),
}


def skinny_config(M: int, N: int, K: int, itemsize: int, device: torch.device, sms: int) -> dict:
    """Tiles for M rows against an [N, K] weight of ``itemsize`` bytes an element: the winners of the H200 sweep
    (see ``use_skinny``) by shape class. Under 4096 rows 4-row tiles with long K steps (2048 columns at one row);
    from 4096 rows 8-row tiles; from 7168 rows (one row) or 16384 (two) a reduction every K step, whose small
    accumulators leave room for more programs in flight."""
    if device.type != "cuda":  # the interpreter: small tiles, two K steps on the tests' shapes
        return dict(BLOCK_N=8, BLOCK_K=64, REDUCE_END=1, num_warps=4, num_stages=1)
    kmax = max(64, triton.next_power_of_2(K))
    bn, bk16, bk8, red = next(t for below, t in _TILES.get(M, _TILES[4]) if below is None or N < below)
    bk = bk8 if itemsize == 1 else bk16
    if -(-N // bn) < sms and bn > 4:  # too few programs for the SMs: narrower tiles
        bn //= 2
    return dict(BLOCK_N=bn, BLOCK_K=min(bk, kmax), REDUCE_END=red, num_warps=4, num_stages=3)


def skinny_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None, q=None, out: torch.Tensor | None = None,
                  cfg: dict | None = None) -> torch.Tensor:
    """x2 [M, K] (M <= MAX_ROWS, unit stride along K) x weight [N, K] -> [M, N] in x2's dtype. ``q``: the weight's
    QuantSpec when it is e4m3 (``weight_scale`` its scales); ``out``: an [M, N] buffer of unit column stride;
    ``cfg``: explicit tiles (the benchmark's sweep), else ``skinny_config``."""
    M, K = x2.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_linear: x2 must have 1..{MAX_ROWS} rows, got {M}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError(f"skinny_linear: weight must have unit stride along K, got strides {weight.stride()}")
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device) if out is None else out
    if cfg is None:
        cfg = skinny_config(M, N, K, weight.element_size(), x2.device, _sm_count(x2.device))
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    ws, s_n, s_k, meta = weight_args("skinny_linear", weight_scale, q, cfg)
    skinny_k.skinny_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x2, weight, ws, bias, y, N, K, x2.stride(0), weight.stride(0), s_n, s_k, y.stride(0),
        ROWS=M, HAS_BIAS=bias is not None, **meta, **launch_options(x2.device))
    return y


def weight_args(name: str, weight_scale: torch.Tensor | None, q, cfg: dict) -> tuple:
    """One weight's scale arguments for the skinny tile (here and in ``ops/linear_add_norm.py``): (scales as the
    kernel reads them or None, their row and K-group strides, the constexprs and launch sizes of ``cfg``)."""
    mode = _W_SCALE[None if q is None else q.scale]
    qbn, qbk = (q.block_n, q.block_k) if mode == 1 else (128, 128)
    bk = cfg["BLOCK_K"]
    if mode == 1 and (bk % qbk and qbk % bk):  # a scale block of 384: steps of its largest power-of-two divisor
        bk = min(bk, qbk & -qbk)
    ws = weight_scale if mode else None
    if ws is not None and mode == 1 and ws.dim() != 2:
        raise ValueError(f"{name}: block scales must be 2-D, got {tuple(ws.shape)}")
    ue8m0 = ws is not None and ws.dtype == torch.float8_e8m0fnu
    if ue8m0:
        ws = ws.view(torch.uint8)
    s_n = ws.stride(0) if ws is not None and ws.dim() >= 1 else 0
    s_k = ws.stride(1) if ws is not None and ws.dim() == 2 else 0
    return ws, s_n, s_k, dict(W_SCALE=mode, Q_BLOCK_N=qbn, Q_BLOCK_K=qbk, UE8M0=ue8m0, BLOCK_N=cfg["BLOCK_N"],
                              BLOCK_K=bk, REDUCE_END=cfg["REDUCE_END"], num_warps=cfg["num_warps"],
                              num_stages=cfg["num_stages"])


MAX_GROUP = 4  # members of one skinny_group launch (q / k / v: 3; gate / up: 2)


def skinny_group(x2: torch.Tensor, weights: list, biases: list | None = None, scales: list | None = None, q=None,
                 cfg: dict | None = None, outs: list | None = None) -> list:
    """``skinny_linear`` of x2 [M, K] against 2..MAX_GROUP weights [N_i, K] of one format (16-bit, or e4m3 of one
    QuantSpec ``q`` with ``scales``), in one launch (``kernels/skinny.skinny_group_kernel``): [y_i [M, N_i]], each
    as ``skinny_linear`` would compute it with the same tiles. The tiles are chosen for the members' total rows.
    ``outs``: [M, N_i] buffers of unit column stride to write into."""
    a = _group_args("skinny_group", 2, x2, weights, biases, scales, q, cfg, outs)
    x2 = a["x2"]
    skinny_k.skinny_group_kernel[a["grid"]](x2, *a["ptrs"], x2.shape[1], x2.stride(0), *a["strides"], **a["meta"])
    return a["ys"]


def _group_args(name: str, g_min: int, x2, weights, biases, scales, q, cfg, outs) -> dict:
    """The members' launch arguments, checked, for the group kernels (``skinny_group``, ``skinny_norm_group``):
    x2 (unit stride along K), the member pointers and sizes (``ptrs``), their strides, the constexprs and launch
    options (``meta``), the grid and the outputs ``ys``."""
    M, K = x2.shape
    G = len(weights)
    if not g_min <= G <= MAX_GROUP:
        raise ValueError(f"{name}: weights must hold {g_min}..{MAX_GROUP} matrices, got {G}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"{name}: x2 must have 1..{MAX_ROWS} rows, got {M}")
    biases = list(biases) if biases is not None else [None] * G
    scales = list(scales) if scales is not None else [None] * G
    if len(biases) != G or len(scales) != G:
        raise ValueError(f"{name}: biases and scales must have one entry per weight ({G}), got "
                         f"{len(biases)} and {len(scales)}")
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != K or w.stride(-1) != 1:
            raise ValueError(f"{name}: weights[{i}] must be [N, {K}] with unit stride along K, got "
                             f"{tuple(w.shape)} strides {w.stride()}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    mode = _W_SCALE[None if q is None else q.scale]
    N_all = sum(w.shape[0] for w in weights)
    if cfg is None:
        cfg = skinny_config(M, N_all, K, weights[0].element_size(), x2.device, _sm_count(x2.device))
    qbn, qbk = (q.block_n, q.block_k) if mode == 1 else (128, 128)
    bk = cfg["BLOCK_K"]
    if mode == 1 and (bk % qbk and qbk % bk):
        bk = min(bk, qbk & -qbk)
    if outs is not None and (len(outs) != G or any(tuple(o.shape) != (M, w.shape[0]) or o.stride(-1) != 1
                                                   for o, w in zip(outs, weights))):
        raise ValueError(f"{name}: outs must be {G} buffers [M={M}, N_i] of unit column stride, got "
                         f"{[tuple(o.shape) for o in outs]}")
    ys = [torch.empty(M, w.shape[0], dtype=x2.dtype, device=x2.device) for w in weights] if outs is None else outs
    bs = [b if b is None or b.stride(-1) == 1 else b.contiguous() for b in biases]
    ws, ue8m0 = [], False
    for i, s in enumerate(scales):
        if not mode:
            ws.append(None)
            continue
        if s is None or (mode == 1 and s.dim() != 2):
            raise ValueError(f"{name}: scales[{i}] must be the weight's {q.scale} scales, got "
                             f"{None if s is None else tuple(s.shape)}")
        ue8m0 = s.dtype == torch.float8_e8m0fnu
        ws.append(s.view(torch.uint8) if ue8m0 else s)
    pad = MAX_GROUP - G

    def four(vals, fill):
        return list(vals) + [fill] * pad

    s_n = [s.stride(0) if s is not None and s.dim() >= 1 else 0 for s in ws]
    s_k = [s.stride(1) if s is not None and s.dim() == 2 else 0 for s in ws]
    hb = four([b is not None for b in bs], False)
    return dict(
        x2=x2, ys=ys, grid=(sum(triton.cdiv(w.shape[0], cfg["BLOCK_N"]) for w in weights),),
        ptrs=[*four(weights, None), *four(ws, None), *four(bs, None), *four(ys, None),
              *four([w.shape[0] for w in weights], 0)],
        strides=[*four([w.stride(0) for w in weights], 0), *four(s_n, 0), *four(s_k, 0),
                 *four([y.stride(0) for y in ys], 0)],
        meta=dict(G=G, ROWS=M, HB0=hb[0], HB1=hb[1], HB2=hb[2], HB3=hb[3], W_SCALE=mode, Q_BLOCK_N=qbn,
                  Q_BLOCK_K=qbk, UE8M0=ue8m0, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, REDUCE_END=cfg["REDUCE_END"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(x2.device)))


def skinny_norm_group(x2: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      offset: bool, weights: list, biases: list | None = None, scales: list | None = None, q=None,
                      cfg: dict | None = None, outs: list | None = None) -> tuple[list, torch.Tensor | None]:
    """1..MAX_GROUP linears of the RMSNorm of x2 [M, K] (+ ``residual`` [M, K]) in one launch
    (``kernels/skinny_norm.skinny_norm_group_kernel``): ([y_i [M, N_i]], h), y_i = linear(rmsnorm(h), W_i, b_i)
    with the norm's fp32 scale applied to each output row, h = x2 + residual in x2's dtype (None without a
    residual). ``norm_weight`` [K] multiplies (``offset``: 1 + it multiplies); the members as ``skinny_group``'s."""
    M, K = x2.shape
    if norm_weight.shape != (K,):
        raise ValueError(f"skinny_norm_group: norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x2.shape or residual.dtype != x2.dtype):
        raise ValueError(f"skinny_norm_group: residual must be [{M}, {K}] of {x2.dtype}, got "
                         f"{tuple(residual.shape)} of {residual.dtype}")
    a = _group_args("skinny_norm_group", 1, x2, weights, biases, scales, q, cfg, outs)
    x2 = a["x2"]
    h = r = None
    if residual is not None:
        r = residual if residual.stride(-1) == 1 else residual.contiguous()
        h = torch.empty_like(x2, memory_format=torch.contiguous_format)
    g = norm_weight if norm_weight.stride(-1) == 1 else norm_weight.contiguous()
    rr, hh = (r, h) if r is not None else (x2, x2)  # never read nor written without HAS_RES
    skinny_norm_k.skinny_norm_group_kernel[a["grid"]](
        x2, rr, hh, g, float(eps), *a["ptrs"], K, x2.stride(0), rr.stride(0), hh.stride(0), *a["strides"],
        HAS_RES=r is not None, OFFSET=bool(offset), **a["meta"])
    return a["ys"], h
