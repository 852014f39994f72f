"""The numeric check of ``detect_moe``: a structural match is only accepted once it is shown to compute the same thing.

    matched region  --cut out-->  GraphModule  --run on random tokens, real weights where Dynamo gave them-->  got
    candidate MoESpec  -->  moecomp.oracle.reference.moe_forward on the same tensors  -->  want
    got ~ want (fp32: policy.FX_CHECK_TOL_FULL; 16-bit: policy.FX_CHECK_MIN_TOKEN_SHARE of the tokens within
    policy.FX_CHECK_TOL_TOKEN_LOW)  -->  accepted (the first candidate that agrees)

The op's tensors are the placeholders the match binds, or, for experts kept as per-expert modules, the per-expert
placeholders concatenated on dim 0 and stacked over the experts (``Block.stacked``). Hash routing's token ids (a call
input) are drawn in [0, V) for the check's tokens (the crowd's copies share their token's id); its table is the real
one (random ids in [0, E) without example inputs).

Block tensors the region reads but no binding names, all zeros at check time, are given random values (their effect
would vanish from the check, and the op never reads them); an output bias the epilogue peeled stays zero.

A spec that clamps (swiglu_oai, activation_clamp, activation_clamp_after) is checked again with the clamped
projections' weights scaled up until the clamps bind. Token counts follow the graph's symbolic sizes (about
``policy.FX_CHECK_TOKENS``), kept small enough that blocks which gather whole expert matrices per token (dequantized,
for FP8 / 4-bit experts) stay within ``policy.WORKING_MEMORY_BYTES``; nothing here dequantizes all experts at once
(the clamp stress reads the pre-activations a chunk of experts at a time).

Memory: a check that runs out of device memory is run again on fewer tokens (``policy.FX_CHECK_MIN_TOKENS``), then
on CPU copies of the tensors it reads; the verdict says so. An out-of-memory error is never taken for a failed check:
when every try ran out, it leaves as a ``moecomp.core.reject.StageError`` ("numeric check").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...core import policy, quant as q8
from ...oracle import reference
from ...core.args import NORM_ARGS, OP_ARGS, PEELED, SHARED_NORM_ARGS
from ...core.reject import RejectCode, StageError, is_oom, raise_if_oom
from . import graph as _fx
from .context import Context as _Context
from .graph import op_name
from .refuse import Reject
from .ties import TIE_NOTE, tie_tokens


@dataclass
class Block:
    """What the check runs: the nodes from ``x_root`` to ``out``, and where each op argument's tensor comes from."""

    x_root: fx.Node  # the block input (the cut-out graph's first input)
    x_in: fx.Node  # the op's input: x_root or a view of it with the output's shape
    out: fx.Node
    nodes: set  # region | support
    bindings: dict  # op argument -> placeholder name | None
    stacked: dict = field(default_factory=dict)  # op argument -> per expert, placeholder names concatenated on dim 0
    arg_shapes: dict = field(default_factory=dict)  # op argument -> shape the op needs it viewed as
    arg_rows: dict = field(default_factory=dict)  # op argument -> the op reads the first n rows (zero experts)
    arg_views: dict = field(default_factory=dict)  # op argument -> moe_flat.FlatView: the op reads that view of it


