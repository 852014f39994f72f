"""The verify stage: a recogniser's :class:`moecomp.core.match.Match` proved on probes, or refused.

    Match ──► activations against the block's own modules on wide inputs (clamps reached)
          ──► the block's original forward and ``torch.ops.moecomp.moe_forward`` on the same probe input
              (:mod:`moecomp.core.policy`: shape, tolerance per dtype, 16-bit routing near-ties excused); if only the
              routed part is off by one constant, the constant is fitted (snapped to the block's own numbers)
          ──► an expert capacity: again on crowd probes, where it drops pairs (``_check_crowded``)
          ──► extra forward arguments (``input_ids``) checked to make no difference (hash routing: the token ids are
              an argument of both runs, drawn in [0, V): ``probe.hash_call_args``)
          ──► [an epilogue: ``epilogue(op(x))`` against the whole block, on two inputs: verify_epilogue]
          ──► Verified(match, contract, error, ignored arguments, epilogue)    (else ``Refused`` with a code)

Every recogniser's Match goes through the same checks; nothing here depends on which recogniser produced it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import policy
from ..oracle import reference
from ..bind.bind import bound_tensors, forward_params
from ..probe.activations import activation_mismatch
from ..core.match import Match, Verified, apply_epilogue, is_tensor_entry
from ..formats.fp8 import plain_fp8
from ..ops.moe_op import MOE_ARGS, OP_ARGS
from ..probe.block import contract_of, hash_call_args, primary, run_probe
from ..core.reject import Refused, RejectCode, raise_if_oom
from ..core.spec import MoESpec, SpecError

_example = policy.probe_input  # the verify check's input (shape, distribution, seed: see moecomp.core.policy)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    if not torch.isfinite(a).all():
        return float("inf")
    scale = ref.abs().max().item()
    if scale == 0:
        return float((a - ref).abs().max().item())
    return float((a - ref).abs().max().item() / scale)


def err_with_ties(block, spec: MoESpec, bindings, derived, x, y, ref, notes: list | None = None,
                  call_args: dict | None = None) -> float:
    """``rel_err(y, ref)``, except that in 16-bit a few tokens that differ because their routing is within a
    rounding of a tie (``reference.near_tie_tokens``) are left out; the count goes to ``notes``. When ties are
    excused (window per dtype, largest share of tokens) is :mod:`moecomp.core.policy`'s."""
    err = rel_err(y, ref)
    tol = policy.verify_tolerance(x.dtype, spec)
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
    t = bound_tensors(block, spec, bindings, derived, call_args)
    with torch.no_grad():
        near = reference.near_tie_tokens(x2, t[0], t[1], t[2], spec, rel)
    if bool((bad & ~near).any()):
        return err
    if notes is not None:
        notes.append(f"{int(bad.sum())} of {bad.numel()} check tokens took the other expert at a routing tie "
                     f"(16-bit router logits within a rounding of a tie); error measured on the others")
    return float(per_token[~bad].max()) if bool((~bad).any()) else 0.0


def _run_op(block, spec: MoESpec, bindings, derived, x, call_args: dict | None = None):
    tensors = bound_tensors(block, spec, bindings, derived, call_args)
    n = len(MOE_ARGS)
    with torch.no_grad():
        return torch.ops.moecomp.moe_forward(x, *tensors[:n], spec.key, *tensors[n:])


def run_op(block, spec: MoESpec, bindings, derived, x):
    """The op on ``x`` with the block's own tensors, as this stage runs it (the output fit's candidates)."""
    return _run_op(block, spec, bindings, derived, x)


