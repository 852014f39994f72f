"""The pair reader: a router and an experts module that are siblings in a parent whose forward also does other things
(a decoder layer with attention, norms and a dense MLP next to them: Gemma-4, DiffusionGemma), read as one
``MoESpec`` whose router reads its own input (``router_input``).

Found by structure and meaning, never by names: the candidate paths come from ``structure.iter_blocks`` (a router
weight [E, H] in one child, 3-D expert weights in another); then the parent runs once, on a call it really makes
(``pair.ParentCalls``), with both children observed:

    router    called once, one tensor r [..., H] in; among its outputs integer ids [T, k] (in [0, E)) and floating
              weights [T, k]
    experts   called once, after it, with those two very objects (nothing in the parent transformed them) and a
              tensor h [T, H]; returns [T, H]

The experts' activation is fitted on probes of the experts module alone (each spec activation against
``reference.experts`` on the module's own weights). The router is fitted on probes of the router module alone:
its [E, H] weight (+ an [E] bias), and, held anywhere under it, at most one [H] vector (``router_in_scale``) and one
[E] vector other than the bias (``expert_scale``). The hypotheses (RMS norm or not, the [H] vector used or not, the
[E] vector used or not, softmax / sigmoid, renormalised or not) each get their constant fitted (``router_in_const``
from the log-ratio of two chosen weights; the norm's epsilon from rows of tiny magnitude; a routed scale from the
weights' ratio) and must give the router's ids exactly and its weights within the routing tolerance. Vectors whose
entries are all equal (a fresh init of ones) are given random values while fitted, so their roles are proven.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..core import policy
from ..oracle import reference
from ..core.reject import Refused, RejectCode
from ..core.spec import ACTIVATIONS, MoESpec, SpecError, expert_bias_fields
from ..core.match import PairLayout
from ..probe.block import randomised
from ..formats.packed import PackedExperts
from ..core.parts import BlockParts
from ..core.derived import get_path


class PairError(Refused):
    default_code = RejectCode.NOT_RECOGNISED


# ------------------------------------------------------------------------------------------- observing the call
@dataclass
class Observed:
    r_args: tuple
    r_kwargs: dict
    r_out: object
    x_args: tuple
    x_kwargs: dict
    x_out: object
    r_calls: int
    x_calls: int


def observe(parent: nn.Module, call: tuple, router: nn.Module, experts: nn.Module) -> Observed:
    """Run ``parent(*args, **kwargs)`` once with its router and experts children observed."""
    seen = {"r": [], "x": []}

    def hook(key):
        def h(mod, args, kwargs, out):
            seen[key].append((args, kwargs, out))
        return h

    hs = [router.register_forward_hook(hook("r"), with_kwargs=True),
          experts.register_forward_hook(hook("x"), with_kwargs=True)]
    try:
        with torch.no_grad():
            parent(*call[0], **call[1])
    finally:
        for h in hs:
            h.remove()
    r = seen["r"][0] if seen["r"] else ((), {}, None)
    x = seen["x"][0] if seen["x"] else ((), {}, None)
    return Observed(r[0], r[1], r[2], x[0], x[1], x[2], len(seen["r"]), len(seen["x"]))


def layout_of(obs: Observed, E: int, H: int) -> tuple[PairLayout, int]:
    """(the layout of the parent's calls, k) from one observed call; ``PairError`` saying what does not fit."""
    if obs.r_calls != 1 or obs.x_calls != 1:
        raise PairError(f"router ran {obs.r_calls} and experts {obs.x_calls} times in one call of the parent "
                        f"(expected once each)")
    ts = [i for i, a in enumerate(obs.r_args) if isinstance(a, torch.Tensor)]
    if obs.r_kwargs or len(ts) != 1 or obs.r_args[ts[0]].shape[-1] != H:
        raise PairError(f"the router's call is not one tensor [.., H={H}] (positional arguments only)")
    out = obs.r_out if isinstance(obs.r_out, (tuple, list)) else (obs.r_out,)
    ids = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.dim() == 2 and not o.is_floating_point()]
    if len(ids) != 1:
        raise PairError("the router returns no (or more than one) integer tensor [T, k] of expert ids")
    i_ids = ids[0]
    T, k = out[i_ids].shape
    ws = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.is_floating_point()
          and tuple(o.shape) == (T, k)]
    if len(ws) != 1 or not 1 <= k <= E or int(out[i_ids].min()) < 0 or int(out[i_ids].max()) >= E:
        raise PairError("the router's outputs hold no single weights tensor [T, k] beside ids in [0, E)")
    i_w = ws[0]
    xa = obs.x_args
    pos_ids = [i for i, a in enumerate(xa) if a is out[i_ids]]
    pos_w = [i for i, a in enumerate(xa) if a is out[i_w]]
    if obs.x_kwargs or len(pos_ids) != 1 or len(pos_w) != 1:
        raise PairError("the parent transforms the router's outputs before the experts (the experts were not "
                        "handed the router's ids and weights as it returned them)", RejectCode.UNSUPPORTED_STRUCTURE)
    hs = [i for i, a in enumerate(xa) if isinstance(a, torch.Tensor) and a.is_floating_point() and i != pos_w[0]
          and tuple(a.shape) == (T, H)]
    if len(hs) != 1 or not isinstance(obs.x_out, torch.Tensor) or tuple(obs.x_out.shape) != (T, H):
        raise PairError(f"the experts' call is not (hidden [T, H], ids, weights) -> [T, H={H}]")
    lay = PairLayout(r_arg=ts[0], r_nargs=len(obs.r_args), r_nout=len(out), r_ids=i_ids, r_w=i_w,
                     x_nargs=len(xa), x_h=hs[0], x_ids=pos_ids[0], x_w=pos_w[0])
    if not isinstance(obs.r_out, (tuple, list)):
        raise PairError("the router returns one tensor, not its ids and weights")
    return lay, k


