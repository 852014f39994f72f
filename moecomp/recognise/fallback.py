"""Attribute-based MoE block detection: the fallback for blocks Dynamo cannot capture, and for meta-device models.

``static_extract(block, parts)`` names the block's parts (:mod:`moecomp.recognise.structure`) and reads the routing and
expert settings from the module and its config; ``measure(block, x, extraction)``, when it may run the block,
*measures* what cannot be read:

1. the activation: ``act_fn`` / ``_apply_gate`` are called on a probe tensor spanning [-12, 12] and compared with
   every activation the spec knows (this also catches clamped SwiGLU variants the spec cannot express);
2. the routing: the block runs once on a random input with a hook on the experts module that records the
   ``(top_k_index, top_k_weights)`` it receives; every routing the spec can express (scoring, order, renormalise,
   groups, group score) is evaluated on the same router logits and the one that picks the same experts with the
   same weights (up to one constant, the routed scaling) is kept (sparsemixer routing: ``sparsemixer_fit``);
3. precisions: router GEMM in fp32 or in the model dtype, routing weights rounded to the model dtype or not,
   from the dtypes the router returns when run in bf16.

Without an input (meta tensors) only the static guesses are made and the result is marked unverified.
The caller (``moecomp.optimize``) still checks the whole block's output against the op before rewriting.
Probe inputs and match tolerances come from :mod:`moecomp.core.policy`. Hash routing: :mod:`moecomp.recognise.hash_reader`.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import math
import re
import tokenize
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..core import policy
from ..oracle import reference
from ..core.match import Evidence, Match
from ..core.reject import Refused, Reject, RejectCode
from ..core.spec import MoESpec, SharedExpertSpec, SpecError, expert_bias_fields
from ..probe.block import ProbeRun, hash_call_args, run_probe
from ..formats import fp8
from . import gamma_reader, hash_reader, norm_fit, output_fit, router_scale, sparsemixer_fit
from ..core import names
from .fallback_bind import FallbackError, bindings as _bindings, quant as _quant
from ..probe.activations import describe_unknown_gate, probe_activation, probe_gate, probe_mlp
from ..core.names import read_attr
from ..formats.packed import PackedExperts
from ..core.parts import BlockParts, MLPParts
from .structure import NotABlock, find_parts
from ..core.derived import get_path


ROUTING_MEASURED = "routing measured from the experts' inputs"  # an evidence note (recognise._observed reads it)
_TO_FIT = "to be fitted on the output"  # an activation the attribute reader could not name (stacked experts)


# ----------------------------------------------------------------------------------------------- attributes


def attr_sources(block: nn.Module, parts: BlockParts) -> list:
    """Objects to read settings from, most specific first: router, block, experts, their configs."""
    out = []
    try:
        out.append(get_path(block, parts.router_module))
    except AttributeError:
        pass
    out.append(block)
    experts = get_path(block, parts.experts)
    out.append(experts)
    for o in list(out):
        cfg = getattr(o, "config", None)
        if cfg is not None and not isinstance(cfg, nn.Module):
            out.append(cfg)
    seen, uniq = set(), []
    for o in out:
        if id(o) not in seen:
            seen.add(id(o))
            uniq.append(o)
    return uniq


def _source(obj) -> str:
    """The forward's source with comments blanked out (a comment such as "sigmoid scoring, not softmax" must not
    count as a softmax); code formatting is kept as written, since the source patterns below depend on it."""
    try:
        src = inspect.getsource(type(obj).forward if not inspect.isfunction(obj) else obj)
    except (OSError, TypeError):
        return ""
    return _strip_comments(src)


def _strip_comments(src: str) -> str:
    lines = src.splitlines(keepends=True)
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return src
    for t in reversed(toks):
        if t.type == tokenize.COMMENT:
            (row, col), (_, end) = t.start, t.end
            line = lines[row - 1]
            lines[row - 1] = line[:col] + line[end:]
    return "".join(lines)


def _mlp_activation(mod: nn.Module, sources) -> tuple[str | None, str]:
    """Activation of a dense MLP module: probe its act_fn, else read hidden_act from the config."""
    for n in ("act_fn", "act", "activation_fn", "activation"):
        fn = getattr(mod, n, None)
        if fn is not None and callable(fn):
            a = probe_activation(fn)
            return a, ("probed" if a else f"{n}={type(fn).__name__} is not an activation the spec knows")
    name = read_attr(sources, ("hidden_act", "hidden_activation", "mlp_hidden_act"), (str,))
    return names.ACT_NAMES.get(name), f"read hidden_act={name!r}"


# ----------------------------------------------------------------------------------------------- static spec
_F32 = r"(float\(\)|type\(torch\.float(32)?\)|to\(torch\.float(32)?\)|to\(self\.weight\.dtype\))"
_RE_ROUTER_FP32 = [
    re.compile(r"(linear|matmul|mm)\(\s*[\w\.]+\." + _F32),  # linear(x.float(), ...)
    re.compile(r"hidden_states\s*=\s*hidden_states\." + _F32),  # x = x.float(); linear(x, ...)
    re.compile(r"flat\s*=\s*flat\." + _F32),
]
_RE_ROUND = re.compile(
    r"\.to\(\s*(hidden_states|router_logits|x|hidden|flat|input)\.dtype\s*\)|type_as\(hidden_states\)")
_RE_TOPK_LOGITS = re.compile(r"topk\(\s*(router_)?logits|(router_)?logits\.topk\(|topk\(\s*(router_)?logits\s*,")
_RE_TOPK_PROBS = re.compile(r"topk\(\s*(router_)?(probs|probabilities|scores|routing_weights)|(probs|scores)\.topk\(")


def _routing_guess(block: nn.Module, parts: BlockParts, sources) -> dict:
    """Routing fields as read from attributes and forward source (no running): a best guess that also orders
    the candidates ``measure`` tries (equivalent routings, e.g. top-k->softmax vs renormalised softmax->top-k, are
    told apart only by this order)."""
    E = parts.num_experts
    rsrc = _source(get_path(block, parts.router_module)) if parts.router_module else ""
    src = rsrc + "\n" + _source(block)
    g = {}
    scoring = read_attr(sources, names.SCORING_NAMES, (str,))
    scoring = {"softmax": "softmax", "sigmoid": "sigmoid", "sqrtsoftplus": "sqrtsoftplus",
               "sqrt_softplus": "sqrtsoftplus"}.get(str(scoring).lower()) if scoring else None
    if scoring is None:
        if re.search(r"sigmoid", src) and not re.search(r"softmax", src):
            scoring = "sigmoid"
        elif parts.correction_bias is not None and "softmax" not in src:
            scoring = "sigmoid"
        else:
            scoring = "softmax"
    g["scoring"] = scoring
    if scoring == "softmax" and _RE_TOPK_LOGITS.search(src) and not _RE_TOPK_PROBS.search(src):
        g["score_order"] = "topk_then_score"
    norm = read_attr(sources, names.NORM_NAMES, (bool, int))
    if norm is None:
        norm = ".sum(dim=-1, keepdim=True)" in src or ".sum(-1, keepdim=True)" in src
    g["renormalize"] = bool(norm) and g.get("score_order") != "topk_then_score"
    m = re.search(r"\.sum\(dim=-1, keepdim=True\)\s*\+\s*([0-9.]+e-?[0-9]+|[0-9]*\.[0-9]+)", src)
    if m and g["renormalize"]:
        try:
            g["renorm_eps"] = float(m.group(1))
        except ValueError:
            pass
    m = re.search(r"\.sum\(dim=-1, keepdim=True\)\s*\+\s*self\.(\w+)", src)  # + self.<eps attribute>
    if m and g["renormalize"] and "renorm_eps" not in g:
        v = read_attr(sources, (m.group(1),), (float,))
        if v is not None and 0 <= v < 1e-3:
            g["renorm_eps"] = float(v)
    ng = read_attr(sources, names.GROUP_NAMES, (int,))
    tg = read_attr(sources, names.TOPK_GROUP_NAMES, (int,))
    method = read_attr(sources, ("topk_method",), (str,))
    if ng and tg and ng > 1 and E % ng == 0 and (method is None or method != "greedy"):
        g["n_group"], g["topk_group"] = int(ng), int(tg)
        g["group_score"] = "max" if (method == "group_limited_greedy" or ".max(dim=-1)" in src) else "top2_sum"
    scale = read_attr(sources, names.SCALE_NAMES, (int, float))
    if scale is not None and not isinstance(scale, bool):
        g["routed_scaling_factor"] = float(scale)
    g["has_correction_bias"] = parts.correction_bias is not None
    g["has_router_bias"] = parts.router_bias is not None
    g["router_fp32"] = any(r.search(rsrc or src) for r in _RE_ROUTER_FP32)
    g["round_weights"] = bool(_RE_ROUND.search(rsrc or src))
    # the whole classes (helpers such as AXK2's apply_group_scoring live outside forward)
    csrc = src + "\n" + (_class_source(get_path(block, parts.router_module)) if parts.router_module else "") + \
        "\n" + _class_source(block)
    if g["has_correction_bias"] and _RE_BIAS_ON_LOGITS.search(csrc):
        g["bias_on_logits"] = True
        g.pop("score_order", None)
    if g.get("n_group", 1) > 1 and _RE_MASK_ZERO.search(csrc) and not _RE_MASK_INF.search(csrc):
        g["group_mask_zero"] = True
    m = _RE_RENORM_MIN.search(csrc)
    if m and g["renormalize"]:
        v = _resolve_number(m.group(1), [get_path(block, parts.router_module) if parts.router_module else block,
                                         block] + list(sources))
        if v is not None and v > 0:
            g["renorm_min"] = v
    return g


# topk(logits + bias): the correction bias steers the choice on the logits (Kolibri-1)
_RE_BIAS_ON_LOGITS = re.compile(r"topk\(\s*(router_)?logits\s*\+|(router_)?logits\s*\+\s*self\.\w*(bias|correction)")
_RE_MASK_ZERO = re.compile(r"masked_fill\((?:[^()]|\([^()]*\))*,\s*0(\.0*)?\s*\)")
_RE_MASK_INF = re.compile(r"masked_fill\((?:[^()]|\([^()]*\))*,\s*(float\(\s*[\"']-inf[\"']\s*\)|-math\.inf|-torch\.inf)")
# weights / clamp(weights.sum(...), min=norm_min)  (ERNIE-4.5)
_RE_RENORM_MIN = re.compile(r"clamp\(\s*[\w\.]+\.sum\([^()]*\)\s*,\s*min\s*=\s*([\w\.\-+e]+)\s*\)")


def _class_source(obj) -> str:
    try:
        return inspect.getsource(type(obj))
    except (OSError, TypeError):
        return ""


def _resolve_number(expr: str, objs) -> float | None:
    try:
        return float(expr)
    except ValueError:
        pass
    name = expr.split(".")[-1]
    for o in objs:
        v = getattr(o, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _shared_spec(block: nn.Module, parts: BlockParts, sources) -> tuple[SharedExpertSpec | None, list[str]]:
    sp = parts.shared
    if sp is None:
        return None, []
    if any(b is not None for b in (sp.gate_bias, sp.up_bias, sp.down_bias)):
        raise FallbackError(f"shared expert {sp.path!r} has biases (the op has no shared-expert biases)")
    mod = get_path(block, sp.path)
    act, how = _mlp_activation(mod, sources)
    clamp, alpha, limit, after = False, 1.702, 7.0, False
    if not any(p.device.type == "meta" for p in mod.parameters()):
        r = probe_mlp(block, sp, act)
        if r is None:
            raise FallbackError(f"shared expert {type(mod).__name__} computes no activation the spec knows (called "
                                f"on a probe: {how})")
        act, clamp, alpha, limit, after = r
        how = f"measured {act}" + _clamp_note(clamp, after, limit) + (
            f" (alpha {alpha:g}, limit {limit:g})" if act == "swiglu_oai" else "")
    elif act is None:
        raise FallbackError(f"shared expert activation not supported ({how})")
    combine = read_attr(sources, names.SHARED_COMBINE_NAMES, (str,))
    if combine not in (None, "sum", "average"):
        raise FallbackError(f"routed and shared outputs combine as {combine!r} (the op adds or averages them)")
    try:
        spec = SharedExpertSpec(
            intermediate_size=sp.intermediate_size, activation=act, gated=sp.gated,
            layout="concat" if sp.concat else "separate", gate="sigmoid" if parts.shared_gate else "none",
            activation_alpha=alpha if act == "swiglu_oai" else 1.702,
            activation_limit=limit if (clamp or after or act == "swiglu_oai") else 7.0, activation_clamp=clamp,
            activation_clamp_after=after, scale=0.5 if combine == "average" else 1.0,  # the routed half is fitted by the verify stage
        )
    except SpecError as e:
        raise FallbackError(f"shared expert: {e}") from None
    return spec, [f"shared activation {how}"] + (["routed and shared outputs averaged"] if combine == "average"
                                                  else [])


def _clamp_note(clamp: bool, after: bool, limit: float) -> str:
    """How a measured activation is clamped, for the notes."""
    return f" clamped at {limit:g}" if clamp else f" clamped after the activation at {limit:g}" if after else ""


def _expert_activation(block: nn.Module, parts: BlockParts, sources):
    """(activation, gate_up, alpha, limit, clamp, note, {other activation fields}) of the routed experts: the other
    fields are the softcaps and ``activation_clamp_after``, where set."""
    experts = get_path(block, parts.experts)
    if parts.kind == "modulelist":
        mp = parts.expert_mlps[0]
        mod = get_path(block, mp.path)
        act, how = _mlp_activation(mod, sources)
        if not any(p.device.type == "meta" for p in mod.parameters()):
            r = probe_mlp(block, mp, act)
            if r is None:
                raise FallbackError(f"expert MLP {type(mod).__name__} computes no activation the spec knows ({how})")
            act, clamp, alpha, limit, after = r
            return (act, "concat", alpha, limit, clamp, f"measured on expert 0: {act}" + _clamp_note(
                clamp, after, limit), {"activation_clamp_after": after} if after else {})
        if act is None:
            raise FallbackError(f"expert activation not supported ({how})")
        return act, "concat", 1.702, 7.0, False, how, {}
    if getattr(experts, "has_post_expert_norm", False) and parts.expert_norm is None:
        raise FallbackError("experts apply a norm after each expert (has_post_expert_norm) and no child of them "
                            "holds one vector of their width")
    if not parts.gated:
        act, how = _mlp_activation(experts, sources)
        if act is None:
            raise FallbackError(f"expert activation not supported ({how})")
        return act, "concat", 1.702, 7.0, False, how, {}
    concat = getattr(experts, "is_concatenated", None)
    if parts.split_gate_up is None:
        r = probe_gate(experts, concat)
        if r is not None:
            caps = r.gate_softcap or r.up_softcap
            extra = dict(gate_softcap=r.gate_softcap, up_softcap=r.up_softcap) if caps else {}
            extra.update({"activation_clamp_after": True} if r.clamp_after else {})
            return (*r[:5], "probed _apply_gate" + (f" (softcaps gate {r.gate_softcap:g}, up {r.up_softcap:g} "
                                                    "fitted)" if caps else "")
                    + _clamp_note(r.clamp, r.clamp_after, r.limit), extra)
        if getattr(experts, "_apply_gate", None) is not None:
            what = describe_unknown_gate(experts)
            raise FallbackError(f"the experts' gate ({type(experts).__name__}._apply_gate) is not one the spec "
                                f"knows{': ' + what if what else ''}")
    act, how = _mlp_activation(experts, sources)
    if act is None and not any(p.device.type == "meta" for p in experts.parameters()):
        return "silu", "concat", 1.702, 7.0, False, f"{how}: {_TO_FIT}", {}  # stacked: output_fit finds it
    if act is None:
        raise FallbackError(f"expert activation not supported ({how})")
    return act, "concat" if concat in (None, True) else "interleaved", 1.702, 7.0, False, how, {}


def static_extract(block: nn.Module, parts: BlockParts | None = None) -> Match:
    """Spec and bindings from attributes only (safe on the meta device). Routing is a best guess (evidence
    method "fallback (meta)", checked "read only" until :func:`measure` runs the block)."""
    if parts is None:
        try:
            parts = find_parts(block)
        except NotABlock as e:
            raise FallbackError(str(e)) from None
    if parts.kind == "structural":
        raise FallbackError(f"the attribute reader names per-expert parts and knows none of {parts.experts!r}'s "
                            "(found by shapes: only the FX pass reads such a block)", RejectCode.NOT_RECOGNISED)
    if isinstance(get_path(block, parts.experts), PackedExperts):
        raise FallbackError(f"{parts.experts!r} holds 4-bit packed experts (PackedExperts, "
                            f"{get_path(block, parts.experts).quant.weight}): only the FX pass reads those (their "
                            "dequant_4bit nodes name the scales and zero points)", RejectCode.UNSUPPORTED_STRUCTURE)
    sources = attr_sources(block, parts)
    notes = []
    E, H, I = parts.num_experts, parts.hidden_size, parts.intermediate_size
    if parts.extra_rows or parts.kind == "fused" and get_path(block, parts.w2).shape[0] != E:
        held = get_path(block, parts.w2).shape[0] if parts.kind == "fused" else E
        raise FallbackError(f"router {parts.router_weight!r} has {E + parts.extra_rows} outputs but the experts hold "
                            f"{held} (zero-computation experts, LongCat-Flash style: what the router's other outputs "
                            "compute is in the block's forward, not its attributes): only the FX pass reads these",
                            RejectCode.UNSUPPORTED_STRUCTURE)
    top_k = read_attr(sources, names.TOPK_NAMES, (int,))
    if top_k is None or isinstance(top_k, bool):
        raise FallbackError("top-k not found among the block's / router's / config's attributes")
    act, gate_up, alpha, limit, clamp, how, act_fields = _expert_activation(block, parts, sources)
    notes.append(f"expert activation: {how}")
    shared, sh_notes = (gamma_reader.stacked_shared_spec(block, parts) if parts.shared is not None
                        and parts.shared.stacked else _shared_spec(block, parts, sources))
    notes += sh_notes
    if parts.extra_modules:
        notes.append(f"block has other parameterised children: {', '.join(parts.extra_modules)}")
    if parts.latent_size:
        notes.append(f"experts of width {parts.latent_size} between {parts.latent_in} / {parts.latent_out} (shapes)")
    routing = {**_routing_guess(block, parts, sources), **gamma_reader.gamma_fields(parts)}
    bindings, derived = _bindings(block, parts)
    try:
        norm_fields, norm_bind, norm_notes = norm_fit.read_norms(block, parts)
    except norm_fit.NormUnread as e:
        raise FallbackError(str(e), RejectCode.NOT_RECOGNISED) from None
    bindings.update(norm_bind)
    notes += norm_notes
    hash_reader.apply(block, parts, int(top_k), routing, bindings, notes)  # a token-id table: hash routing
    quant, shared_quant = _quant(block, parts, bindings)
    if shared_quant is not None:
        shared = dataclasses.replace(shared, quant=shared_quant)
    kw = dict(routing, **norm_fields)
    try:
        spec = MoESpec(
            num_experts=E, top_k=int(top_k), hidden_size=H, intermediate_size=I,
            activation=act, gated=parts.gated, activation_alpha=alpha, activation_limit=limit,
            activation_clamp=clamp, w_layout=parts.w_layout, gate_up=gate_up, shared=shared,
            **expert_bias_fields(bindings.get("b13") is not None, bindings.get("b2") is not None),
            quant=quant, latent_size=parts.latent_size, latent_bias=parts.latent_in_bias is not None,
            **act_fields, **kw,
        )
    except SpecError as e:
        raise FallbackError(f"no valid spec: {e}", RejectCode.SPEC_INVALID) from None
    return Match(spec, bindings, derived, parts, Evidence("fallback (meta)", "read from attributes and source",
                                                         notes=notes))


def _match_routing(ids_ref, w_ref, ids, w, tol) -> float | None:
    """None when the id sets differ on any token, else the weight scale c with w_ref ~= c * w (or nan if no fit)."""
    if ids_ref.shape != ids.shape:
        return None
    a_ids, a_ord = ids_ref.sort(-1)
    b_ids, b_ord = ids.sort(-1)
    if not torch.equal(a_ids, b_ids.to(a_ids.dtype)):
        return None
    a = w_ref.float().gather(-1, a_ord)
    b = w.float().gather(-1, b_ord)
    denom = (b * b).sum()
    if denom == 0:
        return float("nan")
    c = float((a * b).sum() / denom)
    if not torch.allclose(a, c * b, rtol=tol, atol=tol * float(a.abs().max())):
        return float("nan")
    return c


def numeric_consts(sources, k: int) -> list[float]:
    out = []
    for src in sources:
        names = list(vars(src)) if hasattr(src, "__dict__") else []
        for n in names:
            try:
                v = getattr(src, n)
            except Exception:
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0,):
                out += [float(v), 1.0 / float(v)]
    return out + [float(k), 1.0 / k]


def routing_candidates(guess: dict, E: int, k: int, has_corr: bool):
    scorings = list(dict.fromkeys([guess.get("scoring", "softmax"), "softmax", "sigmoid", "sqrtsoftplus"]))
    norm0 = guess.get("renormalize", True)
    bol0 = bool(guess.get("bias_on_logits", False))
    mz0 = bool(guess.get("group_mask_zero", False))
    groups = []
    if guess.get("n_group", 1) > 1:
        gs0 = guess.get("group_score", "top2_sum")
        groups += [(guess["n_group"], guess["topk_group"], gs0),
                   (guess["n_group"], guess["topk_group"], "max" if gs0 == "top2_sum" else "top2_sum")]
    groups.append((1, 1, "top2_sum"))
    orders = ["score_then_topk", "topk_then_score"]
    if guess.get("score_order") == "topk_then_score":
        orders.reverse()
    for order in orders:
        for scoring in scorings:
            if order == "topk_then_score" and scoring != "softmax":
                continue
            for norm in ([norm0, not norm0] if order == "score_then_topk" else [False]):
                for ng, tg, gs in groups:
                    if order == "topk_then_score" and ng > 1:
                        continue
                    bols = [bol0, not bol0] if has_corr and order == "score_then_topk" else [False]
                    mzs = [mz0, not mz0] if ng > 1 else [False]
                    for bol in bols:
                        for mz in mzs:
                            yield dict(scoring=scoring, score_order=order, renormalize=norm, n_group=ng,
                                       topk_group=tg, group_score=gs, bias_on_logits=bol, group_mask_zero=mz)


def measure(block: nn.Module, x: torch.Tensor, ext: Match) -> tuple[Match, ProbeRun]:
    """Run the block on ``x`` and replace the guessed routing / precision fields by measured ones (FP8 modules run
    their plain-PyTorch forward: ``formats/fp8.py``)."""
    with torch.no_grad(), fp8.plain_fp8(block):
        return _measure(block, x, ext)


def _routing_seen(run: ProbeRun, T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k]) the experts module received on the probe run."""
    _, ids, w = run.experts_args[:3]
    if not (isinstance(ids, torch.Tensor) and isinstance(w, torch.Tensor) and ids.dim() == 2 and
            ids.shape[0] == T and w.shape == ids.shape):
        raise FallbackError("the experts module was not called with (hidden [T, H], ids [T, k], weights [T, k])")
    if (ids < 0).any() or (ids >= E).any():
        raise FallbackError("the router produced expert ids outside [0, E) (skip / null experts)",
                            RejectCode.UNSUPPORTED_ROUTING)
    return ids, w


