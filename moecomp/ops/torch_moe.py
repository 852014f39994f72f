"""Vectorised PyTorch MoE: the op's path on CPU (and on CUDA when MOECOMP_CUDA_BACKEND=torch); one of the two
implementations of ``ops/backend.Backend``.

No Python loop over experts: token-expert pairs are sorted by expert once, both expert GEMMs run as grouped
GEMMs over the sorted rows (``torch.nn.functional.grouped_mm`` where the stack has it for the dtype, else a
batched GEMM over gathered weights in bounded chunks), and the weighted combine is one scatter-add. Zero experts
(``spec.zero_experts``): pairs with an id >= E are left out of the GEMMs and add ``weight * x`` (fp32) instead
(``zero_experts.zero_term``). Expert capacity (``spec.has_capacity``): the routing drops the pairs past capacity
(id -1), and no GEMM sees them.
Routing (``ops/cpu_route.py``: the router's own input / prefix, hash routing, capacity, gammas, expert_scale), the
activations (``ops/cpu_act.py``), the shared experts (``ops/cpu_shared.py``) and the norms (``ops/norms.py``) are the
op's own torch code, written apart from the oracle (``moecomp.oracle.reference``) that the tests compare this path with.
Latent experts (``spec.latent_size``): the experts run on ``latent_in(x)`` and their combined output, rounded to x's
dtype, goes through ``latent_out`` before the shared experts are added (``ops/latent.py``). Norms
(``spec.latent_norm`` / ``expert_norm``): on the latent input and on each pair's output row.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..core import policy
from ..core import quant as q8
from ..core.spec import MoESpec
from . import cpu_act, cpu_route, cpu_shared, latent, norms, w4_layout
from .backend import Routed
from .common import split_fused_gate
from .zero_experts import zero_term

_CHUNK_BYTES = 256 << 20  # gathered-weight fallback: at most this much weight copy in flight


@functools.lru_cache(maxsize=None)
def _grouped_mm_ok(device_type: str, dtype: torch.dtype) -> bool:
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        return False
    try:
        a = torch.ones(3, 8, dtype=dtype, device=device_type)
        w = torch.ones(2, 8, 8, dtype=dtype, device=device_type)
        y = fn(a, w, offs=torch.tensor([1, 3], dtype=torch.int32, device=device_type))
        return bool((y == 8).all())
    except Exception:
        return False


def _aligned(t: torch.Tensor) -> bool:
    """What grouped_mm accepts: 16-byte aligned storage; of the matrix dims (the last two) one with stride 1 and the
    other's stride at least that dim's extent and a multiple of 16 bytes; batch strides multiples of 16 bytes.
    (Exempting every unit stride was not enough: a [1, 1] matrix has two, and grouped_mm refuses it.)"""
    es = t.element_size()
    if t.data_ptr() % 16 or t.dim() < 2:
        return False
    s, n = t.stride(), t.shape
    if s[-2] == 1 and s[-1] >= max(1, n[-2]):
        lead = s[-1]
    elif s[-1] == 1 and s[-2] >= max(1, n[-1]):
        lead = s[-2]
    else:
        return False
    return (lead * es) % 16 == 0 and all((st * es) % 16 == 0 for st in s[:-2])


def _in_out(w: torch.Tensor, layout: str) -> torch.Tensor:
    """Per-expert matrices as [E, in, out] (a view, no copy)."""
    return w.transpose(-2, -1) if layout == "out_in" else w


def grouped_linear(xs: torch.Tensor, w_in_out: torch.Tensor, offs: torch.Tensor, sorted_ids: torch.Tensor):
    """xs [P, in] sorted by expert; w [E, in, out]; offs [E] cumulative row counts -> [P, out]."""
    if xs.shape[0] == 0:
        return xs.new_empty(0, w_in_out.shape[-1])
    if _grouped_mm_ok(xs.device.type, xs.dtype) and _aligned(xs) and _aligned(w_in_out):
        return F.grouped_mm(xs, w_in_out, offs=offs)
    out = xs.new_empty(xs.shape[0], w_in_out.shape[-1])
    per_row = w_in_out[0].numel() * w_in_out.element_size()
    step = max(1, min(_CHUNK_BYTES, policy.working_bytes() // 2) // per_row)
    for s in range(0, xs.shape[0], step):  # bounded chunks of rows, not a loop over experts
        e = sorted_ids[s : s + step]
        out[s : s + step] = torch.bmm(xs[s : s + step, None, :], w_in_out[e]).squeeze(1)
    return out


def _gate(h: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """The first GEMM's rows h [P, 2I] (or [P, I]) -> the activation [P, I] (``ops/cpu_act.py``)."""
    return cpu_act.act_of(h, spec, spec.intermediate_size)


