"""Epilogues: what a block applies last to the MoE output, found by running it.

    a child module     AXK1's ``return self.post_mlp_layernorm(h)``             bound as  child(moe_forward(x))
    an output bias     JetMoE's ``return layer_output + self.bias`` ([H], or   bound as  moe_forward(x) + bias
                       [1, .., 1, H]: the block's own tensor)

Found by running the block (:func:`find_epilogue`, :func:`find_output_bias`), peeled off while the MoE part is
recognised and verified (:class:`Peeled` puts ``nn.Identity`` in a child's place, zeroes a bias: the FX pass sees
the add of zeros as the identity it then is), then bound as above (``match.apply_epilogue``) and checked whole
(:func:`moecomp.verify.verify.verify_epilogue`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import policy
from ..core.derived import get_path
from ..core.args import PEELED
from ..core.match import is_tensor_entry
from ..core.parts import BlockParts
from ..probe.block import primary
from ..core.reject import raise_if_oom


def block_device_dtype(block: nn.Module, parts: BlockParts):
    """Device and dtype of the block's expert weights (its probes are made there). FP8 or packed 4-bit (uint8) expert
    weights: the dtype of the router weight, the block's compute dtype (activations are never fp8 between layers)."""
    if parts.w13:
        t = get_path(block, parts.w13)
    elif parts.expert_mlps:
        t = get_path(block, parts.expert_mlps[0].down)
    else:  # structural parts: the experts child's first floating tensor
        ex = get_path(block, parts.experts)
        t = next(p for p in list(ex.parameters()) + list(ex.buffers()) if p.is_floating_point())
    if t.dtype in (torch.float8_e4m3fn, torch.uint8):
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
    except Exception as e:
        raise_if_oom(e)
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


def _bias_shaped(t, H: int, dims: int) -> bool:
    """A floating tensor that broadcasts to an output of ``dims`` dims as one value per feature: [H], [1, H],
    [1, 1, H], ... (no more dims than the output)."""
    return (t is not None and t.is_floating_point() and 1 <= t.dim() <= dims and t.shape[-1] == H
            and all(d == 1 for d in t.shape[:-1]))


def find_output_bias(block: nn.Module, parts: BlockParts, x: torch.Tensor) -> list[str]:
    """[name] of the block's own tensor of one value per feature ([H], or [1, ..., 1, H]; parameter or buffer) that
    nothing in ``parts`` names and that the block adds to its output: raising it by d raises the output by d (on a
    random d, within the verify tolerance), [] if none."""
    H = x.shape[-1]
    named = {v for v in vars(parts).values() if isinstance(v, str)}
    cands = [n for n, t in list(block._parameters.items()) + list(block._buffers.items())
             if _bias_shaped(t, H, x.dim()) and n not in named]
    if not cands:
        return []
    g = torch.Generator(device=x.device).manual_seed(policy.EPILOGUE_PROBE_SEED)
    with torch.no_grad():
        base = primary(block(x))
        if not isinstance(base, torch.Tensor) or base.shape[-1] != H:
            return []
        for n in cands:
            t = getattr(block, n)
            d = torch.randn(H, generator=g, device=x.device).to(t.dtype).reshape(t.shape)
            saved = t.detach().clone()
            try:
                t.add_(d)
                moved = primary(block(x)) - base
            finally:
                t.copy_(saved)
            want = d.to(moved.dtype).expand_as(moved)
            if float((moved - want).norm() / want.norm()) <= policy.verify_tolerance(x.dtype, None):
                return [n]
    return []


class Peeled:
    """Context manager: the named children of ``block`` are ``nn.Identity`` inside it, the named tensors (output
    biases) are zeros (their values restored on exit, also after an error)."""

    def __init__(self, block: nn.Module, names):
        self.block, self.names, self.saved, self.values = block, list(names), {}, {}

    def __enter__(self):
        for n in self.names:
            if is_tensor_entry(self.block, n):
                t = getattr(self.block, n)
                with torch.no_grad():
                    self.values[n] = t.detach().clone()
                    t.zero_()
                setattr(t, PEELED, True)  # the capture's tail check takes its add as the identity
            else:
                self.saved[n] = self.block._modules[n]
                self.block._modules[n] = nn.Identity()
        return self

    def __exit__(self, *exc):
        for n, m in self.saved.items():
            self.block._modules[n] = m
        with torch.no_grad():
            for n, v in self.values.items():
                t = getattr(self.block, n)
                t.copy_(v)
                delattr(t, PEELED)
        return False


def epilogue_of(block: nn.Module, parts: BlockParts) -> list[str]:
    """``find_epilogue``, else ``find_output_bias``, on the check input; [] when there is neither or running the
    block fails."""
    has_tensors = any(_bias_shaped(t, parts.hidden_size, 8) for t in list(block._parameters.values())
                      + list(block._buffers.values()))
    if not (parts.extra_modules or has_tensors):
        return []
    device, dtype = block_device_dtype(block, parts)
    x = policy.probe_input(parts.hidden_size, device, dtype)
    try:
        return (find_epilogue(block, parts, x) if parts.extra_modules else []) or \
            (find_output_bias(block, parts, x) if has_tensors else [])
    except Exception as e:
        raise_if_oom(e)
        return []