def _fit_routing(block: nn.Module, parts: BlockParts, spec: MoESpec, x2: torch.Tensor, ids, w, rout=None) -> dict:
    """The routing fields (and the routed scale, unsnapped) of the first routing the spec knows that picks the
    experts this router picked, with the same weights up to one constant. ``rout``: what the router module returned
    (its logits give the logit scale, ``recognise/router_scale.py``)."""
    E, k = parts.num_experts, ids.shape[1]
    W = get_path(block, parts.router_weight)
    Rb = get_path(block, parts.router_bias) if parts.router_bias else None
    scale = router_scale.measure_scale(rout, x2, W[:E], None if Rb is None else Rb[:E],
                                       numeric_consts(attr_sources(block, parts), k))
    corr = get_path(block, parts.correction_bias).reshape(E) if parts.correction_bias else None
    tol = policy.routing_match_tolerance(x2.dtype)
    guess = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    fp32_variants = [spec.router_fp32, not spec.router_fp32] if x2.dtype != torch.float32 else [spec.router_fp32]
    for fp32 in fp32_variants:
        probe_spec = spec.replace(top_k=k, router_fp32=fp32, routed_scaling_factor=1.0, renorm_eps=0.0,
                                  router_scale=scale)
        logits = reference.router_logits(x2, W, Rb, probe_spec).float()
        for cand in routing_candidates(guess, E, k, corr is not None):
            try:
                cs = probe_spec.replace(**cand)
            except SpecError:
                continue
            w_c, ids_c, _ = reference.route_with_gammas(logits, corr, cs)  # (with gamma rows: renormalised with them)
            c = _match_routing(ids, w, ids_c, w_c, tol)
            if c is not None and not math.isnan(c):
                return dict(cand, top_k=k, router_fp32=fp32, routed_scaling_factor=c, router_scale=scale)
    found = None if spec.gamma_rows else sparsemixer_fit.fit(
        block, parts, spec, x2, ids, w, attr_sources(block, parts), _match_routing,
        fp32_variants)  # k thresholded argmax rounds (PhiMoE)
    if found is not None:
        return found
    if spec.gamma_rows:
        raise FallbackError(
            f"routing not recognised: no sigmoid / sqrt-softplus top-k routing whose k chosen scores, renormalised "
            f"together with the scores of the router's {spec.gamma_rows} rows past the experts (shared_gamma "
            f"'joint_renorm'), gives the weights the experts receive", RejectCode.UNSUPPORTED_ROUTING)
    raise FallbackError(
        "routing not recognised: no softmax / sigmoid / sqrt-softplus, top-k, renormalise, group-limited "
        "or sparsemixer routing the spec knows picks the experts this router picks", RejectCode.UNSUPPORTED_ROUTING)


