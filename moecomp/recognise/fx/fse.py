"""fse: fused shared-expert gate. The router and the shared-expert gate read the same tokens; one GEMM does both.

Where it applies (after rewrite_moe, both linears live inside the op)::

    moe_forward(x, router_w [E,H], ..., shared_gate_w [1,H], spec{shared.gate="sigmoid"})
        =>
    moe_forward(x, cat([router_w, shared_gate_w]) [E+1,H], ..., shared_gate_w=None, spec{fused_shared_gate=True})

    inside the op:  logits_and_gate = x @ router_w.T   # [T, E+1]: one GEMM, one read of x
                    logits, gate    = logits_and_gate[:, :E], logits_and_gate[:, E:]

Decision: FSE is an op-level feature. Doing it in the graph (``linear(x, cat(W_r, W_g))`` then ``split``) would
only move two linears that no longer exist after the rewrite. So this pass changes the op's arguments: the op
implements the fused form (``MoESpec.fused_shared_gate``, ``"fused_shared_gate" in moecomp.ops.moe_op.FEATURES``).

The concatenation is a graph node (``torch.cat`` of two parameter placeholders, (E+1) x H elements per call), so
weight updates stay visible; Inductor constant-folds it when the model is frozen (``torch._inductor.config.freezing``).
When the router reads fp32 copies (``spec.router_fp32``) the gate is cast with it, as the unfused op does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...core.counters import counters
from ...ops.moe_op import MOE_ARGS
from ...core.spec import MoESpec

_ROUTER = 1 + MOE_ARGS.index("router_w")
_GATE = 1 + MOE_ARGS.index("shared_gate_w")
_SPEC = 1 + len(MOE_ARGS)


def fuse_shared_gate(gm: fx.GraphModule, *, count: bool = True) -> dict[str, int]:
    """Fuse the shared-gate GEMM into the router GEMM of every eligible moe_forward call.

    Returns ``{"fused": n}`` (empty when nothing is eligible); ``count`` adds it to ``moecomp.counters["fse"]``."""
    target = torch.ops.moecomp.moe_forward.default
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
    eligible = []
    for n in nodes:
        spec = MoESpec.from_key(n.args[_SPEC])
        if spec.can_fuse_shared_gate and n.args[_GATE] is not None:
            eligible.append((n, spec))
    if not eligible:
        return {}
    for n, spec in eligible:
        args = list(n.args)
        with gm.graph.inserting_before(n):
            gate = args[_GATE]
            router = args[_ROUTER]
            cat = gm.graph.call_function(torch.cat, ([router, gate], 0))
        args[_ROUTER] = cat
        args[_GATE] = None
        args[_SPEC] = spec.replace(fused_shared_gate=True).key
        n.args = tuple(args)
    gm.graph.lint()
    gm.recompile()
    if count:
        counters["fse"]["fused"] += len(eligible)
    return {"fused": len(eligible)}
