"""The verify stage of ``moecomp.optimize``: ``torch.ops.moecomp.moe_forward`` against the block's original forward
on the probe input (:mod:`moecomp.policy`: shape, tolerance per dtype, 16-bit routing near-ties excused), the one
constant it may fit on the routed part, and the check of an epilogue (``epilogue(op(x))`` against the whole block).
"""

from __future__ import annotations

import math

import torch

from . import policy, reference
from .ops.moe_op import MOE_ARGS
from .reject import RejectCode
from .spec import MoESpec, SpecError
from .hf import bind as _bind
from .hf import fallback as _fb
from .hf.structure import get_path

_example = policy.probe_input  # the verify check's input (shape, distribution, seed: see moecomp.policy)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    if not torch.isfinite(a).all():
        return float("inf")
    scale = ref.abs().max().item()
    if scale == 0:
        return float((a - ref).abs().max().item())
    return float((a - ref).abs().max().item() / scale)


def _err_with_ties(block, spec: MoESpec, bindings, derived, x, y, ref, notes: list | None = None) -> float:
    """``_rel_err(y, ref)``, except that in 16-bit a few tokens that differ because their routing is within a
    rounding of a tie (``reference.near_tie_tokens``) are left out; the count goes to ``notes``. When ties are
    excused (window per dtype, largest share of tokens) is :mod:`moecomp.policy`'s."""
    err = _rel_err(y, ref)
    tol = policy.verify_tolerance(x.dtype)
    rel = policy.tie_window(x.dtype)
    if err <= tol or rel is None or not torch.isfinite(y).all():
        return err
    H = x.shape[-1]
    y2, r2, x2 = y.float().reshape(-1, H), ref.float().reshape(-1, H), x.reshape(-1, H)
    scale = r2.abs().max().clamp_min(1e-30)
    per_token = (y2 - r2).abs().amax(-1) / scale  # [T]
    bad = per_token > tol
    if int(bad.sum()) > policy.max_tie_tokens(bad.numel()):
        return err
    t = _bind.bound_tensors(block, spec, bindings, derived)
    with torch.no_grad():
        near = reference.near_tie_tokens(x2, t[0], t[1], t[2], spec, rel)
    if bool((bad & ~near).any()):
        return err
    if notes is not None:
        notes.append(f"{int(bad.sum())} of {bad.numel()} check tokens took the other expert at a routing tie "
                     f"(16-bit router logits within a rounding of a tie); error measured on the others")
    return float(per_token[~bad].max()) if bool((~bad).any()) else 0.0


def _run_op(block, spec: MoESpec, bindings, derived, x):
    tensors = _bind.bound_tensors(block, spec, bindings, derived)
    with torch.no_grad():
        return torch.ops.moecomp.moe_forward(x, *tensors, spec.key)


def _verify(block, spec, bindings, derived, run, consts, notes: list | None = None) -> tuple[MoESpec, float]:
    """Compare the op with the original output; fit one constant on the routed part if that alone is off."""
    x = run.x
    ref = _fb._primary(run.output).reshape(x.shape)
    y = _run_op(block, spec, bindings, derived, x)
    err = _err_with_ties(block, spec, bindings, derived, x, y, ref, notes)
    tol = policy.verify_tolerance(x.dtype)
    if err <= tol:
        return spec, err
    # routed output scaled outside the router (e.g. `experts(...) * routed_scaling_factor` in the block)
    spec1 = spec.replace(routed_scaling_factor=1.0)
    routed = _run_op(block, spec1.replace(shared=None), {**bindings, **{k: None for k in MOE_ARGS if
                                                                        k.startswith("shared")}}, derived, x).float()
    shared = _run_op(block, spec1, bindings, derived, x).float() - routed if spec.shared is not None else 0.0
    num = ((ref.float() - shared) * routed).sum()
    den = (routed * routed).sum()
    if den > 0:
        c = _fb._snap(float(num / den), consts)
        if math.isfinite(c) and c != spec.routed_scaling_factor:
            try:
                spec2 = spec1.replace(routed_scaling_factor=c)
            except SpecError:
                return spec, err
            y2 = _run_op(block, spec2, bindings, derived, x)
            err2 = _err_with_ties(block, spec2, bindings, derived, x, y2, ref, notes)
            if err2 <= tol:
                return spec2, err2
    return spec, err


def _check_epilogue(block, spec, bindings, derived, x, epilogue, rep) -> None:
    """The whole block against ``epilogue(op(x))`` on the check input and on a second, fresh input."""
    tol = policy.verify_tolerance(x.dtype)
    worst = 0.0
    for xx in (x, _example(x.shape[-1], x.device, x.dtype, seed=policy.EPILOGUE_PROBE_SEED)):
        with torch.no_grad():
            ref = _fb._primary(block(xx)).reshape(xx.shape)
            y = _run_op(block, spec, bindings, derived, xx)
            for n in epilogue:
                y = get_path(block, n)(y)
        worst = max(worst, _err_with_ties(block, spec, bindings, derived, xx, y, ref, rep.notes))
    if not worst <= tol:
        raise _fb.FallbackError(f"op followed by {', '.join(epilogue)} differs from the block: max rel. err "
                                f"{worst:.2e} > {tol:g}", RejectCode.VERIFICATION_FAILED)
    rep.max_rel_err = max(rep.max_rel_err or 0.0, worst)
    rep.notes.append(f"epilogue: the block applies {', '.join(epilogue)} to the MoE output; bound as "
                     f"{epilogue[0]}(moe_forward(x)) (checked: max rel. err {worst:.1e})")