def _measure(block: nn.Module, x: torch.Tensor, ext: Match) -> tuple[Match, ProbeRun]:
    parts, spec, bindings = ext.parts, ext.spec, ext.bindings
    run = run_probe(block, parts, x, **hash_call_args(block, ext.bindings, x))
    notes = list(ext.evidence.notes)
    x2 = x.reshape(-1, x.shape[-1])
    changes = {}
    if run.experts_args is not None:
        ids, w = _routing_seen(run, x2.shape[0], parts.num_experts)
        found = (hash_reader.fit(block, ext, x2, ids, w, run.kwargs, _match_routing) if spec.hash_routing
                 else _fit_routing(block, parts, spec, x2, ids, w, run.router_out))
        ws = gamma_reader.find_weight_scale(block, parts, x, ids, w, lambda r: _routing_seen(r, x2.shape[0],
                                                                                        parts.num_experts),
                                            **run.kwargs)  # a learned [1] tensor times the weights
        if ws is not None:
            bindings = {**bindings, "weight_scale": ws[0]}
            found.update(has_weight_scale=True, routed_scaling_factor=found["routed_scaling_factor"] / ws[1])
            notes.append(f"weight scale: {ws[0]} (doubling it doubles the routing weights)")
        consts = numeric_consts(attr_sources(block, parts), found["top_k"])
        # (16-bit weights the experts receive are rounded: the fit over them lands within a rounding of the dtype)
        found["routed_scaling_factor"] = policy.snap_constant(found["routed_scaling_factor"], consts,
                                                              policy.TIE_REL.get(w.dtype, policy.SNAP_REL))
        if not found["renormalize"] or found["score_order"] == "topk_then_score":
            found["renorm_eps"] = found["renorm_min"] = 0.0
        else:
            found["renorm_eps"], found["renorm_min"] = spec.renorm_eps, spec.renorm_min
        changes.update(found)
        prec = _measure_precision(block, parts, run, x)  # where the router runs in a low-precision dtype
        if prec is not None:
            changes.update(prec)
            notes.append(f"router precision measured: {prec}")
        notes.append(ROUTING_MEASURED)
    else:
        notes.append("routing read from attributes (experts not called as one module); checked on the output")
    try:
        new_spec = spec.replace(**changes)
    except SpecError as e:
        raise FallbackError(f"measured routing gives no valid spec: {e}", RejectCode.SPEC_INVALID) from None
    ev = Evidence("fallback", "routing and activation measured on a probe run", notes=notes)
    return ext.replace(spec=new_spec, bindings=bindings, evidence=ev), run


