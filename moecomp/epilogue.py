"""Epilogues: a child module a block applies last to the MoE output (AXK1's ``return self.post_mlp_layernorm(h)``).

Found by running the block (:func:`find_epilogue`), peeled off while the MoE part is recognised and verified
(:class:`Peeled` puts ``nn.Identity`` in its place), then bound as ``epilogue(moe_forward(x))`` and checked whole
(:func:`moecomp.verify.verify` with ``epilogue``).
"""

from __future__ import annotations

import torch
from torch import nn

from . import policy
from .derived import get_path
from .hf.structure import BlockParts
from .probe import primary


def block_device_dtype(block: nn.Module, parts: BlockParts):
    """Device and dtype of the block's expert weights (its probes are made there). FP8 expert weights: the dtype of
    the router weight, the block's compute dtype (activations are never fp8 between layers)."""
    if parts.w13:
        t = get_path(block, parts.w13)
    elif parts.expert_mlps:
        t = get_path(block, parts.expert_mlps[0].down)
    else:  # structural parts: the experts child's first floating tensor
        ex = get_path(block, parts.experts)
        t = next(p for p in list(ex.parameters()) + list(ex.buffers()) if p.is_floating_point())
    if t.dtype == torch.float8_e4m3fn:
        r = get_path(block, parts.router_weight)
        return t.device, r.dtype if r.is_floating_point() and r.element_size() > 1 else torch.bfloat16
    return t.device, t.dtype


def find_epilogue(block: nn.Module, parts: BlockParts, x: torch.Tensor) -> list[str]:
    """Children the block applies last to its result (``return self.post_mlp_layernorm(h)``), seen by running it.

    A candidate is a parameterised child that nothing else explains (``parts.extra_modules``), called once on one
    [.., H] tensor, whose output *is* the block's output. It is peeled off (replaced by ``nn.Identity`` while the MoE
    part is detected) and applied after the op; the whole is then checked against the block.
    """
    cands = [n for n in parts.extra_modules if isinstance(block._modules.get(n), nn.Module)]
    if not cands:
        return []
    seen: dict = {}
    handles = []
    for n in cands:
        def hook(mod, args, out, _n=n):
            seen.setdefault(_n, []).append((args, out))
        handles.append(block._modules[n].register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = block(x)
    except Exception:
        return []
    finally:
        for h in handles:
            h.remove()
    prim = primary(out)
    if not isinstance(prim, torch.Tensor):
        return []
    for n, calls in seen.items():
        if len(calls) != 1:
            continue
        args, o = calls[0]
        if (len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].shape[-1] == x.shape[-1]
                and isinstance(o, torch.Tensor) and o.numel() == prim.numel() and torch.equal(o.reshape(prim.shape),
                                                                                             prim)):
            return [n]
    return []


class Peeled:
    """Context manager: the named children of ``block`` are ``nn.Identity`` inside it."""

    def __init__(self, block: nn.Module, names):
        self.block, self.names, self.saved = block, list(names), {}

    def __enter__(self):
        for n in self.names:
            self.saved[n] = self.block._modules[n]
            self.block._modules[n] = nn.Identity()
        return self

    def __exit__(self, *exc):
        for n, m in self.saved.items():
            self.block._modules[n] = m
        return False


def epilogue_of(block: nn.Module, parts: BlockParts) -> list[str]:
    """``_find_epilogue`` on the check input; [] when the block has no unexplained children or running it fails."""
    epilogue = []
    if parts.extra_modules:
        device, dtype = block_device_dtype(block, parts)
        try:
            epilogue = find_epilogue(block, parts, policy.probe_input(parts.hidden_size, device, dtype))
        except Exception:
            epilogue = []
    return epilogue
