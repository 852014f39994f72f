"""The dispatch reader: a recogniser for blocks found by their shapes (``structure.structural_parts``: a router
[E, H] and one module per expert) whose forward Dynamo cannot capture, e.g. Switch Transformers' and NLLB-MoE's
(their expert capacity gives data-dependent shapes, and they pick an expert module by a string key built from a
tensor). It reads what the block computes by running it with every expert module observed; no names are read:

  experts   each expert module: its linear children by shape (in [I, H] or two of them, or [2I, H]; out [H, I], the
            last), nothing else holding weights; the activation (and gate / up order) measured by calling it
            (``activations.probe_mlp``); all experts alike
  dispatch  the block runs on probe hidden states with a forward hook on every expert: the rows an expert receives
            are rows of the block input (which tokens reached it), the rows it returns its outputs; the block output
            is then solved, token by token, as a weighted sum of the outputs of the experts that token reached
            (least squares; the residual must vanish: nothing else is added, a token no expert took outputs 0)
  routing   every routing the spec knows (the attribute reader's candidates) on the router's logits: the first whose
            pairs include every observed one and whose weights are the observed ones up to one routed scale
  capacity  a pair the routing picks that no expert computed is a drop: a capacity explains the drops when, per
            group (the call, or each sequence), exactly the pairs ranked past C in their expert are missing. The
            probes crowd one expert (``policy.crowd_probe``: half of every sequence for the routing fit, then whole
            sequences of growing length) until pairs are dropped, then once more at twice the length: the same C is a fixed capacity, a C that follows the tokens a
            capacity factor (snapped to a number the block holds, else the simplest fraction that fits). The
            weights then tell whether the renormalisation follows the drop (and its floor, on far-crowded tokens).
            No drops where expert 0 was every token's first choice in sequences up to the longest probe: no capacity,
            and the Match holds ``max_tokens`` (that length: longer calls run the block's original forward, a
            capacity beyond the probes cannot be ruled out)

The verify stage then checks the Match on its own probes, crowd probes included (``verify/verify.py``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import torch
from torch import nn

from ..core import policy
from ..oracle import reference
from ..core.match import Evidence, Match
from ..core.reject import Refused, Reject, RejectCode, raise_if_oom
from ..core.spec import MoESpec, SpecError, expert_bias_fields
from ..probe.activations import probe_mlp
from .fallback import routing_candidates as _routing_candidates, attr_sources, numeric_consts
from .fallback_bind import bindings as _bindings
from ..core.parts import BlockParts, MLPParts
from ..core.derived import get_path


class DispatchError(Refused):
    """The dispatch reader cannot describe the block: ``reason`` says why, ``code`` what kind of refusal."""


# ------------------------------------------------------------------------------------------------------ experts
def _expert_modules(block: nn.Module, parts: BlockParts) -> list[tuple[str, nn.Module]]:
    """(path, module) of each expert: the children of the experts holder that hold parameters, in order."""
    if not parts.experts:
        raise DispatchError("the experts are spread over several children or are the block's own tensors (no one "
                            "module holds them)",
                            RejectCode.UNSUPPORTED_STRUCTURE)
    holder = get_path(block, parts.experts)
    mods = [(f"{parts.experts}.{n}", m) for n, m in holder.named_children() if any(True for _ in m.parameters())]
    if len(mods) != parts.num_experts:
        raise DispatchError(f"{parts.experts!r} holds {len(mods)} modules with parameters under a router of "
                            f"{parts.num_experts} outputs", RejectCode.UNSUPPORTED_STRUCTURE)
    return mods


def _mlp_by_shapes(mod: nn.Module, path: str, H: int) -> list[MLPParts]:
    """Candidate readings of one expert as a dense MLP from its linear children's shapes alone (gate / up order
    unknown: both), [] when it is not one (other parameters, other shapes)."""
    lins = [(n, c) for n, c in mod.named_children()
            if isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.dim() == 2]
    owned = {id(p) for _, c in lins for p in c.parameters(recurse=False)}
    if not lins or {id(p) for p in mod.parameters()} != owned:
        return []
    bias = {n: (f"{path}.{n}.bias" if isinstance(getattr(c, "bias", None), torch.Tensor) else None) for n, c in lins}
    w = {n: f"{path}.{n}.weight" for n, _ in lins}
    (dn, down), ins = lins[-1], lins[:-1]
    Hd, I = down.weight.shape
    if Hd != H or any(c.weight.shape[1] != H for _, c in ins):
        return []
    shapes = [tuple(c.weight.shape) for _, c in ins]
    if shapes == [(I, H)]:
        (u, _), = ins
        return [MLPParts(path, False, False, None, w[u], w[dn], None, bias[u], bias[dn], I)]
    if shapes == [(2 * I, H)]:
        (gu, _), = ins
        return [MLPParts(path, True, True, w[gu], None, w[dn], bias[gu], None, bias[dn], I)]
    if shapes == [(I, H), (I, H)]:
        (a, _), (b, _) = ins
        return [MLPParts(path, True, False, w[g], w[u], w[dn], bias[g], bias[u], bias[dn], I)
                for g, u in ((a, b), (b, a))]
    return []


def read_experts(block: nn.Module, parts: BlockParts) -> tuple[list[MLPParts], tuple]:
    """Each expert as a dense MLP and the activation they compute (``activations.MlpReading``); DispatchError when
    they are not alike dense MLPs of an activation the spec knows."""
    mods = _expert_modules(block, parts)
    cands = _mlp_by_shapes(mods[0][1], mods[0][0], parts.hidden_size)
    if not cands:
        raise DispatchError(f"expert {mods[0][0]!r} ({type(mods[0][1]).__name__}) is not a dense MLP by its shapes "
                            "(linear children [I, H] (two, or one [2I, H]) then [H, I], nothing else with weights)",
                            RejectCode.UNSUPPORTED_STRUCTURE)
    for cand in cands:  # which reading (gate / up order) and activation the module computes
        act = probe_mlp(block, cand)
        if act is not None:
            break
    else:
        raise DispatchError(f"expert {mods[0][0]!r} computes no activation the spec knows (or its gate / up are "
                            "not the linears its shapes suggest)", RejectCode.NOT_RECOGNISED)
    names = [p.rsplit(".", 2)[-2] if p else None for p in (cand.gate, cand.up, cand.down)]
    mlps = []
    for path, m in mods:
        mine = _mlp_by_shapes(m, path, parts.hidden_size)
        pick = [c for c in mine if [p.rsplit(".", 2)[-2] if p else None for p in (c.gate, c.up, c.down)] == names]
        if len(pick) != 1 or pick[0].intermediate_size != cand.intermediate_size:
            raise DispatchError(f"expert {path!r} is not built like {mods[0][0]!r}", RejectCode.UNSUPPORTED_STRUCTURE)
        mlps.append(pick[0])
    return mlps, act


# ----------------------------------------------------------------------------------------------------- dispatch
@dataclasses.dataclass
class Observed:
    """One probe run: its input, which (token, expert) pairs an expert computed, with which weight."""

    x: torch.Tensor  # [..., H] the probe input
    took: torch.Tensor  # [T, E] bool
    weight: torch.Tensor  # [T, E] float64, 0 off ``took``
    # every expert ran on every token (a dense loop): ``took`` holds the pairs clearly weighted; a routing may pick
    # more (weights too small to tell from 0), never fewer, and nothing can have been dropped
    dense: bool = False


def observe(block: nn.Module, experts: list[nn.Module], x: torch.Tensor) -> Observed:
    """Run the block on ``x`` with every expert module hooked (see the module docstring)."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    T, E = x2.shape[0], len(experts)
    row_of = {bytes(x2[t].detach().cpu().float().numpy().tobytes()): t for t in range(T)}
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, a, out, _e=e: calls.append((_e, a[0], out)) if a else None)
             for e, m in enumerate(experts)]
    try:
        with torch.no_grad():
            out = block(x)
    finally:
        for h in hooks:
            h.remove()
    out = (out[0] if isinstance(out, (tuple, list)) else out).reshape(T, H).double()
    took = torch.zeros(T, E, dtype=torch.bool)
    times = torch.zeros(T, E, dtype=torch.long)
    ys: dict[tuple[int, int], torch.Tensor] = {}
    for e, inp, y in calls:
        if not (isinstance(inp, torch.Tensor) and isinstance(y, torch.Tensor)) or inp.shape[-1] != H or \
                y.shape != inp.shape:
            raise DispatchError(f"expert {e} was called with / returned something other than rows [n, H]",
                                RejectCode.NOT_RECOGNISED)
        for r, yr in zip(inp.reshape(-1, H), y.reshape(-1, H)):
            t = row_of.get(bytes(r.detach().cpu().float().numpy().tobytes()))
            if t is None:
                raise DispatchError(f"expert {e} received rows that are not rows of the block input",
                                    RejectCode.NOT_RECOGNISED)
            times[t, e] += 1
            took[t, e] = True
            ys[(t, e)] = yr.detach().cpu().double()
    if times.numel() and int(times.max()) > 1:
        e = int(times.amax(0).argmax())
        raise DispatchError(f"expert {e} took one token {int(times[:, e].max())} times in one call (and "
                            f"{int((times.sum(0) > 0).sum())} of {E} experts computed anything): the experts are not "
                            "chosen by a top-k of the router (that gives a token at most one pair per expert)",
                            RejectCode.UNSUPPORTED_ROUTING)
    w = _solve_weights(out.cpu(), took, ys, x.dtype)
    dense = E > 1 and T > 0 and bool(took.all())
    if dense:  # every expert ran on every token: the pairs taken are the ones weighted, the others got weight 0
        took = w.abs() > policy.verify_tolerance(x.dtype) * w.abs().amax(1, keepdim=True)
        w = w * took
    return Observed(x, took, w, dense)