class _Sources:
    """Placeholders per op argument, and the op's tensor built from their values."""

    def __init__(self, ctx: _Context, blk: Block):
        ph = {n.name: n for n in ctx.placeholders}
        self.single = {k: ph[v] for k, v in blk.bindings.items() if v is not None}
        self.stacked = {k: [[ph[n] for n in names] for names in per] for k, per in blk.stacked.items()}

    def of(self, k: str) -> list:
        if k in self.stacked:
            return [p for names in self.stacked[k] for p in names]
        return [self.single[k]] if k in self.single else []

    def tensor(self, k: str, value):
        """The op's ``k`` from ``value(placeholder)``: the value itself, or the per-expert values concatenated on
        dim 0 and stacked."""
        if k in self.stacked:
            return torch.stack([torch.cat([value(p) for p in names], 0) for names in self.stacked[k]])
        return value(self.single[k]) if k in self.single else None

    def bytes_per_expert(self, E: int) -> int:
        """Working bytes of one expert's w13 and w2 gathered by the block (``w[ids]``): the gathered copy, plus its
        fp32 dequantization for fp8 / packed 4-bit weights (two weights a byte)."""
        total = 0
        for k in ("w13", "w2"):
            vals = [_fx.meta_val(p) for p in self.stacked[k][0]] if k in self.stacked else [
                _fx.meta_val(self.single[k])]
            for v in vals:
                if isinstance(v, torch.Tensor):
                    size = {torch.float8_e4m3fn: 1 + 4, torch.uint8: 1 + 2 * 4}.get(v.dtype, v.element_size())
                    per = 1 if k in self.stacked else v.shape[0] if v.dim() == 3 else E  # (2-D: experts held flat)
                    total += (v.numel() // per) * size
        return total


def verify(ctx: _Context, candidates, blk: Block):
    """Cut the block into a GraphModule and compare it with the reference for each candidate spec: (the first spec
    that agrees, how it was verified, notes for the report). Raises ``Reject`` (VERIFICATION_FAILED) when none
    agrees.

    A spec that clamps (swiglu_oai, activation_clamp, activation_clamp_after) or softcaps (gate_softcap / up_softcap) is checked a second
    time with the clamped projections' weights scaled up so that the clamps bind (the caps bend): random weights
    rarely reach a limit like 10, and a clamp that never binds proves nothing about it.

    Out of memory: tried again on fewer tokens, then on CPU copies (module docstring); ``StageError`` when every try
    ran out."""
    spec0 = candidates[0]
    src = _Sources(ctx, blk)
    # token budget: a block that gathers whole expert matrices per (token, slot) (batched_mm style) materialises
    # T * k of them; keep that within the working memory
    per_expert = src.bytes_per_expert(spec0.num_experts)
    target, per_token = policy.FX_CHECK_TOKENS, 0
    if _gathers(blk.nodes, src.of("w13") + src.of("w2")):
        per_token = max(1, spec0.top_k * per_expert)
        target = min(target, policy.working_bytes() // per_token)
        if target >= 1 and not _sym_values(blk.x_root, target, per_token):
            target = 0  # no token count the graph takes fits (static shapes: the traced one; else at least 2 a dim)
    if target < 1:
        if len(candidates) > 1:
            raise Reject("experts too large for the numeric check and the structure leaves choices open")
        return spec0, "skipped: the gathered expert weights would exceed policy.WORKING_MEMORY_BYTES", [
            "FX numeric check skipped: the expert weights the block gathers for its check tokens would exceed "
            "policy.WORKING_MEMORY_BYTES (the match rests on the structure and the verify stage)"]
    sub, inputs = extract_region(ctx, blk.nodes, blk.x_root, blk.out)
    tries = [(target, False)]
    if target > policy.FX_CHECK_MIN_TOKENS:
        tries.append((policy.FX_CHECK_MIN_TOKENS, False))
    if _device(ctx, inputs).type != "cpu":
        tries.append((target, True))
    ran_out = []
    for tokens, on_cpu in tries:
        try:
            spec, msg = _check(ctx, candidates, blk, src, sub, inputs, tokens, per_token, on_cpu)
        except Reject:
            raise
        except Exception as e:
            if not is_oom(e):  # a failure of the check itself, not a verdict: named as such
                raise StageError("numeric check", e) from e
            text = str(e).strip().splitlines()[0][:160] if str(e).strip() else "out of memory"
            ran_out.append(f"{tokens} tokens{' on the CPU' if on_cpu else ''}: {text}")
            del e
            _release()
            continue
        notes = [f"FX numeric check: {msg}"] if TIE_NOTE in msg else []
        if target < policy.FX_CHECK_MIN_TOKENS:
            notes.append(f"FX numeric check on {target} token(s): the expert weights the block gathers for more "
                         "would exceed policy.WORKING_MEMORY_BYTES")
        if ran_out:
            notes.append(f"FX numeric check ran out of memory ({'; '.join(ran_out)}); retried: {msg}")
        return spec, msg, notes
    raise StageError("numeric check", torch.OutOfMemoryError("; ".join(ran_out)))


def _release() -> None:
    """Give cached device memory back after running out (the next try starts from what is really free)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device(ctx: _Context, inputs) -> torch.device:
    for p in inputs[1:]:
        v = ctx.values.get(p)
        if isinstance(v, torch.Tensor) and not _fx.is_fake(v):
            return v.device
    return torch.device("cpu")


def _check(ctx, candidates, blk: Block, src: _Sources, sub, inputs, target: int, per_token: int, on_cpu: bool):
    """One run of the check at ``target`` tokens (``on_cpu``: the graph and the reference on CPU copies)."""
    spec0 = candidates[0]
    if on_cpu:
        sub = _on_cpu(sub)
    errs, ran = [], False
    for vals in _sym_values(blk.x_root, target, per_token):
        gen = torch.Generator(device="cpu").manual_seed(policy.FX_CHECK_SEED)
        args, x_val = _make_inputs(ctx, inputs, blk.x_root, gen, vals)
        _hash_inputs(ctx, inputs, args, blk, spec0, gen, vals)
        _unzero_unbound(ctx, inputs, args, src, gen)
        _unzero_norms(inputs, args, src, gen)
        tensors = {k: src.tensor(k, lambda p: args[inputs.index(p)] if p in inputs else placeholder_value(ctx, p, gen))
                   for k in OP_ARGS}
        tensors.update({k: tensors[k][:n] for k, n in blk.arg_rows.items() if tensors.get(k) is not None})
        tensors.update({k: _viewed(tensors[k], v, k) for k, v in blk.arg_views.items() if tensors.get(k) is not None})
        if on_cpu:
            args, x_val = [_cpu(a) for a in args], _cpu(x_val)
            tensors = {k: _cpu(v) for k, v in tensors.items()}
        with torch.no_grad():
            try:
                got = run_disabled(sub, args)
            except Exception as e:  # noqa: BLE001
                raise_if_oom(e)
                errs.append(f"the block's own graph failed to run ({type(e).__name__}: {str(e)[:200]})")
                continue
            ran = True
            xin = x_val if blk.x_in is blk.x_root else x_val.reshape(got.shape)
            found = _first_agreeing(ctx, sub, args, inputs, src, tensors, candidates, blk, xin, got, errs)
            if found is not None:
                spec, msg = found
                where = " on the CPU" if on_cpu else ""
                return spec, f"numeric, {x_val.numel() // x_val.shape[-1]} tokens{where} ({msg})"
        break  # the graph ran: its verdict stands
    code = RejectCode.VERIFICATION_FAILED if ran else RejectCode.CHECK_ERROR
    raise Reject("numeric check failed: " + "; ".join(errs), code)


def _cpu(v):
    return v.cpu() if isinstance(v, torch.Tensor) else v


def _on_cpu(sub: fx.GraphModule) -> fx.GraphModule:
    """``sub`` with every device its nodes name (factory ``device=`` arguments, ``.to(device)``) made the CPU."""
    def cpu(a):
        if isinstance(a, torch.device) and a.type != "cpu":
            return torch.device("cpu")
        if isinstance(a, str) and a.startswith(("cuda", "xpu", "mps")):
            return "cpu"
        return a

    g, env = fx.Graph(), {}
    for n in sub.graph.nodes:
        new = g.node_copy(n, lambda a: env[a])
        new.args = fx.node.map_aggregate(new.args, cpu)
        new.kwargs = fx.node.map_aggregate(new.kwargs, cpu)
        env[n] = new
    return fx.GraphModule(sub, g)


def _first_agreeing(ctx, sub, args, inputs, src, tensors, candidates, blk, xin, got, errs):
    """(spec, message) of the first candidate the graph's output ``got`` agrees with (clamps binding too); None when
    none does (the reasons appended to ``errs``)."""
    for spec in candidates:
        ok, msg = _agree(got, xin, tensors, spec, blk.arg_shapes, xin.dtype)
        if not ok:
            errs.append(f"{spec.describe()}: {msg}")
            continue
        stressed = _stress(sub, args, inputs, src, tensors, spec, xin, blk.arg_shapes)
        if stressed is not None and not stressed[0]:
            errs.append(f"{spec.describe()}: agrees, but not once the activation clamps bind ({stressed[1]})")
            continue
        more = f"; clamps binding: {stressed[1]}" if stressed is not None else ""
        return spec, msg + more
    return None


def _agree(got, xin, tensors, spec, arg_shapes, dtype):
    t = dict(tensors)
    for k, shape in arg_shapes.items():
        if t.get(k) is not None:
            t[k] = t[k].reshape(shape)
    try:
        want = reference.moe_forward(xin, **t, spec=spec).float()
    except Exception as e:  # noqa: BLE001
        raise_if_oom(e)
        return False, f"reference failed ({e})"
    if spec.zero_experts and not _zero_reached(xin, t, spec):
        return False, "no check token was routed to a zero expert (what they compute would be unproven)"
    got, want = got.float().reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    ok, msg = _close(got, want, dtype, policy.fp8_quantized(spec))
    if ok:
        return ok, msg
    ties = tie_tokens(xin.reshape(-1, xin.shape[-1]), t, spec, dtype)
    if ties is None:
        return ok, msg
    ok2, msg2 = _close(got[~ties], want[~ties], dtype, policy.fp8_quantized(spec))
    n, distinct = int(ties.sum()), int(torch.unique(xin.reshape(-1, xin.shape[-1])[ties], dim=0).shape[0])
    return ok2, f"{msg2}; {n} check token(s) ({distinct} distinct) {TIE_NOTE}"



def _zero_reached(xin, t: dict, spec) -> bool:
    """Does the reference route some check token to a zero expert (``spec.zero_experts``)?"""
    x2 = xin.reshape(-1, xin.shape[-1])
    logits = reference.router_logits(x2, t["router_w"], t.get("router_b"), spec)
    _, ids = reference.route(logits, t.get("correction_bias"), spec)
    return bool((ids >= spec.num_experts).any())


def _stress(sub, args, inputs, src, tensors, spec, xin, arg_shapes):
    """Run graph and reference again with the clamped projections scaled so that about a third of the
    pre-activations exceed the limit. None when the spec clamps nothing."""
    scaled = {}
    x2 = xin.reshape(-1, xin.shape[-1]).float()
    if _clamps(spec) or _cap(spec):
        xe = x2 if not spec.latent_size else reference.latent_in(x2, tensors["latent_in_w"], tensors["latent_in_b"])
        scaled["w13"] = _stress_factor(_pre_activations(xe, tensors, spec), _cap(spec) or spec.activation_limit)
    sh = spec.shared
    if sh is not None and (_clamps(sh) or _cap(sh)):
        for k in ("shared_w1", "shared_w3"):
            if tensors.get(k) is not None:
                w = tensors[k].float() if sh.quant is None else q8.dequantize(tensors[k], tensors[f"{k}_scale"],
                                                                               sh.quant)
                scaled[k] = _stress_factor(x2 @ w.T, _cap(sh) or sh.activation_limit)
    if not scaled:
        return None
    args2, tensors2, undo = list(args), dict(tensors), []
    try:
        for k, f in scaled.items():
            if tensors.get(f"{k}_scale") is not None:  # a quantized weight: scale its scales (w = q * s)
                k = f"{k}_scale"
            idx = [inputs.index(p) for p in src.of(k) if p in inputs]
            done = _scale_all([tensors[k]] + [args[i] for i in idx], f, undo)
            tensors2[k] = done[id(tensors[k])]
            for i in idx:
                args2[i] = done[id(args[i])]
        try:
            got = run_disabled(sub, args2)
        except Exception as e:  # noqa: BLE001
            raise_if_oom(e)
            return False, f"the block's own graph failed to run ({type(e).__name__})"
        return _agree(got, xin, tensors2, spec, arg_shapes, xin.dtype)
    finally:
        for t, p in reversed(undo):  # weights scaled in place: back to their values (exactly: p a power of two)
            t.div_(p)


def _scale_all(ts: list, f: float, undo: list) -> dict:
    """{id(t): t times f} for the distinct tensors ``ts`` (a tensor bound twice is scaled once). Float weights that
    together take more than a quarter of the working memory are scaled in place instead of copied, by the power of
    two at or above f (exact both ways; ``undo`` gets (tensor, factor) to divide back), unless that could overflow
    their dtype or they cannot be written: a stacked layer's w13 in 16 bits is several GB."""
    distinct = list({id(t): t for t in ts if t is not None}.values())
    big = sum(t.numel() * t.element_size() for t in distinct) > policy.working_bytes() // 4
    p = 2.0 ** math.ceil(math.log2(f))
    out = {}
    for t in distinct:
        if big and t.is_floating_point() and t.element_size() >= 2 and _fits(t, p):
            try:
                t.mul_(p)
            except RuntimeError:  # (not writable: a view of read-only storage)
                out[id(t)] = _times(t, f)
                continue
            undo.append((t, p))
            out[id(t)] = t
        else:
            out[id(t)] = _times(t, f)
    return out


def _fits(t: torch.Tensor, p: float) -> bool:
    """Does every value of ``t`` times ``p`` stay finite in t's dtype (reductions only: no copy of t)?"""
    m = max(abs(float(t.amax())), abs(float(t.amin())))
    return math.isfinite(m) and m * p < torch.finfo(t.dtype).max


def _pre_activations(xe: torch.Tensor, tensors: dict, spec) -> torch.Tensor:
    """xe [T, in] through every expert's w13: [T', E, N] fp32 for the first T' tokens whose values fill the stress
    sample (``_stress_factor`` reads the first ``FX_CLAMP_STRESS_SAMPLE`` of them, token-major: the same values as
    all T tokens would give), w13 dequantized (or made fp32) a chunk of experts at a time."""
    w13 = tensors["w13"]
    E = w13.shape[0]
    N = w13.shape[1] if spec.w_layout == "out_in" else w13.shape[2]
    T = min(xe.shape[0], -(-policy.FX_CLAMP_STRESS_SAMPLE // max(1, E * N)))
    x = xe[:T].float()
    h = torch.empty(T, E, N, dtype=torch.float32, device=xe.device)
    halves = 2 if spec.gated else 1
    for e0, e1 in policy.expert_chunks(E, w13[0].numel() * (8 if w13.dtype == torch.uint8 else 4)):
        if spec.quant is None:
            w = w13[e0:e1].float()
        else:
            zero = tensors.get("w13_zero")
            w = q8.dequantize(w13[e0:e1], tensors["w13_scale"][e0:e1], spec.quant, halves,
                              None if zero is None else zero[e0:e1])
        h[:, e0:e1] = torch.einsum("th,enh->ten", x, w) if spec.w_layout == "out_in" else torch.einsum(
            "th,ehn->ten", x, w)
        del w
    return h


def _times(t: torch.Tensor, f: float) -> torch.Tensor:
    """t * f in t's dtype; e8m0 scales (powers of two, no arithmetic of their own) times the power of two at or above
    f, so the product stays exact."""
    if q8.E8M0 is not None and t.dtype == q8.E8M0:
        return (t.float() * 2.0 ** math.ceil(math.log2(f))).to(t.dtype)
    return t * f


def _clamps(s) -> bool:
    """Does a MoESpec / SharedExpertSpec clamp (swiglu_oai, activation_clamp, activation_clamp_after)?"""
    return s.activation_clamp or s.activation_clamp_after or s.activation == "swiglu_oai"


def _cap(s) -> float:
    """The largest softcap of a MoESpec / SharedExpertSpec (0: none): the stress check drives the pre-activations
    past it, where tanh(v / c) * c bends (a cap out of reach of random weights would otherwise go unchecked)."""
    return max(s.gate_softcap, s.up_softcap)


def _stress_factor(h: torch.Tensor, limit: float) -> float:
    sample = h.abs().flatten()[: policy.FX_CLAMP_STRESS_SAMPLE].float()
    q = torch.quantile(sample, policy.FX_CLAMP_STRESS_QUANTILE).item()
    return max(1.0, policy.FX_CLAMP_STRESS_OVERSHOOT * limit / max(q, policy.FX_CHECK_SCALE_FLOOR))


def _close(got: torch.Tensor, want: torch.Tensor, dtype, quantized: bool = False) -> tuple[bool, str]:
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = want.abs().max().clamp_min(policy.FX_CHECK_SCALE_FLOOR)
    err = ((got - want).abs().max() / scale).item()
    if dtype in (torch.float32, torch.float64) and not quantized:
        return err <= policy.FX_CHECK_TOL_FULL, f"max rel err {err:.2e}"
    tok_scale = want.abs().amax(-1).clamp_min(policy.FX_CHECK_TOKEN_SCALE_FLOOR * scale.item())
    tok_err = (got - want).abs().amax(-1) / tok_scale
    tol = policy.FX_CHECK_TOL_TOKEN_FP8 if quantized else policy.FX_CHECK_TOL_TOKEN_LOW
    frac = (tok_err <= tol).float().mean().item()
    return frac >= policy.FX_CHECK_MIN_TOKEN_SHARE, f"{frac:.0%} tokens within {tol:g} (max rel err {err:.2e})"


def _viewed(t: torch.Tensor, view, k: str) -> torch.Tensor:
    """``view`` (a ``moe_flat.FlatView``) of ``t``; a tensor that only a copy could read so is refused."""
    try:
        return view.apply(t)
    except RuntimeError as e:
        raise Reject(f"{k}: the block's tensor {tuple(t.shape)} with strides {t.stride()} cannot be viewed as "
                     f"{view.shape} without a copy ({str(e)[:120]}); the op reads the weights it is given in place",
                     RejectCode.NOT_RECOGNISED) from None


@torch._dynamo.disable
def run_disabled(sub, args):
    return sub(*args)


def extract_region(ctx: _Context, nodes: set, x_root, out):
    """A GraphModule computing ``out`` from x_root and the placeholders the region reads."""
    g = fx.Graph()
    env = {}
    inputs = [x_root]
    env[x_root] = g.placeholder("x")
    env[x_root].meta = dict(x_root.meta)
    needed = _fx.ancestors(out, nodes | set(ctx.placeholders), pos=ctx.order) | {out}
    # mutations of needed tensors
    extra = set()
    for n in nodes:
        if _fx.is_inplace(n) and _fx.base_tensor(_fx.mutated_arg(n)) in needed | extra:
            extra.add(n)
            extra |= _fx.ancestors(n, nodes | set(ctx.placeholders), pos=ctx.order)
    needed |= extra
    for p in ctx.placeholders:
        if p in needed and p is not x_root:
            env[p] = g.placeholder(p.name)
            env[p].meta = dict(p.meta)
            inputs.append(p)
    for n in ctx.graph.nodes:
        if n in needed and n not in env and n.op not in ("placeholder", "output"):
            if not all(a in env for a in n.all_input_nodes):
                raise Reject(f"region is not self-contained at {n.name}")
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return fx.GraphModule(ctx.gm, g), inputs


def _gathers(nodes, weights) -> bool:
    """Does the block index a 3-D expert weight with a tensor (``w13[ids]``)?"""
    for n in nodes:
        if op_name(n) in ("getitem", "index_select") and _fx.weight_base(n) in weights:
            idx = n.args[1] if len(n.args) > 1 else None
            items = idx if isinstance(idx, (tuple, list)) else (idx,)
            if any(isinstance(i, fx.Node) for i in items) or op_name(n) == "index_select":
                return True
    return False


def _sym_values(x_root, target: int, bytes_per_token: int = 0) -> list[dict]:
    """Values for the free symbols of x's shape: the smallest that give ``target`` tokens, then the traced hints
    (when the first fail to run); with ``bytes_per_token`` (gathered weights), only those whose tokens stay within
    ``policy.WORKING_MEMORY_BYTES`` (static shapes: [{}] when the traced count does, else [])."""
    xs = _fx.shape_of(x_root)

    def fits(vals) -> bool:
        return not bytes_per_token or tokens(vals) * bytes_per_token <= policy.working_bytes()

    free, hints = [], {}
    for d in xs:
        if isinstance(d, torch.SymInt):
            node = d.node
            env = getattr(node.shape_env, "backed_var_to_val", None) or node.shape_env.var_to_val
            for sym in node.expr.free_symbols:
                if sym not in hints:
                    free.append(sym)
                    hints[sym] = int(env.get(sym, 2))
    def tokens(vals):
        n = 1
        for d in xs[:-1]:
            n *= int(d.node.expr.xreplace(vals)) if isinstance(d, torch.SymInt) else int(d)
        return n

    if not free:
        return [{}] if fits({}) else []
    out, below = [], None
    for v in range(2, 4097):
        vals = {sym: v for sym in free}
        if tokens(vals) >= target:
            if fits(vals) or below is not None:  # (else the largest below the target that fits)
                out.append(vals if fits(vals) else below)
            break
        below = vals if fits(vals) else below
    if hints not in out and fits(hints):
        out.append(hints)
    return out


def _make_inputs(ctx: _Context, inputs, x_root, gen, vals):
    """Values for the cut-out graph: random tokens for x, real (or random) weights, sizes for SymInts."""
    xs = _fx.shape_of(x_root)
    shape = [int(d.node.expr.xreplace(vals)) if isinstance(d, torch.SymInt) else int(d) for d in xs]
    dev = None
    for p in inputs[1:]:
        v = ctx.values.get(p)
        if isinstance(v, torch.Tensor) and not _fx.is_fake(v):
            dev = v.device
            break
    dev = dev or torch.device("cpu")
    dt = _fx.dtype_of(x_root) or torch.float32
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    flat = x.view(-1, shape[-1])
    T = flat.shape[0]
    crowd = T // policy.FX_CHECK_CROWD_DIVISOR
    if crowd:
        flat[:crowd] = flat[crowd]  # a crowd of identical tokens: one expert gets many
    x = x.to(device=dev, dtype=dt)
    args = [x]
    for p in inputs[1:]:
        mv = _fx.meta_val(p)
        if isinstance(mv, torch.SymInt):
            args.append(int(mv.node.expr.xreplace(vals)))
        elif isinstance(ctx.values.get(p), (int, torch.SymInt)) and not isinstance(mv, torch.Tensor):
            args.append(int(ctx.values[p]))
        else:
            args.append(placeholder_value(ctx, p, gen))
    return args, x


def _unzero_unbound(ctx: _Context, inputs, args: list, src: _Sources, gen) -> None:
    """Block tensors the region reads but the op does not (no binding names them) that are all zeros now get random
    values for the check: an add of zeros (a [1, 1, H] offset buffer) or a multiply by them would otherwise vanish
    from the check, and the op, which never reads them, would go wrong once they are not zero. An output bias the
    epilogue peeled for the capture (``args.PEELED``) stays zero: it is bound after the op."""
    bound = {p for k in OP_ARGS for p in src.of(k)}
    for i, p in enumerate(inputs[1:], 1):
        v = ctx.values.get(p)
        if (p in bound or p not in ctx.static_ph or not isinstance(v, torch.Tensor) or _fx.is_fake(v)
                or v.dim() == 0 or not v.is_floating_point() or getattr(v, PEELED, False) or bool(v.count_nonzero())):
            continue
        args[i] = torch.randn(tuple(v.shape), generator=gen).to(device=v.device, dtype=v.dtype)


def _unzero_norms(inputs, args: list, src: _Sources, gen) -> None:
    """The norms' weights (``NORM_ARGS``, ``SHARED_NORM_ARGS``) plus N(0, 0.5) noise when constant: a zero weight
    makes the forms rms * (1 + w) and rms alike (MuseSpark's norms start at zero), and a constant per-expert weight
    hides which expert's row a pair reads (Ergo's start at one): the check would prove neither."""
    for k in NORM_ARGS + SHARED_NORM_ARGS:
        for p in src.of(k):
            i = inputs.index(p) if p in inputs else None
            a = args[i] if i is not None else None
            if isinstance(a, torch.Tensor) and a.numel() and bool((a == a.reshape(-1)[0]).all()):
                args[i] = (a + 0.5 * torch.randn(tuple(a.shape), generator=gen)).to(a.dtype)


def _hash_inputs(ctx: _Context, inputs, args: list, blk: Block, spec, gen, vals) -> None:
    """Hash routing's inputs in ``args``: token ids [0, V) shaped like the traced ones at these sizes (one per check
    token; the crowd shares one id), and a table of random ids in [0, E) when its real value is unknown."""
    tok_name, tab_name = blk.bindings.get("token_ids"), blk.bindings.get("hash_table")
    if tok_name is None or tab_name is None:
        return
    by_name = {p.name: i for i, p in enumerate(inputs)}
    tab_i, tok_i = by_name.get(tab_name), by_name.get(tok_name)
    if tab_i is None or tok_i is None:
        raise Reject("hash routing: the table or the token ids are not inputs of the block's region")
    table, real = args[tab_i], ctx.values.get(inputs[tab_i])
    if not isinstance(real, torch.Tensor) or _fx.is_fake(real):  # no real table: random expert ids
        shape = tuple(int(d) for d in _fx.shape_of(inputs[tab_i]))
        table = args[tab_i] = torch.randint(0, spec.num_experts, shape, generator=gen)
    T = args[0].numel() // args[0].shape[-1]
    try:
        shape = [int(d.node.expr.xreplace(vals)) if isinstance(d, torch.SymInt) else int(d)
                 for d in _fx.shape_of(inputs[tok_i])]
    except (TypeError, ValueError):  # sizes not all from x's symbols: one id per token
        shape = [T]
    tok = torch.randint(0, table.shape[0], (T,), generator=gen)
    crowd = T // policy.FX_CHECK_CROWD_DIVISOR
    if crowd:
        tok[:crowd] = tok[crowd]
    dt = _fx.dtype_of(inputs[tok_i]) or torch.long
    args[tok_i] = tok.reshape(shape).to(device=table.device, dtype=dt)


def placeholder_value(ctx: _Context, p, gen):
    v = ctx.values.get(p)
    if isinstance(v, torch.Tensor) and not _fx.is_fake(v):
        return v
    mv = _fx.meta_val(p)
    if isinstance(mv, torch.Tensor):
        if mv.dim() == 0:
            raise Reject(f"the value of scalar input {p.name} is unknown (pass example inputs)")
        fan = mv.shape[-1] if mv.dim() else 1
        t = torch.randn(tuple(int(d) for d in mv.shape), generator=gen) / math.sqrt(max(1, fan))
        return t.to(dtype=mv.dtype)
    if isinstance(v, (int, float)):
        return v
    raise Reject(f"no value for input {p.name}")
