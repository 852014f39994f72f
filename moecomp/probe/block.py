"""One recorded call of a block's original forward: the probe the attribute recogniser measures and the verify
stage compares against (its input, output, and what the router and experts modules were called with).

Hash-routed blocks (``MoESpec.hash_routing``) also take the tokens' ids: :func:`hash_call_args` gives a Match's
probe ids (the forward argument its ``token_ids`` binding names, drawn in [0, rows of its table))."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..core import policy
from ..core.derived import get_path
from ..core.match import Contract, arg_name, reshape_to, shape_mode
from ..core.reject import Refused, RejectCode
from ..core.parts import BlockParts


@dataclass
class ProbeRun:
    """What one call of the original block forward did."""

    x: torch.Tensor
    output: object
    experts_args: tuple | None = None  # (hidden [T, H], ids [T, k], weights [T, k]) given to the experts module
    router_args: tuple | None = None  # (args, kwargs) of the router module call
    router_out: object = None
    router_calls: int = 0
    kwargs: dict = None  # further forward arguments the block was called with (hash routing's token ids)


def run_probe(block: nn.Module, parts: BlockParts, x: torch.Tensor, **kwargs) -> ProbeRun:
    rec = ProbeRun(x=x, output=None, kwargs=dict(kwargs))
    handles = []
    experts = get_path(block, parts.experts)
    if parts.kind == "fused":
        def exp_hook(mod, args, kw):
            a = list(args) + [v for v in kw.values()]
            if len(a) >= 3 and rec.experts_args is None:
                rec.experts_args = tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in a[:3])
        handles.append(experts.register_forward_pre_hook(exp_hook, with_kwargs=True))
    if parts.router_module:
        router = get_path(block, parts.router_module)

        def r_pre(mod, args, kw):
            rec.router_calls += 1
            if rec.router_args is None:
                rec.router_args = (args, kw)

        def r_post(mod, args, out):
            if rec.router_out is None:
                rec.router_out = out

        handles.append(router.register_forward_pre_hook(r_pre, with_kwargs=True))
        handles.append(router.register_forward_hook(r_post))
    try:
        with torch.no_grad():
            rec.output = block(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return rec


def hash_call_args(block: nn.Module, bindings: dict, x: torch.Tensor, seed: int | None = None) -> dict:
    """{forward parameter: probe token ids} for a Match whose ``token_ids`` is a forward argument (hash routing),
    drawn in [0, rows of its bound table); {} otherwise."""
    name = arg_name(bindings.get("token_ids"))
    if name is None or bindings.get("hash_table") is None:
        return {}
    V = get_path(block, bindings["hash_table"]).shape[0]
    kw = {} if seed is None else {"seed": seed}
    return {name: policy.probe_token_ids(x.shape[:-1], V, x.device, **kw)}


def primary(out):
    """The block's main result (the first element of a tuple / list result)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _unbindable(why: str) -> Refused:
    return Refused(why, RejectCode.BIND_FAILED)


def contract_of(run: ProbeRun) -> Contract:
    """How the block shaped its result on this run (a :class:`moecomp.core.match.Contract`); refused (``BIND_FAILED``)
    when the binder could not reproduce it: extra outputs that are not the router's, odd shapes, a list."""
    x = run.x
    out = run.output
    H = x.shape[-1]
    prim = primary(out)
    if not isinstance(prim, torch.Tensor):
        raise _unbindable(f"forward returns {type(prim).__name__}, not a tensor")
    if prim.shape == x.shape:
        pmode = "same"
    elif prim.dim() == 2 and prim.shape == (x.numel() // H, H):
        pmode = "flat2d"
    elif prim.dim() == 1 and prim.numel() == x.numel():
        pmode = "flat1d"
    else:
        raise _unbindable(f"output shape {tuple(prim.shape)} does not follow the input {tuple(x.shape)}")
    if not isinstance(out, (tuple, list)):
        return Contract(pmode)
    if isinstance(out, list):
        raise _unbindable("forward returns a list")
    extras = []
    router_call = "x2"
    rout = run.router_out
    rouf = list(rout) if isinstance(rout, (tuple, list)) else [rout]
    for e in out[1:]:
        if e is None:
            extras.append(("none",))
            continue
        hit = None
        if isinstance(e, torch.Tensor):
            for j, r in enumerate(rouf):
                if isinstance(r, torch.Tensor):
                    mode = shape_mode(e, r)
                    if mode and torch.equal(reshape_to(r, mode, e), e):
                        hit = ("router", j if isinstance(rout, (tuple, list)) else -1, mode)
                        break
        if hit is None:
            raise _unbindable("forward returns extra outputs that are not the router's outputs")
        extras.append(hit)
    if any(x[0] == "router" for x in extras):
        if run.router_calls != 1 or run.router_args is None:
            raise _unbindable("extra outputs come from a router that was not called exactly once")
        args, kw = run.router_args
        if kw or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise _unbindable("extra outputs come from a router called with more than the hidden states")
        a = args[0]
        if a.shape == x.shape and torch.equal(a, x):
            router_call = "x"
        elif a.shape == (x.numel() // H, H) and torch.equal(a, x.reshape(-1, H)):
            router_call = "x2"
        else:
            raise _unbindable("extra outputs come from a router called on something other than the input")
    return Contract(pmode, True, tuple(extras), router_call)


# ----------------------------------------------------------------------------------------------- hooks


@contextlib.contextmanager
def randomised(root: nn.Module, paths: list, seed: int = 7):
    """Tensors at ``paths`` (under ``root``) hold random values in [0.5, 1.5) inside the block, restored after."""
    g = torch.Generator().manual_seed(seed)
    saved = []
    try:
        with torch.no_grad():
            for p in paths:
                t = get_path(root, p)
                saved.append((t, t.detach().clone()))
                t.copy_((torch.rand(t.shape, generator=g) + 0.5).to(t.dtype))
        yield
    finally:
        with torch.no_grad():
            for t, v in saved:
                t.copy_(v)
