"""A bound block's op call while a routing session is active (``core/replay.py``; ``moecomp.replay_routing`` /
``moecomp.record_routing`` on an optimized model): the session's ids passed as ``routes_in`` (replay), or the ids
the op chose recorded in an int32 buffer the routing kernel writes (``moe_forward_routes``: no extra launch). A
block holding a shard of its experts (``moecomp.shard_experts``) calls the parallel op the same way (``parallel/op.py``:
its ids are global expert ids, routed on every rank before the exchange)."""

from __future__ import annotations

import torch

from ..core import replay
from ..ops.moe_op import call_moe_forward
from ..parallel.op import call as call_parallel


def handle(block):
    """The active session's handle for ``block``, or None (no session, or the block is not part of it)."""
    s = replay.session()
    return None if s is None else s.get(block)


def routed_call(h, x_op: torch.Tensor, x: torch.Tensor, tensors, spec):
    """``call_moe_forward`` (sharded experts, ``spec.parallel``: ``parallel.op.call``) with the session's routes:
    replayed ids in, or the op's ids recorded (``h.store``). ``x_op``: the op's input; ``x``: the block's input (its
    shape names batch and tokens)."""
    run = call_moe_forward if spec.parallel is None else call_parallel
    ids = h.ids(x)
    if ids is not None:
        return run(x_op, tensors, spec, routes_in=ids)
    buf = torch.empty(x_op.numel() // x_op.shape[-1], spec.top_k, dtype=torch.int32, device=x_op.device)
    y = run(x_op, tensors, spec, routes_out=buf)
    h.store(buf, x)
    return y