def recognise(block: nn.Module, parts: BlockParts, x: torch.Tensor | None = None) -> Match | Reject:
    """The attribute reader's answer for one block: a Match, measured by running the block on ``x`` when given
    (read from attributes only otherwise: the meta device), or a Reject."""
    try:
        with fp8.plain_fp8(block if x is not None else None):
            m = static_extract(block, parts)
            if x is not None:
                m, run = measure(block, x, m)
                m = _fit_output(block, m, run, x)
        return m
    except Refused as e:
        return e.reject


def _fit_output(block: nn.Module, m: Match, run: ProbeRun, x: torch.Tensor) -> Match:
    """Stacked expert weights the block runs with its own code (its experts module, if any, never called with the
    routing): activation, layout and routing fitted on the block's output (``output_fit``) when the guess read from
    attributes does not give it; FallbackError when the activation was not named and no fit is found."""
    if run.experts_args is not None or m.parts.kind != "fused":
        return m
    got = output_fit.fit(block, m, x, routing_candidates)
    if got is not None:
        return got
    if any(_TO_FIT in n for n in m.evidence.notes):
        raise FallbackError("the experts' activation is not named, and no activation / gate split / layout / routing "
                            "the spec knows reproduces the block's output from its stacked expert weights",
                            RejectCode.NOT_RECOGNISED)
    return m


