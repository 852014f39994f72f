"""Verify a router / experts pair (``moecomp.api.pair``) on its parent's own output: the parent runs on probe inputs
(a call it really made, its hidden states replaced by random values) with its original children and with the pair's
stand-ins installed (``bind/bind_pair.py``); every tensor it returns must agree within ``policy.verify_tolerance``, the
stand-ins must have taken the op's path exactly once per parent call and never their fallback. Constant tensors
under the router (a fresh init of ones) hold random values meanwhile, so a binding that ignored them would differ.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..core import policy
from ..oracle import reference
from ..bind.bind_pair import bind_pair, unbind_pair
from ..core.derived import get_path
from ..core.match import PairMatch
from ..probe.block import randomised
from ..core.reject import Refused, RejectCode, raise_if_oom


def fresh_call(call: tuple, root: nn.Module | None) -> tuple:
    """A deep copy of a recorded call (a cache it holds is written by every call of the parent: each run gets the
    state the recorded call had); ``root``'s modules, parameters and buffers are shared, never copied."""
    memo = {}
    if root is not None:
        for m in root.modules():
            memo[id(m)] = m
        for t in list(root.parameters()) + list(root.buffers()):
            memo[id(t)] = t
    try:
        return copy.deepcopy(call, memo)
    except Exception as e:  # something in it cannot be copied: the call as recorded
        raise_if_oom(e)
        return call


def hidden_slot(call: tuple, H: int):
    """("args", i) / ("kwargs", name) of the call's hidden states: its first floating tensor [..., H]."""
    args, kwargs = call
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2 and a.shape[-1] == H:
            return ("args", i)
    for n, a in kwargs.items():
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2 and a.shape[-1] == H:
            return ("kwargs", n)
    return None


def probe_call(call: tuple, slot, seed: int) -> tuple:
    """The call with its hidden states replaced by N(0, 1) values of the same shape, dtype and device."""
    args, kwargs = list(call[0]), dict(call[1])
    x = args[slot[1]] if slot[0] == "args" else kwargs[slot[1]]
    g = torch.Generator().manual_seed(policy.PROBE_SEED + seed)
    p = torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
    if slot[0] == "args":
        args[slot[1]] = p
    else:
        kwargs[slot[1]] = p
    return tuple(args), kwargs


def _near_ties(parent: nn.Module, m: PairMatch, r) -> torch.Tensor | None:
    """[T] bool, 16-bit routers only: the probe tokens whose routing is within a rounding of a tie
    (``reference.near_tie_tokens`` on the router's prefixed input); left out of the comparison when they are at most
    ``policy.max_tie_tokens`` (a wrong spec changes every token), ``TOO_MANY_TIES`` when more; None in fp32."""
    rel = policy.tie_window(r.dtype) if isinstance(r, torch.Tensor) else None
    if rel is None:
        return None
    t = {a: None if p is None else get_path(parent, p) for a, p in m.bindings.items()}
    r2 = r.reshape(-1, r.shape[-1])
    ri = reference.router_input(r2, r2, t.get("router_in_scale"), m.spec)
    near = reference.near_tie_tokens(ri, t["router_w"], t.get("router_b"), None, m.spec, rel)
    return near if int(near.sum()) <= policy.max_tie_tokens(near.numel()) else TOO_MANY_TIES


TOO_MANY_TIES = object()  # a 16-bit probe with more near-ties than the check may excuse (``policy.PAIR_PROBE_SEEDS``)


def _tensors_of(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors_of(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors_of(o)]
    return [o for o in getattr(out, "__dict__", {}).values() if isinstance(o, torch.Tensor)]


def verify_pair(parent: nn.Module, m: PairMatch, call: tuple, name: str = "") -> float:
    """The largest relative error of the parent's outputs, stand-ins against originals, over two probes (16-bit: two
    whose near-tie tokens the check may excuse, of ``policy.PAIR_PROBE_SEEDS``); raises
    ``Refused`` (VERIFICATION_FAILED) when over the tolerance or when the op's path was not taken."""
    slot = hidden_slot(call, m.spec.hidden_size)
    if slot is None:
        raise Refused("the parent's call has no hidden states [.., H] to probe with", RejectCode.CHECK_ERROR)
    err, used = 0.0, 0
    router = get_path(parent, m.router)
    with randomised(parent, m.perturb), torch.no_grad():
        for seed in policy.PAIR_PROBE_SEEDS:
            if used == policy.PAIR_PROBES_NEEDED:
                break
            c = probe_call(call, slot, seed)
            c1 = fresh_call(c, parent)
            seen = []
            h = router.register_forward_pre_hook(lambda mod, a: seen.append(a[m.layout.r_arg]))
            try:
                ref = [t.detach().clone() for t in _tensors_of(parent(*c1[0], **c1[1]))]
            finally:
                h.remove()
            near = _near_ties(parent, m, seen[0] if seen else None)
            if near is TOO_MANY_TIES:
                continue
            used += 1
            st = bind_pair(parent, name, m.spec, m.bindings, m.router, m.experts, m.layout)
            try:
                c2 = fresh_call(c, parent)
                got = _tensors_of(parent(*c2[0], **c2[1]))
                calls, fallbacks = st.calls, st.fallbacks
            finally:
                unbind_pair(parent)
            if calls != 1 or fallbacks:
                raise Refused(f"the pair's stand-ins took the op's path {calls} times and their fallback {fallbacks} "
                              f"times in one call of the parent (expected once and never)",
                              RejectCode.VERIFICATION_FAILED)
            if len(got) != len(ref) or any(a.shape != b.shape for a, b in zip(got, ref)):
                raise Refused("the parent's outputs changed shape with the pair rewritten",
                              RejectCode.VERIFICATION_FAILED)
            for a, b in zip(got, ref):
                if not a.is_floating_point():
                    if not torch.equal(a, b):
                        raise Refused("the parent's integer outputs differ with the pair rewritten",
                                      RejectCode.VERIFICATION_FAILED)
                    continue
                d = (a.float() - b.float()).abs()
                if near is not None and a.numel() == near.numel() * m.spec.hidden_size:
                    d = d.reshape(-1, m.spec.hidden_size)[~near]  # 16-bit: tokens a rounding from a routing tie
                e = float(d.max() / b.float().abs().max().clamp_min(1e-30)) if d.numel() else 0.0
                if not torch.isfinite(a).all() or not e <= policy.verify_tolerance(b.dtype):
                    raise Refused(f"the parent's output differs with the pair rewritten: max rel. err {e:.2e} > "
                                  f"{policy.verify_tolerance(b.dtype):g}", RejectCode.VERIFICATION_FAILED)
                err = max(err, e)
    if used < policy.PAIR_PROBES_NEEDED:
        n = len(policy.PAIR_PROBE_SEEDS)
        raise Refused(f"{n - used} of {n} probes of the parent had more 16-bit routing "
                      "near-ties than the check may excuse: too few probes to verify the pair on",
                      RejectCode.VERIFICATION_FAILED)
    return err
