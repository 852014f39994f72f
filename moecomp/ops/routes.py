"""Routing record and replay in the op (issue 43): ``moe_forward``'s last argument ``routes_in`` and the recording
op ``moe_forward_routes(routes_out, route_weights_out, <moe_forward's arguments>)`` (``ops/moe_op.py`` says why a
second op).

    routes_out         int32 [T, k], caller-owned, written: each token's expert ids, the ids the op used, in its
                       slot order (T = the tokens of x, its leading dims flattened; k = spec.top_k)
    route_weights_out  float32 [T, k] or None, caller-owned, written: the combine weights the op used at those ids
    routes_in          int32 or int64 [T, k] or None: the ids to use instead of the op's own selection (replay)

Both outputs are declared mutated by moe_forward_routes. Every row of x is routed and written (the op has no notion of
padding: a padding token's row holds what the router chose for it; marking padding is the caller's business). With an
expert capacity (``spec.has_capacity``) ``routes_out`` holds the selection before the drop (every slot a real id;
replaying it drops the same pairs again, the drop being a function of the ids) and ``route_weights_out`` 0 at the
dropped pairs. With ``routes_in`` given, ``routes_out`` receives those ids (clamped, on CUDA: below).

Replay's weights are the router's scores at the given ids, renormalised and scaled as the spec says (score function,
renormalize, routed_scaling_factor, expert_scale, weight_scale, the shared gammas' joint denominator, rounding), with
``topk_then_score`` the score of the k given logits; the correction bias and the group limits only select, so they
play no part. Sparsemixer and hash routing refuse replay (``refusal``).

Checks (``check``): SpecError (a ValueError) naming the argument, for a wrong dtype, shape or device, on every entry
point (fake kernels too); the values of ``routes_in`` on CPU only (``check_values``): on CUDA reading them is a host
sync, so the paths clamp each id into [0, router_width - 1] instead (memory safety: a wrong id gives a wrong
expert, never an out-of-bounds read).

Off by default: moe_forward without routes_in runs nothing of this (the kernel compiles without it).
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec, SpecError

ROUTE_ARGS = ("routes_out", "route_weights_out", "routes_in")
OUTS = ("routes_out", "route_weights_out")
_IN_DTYPES = (torch.int32, torch.int64)


def refusal(spec: MoESpec) -> str | None:
    """Why replay is not meaningful for this spec (None where it is)."""
    if spec.score_order == "sparsemixer":
        return "sparsemixer routing (PhiMoE), whose weights are rounds over the experts its own picks left free"
    if spec.hash_routing:
        return "hash routing, whose ids are hash_table[token_ids] and not a choice from the router's scores"
    return None


def _tokens(x: torch.Tensor):
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def _wrong_shape(t: torch.Tensor, T, k: int, symbolic: bool) -> bool:
    if t.dim() != 2:
        return True
    return any((not symbolic or (type(a) is int and type(b) is int)) and a != b for a, b in zip(t.shape, (T, k)))


def check(x: torch.Tensor, args: dict, spec: MoESpec, symbolic: bool = False) -> None:
    """SpecError unless the given routing arguments fit x and the spec: device, dtype, shape [T, k]; replay refused
    for specs where it is not meaningful (``refusal``)."""
    T, k = _tokens(x), spec.top_k
    want = {"routes_out": ((torch.int32,), "torch.int32"), "route_weights_out": ((torch.float32,), "torch.float32"),
            "routes_in": (_IN_DTYPES, "torch.int32 or torch.int64")}
    for name in ROUTE_ARGS:
        t = args.get(name)
        if t is None:
            continue
        if name == "routes_in" and refusal(spec) is not None:
            raise SpecError(f"routes_in was given, but replaying routes is not meaningful for {refusal(spec)}; "
                            f"expected None ({spec.describe()})")
        dtypes, words = want[name]
        if t.dtype not in dtypes:
            raise SpecError(f"{name} has dtype {t.dtype}; expected {words}")
        if t.device != x.device:
            raise SpecError(f"{name} is on {t.device}; expected {x.device}, the device of x (hidden_states)")
        if _wrong_shape(t, T, k, symbolic):
            raise SpecError(f"{name} has shape {tuple(t.shape)}; expected [T={T}, top_k={k}] (T = the tokens of x "
                            f"{tuple(x.shape)}, its leading dims flattened)")


def check_values(routes_in: torch.Tensor | None, spec: MoESpec) -> None:
    """SpecError unless every replayed id is in [0, router_width) (CPU only: on CUDA the paths clamp instead)."""
    if routes_in is None or routes_in.is_cuda or routes_in.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(routes_in))
    if lo < 0 or hi >= spec.router_width:
        zero = f" + zero_experts={spec.zero_experts}" if spec.zero_experts else ""
        raise SpecError(f"routes_in holds ids in [{lo}, {hi}]; expected every id in [0, num_experts="
                        f"{spec.num_experts}{zero})")


def given(args: dict, spec: MoESpec) -> torch.Tensor | None:
    """The replayed ids as int64 [T, k], clamped into [0, router_width - 1] (a no-op for checked ids), or None."""
    r = args.get("routes_in")
    return None if r is None else r.long().clamp(0, spec.router_width - 1)


def record(args: dict, ids: torch.Tensor | None, weights: torch.Tensor | None) -> None:
    """Copy ids / weights into the caller's buffers where given (the torch path; the Triton path writes them in the
    routing kernel)."""
    out, wout = args.get("routes_out"), args.get("route_weights_out")
    if out is not None and ids is not None:
        out.copy_(ids)
    if wout is not None and weights is not None:
        wout.copy_(weights)


def kernel_kwargs(args: dict, weights: bool = True) -> dict:
    """The routing kernel's arguments for record / replay (``kernels/routing.py``: GIVEN, REC_IDS, REC_W), {} when
    none is given (the kernel then compiles without them). ``weights`` False: the weights are recorded after the
    kernel (an expert capacity's drop, ``ops/capacity.py``)."""
    kw = {}
    g, out, wout = args.get("routes_in"), args.get("routes_out"), args.get("route_weights_out")
    if g is not None:
        kw.update(given_ptr=g, stride_gt=g.stride(0), stride_gk=g.stride(1), GIVEN=True)
    if out is not None:
        kw.update(rec_ids_ptr=out, stride_rt=out.stride(0), stride_rk=out.stride(1), REC_IDS=True)
    if wout is not None and weights:
        kw.update(rec_w_ptr=wout, stride_wt=wout.stride(0), stride_wk=wout.stride(1), REC_W=True)
    return kw