def check_spec(block, spec, bindings, derived, run, consts, notes: list | None = None) -> tuple[MoESpec, float]:
    """Compare the op with the original output; fit one constant on the routed part if that alone is off."""
    x, kw = run.x, run.kwargs
    ref = primary(run.output).reshape(x.shape)
    y = _run_op(block, spec, bindings, derived, x, kw)
    err = err_with_ties(block, spec, bindings, derived, x, y, ref, notes, kw)
    tol = policy.verify_tolerance(x.dtype, spec)
    if err <= tol or spec.weight_on_input or spec.gamma_rows:  # weights on the expert input: the routed output is
        return spec, err  # not linear in them; shared gammas: the routed scale scales the shared experts too
    # routed output scaled outside the router (e.g. `experts(...) * routed_scaling_factor` in the block)
    spec1 = spec.replace(routed_scaling_factor=1.0)
    routed = _run_op(block, spec1.replace(shared=None), {**bindings, **{k: None for k in OP_ARGS if
                                                                        k.startswith("shared")}}, derived, x,
                     kw).float()
    shared = _run_op(block, spec1, bindings, derived, x, kw).float() - routed if spec.shared is not None else 0.0
    if spec.latent_bias:  # the output projection's bias is not scaled with the routed part: fit c on the rest
        b_out = bound_tensors(block, spec, bindings, derived)[OP_ARGS.index("latent_out_b")].float()
        routed, shared = routed - b_out, shared + b_out
    num = ((ref.float() - shared) * routed).sum()
    den = (routed * routed).sum()
    if den > 0:
        c = policy.snap_constant(float(num / den), consts)
        if math.isfinite(c) and c != spec.routed_scaling_factor:
            try:
                spec2 = spec1.replace(routed_scaling_factor=c)
            except SpecError:
                return spec, err
            y2 = _run_op(block, spec2, bindings, derived, x, kw)
            err2 = err_with_ties(block, spec2, bindings, derived, x, y2, ref, notes, kw)
            if err2 <= tol:
                return spec2, err2
    return spec, err


def _check_epilogue(block, match: Match, x, epilogue, notes: list) -> float:
    """The whole block against ``epilogue(op(x))`` on the check input and on a second, fresh input."""
    spec, bindings, derived = match.spec, match.bindings, match.derived
    tol = policy.verify_tolerance(x.dtype, spec)
    worst = 0.0
    for xx in (x, _example(x.shape[-1], x.device, x.dtype, seed=policy.EPILOGUE_PROBE_SEED)):
        kw = hash_call_args(block, bindings, xx)
        with torch.no_grad():
            ref = primary(block(xx, **kw)).reshape(xx.shape)
            y = apply_epilogue(block, epilogue, _run_op(block, spec, bindings, derived, xx, kw))
        worst = max(worst, err_with_ties(block, spec, bindings, derived, xx, y, ref, notes, kw))
    if not worst <= tol:
        raise Refused(f"op followed by {', '.join(epilogue)} differs from the block: max rel. err "
                      f"{worst:.2e} > {tol:g}", RejectCode.VERIFICATION_FAILED)
    bound = "moe_forward(x)"
    for n in epilogue:
        bound = f"{bound} + {n}" if is_tensor_entry(block, n) else f"{n}({bound})"
    notes.append(f"epilogue: the block applies {', '.join(epilogue)} to the MoE output; bound as {bound} (checked: "
                 f"max rel. err {worst:.1e})")
    return worst


def _ignored_params(block, x: torch.Tensor, ref, extra_params, kw: dict) -> frozenset:
    """Extra forward parameters (e.g. ``input_ids``) that leave this block's output unchanged (``kw``: the arguments
    the op reads, hash routing's token ids, given as in the probe run and not tried)."""
    ok = set()
    for p in extra_params:
        if "ids" not in p or p in kw:
            continue
        val = torch.ones(x.shape[:-1], dtype=torch.long, device=x.device)
        try:
            with torch.no_grad():
                out = block(x, **kw, **{p: val})
        except Exception as e:
            raise_if_oom(e)
            continue
        o = primary(out)
        if isinstance(o, torch.Tensor) and torch.equal(o, primary(ref)):
            ok.add(p)
    return frozenset(ok)


def fit_routed_scale(block, match: Match, x: torch.Tensor, consts) -> MoESpec:
    """``match.spec`` with the routed scale the probe run shows (for comparing recognisers; no tolerance check)."""
    with plain_fp8(block):
        run = run_probe(block, match.parts, x, **hash_call_args(block, match.bindings, x))
        spec, _ = check_spec(block, match.spec, match.bindings, match.derived, run, consts)
    return spec


def verify(block, match: Match, x: torch.Tensor, consts, notes: list) -> Verified:
    """Prove ``match`` on the probe input ``x`` (see the module docstring). ``consts``: the numbers the block's
    attributes and source mention (a fitted routed scale snaps to one of them). Refuses with ``Refused``:
    VERIFICATION_FAILED (outputs or activations differ), SPEC_INVALID (the op refuses the block's tensors),
    BIND_FAILED (the forward's outputs cannot be reproduced), CHECK_ERROR (the block or the op raised).

    FP8 modules of the block run their plain-PyTorch forward (``formats/fp8.py``: the dequantized reference, activations
    quantized as the module says) while it is checked: transformers' own needs the hub's kernel."""
    with plain_fp8(block):
        return _verify_match(block, match, x, consts, notes)