def _solve_weights(out: torch.Tensor, took: torch.Tensor, ys: dict, dtype) -> torch.Tensor:
    """[T, E] weights w with out[t] = sum_e w[t, e] * y[t, e] over the pairs taken (least squares per token);
    DispatchError when a token's output is not such a sum (within the verify tolerance of the output's scale)."""
    T, E = took.shape
    H = out.shape[1]
    k = max(1, int(took.sum(1).max()))
    A = torch.zeros(T, H, k, dtype=torch.float64)
    cols = [[e for e in range(E) if took[t, e]] for t in range(T)]
    for t, es in enumerate(cols):
        for j, e in enumerate(es):
            A[t, :, j] = ys[(t, e)]
    sol = torch.linalg.lstsq(A, out[:, :, None], driver="gelsd").solution[:, :, 0]  # [T, k]
    res = (out - (A @ sol[:, :, None])[:, :, 0]).norm(dim=1)
    scale = float(out.norm(dim=1).max().clamp_min(1e-30))
    tol = policy.verify_tolerance(dtype)
    if float(res.max()) > tol * scale:
        t = int(res.argmax())
        raise DispatchError(f"the block's output is not a weighted sum of what its experts returned (token {t}: "
                            f"residual {float(res[t]) / scale:.1e} of the output's scale)", RejectCode.NOT_RECOGNISED)
    w = torch.zeros(T, E, dtype=torch.float64)
    for t, es in enumerate(cols):
        for j, e in enumerate(es):
            w[t, e] = sol[t, j]
    return w