def _fake_quant_rows(xs: torch.Tensor, qs, static, sorted_ids) -> torch.Tensor:
    """Rows of GEMM input [P, K] as the quantized GEMM sees them (fp32): per token group ("dynamic"), with each
    row's expert's scale ("static"), or as they are ("none")."""
    if qs.activation == "static":
        s = static.float()[sorted_ids][:, None]  # [P, 1]
        inv = torch.ones((), device=xs.device) / s
        return (xs.float() * inv).clamp(-q8.FP8_MAX, q8.FP8_MAX).to(q8.FP8).float() * s
    return q8.fake_quant_act(xs, qs)


def _experts_quantized(x, topk_ids, topk_weights, args: dict, spec: MoESpec) -> torch.Tensor:
    """Quantized routed experts: each weight dequantized for the call (fp32, not kept), GEMM inputs quantized as
    the spec says; the intermediate activation rounded to x's dtype first, as the CUDA kernels store it. Only the
    experts the call routes to are dequantized, a chunk of them at a time (``policy.expert_chunks``): never the
    whole stack at once."""
    qs = spec.quant
    k = topk_ids.shape[1]
    sorted_ids, order, offs = _sorted_pairs(topk_ids, spec)
    tok = order // k
    w = topk_weights.reshape(-1)[order, None].float()  # [P, 1] in sorted order
    xs = x[tok].float() * w if spec.weight_on_input else x[tok]
    gated = 2 if spec.gated else 1
    h = _dequantized_linear(_fake_quant_rows(xs, qs, args.get("a13_scale"), sorted_ids), args, "w13", gated,
                            sorted_ids, offs, spec)
    if args.get("b13") is not None:
        h = h + args["b13"][sorted_ids].float()
    h = _gate(h, spec).to(x.dtype)
    y = _dequantized_linear(_fake_quant_rows(h, qs, args.get("a2_scale"), sorted_ids), args, "w2", 1, sorted_ids,
                            offs, spec)
    if args.get("b2") is not None:
        y = y + args["b2"][sorted_ids].float()
    if not spec.weight_on_input:
        y = y * w
    return _combine(x, topk_ids, topk_weights, tok, y, spec)