def _verify_match(block, match: Match, x: torch.Tensor, consts, notes: list) -> Verified:
    parts, spec = match.parts, match.spec
    why = activation_mismatch(block, parts, spec)
    if why is not None:
        raise Refused(f"activation check: {why}", RejectCode.VERIFICATION_FAILED)
    run = run_probe(block, parts, x, **hash_call_args(block, match.bindings, x))
    contract = contract_of(run)
    try:
        spec, err = check_spec(block, spec, match.bindings, match.derived, run,
                            list(consts) + [float(spec.top_k), 1.0 / spec.top_k], notes)
    except SpecError as e:
        raise Refused(f"op rejected the block's tensors: {e}", RejectCode.SPEC_INVALID) from None
    tol = policy.verify_tolerance(x.dtype, spec)
    if not err <= tol:
        extra = f" (block also has {', '.join(parts.extra_modules)})" if parts.extra_modules else ""
        raise Refused(f"op output differs from the block's: max rel. err {err:.2e} > {tol:g}{extra}",
                      RejectCode.VERIFICATION_FAILED)
    if spec.has_capacity:
        err = max(err, _check_crowded(block, match.replace(spec=spec), contract, x, notes))
    _, extra_params = forward_params(block)
    ignored = _ignored_params(block, run.x, run.output, extra_params, run.kwargs) if extra_params else frozenset()
    return Verified(match.replace(spec=spec), contract, err, ignored)


def _check_crowded(block, match: Match, contract, x: torch.Tensor, notes: list) -> float:
    """An expert capacity checked where it drops pairs: the block against the op on two crowd probes
    (``policy.crowd_probe``: half of every sequence sent to expert 0 first, then all of one longer sequence of another
    length, for a capacity factor's rounding), long enough to overflow a fixed capacity and any factor below 1."""
    spec, bindings, derived = match.spec, match.bindings, match.derived
    if spec.capacity_per == "sequence" and contract.primary != "same":
        raise Refused("the expert capacity counts per sequence, but the block returns its output flattened (the "
                      "op would not see the sequences)", RejectCode.BIND_FAILED)
    tol = policy.verify_tolerance(x.dtype, spec)
    rw, rb, cb = bound_tensors(block, spec, bindings, derived)[:3]
    S = max(16, 2 * spec.capacity)
    worst, dropped = 0.0, 0
    for shape, share in (((policy.CAPACITY_PROBE_BATCH, S), policy.CROWD_SHARE),
                         ((1, 2 * S + 3), policy.CAPACITY_CROWD_SHARE)):
        xx = policy.crowd_probe(rw, rb, shape, 0, x.dtype, share=share)
        with torch.no_grad():
            ref = primary(block(xx)).reshape(xx.shape)
            logits = reference.router_logits(xx.reshape(-1, xx.shape[-1]), rw, rb, spec)
            dropped += int((reference.route(logits, cb, spec, group=reference.group_size(xx.shape, spec))[1]
                            < 0).sum())
        y = _run_op(block, spec, bindings, derived, xx)
        worst = max(worst, err_with_ties(block, spec, bindings, derived, xx, y, ref, notes))
    if not worst <= tol:
        raise Refused(f"op output differs from the block's where its expert capacity drops pairs: max rel. err "
                      f"{worst:.2e} > {tol:g}", RejectCode.VERIFICATION_FAILED)
    notes.append(f"expert capacity checked on crowd probes ({dropped} pairs dropped): max rel. err {worst:.1e}")
    return worst


def verify_epilogue(block, verified: Verified, x: torch.Tensor, epilogue, notes: list) -> Verified:
    """``verified`` (found with the ``epilogue`` children peeled off) checked against the whole block again, as
    ``epilogue(op(x))``; refused (VERIFICATION_FAILED) when they differ."""
    if not epilogue:
        return verified
    with plain_fp8(block):
        err = _check_epilogue(block, verified.match, x, epilogue, notes)
    return dataclasses.replace(verified, max_rel_err=max(verified.max_rel_err, err), epilogue=tuple(epilogue))