# ------------------------------------------------------------------------------------------------------ routing
@dataclasses.dataclass
class _Router:
    w: torch.Tensor
    b: torch.Tensor | None
    corr: torch.Tensor | None


def _route(obs: Observed, r: _Router, spec: MoESpec, group: int | None = None):
    """The (weights [T, k], ids [T, k]) ``spec`` routes ``obs.x`` to (ids -1: dropped)."""
    x2 = obs.x.reshape(-1, obs.x.shape[-1])
    logits = reference.router_logits(x2, r.w, r.b, spec).float()
    return reference.route(logits, r.corr, spec, torch.float64, group=group)


def _dense(ids: torch.Tensor, w: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(took [T, E], weight [T, E]) of a routing's pairs (ids -1 left out)."""
    ids, w = ids.cpu(), w.cpu()
    keep = ids >= 0
    rows = torch.arange(ids.shape[0])[:, None].expand_as(ids)[keep]
    took = torch.zeros(ids.shape[0], E, dtype=torch.bool)
    weight = torch.zeros(ids.shape[0], E, dtype=torch.float64)
    took[rows, ids[keep]] = True
    weight[rows, ids[keep]] = w[keep].double()
    return took, weight


def _scale(obs: Observed, weight: torch.Tensor, tol: float) -> float | None:
    """c with obs.weight == c * weight (within ``tol``), or None."""
    den = float((weight * weight).sum())
    if den == 0:
        return None
    c = float((obs.weight * weight).sum()) / den
    ok = torch.allclose(obs.weight, c * weight, rtol=tol, atol=tol * float(obs.weight.abs().max()))
    return c if ok and math.isfinite(c) and c > 0 else None


def _groups(obs: Observed) -> list[tuple[str, int]]:
    """(capacity_per, tokens per group) hypotheses for a probe: each sequence (when there are several), the call."""
    T = obs.took.shape[0]
    out = [("sequence", obs.x.shape[-2])] if obs.x.dim() >= 3 and obs.x.shape[-2] < T else []
    return out + [("call", T)]


def _capacities(obs: Observed, ids: torch.Tensor) -> list[tuple[str, int, int]]:
    """(capacity_per, group, C) that explain exactly which of the routing's pairs ``ids`` [T, k] the probe dropped."""
    kept = obs.took.gather(1, ids.cpu())
    out = []
    for per, group in _groups(obs):
        rank = reference.capacity_ranks(ids.cpu(), obs.took.shape[1], group)
        lo = int(rank[kept].max()) + 1 if bool(kept.any()) else 0
        hi = int(rank[~kept].min())
        if lo <= hi:
            out.append((per, group, hi))
    return out


def fit_routing(obs: Observed, r: _Router, base: MoESpec, k: int) -> tuple[dict, list, list]:
    """The first candidate routing whose pairs include the observed ones: (its fields, the capacity hypotheses that
    explain this probe's drops, the drop variants whose weights match, each with its routed scale). Without drops:
    (fields with the routed scale, [], [])."""
    E = obs.took.shape[1]
    tol = policy.routing_match_tolerance(obs.x.dtype)
    fp32s = [True, False] if obs.x.dtype != torch.float32 else [base.router_fp32]
    for fp32 in fp32s:
        for cand in _routing_candidates({}, E, k, r.corr is not None):
            try:
                spec = base.replace(**cand, top_k=k, router_fp32=fp32)
            except SpecError:
                continue
            w, ids = _route(obs, r, spec)
            took, weight = _dense(ids, w, E)
            if bool((obs.took & ~took).any()):
                continue  # an observed pair this routing does not pick
            fields = dict(cand, top_k=k, router_fp32=fp32)
            if obs.dense or torch.equal(obs.took, took):
                c = _scale(obs, weight, tol)
                if c is not None:
                    return dict(fields, routed_scaling_factor=c), [], []
                continue
            found = _drops(obs, r, spec)
            if found is not None:
                return fields, *found
    raise DispatchError("routing not recognised: no routing the spec knows (softmax / sigmoid / sqrt-softplus, top-k, "
                        "renormalised, group-limited, with an expert capacity) picks the pairs the experts computed "
                        "with their weights", RejectCode.UNSUPPORTED_ROUTING)


def _drops(obs: Observed, r: _Router, spec: MoESpec) -> tuple[list, list] | None:
    """(capacity hypotheses, drop variants whose weights match) for a routing ``spec`` some of whose pairs the probe
    dropped; None when no capacity explains them."""
    w, ids = _route(obs, r, spec)
    caps = _capacities(obs, ids)
    variants = [v for v in _drop_variants(spec, obs.x.dtype)
                if any(_drop_scale(obs, r, spec, v, cap) is not None for cap in caps)]
    return (caps, variants) if variants else None


def _drop_variants(spec: MoESpec, dtype) -> list[dict]:
    """Where the renormalisation sits relative to the drop, and its floor: none, or the dtype's epsilon."""
    if not spec.renormalize:
        return [dict(renorm_after_drop=False, renorm_min=0.0)]
    eps = float(torch.finfo(dtype).eps)
    return [dict(renorm_after_drop=False, renorm_min=0.0), dict(renorm_after_drop=True, renorm_min=0.0),
            dict(renorm_after_drop=True, renorm_min=eps)]


def _drop_scale(obs: Observed, r: _Router, spec: MoESpec, variant: dict, cap: tuple) -> float | None:
    """The routed scale with which ``spec`` + ``variant`` + the capacity ``cap`` = (capacity_per, group, C or
    capacity fields) gives this probe's pairs and weights, or None."""
    per, group, C = cap
    fields = C if isinstance(C, dict) else dict(capacity=C, capacity_factor=0.0, capacity_per=per)
    w, ids = _route(obs, r, spec.replace(**variant, **fields), group)
    took, weight = _dense(ids, w, obs.took.shape[1])
    return _scale(obs, weight, policy.routing_match_tolerance(obs.x.dtype)) if torch.equal(took, obs.took) else None


# ----------------------------------------------------------------------------------------------------- capacity
def _factor(n1: int, C1: int, n2: int, C2: int, consts) -> float | None:
    """f with ceil(f * n1) = C1 and ceil(f * n2) = C2: a number the block holds, else the simplest fraction."""
    lo, hi = max(Fraction(C1 - 1, n1), Fraction(C2 - 1, n2)), min(Fraction(C1, n1), Fraction(C2, n2))
    if lo >= hi:
        return None
    for v in consts:
        if v > 0 and math.ceil(v * n1) == C1 and math.ceil(v * n2) == C2:
            return float(v)
    for q in range(1, n2 + 1):
        p = math.floor(hi * q)
        if Fraction(p, q) > lo:
            return p / q
    return None


def _capacity(obs1: Observed, obs2: Observed, r: _Router, spec: MoESpec, caps1: list, variants: list,
              consts) -> dict:
    """Capacity and drop-variant fields (with the routed scale) that explain two probes with drops, the second of
    twice the first's length: the same C is a fixed capacity, a C that follows the tokens a capacity factor."""
    w, ids = _route(obs2, r, spec)
    caps2 = {per: (group, C) for per, group, C in _capacities(obs2, ids)}
    for per, g1, C1 in caps1:
        if per not in caps2:
            continue
        g2, C2 = caps2[per]
        f = None if C1 == C2 else _factor(g1, C1, g2, C2, consts)
        if C1 != C2 and f is None:
            continue
        fields = dict(capacity=C1, capacity_factor=0.0, capacity_per=per) if f is None else dict(
            capacity=0, capacity_factor=f, capacity_per=per)
        for v in variants:  # the first that fits both probes
            c1, c2 = (_drop_scale(o, r, spec, v, (per, g, fields)) for o, g in ((obs1, g1), (obs2, g2)))
            if c1 is not None and c2 is not None and abs(c1 - c2) <= policy.routing_match_tolerance(
                    obs1.x.dtype) * abs(c1):
                return dict(fields, **v, routed_scaling_factor=c1)
    raise DispatchError(f"pairs are dropped, but no capacity (fixed, or a factor of the tokens, per call or per "
                        f"sequence) explains the drops and weights of two probes ({caps1} at "
                        f"{obs1.x.shape[-2]} tokens a sequence, {sorted(caps2.items())} at {obs2.x.shape[-2]})",
                        RejectCode.UNSUPPORTED_ROUTING)


# ---------------------------------------------------------------------------------------------------- recognise
def _read(block: nn.Module, parts: BlockParts, dtype) -> Match:
    mlps, (act, clamp, alpha, limit, after) = read_experts(block, parts)
    experts = [get_path(block, m.path) for m in mlps]
    W = get_path(block, parts.router_weight)
    r = _Router(W, get_path(block, parts.router_bias) if parts.router_bias else None,
                get_path(block, parts.correction_bias).reshape(-1) if parts.correction_bias else None)
    m0 = mlps[0]
    base = MoESpec(num_experts=parts.num_experts, top_k=1, hidden_size=parts.hidden_size,
                   intermediate_size=m0.intermediate_size, activation=act, gated=m0.gated,
                   activation_clamp=clamp, activation_alpha=alpha, activation_limit=limit,
                   activation_clamp_after=after,
                   has_router_bias=r.b is not None,
                   **expert_bias_fields((m0.gate_bias if m0.gated else m0.up_bias) is not None,
                                        m0.down_bias is not None),
                   has_correction_bias=r.corr is not None)

    def probe(B, S, share):
        return observe(block, experts, policy.crowd_probe(W, r.b, (B, S), 0, dtype, share=share))

    B, seqs = policy.CAPACITY_PROBE_BATCH, policy.CAPACITY_PROBE_SEQS
    S, share = seqs[0], policy.CROWD_SHARE
    obs = probe(B, S, share)  # half crowded: the routing is fitted on the others
    k = int(obs.took.sum(1).max()) or 1
    fields, caps, variants = fit_routing(obs, r, base, k)
    plain = base.replace(**{f: v for f, v in fields.items() if f != "routed_scaling_factor"})
    share = policy.CAPACITY_CROWD_SHARE
    for S in seqs if not caps else ():  # whole sequences crowded, longer and longer: are pairs dropped?
        obs = probe(B, S, share)
        w, ids = _route(obs, r, plain)
        took = _dense(ids, w, parts.num_experts)[0]
        if obs.dense or torch.equal(took, obs.took):
            continue
        found = _drops(obs, r, plain) if not bool((obs.took & ~took).any()) else None
        if found is None:
            raise DispatchError(f"on a crowd probe of {S} tokens a sequence the experts computed other pairs than "
                                "the routing fitted picks, and no capacity explains it", RejectCode.UNSUPPORTED_ROUTING)
        caps, variants = found
        break
    consts = numeric_consts(attr_sources(block, parts), k)
    notes, max_tokens = [], 0
    if caps:
        fields.update(_capacity(obs, probe(B, 2 * S, share), r, plain, caps, variants, consts))
        notes.append(f"expert capacity measured: pairs dropped on crowd probes of {S} and {2 * S} tokens a sequence")
    elif obs.dense:  # every expert computed every token: nothing is ever dropped, whatever the length
        notes.append("every expert computed every token (weighted 0 off its top-k): no capacity")
    else:  # expert 0 took every token of sequences of seqs[-1] tokens: any call of at most that many is safe
        max_tokens = seqs[-1]
        notes.append(f"no pair dropped where expert 0 was every token's first choice, in sequences of up to "
                     f"{max_tokens} tokens: bound for calls of at most {max_tokens} tokens (longer ones run the "
                     "original forward)")
    fields["routed_scaling_factor"] = policy.snap_constant(fields["routed_scaling_factor"], consts,
                                                           policy.TIE_REL.get(dtype, policy.SNAP_REL))
    try:
        spec = base.replace(**fields)
    except SpecError as e:
        raise DispatchError(f"measured routing gives no valid spec: {e}", RejectCode.SPEC_INVALID) from None
    mparts = dataclasses.replace(parts, kind="modulelist", expert_mlps=mlps, gated=m0.gated,
                                 intermediate_size=m0.intermediate_size)
    bindings, derived = _bindings(block, mparts)
    ev = Evidence("dispatch", "routing, capacity and activation measured with the experts observed", notes=notes)
    return Match(spec, bindings, derived, mparts, ev, max_tokens=max_tokens)


def recognise(block: nn.Module, parts: BlockParts, x: torch.Tensor) -> Match | Reject:
    """The dispatch reader's answer for ``block`` (probes in ``x``'s dtype and device), a Match or a Reject."""
    try:
        with torch.no_grad():
            return _read(block, parts, x.dtype)
    except Refused as e:
        return e.reject
    except Exception as e:  # the block's own forward (or an expert's) failed on a probe
        raise_if_oom(e)
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return Reject(RejectCode.CHECK_ERROR, f"running the block failed: {type(e).__name__}: {msg}")
