"""A rank's shard of the block's whole expert tensors (``ParallelSpec``): what ``shard_experts`` keeps, and what a
loader that reads only its shard must produce (the parallel path checks these shapes: ``local.check_shards``).

    EP, experts [a, b):   every tensor with a leading E: t[a:b]      (w13, b13, w2, b2, scales, zeros, a13 / a2)
    replicated:           every tensor whole (a copy)
    TP, columns s = [lo, hi) of I (in the experts' own layout):
        w13  out_in [E, N, H] rows / in_out [E, H, N] columns: concat gate | up -> gate[s] | up[s]; interleaved
             -> rows 2lo .. 2hi; not gated -> s; b13 [E, N] the same
        w2   out_in [E, H, I] columns s (4-bit: bytes lo / 2 .. hi / 2) / in_out [E, I, H] rows s; b2 whole
        scales and zeros with w13's rows: "block" gate / up blocks lo / block_n .. hi / block_n; "channel" / "group"
             the rows as w13's; w2's: "block" / "group" columns lo / block_k .. hi / block_k; "channel", "tensor",
             static activation scales: whole
    (the spec checks that s cuts whole scale blocks: ``spec_parallel._check_tp_quant``)

Every shard is a fresh contiguous tensor (its own storage), so dropping the whole tensor frees it.
"""

from __future__ import annotations

import torch

from ..core.spec import MoESpec, SpecError
from .local import SHARD_ARGS


def shard_tensors(args: dict, spec: MoESpec) -> dict:
    """{name: this rank's shard} for the shard tensors in ``args`` (whole tensors), per ``spec.parallel``."""
    p = spec.parallel
    if p is None:
        raise SpecError("shard_tensors needs a spec with a parallel part (MoESpec.parallel)")
    out = {}
    for name in SHARD_ARGS:
        t = args.get(name)
        if t is None:
            continue
        if p.mode == "ep":
            out[name] = t[p.local_experts.start:p.local_experts.stop].contiguous().clone()
        elif p.mode == "replicated":
            out[name] = t.contiguous().clone()
        else:
            out[name] = _tp(name, t, spec).contiguous().clone()
    return out


def _halves(t: torch.Tensor, dim: int, lo: int, hi: int, half: int, gated: bool, gate_up: str) -> torch.Tensor:
    """Rows (or columns) of a gate | up tensor along ``dim``: [lo, hi) of each half (``half`` rows a half)."""
    if not gated:
        return t.narrow(dim, lo, hi - lo)
    if gate_up == "interleaved":
        return t.narrow(dim, 2 * lo, 2 * (hi - lo))
    return torch.cat([t.narrow(dim, lo, hi - lo), t.narrow(dim, half + lo, hi - lo)], dim)


def _tp(name: str, t: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    p, q = spec.parallel, spec.quant
    I, s = spec.intermediate_size, p.local_intermediate
    lo, hi = s.start, s.stop
    if name in ("b2", "a13_scale", "a2_scale"):
        return t
    if name in ("w13", "b13"):
        dim = 2 if (name == "w13" and spec.w_layout == "in_out") else 1
        return _halves(t, dim, lo, hi, I, spec.gated, spec.gate_up)
    if name == "w2":
        if spec.w_layout == "in_out":
            return t[:, lo:hi]
        return t[..., lo // 2:hi // 2] if q is not None and q.packed else t[..., lo:hi]
    # scales and zeros
    if q.scale == "tensor" or (name.startswith("w2") and q.scale == "channel"):
        return t
    if name.startswith("w13"):
        if q.scale == "block":
            if spec.gated and spec.gate_up == "interleaved":
                raise SpecError("parallel tp of block-scaled experts with interleaved gate / up rows is not "
                                "supported (the blocks mix gate and up rows)")
            bn = q.block_n
            return _halves(t, 1, lo // bn, hi // bn, t.shape[1] // 2 if spec.gated else 0, spec.gated, "concat")
        return _halves(t, 1, lo, hi, I, spec.gated, spec.gate_up)  # channel [E, N] / group [E, N, groups]: rows
    bk = q.block_k  # w2's block / group scales: columns of I
    return t[..., lo // bk:hi // bk]