def _constant(t: torch.Tensor) -> bool:
    return t.numel() > 1 and bool((t == t.reshape(-1)[0]).all())


# ------------------------------------------------------------------------------------------------------ experts
def _layouts(experts: nn.Module, parts: BlockParts, prefix: str, E: int, H: int) -> list[dict]:
    """Candidate weight layouts of the experts module: what ``structure`` read (3-D weights by name), else every
    reading of its two 3-D [E, ., .] tensors by shape: w13 [E, N, H] / w2 [E, H, I] ("out_in") or [E, H, N] /
    [E, I, H] ("in_out"), N = 2I gated or I not; an [E, N] and an [E, H] tensor beside them: their biases."""
    strip = (lambda p: p[len(prefix) + 1:] if p and p.startswith(prefix + ".") else None)
    if parts.kind == "fused" and parts.w13 and parts.w2 and not parts.split_gate_up:
        return [dict(w13=strip(parts.w13), w2=strip(parts.w2), b13=strip(parts.b13), b2=strip(parts.b2),
                     gated=parts.gated, w_layout=parts.w_layout, I=parts.intermediate_size)]
    named = list(experts.named_parameters()) + list(experts.named_buffers())
    three = [(n, t) for n, t in named if t.dim() == 3 and t.shape[0] == E and t.is_floating_point()]
    two = [(n, t) for n, t in named if t.dim() == 2 and t.shape[0] == E and t.is_floating_point()]
    out = []
    for (na, a), (nb, b) in ((x, y) for x in three for y in three if x[0] != y[0]):
        for lay, N, I, hw in (("out_in", a.shape[1], b.shape[2], (a.shape[2], b.shape[1])),
                              ("in_out", a.shape[2], b.shape[1], (a.shape[1], b.shape[2]))):
            if hw != (H, H):
                continue
            for gated in (True, False):
                if N != (2 * I if gated else I):
                    continue
                b13 = [n for n, t in two if t.shape[1] == N]
                b2 = [n for n, t in two if t.shape[1] == H and n not in b13]
                out.append(dict(w13=na, w2=nb, b13=b13[0] if len(b13) == 1 else None,
                                b2=b2[0] if len(b2) == 1 else None,
                                gated=gated, w_layout=lay, I=int(I)))
    return out


