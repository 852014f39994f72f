"""``MoESpec.hash_routing`` in the op (DeepSeek-V4's ``hash_moe`` layers): the expert ids are a frozen table's rows,
``hash_table[token_ids]`` [T, k], and the weights the router's scores at those ids (then renormalised and scaled
as the spec says: ``moecomp.oracle.reference.route`` with the ids given).

Arguments (``HASH_ARGS``, after the scales): ``hash_table`` [V, k] integer (k = top_k, V >= 1) and ``token_ids``
integer with one id per token of x (any shape of T elements: [B, S] beside x [B, S, H], or [T]); both on x's device.
Without ``spec.hash_routing`` both must be None.

Values. A token id outside [0, V) or a table entry outside [0, E) would index past the table or the weights:

* ``check_values`` raises a SpecError naming the argument where the op can read the values: always on CPU; on CUDA
  (one host sync) only outside CUDA-graph capture and compilation, and not with ``MOECOMP_CHECK_IDS=0`` (as for
  moe_experts' ids). A bound block checks its table once at bind time (``check_table``).
* every path clamps on every call, so that what cannot be checked is still memory-safe: token ids into [0, V - 1],
  the looked-up ids into [0, E - 1] (``lookup`` on the torch path; the routing kernel's HASH branch on the Triton
  path, ``kernels/routing.py``). A clamped value gives a wrong expert, never an out-of-bounds read or write.
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec, SpecError
from .common import check_ids_wanted as _check_ids_wanted

_INT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _tokens(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def check_args(x: torch.Tensor, table, token_ids, spec: MoESpec, symbolic: bool = False) -> None:
    """SpecError unless (``hash_table``, ``token_ids``) fit ``spec`` and x: presence, integer dtype, device, shape
    (``symbolic``: sizes that are SymInts are left to the run-time check)."""
    if not spec.hash_routing:
        for name, t in (("hash_table", table), ("token_ids", token_ids)):
            if t is not None:
                raise SpecError(f"{name} was given but the spec has no hash routing (hash_routing=False); expected "
                                f"None ({spec.describe()})")
        return
    k = spec.top_k
    for name, t, want in (("hash_table", table, f"[V, top_k={k}]"), ("token_ids", token_ids, "one per token of x")):
        if t is None:
            raise SpecError(f"{name} is required by the spec (hash_routing) but was None; expected an integer tensor "
                            f"{want}")
        if t.dtype not in _INT:
            raise SpecError(f"{name} has dtype {t.dtype}; expected an integer dtype (int64 or int32)")
        if t.device != x.device:
            raise SpecError(f"{name} is on {t.device}; expected {x.device}, the device of x (hidden_states)")
    if table.dim() != 2 or (type(table.shape[1]) is int and table.shape[1] != k) or (
            type(table.shape[0]) is int and table.shape[0] < 1):
        raise SpecError(f"hash_table has shape {tuple(table.shape)}; expected 2-D [V >= 1, top_k={k}]")
    n, T = token_ids.numel(), _tokens(x)
    if not symbolic or (type(n) is int and type(T) is int):
        if n != T:
            raise SpecError(f"token_ids has shape {tuple(token_ids.shape)} ({n} ids); expected one id per token of x "
                            f"{tuple(x.shape)} ({T} tokens)")


def check_table(table: torch.Tensor, spec: MoESpec) -> None:
    """SpecError unless every entry of ``hash_table`` is in [0, num_experts) (the whole table: a bind-time check)."""
    if table.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(table.long())).tolist())
    if lo < 0 or hi >= spec.num_experts:
        raise SpecError(f"hash_table holds expert ids in [{lo}, {hi}]; expected every id in [0, "
                        f"num_experts={spec.num_experts})")


def check_values(table: torch.Tensor, token_ids: torch.Tensor, spec: MoESpec) -> None:
    """SpecError unless every token id is in [0, V) and every table row they select holds ids in [0, E) (read where
    ``_check_ids_wanted`` allows: see the module docstring). One device-to-host read on CUDA."""
    if token_ids.numel() == 0 or not _check_ids_wanted(token_ids):
        return
    V = table.shape[0]
    tok = token_ids.reshape(-1).long()
    picked = table[tok.clamp(0, V - 1)].long()  # [T, k] (clamped: the check itself must not read out of bounds)
    t_lo, t_hi, p_lo, p_hi = torch.stack([*torch.aminmax(tok), *torch.aminmax(picked)]).tolist()
    if t_lo < 0 or t_hi >= V:
        raise SpecError(f"token_ids holds ids in [{t_lo}, {t_hi}]; expected every id in [0, V={V}) (the rows of "
                        f"hash_table)")
    if p_lo < 0 or p_hi >= spec.num_experts:
        raise SpecError(f"hash_table rows of these tokens hold expert ids in [{p_lo}, {p_hi}]; expected every id in "
                        f"[0, num_experts={spec.num_experts})")


def lookup(table: torch.Tensor, token_ids: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """ids [T, k] int64 = hash_table[token_ids], token ids clamped into [0, V - 1] and the ids into [0, E - 1] (the
    torch path's memory safety; the values were checked before where they could be)."""
    tok = token_ids.reshape(-1).long().clamp(0, table.shape[0] - 1)
    return table[tok].long().clamp(0, spec.num_experts - 1)


def route_kwargs(spec: MoESpec, args: dict) -> dict:
    """Extra launch arguments of route_topk_kernel: {} unless ``spec.hash_routing``; then the table, its row stride,
    V and the token ids (unit stride)."""
    if not spec.hash_routing:
        return {}
    if args.get("hash_table") is None or args.get("token_ids") is None:
        raise ValueError("the routing kernel of a hash_routing spec needs hash_table and token_ids (hashed=...)")
    table, tok = args["hash_table"], args["token_ids"].reshape(-1)
    if tok.numel() > 1 and tok.stride(0) != 1:
        tok = tok.contiguous()
    if table.stride(1) != 1 and table.shape[1] > 1:
        table = table.contiguous()
    return dict(HASH=True, table_ptr=table, tok_ptr=tok, n_vocab=table.shape[0], stride_table=table.stride(0))