def _measure_precision(block, parts: BlockParts, run: ProbeRun, x: torch.Tensor) -> dict | None:
    """router_fp32 / round_weights as the block shows them when it runs in a low-precision dtype.

    fp32 blocks cannot show either (casts to fp32 are no-ops there): their values come from the forward source,
    like the FX pass reads them from the casts in the traced graph.
    """
    if x.dtype == torch.float32 or run.experts_args is None:
        return None
    out = {"round_weights": run.experts_args[2].dtype == x.dtype}
    rout = run.router_out
    E, H = parts.num_experts, parts.hidden_size
    logits = None
    if isinstance(rout, torch.Tensor) and rout.shape[-1] == E:
        logits = rout
    elif isinstance(rout, (tuple, list)):
        logits = next((o for o in rout if isinstance(o, torch.Tensor) and o.is_floating_point()
                       and o.shape[-1] == E and o.numel() == x.numel() // H * E), None)
    if logits is not None:
        x2 = x.reshape(-1, H)
        W = get_path(block, parts.router_weight)[:E]  # (the rows of the E experts: not the gamma rows)
        b = get_path(block, parts.router_bias)[:E] if parts.router_bias else None
        lo = F.linear(x2, W.to(x.dtype), None if b is None else b.to(x.dtype)).float()
        hi = F.linear(x2.float(), W.float(), None if b is None else b.float())
        lg = logits.reshape(-1, E).float()
        out["router_fp32"] = bool(logits.dtype == torch.float32 and (lg - hi).abs().max() < (lg - lo).abs().max())
    return out
