"""The attribute reader's error type and its op-argument bindings (split from ``fallback.py``): every ``OP_ARGS``
name -> the block-relative path of the tensor the op reads for it (router, experts, shared experts, FP8 scales,
latent projections), or a :class:`moecomp.core.derived.Derived` built once from pieces (ModuleList experts stacked, split
gate / up concatenated). ``recognise/dispatch_reader.py`` binds its blocks the same way."""

from __future__ import annotations

from torch import nn

from ..core.derived import Derived
from ..ops.moe_op import OP_ARGS
from ..core.reject import Refused, RejectCode
from ..formats import fp8
from ..core.parts import BlockParts
from ..core.derived import get_path


class FallbackError(Refused):
    """The attribute reader cannot describe this block with a MoESpec (or the block fails a check): ``reason`` says
    why (text for the report), ``code`` (a :class:`moecomp.core.reject.RejectCode`) what kind of refusal it is."""


def quant(block: nn.Module, parts: BlockParts, b: dict):
    """(routed QuantSpec | None, shared QuantSpec | None) of FP8 weights (``formats/fp8.py``: e4m3 tensors with scales of
    the blocked shape); their scales' paths go into the bindings ``b``."""
    try:
        ex = fp8.experts_fp8(get_path(block, parts.experts), parts.experts) if parts.kind == "fused" else None
        quant = None
        if ex is not None:
            quant = ex.quant
            b.update({k: f"{parts.experts}.{n}" for k, n in ex.names().items()})
        elif any(fp8.is_fp8(t) for t in get_path(block, parts.experts).parameters()):
            raise FallbackError("FP8 expert weights in a layout moecomp does not read", RejectCode.UNSUPPORTED_STRUCTURE)
        sp, sq = parts.shared, None
        if sp is not None:
            found = {}
            for k, w in (("shared_w1", sp.gate if sp.gated else None), ("shared_w3", sp.up), ("shared_w2", sp.down)):
                if w is not None:
                    mpath = w.rsplit(".", 1)[0]
                    found[k] = (mpath, fp8.linear_fp8(get_path(block, mpath), mpath))
            qs = {None if lq is None else lq.quant for _, lq in found.values()}
            if len(qs) != 1:
                raise FallbackError("shared expert linears quantized differently (or only some)",
                                    RejectCode.UNSUPPORTED_STRUCTURE)
            sq = qs.pop()
            if sq is not None:
                b.update({f"{k}_scale": f"{mpath}.{lq.scale}" for k, (mpath, lq) in found.items()})
    except fp8.FP8LayoutError as e:
        raise FallbackError(str(e), RejectCode.SPEC_INVALID) from None
    return quant, sq


def bindings(block: nn.Module, parts: BlockParts) -> tuple[dict[str, str | None], list[Derived]]:
    b: dict[str, str | None] = dict.fromkeys(OP_ARGS)
    derived: list[Derived] = []
    b["router_w"] = parts.router_weight
    b["router_b"] = parts.router_bias
    b["correction_bias"] = parts.correction_bias
    if parts.kind == "fused":
        b["w13"], b["w2"], b["b13"], b["b2"] = parts.w13, parts.w2, parts.b13, parts.b2
        if parts.split_gate_up is not None:
            # [E, I, H] gate and up -> [E, 2I, H] (out_in) or [E, H, I] -> [E, H, 2I] (in_out), built once
            derived.append(Derived("_moecomp_w13", [list(parts.split_gate_up)], kind="cat",
                                   dim=1 if parts.w_layout == "out_in" else 2))
            b["w13"] = "_moecomp_w13"
    else:
        mlps = parts.expert_mlps
        if mlps[0].gated:
            if mlps[0].concat:
                w13 = [[m.gate] for m in mlps]
            else:
                w13 = [[m.gate, m.up] for m in mlps]
        else:
            w13 = [[m.up] for m in mlps]
        derived.append(Derived("_moecomp_w13", w13))
        derived.append(Derived("_moecomp_w2", [[m.down] for m in mlps]))
        b["w13"], b["w2"] = "_moecomp_w13", "_moecomp_w2"
        p0, separate = mlps[0], mlps[0].gated and not mlps[0].concat
        if separate and (p0.gate_bias is None) != (p0.up_bias is None):
            raise FallbackError("expert MLPs have a bias on only one of gate / up")
        if (p0.gate_bias if p0.gated else p0.up_bias) is not None:  # the first GEMM's bias (MoESpec.expert_bias)
            b13 = [[m.gate_bias, m.up_bias] if separate else [m.gate_bias if m.gated else m.up_bias] for m in mlps]
            derived.append(Derived("_moecomp_b13", b13))
            b["b13"] = "_moecomp_b13"
        if p0.down_bias is not None:
            derived.append(Derived("_moecomp_b2", [[m.down_bias] for m in mlps]))
            b["b2"] = "_moecomp_b2"
    sp = parts.shared
    if sp is not None:
        if sp.gated:
            b["shared_w1"] = sp.gate
            b["shared_w3"] = sp.up  # None when concat
        else:
            b["shared_w3"] = sp.up
        b["shared_w2"] = sp.down
        b["shared_gate_w"] = parts.shared_gate
    b.update(parts.latent_bindings())
    return b, derived