def fit_experts(experts: nn.Module, lay: PairLayout, parts: BlockParts, prefix: str, E: int, H: int, k: int,
                dtype, device) -> tuple[dict, dict, float]:
    """(the spec's expert fields, their bindings, error): the weight layout and activation (and gate / up order)
    that make ``reference.experts`` on the module's weights give the module's output on two probes. 4-bit
    experts (``PackedExperts``) state their fields (``_packed_fields``), checked on the same probes."""
    packed = isinstance(experts, PackedExperts)
    layouts = _layouts(experts, parts, prefix, E, H) if not packed else []
    if not layouts and not packed:
        raise PairError("the experts hold no 3-D gate-up / down weights the op can read as they are")
    g = torch.Generator().manual_seed(policy.PROBE_SEED)
    T = 64
    probes = []
    for scale in (1.0, 4.0):
        h = (torch.randn(T, H, generator=g) * scale).to(device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
        wt = (torch.rand(T, k, generator=g) + 0.1).to(device=device, dtype=torch.float32)
        a = [None] * lay.x_nargs
        a[lay.x_h], a[lay.x_ids], a[lay.x_w] = h, ids, wt
        with torch.no_grad():
            probes.append((h, ids, wt, experts(*a).float()))
    tol = policy.verify_tolerance(dtype)
    if packed:
        return _packed_fields(experts, prefix, E, H, k, probes, tol)
    best = (math.inf, None, None)
    for L in layouts:
        w = {n: None if L[n] is None else get_path(experts, L[n]) for n in ("w13", "w2", "b13", "b2")}
        for act in ACTIVATIONS:
            for gate_up in (("concat", "interleaved") if L["gated"] else ("concat",)):
                fields = dict(activation=act, gated=L["gated"], w_layout=L["w_layout"], gate_up=gate_up,
                              intermediate_size=L["I"], **expert_bias_fields(w["b13"] is not None,
                                                                             w["b2"] is not None))
                try:
                    s = MoESpec(E, k, H, **fields)
                except SpecError:
                    continue
                err = 0.0
                for h, ids, wt, y in probes:
                    with torch.no_grad():
                        ref = reference.experts(h, ids, wt, w["w13"], w["b13"], w["w2"], w["b2"], s)
                    err = max(err, float((ref - y).abs().max() / y.abs().max().clamp_min(1e-30)))
                if err < best[0]:
                    best = (err, fields, L)
    if best[1] is None or not best[0] <= tol:
        raise PairError(f"no spec activation gives the experts' output (best rel. err {best[0]:.1e} > {tol:g})",
                        RejectCode.VERIFICATION_FAILED)
    binds = {n: (f"{prefix}.{best[2][n]}" if best[2][n] else None) for n in ("w13", "w2", "b13", "b2")}
    return best[1], binds, best[0]


def _packed_fields(experts: PackedExperts, prefix: str, E: int, H: int, k: int, probes: list,
                   tol: float) -> tuple[dict, dict, float]:
    """``fit_experts`` for 4-bit experts: the module's own fields (its activation, gate / up order, quantization),
    bound to its packed tensors, scales and zeros as they are, checked like a fitted reading: ``reference.experts``
    on those tensors against the module's output on the probes."""
    s = experts.spec(k)
    if (s.num_experts, s.hidden_size) != (E, H):
        raise PairError(f"the 4-bit experts hold E={s.num_experts}, H={s.hidden_size}; the router says E={E}, H={H}")
    fields = dict(activation=s.activation, gated=s.gated, w_layout="out_in", gate_up=s.gate_up,
                  has_expert_bias=s.has_expert_bias, expert_bias=s.expert_bias,
                  intermediate_size=s.intermediate_size, activation_alpha=s.activation_alpha, activation_limit=s.activation_limit,
                  activation_clamp=s.activation_clamp, activation_clamp_after=s.activation_clamp_after, quant=s.quant)
    t = experts.tensors()
    q = {n: t.get(n) for n in ("w13_scale", "w2_scale", "w13_zero", "w2_zero")}
    err = 0.0
    for h, ids, wt, y in probes:
        with torch.no_grad():
            ref = reference.experts(h, ids, wt, t["w13"], t["b13"], t["w2"], t["b2"], s, **q)
        err = max(err, float((ref - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    if not err <= tol:
        raise PairError(f"the 4-bit experts' output differs from their spec's reference (rel. err {err:.1e} > "
                        f"{tol:g})", RejectCode.VERIFICATION_FAILED)
    binds = {n: f"{prefix}.{n}" if v is not None else None for n, v in {**t, **q}.items()}
    return fields, binds, err


# ------------------------------------------------------------------------------------------------------- router
def _router_tensors(router: nn.Module, w_path: str, b_path: str | None, E: int, H: int):
    """(vectors [H], vectors [E] other than the bias, the constant floating tensors) under the router."""
    vec_h, vec_e, const = [], [], []
    for n, t in list(router.named_parameters()) + list(router.named_buffers()):
        if n == w_path or not t.is_floating_point():
            continue
        if _constant(t):
            const.append(n)
        if n == b_path:
            continue
        if tuple(t.shape) == (H,):
            vec_h.append(n)
        elif tuple(t.shape) == (E,):
            vec_e.append(n)
    return vec_h, vec_e, const


def _run_router(router: nn.Module, lay: PairLayout, r: torch.Tensor):
    a = [None] * lay.r_nargs
    a[lay.r_arg] = r
    with torch.no_grad():
        out = router(*a)
    return out[lay.r_w].float(), out[lay.r_ids].long()


def _sorted_routing(w: torch.Tensor, ids: torch.Tensor):
    ids_s, order = ids.sort(-1)
    return w.gather(1, order), ids_s


def _ratios(u: torch.Tensor, b, w: torch.Tensor, ids: torch.Tensor):
    """Per token, c_t with log(w0 / w1) = c_t (u[id0] - u[id1]) + b[id0] - b[id1] (softmax, two chosen experts),
    and the tokens where it is defined; None with fewer than two chosen."""
    if ids.shape[1] < 2:
        return None
    ui = u.gather(1, ids[:, :2]).double()
    du = ui[:, 0] - ui[:, 1]
    lr = torch.log(w[:, 0].double().clamp_min(1e-300) / w[:, 1].double().clamp_min(1e-300))
    if b is not None:
        bi = b.double()[ids[:, :2]]
        lr = lr - (bi[:, 0] - bi[:, 1])
    ok = du.abs() > 1e-3 * du.abs().max().clamp_min(1e-30)
    return lr / torch.where(ok, du, torch.ones_like(du)), ok


def _log_ratio_const(u: torch.Tensor, b, w: torch.Tensor, ids: torch.Tensor) -> float | None:
    """The median over the tokens of ``_ratios``: one constant c."""
    got = _ratios(u, b, w, ids)
    if got is None or not bool(got[1].any()):
        return None
    c = float(got[0][got[1]].median())
    return c if math.isfinite(c) and c > 0 else None


def _snap(c: float, H: int) -> float:
    """A fitted constant snapped (within ``policy.SNAP_REL``) to 1, H ** +-0.5, H ** +-1, or its value to four
    significant digits (a config's 0.25); else as fitted."""
    for n in (1.0, H ** -0.5, H ** 0.5, 1.0 / H, float(H), float(f"{c:.4g}")):
        if abs(c / n - 1) <= policy.SNAP_REL:
            return n
    return c


def _matches(spec: MoESpec, r, W, b, sv, es, w_obs, ids_obs, tol) -> float | None:
    """The routed scale (1 when none) with which ``spec`` routes r as observed, or None."""
    logits = reference.router_logits(reference.router_input(r, r, sv, spec), W, b, spec).float()
    w, ids = reference.route(logits, None, spec, expert_scale=es)
    w, ids = _sorted_routing(w, ids)
    if not torch.equal(ids, ids_obs):
        return None
    den = float((w.double() * w.double()).sum())
    s = float((w_obs.double() * w.double()).sum()) / den if den else math.nan
    if not (math.isfinite(s) and s > 0):
        return None
    s = 1.0 if abs(s - 1) <= policy.SNAP_REL else s
    ok = torch.allclose(w_obs.double(), s * w.double(), rtol=tol, atol=tol * float(w_obs.abs().max()))
    return s if ok else None


def fit_router(router: nn.Module, prefix: str, lay: PairLayout, parts: BlockParts, experts_fields: dict, E: int,
               H: int, k: int, dtype, device) -> tuple[MoESpec, dict, list, list]:
    """(the pair's spec, the router's bindings, the constant tensors to randomise in checks, notes)."""
    rel = (lambda p: p[len(prefix) + 1:] if p and p.startswith(prefix + ".") else ("" if p == prefix else None))
    w_path, b_path = rel(parts.router_weight), rel(parts.router_bias)
    if not w_path:
        raise PairError("the router weight [E, H] is not held by the router module")
    vec_h, vec_e, const = _router_tensors(router, w_path, b_path, E, H)
    if len(vec_h) > 1 or len(vec_e) > 1:
        raise PairError(f"the router holds several [H] / [E] vectors ({vec_h + vec_e}); which does what is not "
                        f"read", RejectCode.UNSUPPORTED_ROUTING)
    g = torch.Generator().manual_seed(policy.PROBE_SEED + 1)
    r = torch.randn(96, H, generator=g).to(device=device, dtype=dtype)
    tol = policy.routing_match_tolerance(dtype)
    with randomised(router, const), torch.no_grad():
        W = get_path(router, w_path)
        b = get_path(router, b_path) if b_path else None
        w_obs, ids_obs = _sorted_routing(*_run_router(router, lay, r))
        for norm in (False, True):
            for sv_p in [None] + vec_h:
                for es_p in [None] + vec_e:
                    sv = None if sv_p is None else get_path(router, sv_p)
                    es = None if es_p is None else get_path(router, es_p)
                    for scoring in ("softmax", "sigmoid"):
                        for renorm in (True, False):
                            try:
                                base = MoESpec(E, k, H, scoring=scoring, renormalize=renorm,
                                               has_router_bias=b is not None, router_input=True, router_norm=norm,
                                               router_in_scale=sv is not None, expert_scale=es is not None,
                                               **experts_fields)
                            except SpecError:
                                continue
                            got = _fit_const(base, r, W, b, sv, es, w_obs, ids_obs, tol, H)
                            if got is None:
                                continue
                            spec, notes = got
                            if norm:
                                spec = _fit_eps(spec, router, lay, W, b, sv, es, dtype, device, notes)
                            binds = {"router_w": f"{prefix}.{w_path}", "router_b": b_path and f"{prefix}.{b_path}",
                                     "router_in_scale": sv_p and f"{prefix}.{sv_p}",
                                     "expert_scale": es_p and f"{prefix}.{es_p}"}
                            return spec, binds, [f"{prefix}.{n}" for n in const], notes
    raise PairError("no routing the spec expresses gives the router's ids and weights (norm / scale vector / "
                    "per-expert scale / softmax or sigmoid / renormalised or not)", RejectCode.UNSUPPORTED_ROUTING)


def _fit_const(base: MoESpec, r, W, b, sv, es, w_obs, ids_obs, tol, H: int):
    cands = [1.0, H ** -0.5]
    if base.scoring == "softmax":
        logits = reference.router_logits(reference.router_input(r, r, sv, base), W, None, base).float()
        w_un = w_obs / es.float()[ids_obs] if es is not None else w_obs
        c = _log_ratio_const(logits, b, w_un, ids_obs)
        if c is not None:
            cands = [_snap(c, H)] + cands
    for c in dict.fromkeys(cands):
        try:
            spec = base.replace(router_in_const=float(c))
        except SpecError:
            continue
        s = _matches(spec, r, W, b, sv, es, w_obs, ids_obs, tol)
        if s is not None:
            spec = spec.replace(routed_scaling_factor=s) if s != 1.0 else spec
            return spec, [f"pair router: {spec.describe()} (constant {c:.6g})"]
    return None


def _fit_eps(spec: MoESpec, router, lay, W, b, sv, es, dtype, device, notes: list) -> MoESpec:
    """The router norm's epsilon, from rows of tiny magnitude (where it dominates the mean square)."""
    if spec.scoring != "softmax" or spec.top_k < 2:
        notes.append(f"pair router: norm epsilon not measurable here; {spec.router_norm_eps:g} assumed")
        return spec
    g = torch.Generator().manual_seed(policy.PROBE_SEED + 2)
    r = (torch.randn(64, spec.hidden_size, generator=g) * 1e-4).to(device=device, dtype=dtype)
    w_obs, ids_obs = _sorted_routing(*_run_router(router, lay, r))
    raw = spec.replace(router_norm=False, router_in_const=1.0)
    u = reference.router_logits(reference.router_input(r, r, sv, raw), W, None, raw).float()
    w_un = w_obs / es.float()[ids_obs] if es is not None else w_obs
    got = _ratios(u, b, w_un, ids_obs)  # per token c * (ms + eps) ** -0.5, ms the row's mean square
    if got is None or not bool(got[1].any()):
        return spec
    q, ok = got
    ms_t = r.double().pow(2).mean(-1)
    eps = float(((spec.router_in_const / q[ok]) ** 2 - ms_t[ok]).median())
    ms = float(ms_t.median())
    if not math.isfinite(eps):
        return spec
    if eps > 0:
        p = 10 ** round(math.log10(eps))
        eps = p if abs(eps / p - 1) < 0.1 else eps
    eps = max(0.0, eps)
    notes.append(f"pair router: norm epsilon {eps:g} (measured on rows of mean square {ms:.1e})")
    return spec.replace(router_norm_eps=float(eps))