def _dequantized_linear(xs: torch.Tensor, args: dict, name: str, halves: int, sorted_ids: torch.Tensor,
                        offs: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """xs [P, in] (sorted by expert) times each row's expert's weight ``name`` dequantized -> fp32 [P, out]: the
    experts hit, a chunk at a time (each chunk's weights dequantized, used, freed; 4-bit weights held in the mma
    layout read back to packed bytes per chunk: ``w4_layout.unpack``)."""
    q, scale, zero = args[name], args[f"{name}_scale"], args.get(f"{name}_zero")
    rows, cols = q.shape[-2], q.shape[-1] * (2 if spec.quant.packed else 1)
    out = torch.empty(xs.shape[0], rows, dtype=torch.float32, device=xs.device)
    if xs.shape[0] == 0:
        return out
    hit = torch.unique_consecutive(sorted_ids)
    ends = offs.long()[hit]
    counts = torch.bincount(sorted_ids, minlength=spec.num_experts)[hit]
    starts, ends_l = (ends - counts).tolist(), ends.tolist()
    for c0, c1 in policy.expert_chunks(len(starts), rows * cols * 4):
        ids = hit[c0:c1]
        qc, qs = w4_layout.unpack(q[ids], spec.quant)  # (the mma layout: this chunk's packed bytes, a copy)
        w = q8.dequantize(qc, scale[ids], qs, halves, None if zero is None else zero[ids])  # [c, out, in]
        r0, r1 = starts[c0], ends_l[c1 - 1]
        local = torch.cumsum(counts[c0:c1], 0).to(torch.int32)
        out[r0:r1] = grouped_linear(xs[r0:r1], w.transpose(-2, -1), local, torch.searchsorted(
            ids, sorted_ids[r0:r1]))
        del w
    return out


def _sorted_pairs(topk_ids: torch.Tensor, spec: MoESpec):
    """(expert of each sorted pair [P'], pair index of each [P'], cumulative rows per expert [E] int32): the pairs
    sorted by expert, stable; without the zero experts' pairs (ids >= E, ``spec.zero_experts``) and the pairs an
    expert capacity dropped (id -1): P' <= P."""
    flat_ids = topk_ids.reshape(-1).long()
    real = None  # [P']: the pairs an expert computes
    if spec.zero_experts:
        real = torch.nonzero(flat_ids < spec.num_experts).squeeze(1)
    elif spec.has_capacity:
        real = torch.nonzero(flat_ids >= 0).squeeze(1)
    sorted_ids, order = torch.sort(flat_ids if real is None else flat_ids[real], stable=True)
    if real is not None:
        order = real[order]
    counts = torch.bincount(sorted_ids, minlength=spec.num_experts)
    return sorted_ids, order, torch.cumsum(counts, 0).to(torch.int32)


def _combine(x, topk_ids, topk_weights, tok, y, spec: MoESpec) -> torch.Tensor:
    """fp32 [T, H]: the pairs' outputs y [P', H] summed into their tokens ``tok`` [P'], plus the zero experts'
    ``weight * x``."""
    if spec.zero_experts:
        out = zero_term(x, topk_ids, topk_weights, spec)
    else:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out


def experts_fp32(x, topk_ids, topk_weights, args: dict, spec: MoESpec) -> torch.Tensor:
    """Routed experts, x [T, H] -> fp32 [T, H]. ``spec.weight_on_input``: the gathered rows are scaled by their
    pair's weight (fp32 product, rounded to x's dtype for the GEMM) and the outputs are summed unweighted.
    ``spec.zero_experts``: pairs of ids >= E skip the GEMMs and add weight * x."""
    if spec.quant is not None:
        return _experts_quantized(x, topk_ids, topk_weights, args, spec)
    k = topk_ids.shape[1]
    sorted_ids, order, offs = _sorted_pairs(topk_ids, spec)  # [P], [P], [E]
    tok = order // k
    w = topk_weights.reshape(-1)[order, None].float()  # [P, 1]
    xs = (x[tok].float() * w).to(x.dtype) if spec.weight_on_input else x[tok]  # [P, H]
    h = grouped_linear(xs, _in_out(args["w13"], spec.w_layout), offs, sorted_ids)  # [P, N]
    if args.get("b13") is not None:
        h = h + args["b13"][sorted_ids]
    h = _gate(h.float(), spec).to(x.dtype)  # [P, I]
    y = grouped_linear(h, _in_out(args["w2"], spec.w_layout), offs, sorted_ids).float()  # [P, H]
    if args.get("b2") is not None:
        y = y + args["b2"][sorted_ids].float()
    y = norms.expert_norm(y, args, spec, x.dtype, sorted_ids)  # spec.expert_norm: each pair's row, before its weight
    if not spec.weight_on_input:
        y = y * w
    return _combine(x, topk_ids, topk_weights, tok, y, spec)


def moe_experts(x, topk_ids, topk_weights, args: dict, spec: MoESpec) -> torch.Tensor:
    return experts_fp32(x, topk_ids, topk_weights, args, spec).to(x.dtype)


def route_all(x2: torch.Tensor, args: dict, spec: MoESpec, shape) -> Routed:
    """The op's routing of x2 [T, H] (``args`` as the op takes them; ``shape``: x's, for the capacity's groups):
    ``cpu_route.route_all`` (ids int64, capacity-dropped pairs -1; ``Backend.route_all``)."""
    return cpu_route.route_all(x2, split_fused_gate(args, spec), spec, shape)


def shared_part(x2: torch.Tensor, args: dict, spec: MoESpec, routed: Routed) -> torch.Tensor:
    """The shared experts' sum on x2 [T, H] -> fp32 [T, H], gated, scaled, times ``routed.gammas``
    (``Backend.shared_part``; ``ops/cpu_shared.py``)."""
    return cpu_shared.shared_part(x2, split_fused_gate(args, spec), spec, routed.gammas)


def moe_forward(x: torch.Tensor, args: dict, spec: MoESpec) -> torch.Tensor:
    args = split_fused_gate(args, spec)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r = cpu_route.route_all(x2, args, spec, shape)
    if spec.latent_size:  # the experts between the two projections, in x's dtype at each projection
        xl = latent.project_in(x2, args, spec)  # [T, L] (normalised: spec.latent_norm)
        routed = experts_fp32(xl, r.ids, r.weights, args, spec.experts_spec()).to(x.dtype)  # [T, L]
        out = latent.project_out(routed, args).float()  # [T, H]
    else:
        out = experts_fp32(x2, r.ids, r.weights, args, spec)  # [T, H] fp32
    if spec.shared is not None:
        out += cpu_shared.shared_part(x2, args, spec, r.gammas)
    return out.to(x.dtype).reshape(shape)
