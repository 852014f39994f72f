"""detect_moe: find Mixture-of-Experts blocks in Dynamo's torch-level FX graph and describe each as a MoESpec.

The matched subgraph (names are roles, not node names; ``[..]`` optional, ``|`` alternatives)::

        x ──[view/reshape]──[.float()]──► linear(·, router_w [E,H], [router_b]) = logits [T,E]
                                                     │
            score_then_topk:  softmax | sigmoid | sqrt(softplus) | none ──► scores
                              [+ correction_bias [E]] ──► choice
                              [view(T,G,E/G) ─ topk(2).sum | amax ─ topk(topk_group) ─ mask ─ masked_fill(-inf)]
                              topk(choice, k) ──► ids ;  weights = topk values | scores.gather(ids)
            topk_then_score:  topk(logits, k) ──► ids ; weights = softmax(values)
                                                     │
                  [weights /= weights.sum(-1) (+eps)] [* routed_scaling] [.to(model dtype)]
                                                     │
        x ──► dispatch by ids ──► GEMM(w13 [E,2I,H] | [E,H,2I]) [+ b13[ids]] ──► act(gate) * up | swiglu_oai | act
                                 ──► GEMM(w2 [E,H,I] | [E,I,H]) [+ b2[ids]] ──► * weights ──► combine over k
                                                     │
        x ──► [shared: down(act(gate_proj x) * up_proj x) [* sigmoid(shared_gate x)]] ──(+)──► [view] ──► out

    dispatch / GEMM / combine may be spelled as transformers' ``grouped_mm`` path (sort, histc, cumsum,
    ``transformers::grouped_mm_fallback`` | ``torch._grouped_mm`` | ``F.grouped_mm``, inverse permutation,
    ``view(T,k,H).sum(1)``), its ``batched_mm`` path (``repeat_interleave``, ``w[ids]``, ``bmm``), an expert-indexed
    einsum / bmm / matmul (``w1[expert_indices]``), or an unrolled per-expert loop (``w13[e]``, ``index_add_``).

How a match is proven (nothing is matched on class or module names):

1. **Region.** From each top-k whose indices select slices of 3-D ``[E, ., .]`` weights, walk back to the router
   linear and its input ``x``. The block is the set of nodes computable from ``x`` plus weights (placeholders of
   static shape that are state, i.e. parameters, buffers, scalar attributes, but not the arguments the compiled
   call was made with: ``_fx.is_call_input``, from Dynamo's record of each input's source) that descend from ``x``;
   its output is the one node of that set that depends on the expert GEMMs and is read outside it (or returned).
   Under static shapes the token ids / hidden states a model is called with have static shapes too: were they
   taken for weights, everything after the first block (residual stream included) would be "computable from x
   plus weights" and one region would swallow every later block.
2. **Structure.** Every spec field is read from the nodes: scoring op, top-k ``k``, correction-bias add, group view
   and group top-k, renormalising sum/div and its eps, scaling multiplier, casts (router in fp32, weights rounded to
   the model dtype), GEMM operand order / transposes (weight layout), the gate's chunk or stride-2 slices and
   activation (and swiglu alpha / limit), per-expert biases, shared-expert linears and their sigmoid gate.
   Scalar module attributes that Dynamo lifts to 0-d inputs (``routed_scaling_factor``, gpt-oss ``alpha`` /
   ``limit``) are read from the example inputs the backend receives and baked into the spec (Dynamo does not guard
   on them; the match records which spec field came from which placeholder in ``MoEMatch.baked``).
   The region may contain only deterministic ops and may mutate only tensors it created.
3. **Numerics.** The region is cut out as its own GraphModule and run on random tokens (a quarter of them copies of
   one token, so one expert gets crowded: capacity limits would show) against ``moecomp.reference.moe_forward``
   with the derived spec and the real weights. fp32/fp64 blocks must agree to 1e-4 (relative to the output's max);
   lower-precision blocks per token to 3e-2, on at least 90% of tokens (routing near-ties may flip). Only where the
   graph leaves a discrete choice open (e.g. weight layout when every dim equals H) are the few candidates tried in
   turn; the first that agrees is taken. The check runs on about ``VERIFY_TOKENS`` tokens (the graph's symbolic
   sizes are set accordingly; the traced sizes are the fallback). A block that gathers whole expert matrices per
   token (``w13[ids]``) would materialise T * k of them: when even 4 tokens exceed ``VERIFY_GATHER_BYTES`` the check
   is skipped, the match rests on the structure alone and says so (``MoEMatch.verified``).

Anything not recognised is left alone and reported in ``DetectResult.rejected`` as ``(where, reason)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .. import reference
from ..ops.moe_op import MOE_ARGS
from ..spec import MoESpec, SharedExpertSpec, SpecError
from . import _fx
from ._fx import arg, op_name

VERIFY_TOKENS = 48  # tokens the numeric check aims for (when the graph's token count is symbolic)
VERIFY_GATHER_BYTES = 2 << 30  # most gathered expert weight (w13[ids] style blocks) the check may materialise

_RANDOM_OPS = frozenset(
    {
        "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "uniform_", "normal_",
        "bernoulli", "bernoulli_", "multinomial", "exponential_", "random_", "cauchy_", "log_normal_",
        "geometric_", "normal", "poisson", "native_dropout",
    }
)
_SCORE_OPS = {"softmax": "softmax", "sigmoid": "sigmoid"}
_ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu": "gelu"}


class _Reject(Exception):
    pass


@dataclass
class MoEMatch:
    """One MoE block found in a graph."""

    spec: MoESpec
    bindings: dict[str, str | None]  # MOE_ARGS name -> placeholder node name (None = absent)
    x: fx.Node  # the op's input: the block input (a view of it with the output's shape)
    output: fx.Node  # the node the op replaces
    nodes: frozenset  # every node of the block (DCE candidates; nodes also read elsewhere stay)
    region: frozenset  # the nodes that descend from x (``nodes`` adds weight-only helpers, which blocks may share)
    router: fx.Node  # the router linear
    topk: fx.Node  # the final top-k
    baked: dict[str, str] = field(default_factory=dict)  # spec field -> placeholder its value was read from
    verified: str = ""  # "numeric (max rel err ...)" or "skipped: why"
    output_dtype: torch.dtype | None = None  # dtype of ``output`` when it differs from x's

    @property
    def placeholders(self) -> dict[str, fx.Node | None]:
        by_name = {n.name: n for n in self.x.graph.nodes if n.op == "placeholder"}
        return {k: (by_name[v] if v is not None else None) for k, v in self.bindings.items()}

    @property
    def where(self) -> str:
        return f"{self.router.name}->{self.output.name}"

    def describe(self) -> str:
        bound = ", ".join(f"{k}={v}" for k, v in self.bindings.items() if v is not None)
        return f"{self.where}: {self.spec.describe()} [{bound}] ({self.verified})"


@dataclass
class DetectResult:
    """Matches plus ``rejected``: (where, reason) for every candidate left alone. Iterates like the match list."""

    matches: list[MoEMatch] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)

    def __iter__(self):
        return iter(self.matches)

    def __len__(self) -> int:
        return len(self.matches)

    def __getitem__(self, i):
        return self.matches[i]


# ---------------------------------------------------------------------------------------------------- entry point
def detect_moe(
    gm: fx.GraphModule,
    example_inputs: list | tuple | None = None,
    *,
    verify: bool = True,
    config: dict | None = None,
) -> DetectResult:
    """Find the MoE blocks of ``gm`` (a Dynamo torch-level graph).

    ``example_inputs``: the values the backend received, in placeholder order. They give the real values of scalar
    attributes (baked into the spec) and the weights for the numeric check; without them the check uses random
    weights of the recorded shapes, and blocks that need a scalar attribute's value are rejected.
    ``verify``: run the numeric check (see the module docstring). ``config``: fallback values for spec fields the
    graph cannot tell (currently unused by the HF families we know; kept for callers that have a model config).
    """
    ctx = _Context(gm, example_inputs, verify=verify, config=config or {})
    result = DetectResult()
    claimed: set = set()
    for t in ctx.final_topks():
        where = f"topk {t.name}"
        try:
            m = _match_at(ctx, t)
        except _Reject as e:
            result.rejected.append((where, str(e)))
            continue
        except SpecError as e:
            result.rejected.append((where, f"derived spec is invalid: {e}"))
            continue
        if m.region & claimed:
            result.rejected.append((where, "overlaps a block matched before"))
            continue
        claimed |= m.region
        result.matches.append(m)
    for where, reason in ctx.early_rejects:
        result.rejected.append((where, reason))
    return result


# --------------------------------------------------------------------------------------------------- graph facts
class _Context:
    def __init__(self, gm, example_inputs, *, verify, config):
        self.gm = gm
        self.graph = gm.graph
        self.verify = verify
        self.config = config
        self.early_rejects: list[tuple[str, str]] = []
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.values: dict = {}
        if example_inputs is not None and len(example_inputs) == len(self.placeholders):
            for p, v in zip(self.placeholders, example_inputs):
                self.values[p] = v
        else:
            for p in self.placeholders:
                self.values[p] = _fx.meta_val(p)
        # weight-like placeholders: SymInts, and tensors of static shape that are state, not call arguments
        # (parameters, buffers, 0-d scalar attributes). Static shape alone is not enough: under static shapes the
        # token ids / hidden states the model is called with are static too, and taking them for weights makes
        # every later layer "computable from the block input plus weights" (one region swallowing all blocks).
        self.static_ph = set()
        for p in self.placeholders:
            v = _fx.meta_val(p)
            if v is None:
                v = self.values.get(p)
            if isinstance(v, (torch.SymInt, int, float, torch.SymFloat)):
                self.static_ph.add(p)
            elif isinstance(v, torch.Tensor) and all(_fx.static_int(d) is not None for d in v.shape):
                if not _fx.is_call_input(p, self.values.get(p)):
                    self.static_ph.add(p)

    def pshape(self, n) -> tuple | None:
        if isinstance(n, fx.Node) and n.op == "placeholder":
            v = _fx.meta_val(n)
            if v is None:
                v = self.values.get(n)
            if isinstance(v, torch.Tensor):
                return tuple(v.shape)
        return None

    def weight_ph(self, n, ndim: int | None = None):
        """``n`` (through casts / views that keep it whole) as a static-shape tensor placeholder, else None."""
        base = _fx.strip_views_casts(n, views=False)
        if isinstance(base, fx.Node) and base.op == "placeholder" and base in self.static_ph:
            s = self.pshape(base)
            if s is not None and (ndim is None or len(s) == ndim):
                return base
        return None

    def final_topks(self) -> list[fx.Node]:
        """Top-k nodes whose indices select slices of 3-D weights with as many experts as the top-k input."""
        ph3 = {}
        for p in self.static_ph:
            s = self.pshape(p)
            if s is not None and len(s) == 3:
                ph3[p] = s[0]
        out = []
        for n in self.graph.nodes:
            if op_name(n) != "topk":
                continue
            s = _fx.shape_of(arg(n, 0))
            if not s:
                continue
            E = _fx.static_int(s[-1])
            if E is None or not any(e == E for e in ph3.values()):
                continue
            # indices must reach a 3-D weight's consumer
            idx = [u for u in n.users if op_name(u) == "getitem" and u.args[1] == 1]
            if not idx:
                continue
            reach = _fx.descendants(idx[0])
            hit = False
            for r in reach:
                for a in r.all_input_nodes:
                    b = _weight_base(a)
                    if b in ph3 and ph3[b] == E:
                        hit = True
                        break
                if hit:
                    break
            if hit:
                out.append(n)
        # (group top-k's read [T, G] / [T, G, E/G] and were skipped by the expert-count check above)
        return out


def _weight_base(n):
    """Follow a (gathered / sliced / transposed / cast) weight back to what it was taken from."""
    while isinstance(n, fx.Node):
        name = op_name(n)
        if name in _fx.VIEW_OPS or name in _fx.CAST_OPS or name in ("getitem", "index_select", "mT"):
            n = arg(n, 0)
        else:
            break
    return n


# ------------------------------------------------------------------------------------------------ linear forms
def _as_linear(ctx: _Context, n: fx.Node):
    """``n`` as y = a @ W.T (+ b) with W a 2-D weight placeholder [out, in]: (a, W, b) or None."""
    name = op_name(n)
    if name == "linear":
        w = ctx.weight_ph(arg(n, 1), 2)
        b = arg(n, 2)
        bp = ctx.weight_ph(b, 1) if isinstance(b, fx.Node) else None
        if w is None or (b is not None and bp is None):
            return None
        return arg(n, 0), w, bp
    if name in ("matmul", "mm"):
        rhs = arg(n, 1)
        if isinstance(rhs, fx.Node) and (op_name(rhs) in ("t",) or (
            op_name(rhs) == "transpose" and sorted(int(d) % 2 for d in rhs.args[1:3]) == [0, 1]
        ) or (op_name(rhs) == "permute" and list(rhs.args[1:]) in ([1, 0], [[1, 0]], [(1, 0)]))):
            w = ctx.weight_ph(arg(rhs, 0), 2)
            if w is not None:
                return arg(n, 0), w, None
    return None


# ------------------------------------------------------------------------------------------------------ matching
@dataclass
class _Routing:
    logits_linear: fx.Node
    x_router: fx.Node
    router_w: fx.Node
    router_b: fx.Node | None
    correction_bias: fx.Node | None
    scoring: str
    score_order: str
    top_k: int
    E: int
    H: int
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    renormalize: bool = False
    renorm_eps: float = 0.0
    scaling: float = 1.0
    round_weights: bool = False
    router_fp32: bool = False
    weights: fx.Node | None = None
    baked: dict = field(default_factory=dict)


def _match_at(ctx: _Context, t: fx.Node) -> MoEMatch:
    r = _routing(ctx, t)
    x_root, x_chain = _x_root(ctx, r.x_router, r.logits_linear)
    region, support = _region(ctx, x_root)
    if t not in region:
        raise _Reject("the top-k is not computed from the router input alone")
    _check_ops(ctx, region | support, x_root)
    ex = _experts(ctx, r, region, support)
    out = _output(ctx, region, ex["g2"])
    sh = _shared(ctx, r, region, x_root, out, ex)
    x_in = _pick_input(ctx, x_root, x_chain, out, region)
    out_dtype = _fx.dtype_of(out)
    x_dtype = _fx.dtype_of(x_in)
    if x_dtype in (torch.bfloat16, torch.float16) and _fx.dtype_of(r.weights) == x_dtype:
        r.round_weights = True  # the weights reach the experts in the model dtype (e.g. a softmax with dtype=bf16)

    base = dict(
        num_experts=r.E,
        top_k=r.top_k,
        hidden_size=r.H,
        intermediate_size=ex["I"],
        scoring=r.scoring,
        score_order=r.score_order,
        renormalize=r.renormalize,
        renorm_eps=r.renorm_eps,
        routed_scaling_factor=r.scaling,
        n_group=r.n_group,
        topk_group=r.topk_group,
        group_score=r.group_score,
        has_correction_bias=r.correction_bias is not None,
        has_router_bias=r.router_b is not None,
        router_fp32=r.router_fp32,
        round_weights=r.round_weights,
        gated=ex["gated"],
        activation_alpha=ex.get("alpha", 1.702),
        activation_limit=ex.get("limit", 7.0),
        has_expert_bias=ex["b13"] is not None,
        shared=sh["spec"] if sh else None,
    )
    baked = dict(r.baked)
    baked.update(ex.get("baked", {}))
    bindings = {k: None for k in MOE_ARGS}
    bindings.update(
        router_w=r.router_w.name,
        router_b=r.router_b.name if r.router_b is not None else None,
        correction_bias=r.correction_bias.name if r.correction_bias is not None else None,
        w13=ex["w13"].name,
        w2=ex["w2"].name,
        b13=ex["b13"].name if ex["b13"] is not None else None,
        b2=ex["b2"].name if ex["b2"] is not None else None,
    )
    if sh:
        bindings.update({k: (v.name if v is not None else None) for k, v in sh["bind"].items()})

    candidates, last_err = [], None
    for layout in ex["layouts"]:
        for gate_up in ex["gate_ups"]:
            for act in ex["activations"]:
                try:
                    candidates.append(MoESpec(**base, w_layout=layout, gate_up=gate_up, activation=act))
                except SpecError as e:
                    last_err = e
    if not candidates:
        raise _Reject(f"no valid spec: {last_err}")

    nodes = frozenset(region | support)
    verified = "skipped: verify=False"
    spec = candidates[0]
    if ctx.verify:
        spec, verified = _verify(ctx, candidates, bindings, x_root, x_in, out, region, support)
    elif len(candidates) > 1:
        raise _Reject("the graph leaves the weight layout / gate split / activation open and verify=False")
    return MoEMatch(
        spec=spec,
        bindings=bindings,
        x=x_in,
        output=out,
        nodes=nodes,
        region=frozenset(region),
        router=r.logits_linear,
        topk=t,
        baked=baked,
        verified=verified,
        output_dtype=out_dtype if out_dtype != x_dtype else None,
    )


# ------------------------------------------------------------------------------------------------------- routing
def _routing(ctx: _Context, t: fx.Node) -> _Routing:
    k = _fx.static_int(arg(t, 1))
    if k is None:
        raise _Reject("top-k count is not a constant")
    dim = arg(t, 2, default=-1)
    choice = arg(t, 0)
    cs = _fx.shape_of(choice)
    if dim not in (-1, len(cs) - 1):
        raise _Reject(f"top-k over dim {dim}, not the expert dim")
    if arg(t, 3, default=True) is False:
        raise _Reject("top-k takes the smallest values")
    E = _fx.static_int(cs[-1])

    # walk back from the top-k input to the router linear
    cur = choice
    scoring_node = None  # output of the scoring function
    scoring = None
    bias = None
    mask_fill = None
    lin = None
    while True:
        name = op_name(cur)
        if name in _fx.CAST_OPS:
            cur = arg(cur, 0)
            continue
        if name == "masked_fill" and mask_fill is None and scoring is None:
            mask_fill = cur
            v = arg(cur, 2)
            if not (isinstance(v, float) and v == -math.inf):
                raise _Reject("top-k input is masked with a value other than -inf")
            cur = arg(cur, 0)
            continue
        if name == "add" and bias is None and scoring is None:
            a, b = arg(cur, 0), arg(cur, 1)
            pa, pb = ctx.weight_ph(a, 1), ctx.weight_ph(b, 1)
            if pb is not None and ctx.pshape(pb) == (E,):
                bias, cur = pb, a
                continue
            if pa is not None and ctx.pshape(pa) == (E,):
                bias, cur = pa, b
                continue
            raise _Reject("an add before the top-k that is not a per-expert bias")
        if name in ("softmax", "sigmoid") and scoring is None:
            if name == "softmax" and arg(cur, 1, default=None) not in (-1, len(_fx.shape_of(cur)) - 1):
                raise _Reject("softmax over a dim other than the experts")
            scoring, scoring_node = _SCORE_OPS[name], cur
            cur = arg(cur, 0)
            continue
        if name == "sqrt" and scoring is None and op_name(arg(cur, 0)) == "softplus":
            sp = arg(cur, 0)
            if arg(sp, 1, "beta", 1) != 1 or arg(sp, 2, "threshold", 20) != 20:
                raise _Reject("softplus with non-default beta / threshold")
            scoring, scoring_node = "sqrtsoftplus", cur
            cur = arg(sp, 0)
            continue
        lf = _as_linear(ctx, cur)
        if lf is not None:
            lin = cur
            break
        raise _Reject(f"unrecognised op '{name or cur.op}' between the router logits and the top-k")
    a, w, b = _as_linear(ctx, lin)
    ws = ctx.pshape(w)
    if ws[0] != E:
        raise _Reject(f"router weight {tuple(ws)} does not produce the {E} logits the top-k reads")
    H = ws[1]
    router_fp32 = _fx.cast_dtype(a) == torch.float32 if op_name(a) in _fx.CAST_OPS else False
    x_router = _fx.strip_views_casts(a, views=False)
    if scoring is None and bias is not None:
        raise _Reject("correction bias without a scoring function")

    R = _Routing(
        logits_linear=lin, x_router=x_router, router_w=w, router_b=b, correction_bias=bias,
        scoring=scoring or "none", score_order="score_then_topk", top_k=k, E=E, H=H, router_fp32=router_fp32,
    )
    if mask_fill is not None:
        _groups(ctx, R, mask_fill, lin)

    vals = [u for u in t.users if op_name(u) == "getitem" and u.args[1] == 0]
    ids = [u for u in t.users if op_name(u) == "getitem" and u.args[1] == 1]
    ids = ids[0]
    # where the weights come from
    w0 = None
    for u in ids.users:
        if op_name(u) == "gather":
            src = arg(u, 0)
            if scoring_node is not None and _fx.strip_views_casts(src, views=False) is scoring_node or src is scoring_node:
                if arg(u, 1) not in (1, -1):
                    raise _Reject("weights gathered over a dim other than the experts")
                w0 = u
    if w0 is None:
        if bias is not None or mask_fill is not None:
            raise _Reject("biased / group-limited top-k without gathering the unbiased scores")
        if not vals:
            raise _Reject("top-k values unused and no gather of the scores")
        v = vals[0]
        sm = [u for u in v.users if op_name(u) == "softmax"]
        if scoring is None and sm:
            if len(sm) != 1 or arg(sm[0], 1, default=None) not in (-1, 1):
                raise _Reject("softmax of the top-k values over an unexpected dim")
            R.scoring, R.score_order, w0 = "softmax", "topk_then_score", sm[0]
        else:
            w0 = v
    _weight_chain(ctx, R, w0)
    return R


def _rowsums(cur: fx.Node) -> list[fx.Node]:
    """Nodes holding cur.sum(-1) shaped to divide cur: ``sum(-1, keepdim=True)`` or ``sum(-1)`` then
    ``unsqueeze(-1)`` / ``[:, None]`` / ``view(-1, 1)``."""
    ndim = len(_fx.shape_of(cur) or ())
    last = (-1, ndim - 1, [-1], [ndim - 1], (-1,), (ndim - 1,))
    out = []
    for u in cur.users:
        if op_name(u) != "sum" or arg(u, 1) not in last:
            continue
        if arg(u, 2, default=False):
            out.append(u)
            continue
        for v in u.users:
            if op_name(v) in ("unsqueeze", "view", "reshape", "getitem") and _fx.same_shape(
                _fx.shape_of(v), tuple(_fx.shape_of(cur)[:-1]) + (1,)
            ):
                out.append(v)
    return out


def _groups(ctx: _Context, R: _Routing, mask_fill: fx.Node, lin: fx.Node) -> None:
    """Group-limited routing: read n_group / topk_group / group score from the mask's ancestry."""
    anc = _fx.ancestors(arg(mask_fill, 1), _fx.descendants(lin), pos=ctx.order)
    gtopk = [n for n in anc if op_name(n) == "topk"]
    views = [n for n in anc if op_name(n) in ("view", "reshape") and len(_fx.shape_of(n) or ()) >= 3]
    if not gtopk or not views:
        raise _Reject("masked top-k without a recognisable group selection")
    # the group-select top-k: input [T, G]; group-score top-k: input [T, G, E/G] with k=2
    sel = [n for n in gtopk if len(_fx.shape_of(arg(n, 0)) or ()) == 2]
    if len(sel) != 1:
        raise _Reject("group selection: expected one top-k over group scores")
    sel = sel[0]
    G = _fx.static_int(_fx.shape_of(arg(sel, 0))[-1])
    kg = _fx.static_int(arg(sel, 1))
    if G is None or kg is None:
        raise _Reject("group sizes are not constants")
    gview = [n for n in views if _fx.static_int(_fx.shape_of(n)[-2]) == G
             and _fx.static_int(_fx.shape_of(n)[-1]) == R.E // G]
    if not gview:
        raise _Reject("no [T, n_group, E/n_group] view of the scores")
    users = set().union(*[_fx.descendants(v) for v in gview]) & anc
    names = {op_name(n) for n in users}
    in_topk = [n for n in gtopk if n is not sel and n in users]
    if in_topk and _fx.static_int(arg(in_topk[0], 1)) == 2 and "sum" in names:
        R.group_score = "top2_sum"
    elif names & {"amax", "max"}:
        R.group_score = "max"
    else:
        raise _Reject("group score is neither top-2 sum nor max")
    R.n_group, R.topk_group = G, kg


def _weight_chain(ctx: _Context, R: _Routing, w0: fx.Node) -> None:
    """Follow the routing weights forward through renormalise / scale / cast."""
    cur = w0
    seen_cast = False
    while True:
        users = list(cur.users)
        sums = _rowsums(cur)
        nxt = None
        for u in users:
            name = op_name(u)
            if name in ("div", "div_") and arg(u, 0) is cur and sums:
                d = arg(u, 1)
                eps = 0.0
                if op_name(d) == "add" and arg(d, 0) in sums:
                    e = _fx.scalar_value(arg(d, 1), ctx.values)
                    if e is None:
                        raise _Reject("renormalisation eps is not a constant")
                    eps, d = e, arg(d, 0)
                elif op_name(d) == "clamp" and arg(d, 0) in sums:
                    raise _Reject("renormalisation with a clamped denominator")
                if d in sums:
                    if R.renormalize:
                        raise _Reject("weights renormalised twice")
                    R.renormalize, R.renorm_eps, nxt = True, eps, u
                    break
            if name in ("mul", "mul_"):
                a, b = arg(u, 0), arg(u, 1)
                other = b if a is cur else a
                v = _fx.scalar_value(other, ctx.values)
                if v is None and isinstance(other, fx.Node) and op_name(other) == "item":
                    raise _Reject("routed scaling read from a tensor whose value is unknown (no example inputs)")
                if v is not None:
                    src = arg(other, 0) if isinstance(other, fx.Node) and op_name(other) == "item" else None
                    if src is not None:
                        R.baked["routed_scaling_factor"] = src.name
                    R.scaling *= v
                    nxt = u
                    break
            if name in _fx.CAST_OPS and not seen_cast:
                dt = _fx.cast_dtype(u)
                if dt is not None and dt.is_floating_point:
                    x_dt = _fx.dtype_of(R.x_router)
                    if dt == x_dt:
                        R.round_weights = True
                    seen_cast = True
                    nxt = u
                    break
        if nxt is None:
            break
        cur = nxt
    R.weights = cur


# ------------------------------------------------------------------------------------------------- block region
def _x_root(ctx: _Context, x_router: fx.Node, lin: fx.Node):
    """The block input: the router input followed back through views (and casts that only feed the router)."""
    chain = [x_router]
    cur = x_router
    while True:
        name = op_name(cur)
        if name in ("view", "reshape", "flatten", "contiguous", "view_as", "reshape_as"):
            prev = arg(cur, 0)
            if not isinstance(prev, fx.Node):
                break
            ps, cs = _fx.shape_of(prev), _fx.shape_of(cur)
            if ps is None or cs is None or not _fx.same_dim(ps[-1], cs[-1]):
                break
            cur = prev
            chain.append(cur)
            continue
        break
    return cur, chain


def _region(ctx: _Context, x_root: fx.Node):
    """Nodes computable from x_root and weight-like placeholders: (descendants of x_root, weight-only helpers)."""
    region, support = {x_root}, set()
    for n in ctx.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr") or n is x_root:
            continue
        if ctx.order[n] < ctx.order[x_root] and not all(
            (a in ctx.static_ph or a in support) for a in n.all_input_nodes
        ):
            continue
        ins = n.all_input_nodes
        if not ins:
            support.add(n)
            continue
        if all(a in region or a in support or a in ctx.static_ph for a in ins):
            if any(a in region for a in ins):
                region.add(n)
            else:
                support.add(n)
    # support nodes needed by the region only
    needed = set()
    for n in region:
        needed |= _fx.ancestors(n, support, pos=ctx.order)
    # mutations of support tensors (e.g. setitem into an empty_like) belong with them
    return region, needed


def _check_ops(ctx: _Context, nodes: set, x_root: fx.Node) -> None:
    for n in nodes:
        name = op_name(n)
        if name in _RANDOM_OPS or name.startswith("rand"):
            raise _Reject(f"random op '{name}' inside the block")
        if name in ("dropout", "dropout_") and arg(n, 2, "training", True) and arg(n, 1, "p", 0.5):
            raise _Reject("dropout in training mode inside the block")
        if _fx.is_inplace(n):
            tgt = _base_tensor(_fx.mutated_arg(n))
            if tgt is None or tgt is x_root or tgt.op == "placeholder" or tgt not in nodes:
                raise _Reject(f"'{n.name}' mutates a tensor the block did not create")


def _base_tensor(n):
    while isinstance(n, fx.Node) and _fx.is_view(n) and op_name(n) != "getitem":
        n = arg(n, 0)
    while isinstance(n, fx.Node) and op_name(n) == "getitem" and isinstance(arg(n, 0), fx.Node) and isinstance(
        _fx.meta_val(arg(n, 0)), torch.Tensor
    ):
        n = arg(n, 0)
    return n if isinstance(n, fx.Node) else None


# ------------------------------------------------------------------------------------------------------- experts
_GEMMS = ("grouped_mm", "bmm", "matmul", "linear", "mm", "einsum", "baddbmm")


def _weight_uses(ctx: _Context, p: fx.Node, nodes: set):
    """GEMM nodes fed by placeholder ``p`` through views / casts / indexing, with whether a transpose was seen."""
    out = []
    stack = [(p, False)]
    seen = set()
    while stack:
        n, tr = stack.pop()
        for u in n.users:
            if u not in nodes or (u, tr) in seen:
                continue
            seen.add((u, tr))
            name = op_name(u)
            if name in _GEMMS:
                out.append((u, tr, n))
            elif name in ("transpose", "t", "permute", "mT", "swapaxes"):
                stack.append((u, not tr))
            elif name in _fx.CAST_OPS or name in ("getitem", "index_select", "contiguous", "view", "reshape",
                                                  "unsqueeze", "squeeze", "expand", "clone", "detach"):
                if name == "getitem" and arg(u, 0) is not n:
                    continue  # p used as the index, not indexed
                stack.append((u, tr))
    return out


def _experts(ctx: _Context, R: _Routing, region: set, support: set) -> dict:
    nodes = region | support
    E, H = R.E, R.H
    cands = []
    for p in ctx.static_ph:
        s = ctx.pshape(p)
        if s is None or len(s) != 3 or s[0] != E:
            continue
        uses = _weight_uses(ctx, p, nodes)
        if uses:
            cands.append((p, uses))
    if len(cands) < 2:
        raise _Reject("no pair of stacked 3-D expert weights [E, ., .] used by the block "
                      "(per-expert nn.Linear modules are not supported)")
    if len(cands) > 2:
        raise _Reject(f"{len(cands)} stacked expert weights used (separate gate / up weights are not supported; "
                      "the op needs them concatenated)")
    (pa, ua), (pb, ub) = cands
    ga = {u for u, _, _ in ua}
    gb = {u for u, _, _ in ub}
    anc_b = set().union(*[_fx.ancestors(x, nodes, pos=ctx.order) for x in gb])
    anc_a = set().union(*[_fx.ancestors(x, nodes, pos=ctx.order) for x in ga])
    a_feeds_b = any(g in anc_b for g in ga)
    b_feeds_a = any(g in anc_a for g in gb)
    if a_feeds_b == b_feeds_a:
        raise _Reject("cannot order the two expert GEMMs")
    (w13, u13), (w2, u2) = ((pa, ua), (pb, ub)) if a_feeds_b else ((pb, ub), (pa, ua))
    s13, s2 = ctx.pshape(w13), ctx.pshape(w2)

    # layout from shapes, structure where shapes tie
    layouts = []
    if s2[1] == H and s13[2] == H and not (s2[2] == H and s13[1] == H):
        layouts = ["out_in"]
    elif s2[2] == H and s13[1] == H and not (s2[1] == H and s13[2] == H):
        layouts = ["in_out"]
    elif s2[1] == H and s13[2] == H and s2[2] == H and s13[1] == H:
        structural = _layout_from_use(u13)
        layouts = [structural] + [x for x in ("out_in", "in_out") if x != structural] if structural else [
            "out_in", "in_out"]
    else:
        raise _Reject(f"expert weights {tuple(s13)} / {tuple(s2)} do not fit hidden size {H}")
    structural = _layout_from_use(u13)
    if structural is not None and len(layouts) == 1 and structural != layouts[0]:
        raise _Reject(f"expert weight shapes say {layouts[0]} but the GEMM reads them as {structural}")
    N = s13[1] if layouts[0] == "out_in" else s13[2]
    I = s2[2] if layouts[0] == "out_in" else s2[1]
    if N == 2 * I:
        gated = True
    elif N == I:
        gated = False
    else:
        raise _Reject(f"first expert GEMM has {N} outputs, second reads {I}: neither gated (2I) nor plain (I)")

    g1 = {u for u, _, _ in u13}
    g2 = {u for u, _, _ in u2}
    g2_anc = set().union(*[_fx.ancestors(x, nodes, pos=ctx.order) for x in g2])
    between = set()
    for g in g1:
        between |= _fx.descendants(g, nodes) & g2_anc
    names = {op_name(n) for n in between}

    res = dict(w13=w13, w2=w2, I=I, gated=gated, layouts=layouts, g1=g1, g2=sorted(g2, key=ctx.order.get)[-1],
               b13=None, b2=None, baked={})

    # gate split
    if gated:
        strided = any(op_name(n) == "getitem" and _has_step2(arg(n, 1)) for n in between)
        if strided:
            res["gate_ups"] = ["interleaved"]
        elif names & {"chunk", "split", "getitem"}:
            res["gate_ups"] = ["concat"]
        else:
            res["gate_ups"] = ["concat", "interleaved"]
    else:
        res["gate_ups"] = ["concat"]

    # activation
    if "clamp" in names and "sigmoid" in names and gated:
        alpha, limit = _swiglu_consts(ctx, between, res)
        res.update(alpha=alpha, limit=limit, activations=["swiglu_oai"])
    else:
        acts = []
        for n in between:
            nm = op_name(n)
            if nm == "gelu":
                acts.append("gelu_tanh" if arg(n, 1, "approximate", "none") == "tanh" else "gelu")
            elif nm in ("silu", "relu"):
                acts.append(nm)
            elif nm == "sigmoid":
                acts.append("silu")  # x * sigmoid(x); the numeric check confirms
        acts = sorted(set(acts))
        if len(acts) != 1:
            raise _Reject(f"expert activation not recognised (ops between the GEMMs: {sorted(names)})")
        res["activations"] = acts

    # per-expert biases: 2-D [E, N] / [E, H] placeholders gathered by expert id inside the block
    b_cands = []
    for p in ctx.static_ph:
        s = ctx.pshape(p)
        if s is None or len(s) != 2 or s[0] != E or p in (R.router_w,):
            continue
        if any(u in nodes for u in p.users):
            b_cands.append(p)
    for p in b_cands:
        s = ctx.pshape(p)
        feeds_g2 = any(a in g2_anc for a in _fx.descendants(p, nodes))
        if feeds_g2 and s[1] == N:
            res["b13"] = p
        elif not feeds_g2 and s[1] == H:
            res["b2"] = p
        else:
            raise _Reject(f"unexplained per-expert 2-D tensor {p.name} {tuple(s)}")
    if (res["b13"] is None) != (res["b2"] is None):
        raise _Reject("only one of the two expert GEMMs has a bias")
    return res


def _has_step2(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(s, slice) and s.step == 2 for s in items)


def _layout_from_use(uses) -> str | None:
    """out_in / in_out from how the first GEMM reads the weight (None when it cannot tell)."""
    votes = set()
    for g, transposed, src in uses:
        name = op_name(g)
        if name == "grouped_mm":
            votes.add("out_in" if transposed else "in_out")
        elif name == "linear":
            votes.add("in_out" if transposed else "out_in")
        elif name in ("bmm", "matmul", "mm"):
            pos = 0 if arg(g, 0) is src else 1
            # weight on the left (W @ x) computes out = W x: [out, in] unless transposed
            left = "out_in" if not transposed else "in_out"
            right = "in_out" if not transposed else "out_in"
            votes.add(left if pos == 0 else right)
    return votes.pop() if len(votes) == 1 else None


def _swiglu_consts(ctx: _Context, between: set, res: dict):
    limit = alpha = None
    for n in between:
        nm = op_name(n)
        if nm == "clamp":
            mx = arg(n, 2, "max")
            v = _fx.scalar_value(mx, ctx.values)
            if v is None:
                raise _Reject("swiglu limit is not readable (no example inputs?)")
            if limit is not None and not math.isclose(v, limit):
                raise _Reject("swiglu clamps with different limits")
            limit = v
            if isinstance(mx, fx.Node) and op_name(mx) == "item":
                res["baked"]["activation_limit"] = arg(mx, 0).name
        if nm == "sigmoid":
            m = arg(n, 0)
            if op_name(m) == "mul":
                for o in (arg(m, 0), arg(m, 1)):
                    v = _fx.scalar_value(o, ctx.values)
                    if v is not None:
                        alpha = v
                        if isinstance(o, fx.Node) and op_name(o) == "item":
                            res["baked"]["activation_alpha"] = arg(o, 0).name
    if alpha is None or limit is None:
        raise _Reject("clamp + sigmoid gate without a readable alpha / limit")
    return alpha, limit


# --------------------------------------------------------------------------------------------------------- output
def _output(ctx: _Context, region: set, g2: fx.Node) -> fx.Node:
    """The region node read outside the region (or returned) that depends on the second expert GEMM."""
    dep = _fx.descendants(g2, region) | {g2}
    outs = []
    for n in region:
        if n not in dep or not isinstance(_fx.meta_val(n), torch.Tensor):
            continue
        if any(u not in region for u in n.users):
            outs.append(n)
    outs = [n for n in outs if not _fx.is_inplace(n) or op_name(n) in ("div_", "add_", "mul_")]
    if len(outs) != 1:
        raise _Reject(f"block has {len(outs)} outputs depending on the experts: {[n.name for n in outs]}")
    return outs[0]


def _pick_input(ctx: _Context, x_root, chain, out, region) -> fx.Node:
    """The alias of x whose shape equals the output's (the op returns its input's shape)."""
    os_ = _fx.shape_of(out)
    for n in [x_root] + list(reversed(chain)):
        if _fx.same_shape(_fx.shape_of(n), os_):
            return n
    raise _Reject(f"output shape {os_} matches no view of the block input")


# ---------------------------------------------------------------------------------------------------- shared MLP
def _shared(ctx: _Context, R: _Routing, region: set, x_root, out, ex) -> dict | None:
    """Dense linears of the region other than the router: a shared-expert MLP and its optional sigmoid gate."""
    lins = []
    for n in region:
        lf = _as_linear(ctx, n)
        if lf is not None and n is not R.logits_linear:
            lins.append((n, *lf))
    if not lins:
        return None
    H = R.H

    def from_x(a):
        return _fx.strip_views_casts(a) is x_root or _fx.strip_views_casts(a) is _fx.strip_views_casts(R.x_router)

    first = [(n, a, w, b) for n, a, w, b in lins if from_x(a)]
    rest = [(n, a, w, b) for n, a, w, b in lins if not from_x(a)]
    if any(b is not None for _, _, _, b in lins):
        raise _Reject("shared expert with biases is not supported")
    gate_lin = [(n, w) for n, a, w, b in first if ctx.pshape(w) == (1, H)]
    mlp_in = [(n, w) for n, a, w, b in first if ctx.pshape(w) != (1, H)]
    if len(rest) != 1 or not mlp_in:
        raise _Reject(f"unrecognised dense linears in the block: {[n.name for n, *_ in lins]}")
    down, _, wd, _ = rest[0]
    Is = ctx.pshape(wd)[1]
    if ctx.pshape(wd)[0] != H:
        raise _Reject(f"shared down projection {ctx.pshape(wd)} does not produce hidden size {H}")
    act_of = {}
    for n, w in mlp_in:
        for u in _fx.descendants(n, region) & _fx.ancestors(down, region, pos=ctx.order):
            nm = op_name(u)
            if nm in ("silu", "relu", "gelu"):
                a = "gelu_tanh" if nm == "gelu" and arg(u, 1, "approximate", "none") == "tanh" else nm
                if arg(u, 0) is n or _fx.strip_views_casts(arg(u, 0)) is n:
                    act_of[n] = a
    bind = dict(shared_w1=None, shared_w3=None, shared_w2=wd, shared_gate_w=None)
    if len(mlp_in) == 2:
        gated_ones = [n for n, _ in mlp_in if n in act_of]
        if len(gated_ones) != 1:
            raise _Reject("shared expert: cannot tell gate_proj from up_proj")
        g = gated_ones[0]
        up = [n for n, _ in mlp_in if n is not g][0]
        wg = [w for n, w in mlp_in if n is g][0]
        wu = [w for n, w in mlp_in if n is up][0]
        if ctx.pshape(wg) != (Is, H) or ctx.pshape(wu) != (Is, H):
            raise _Reject("shared gate / up projections do not match the down projection")
        spec = dict(intermediate_size=Is, activation=act_of[g], gated=True, layout="separate")
        bind.update(shared_w1=wg, shared_w3=wu)
    elif len(mlp_in) == 1:
        n, w = mlp_in[0]
        s = ctx.pshape(w)
        chunked = any(op_name(u) in ("chunk", "split", "getitem") for u in n.users)
        if s == (2 * Is, H) and chunked:
            acts = [op_name(u) for u in _fx.descendants(n, region) & _fx.ancestors(down, region, pos=ctx.order)
                    if op_name(u) in ("silu", "relu", "gelu")]
            if len(set(acts)) != 1:
                raise _Reject("shared expert (concatenated gate/up): activation not recognised")
            spec = dict(intermediate_size=Is, activation=acts[0], gated=True, layout="concat")
            bind.update(shared_w1=w)
        elif s == (Is, H) and n in act_of:
            spec = dict(intermediate_size=Is, activation=act_of[n], gated=False, layout="separate")
            bind.update(shared_w3=w)
        else:
            raise _Reject("shared expert projection not recognised")
    else:
        raise _Reject("more than two shared input projections")
    spec["gate"] = "none"
    if gate_lin:
        if len(gate_lin) != 1:
            raise _Reject("several [1, H] shared-expert gates")
        gl, gw = gate_lin[0]
        if not any(op_name(u) == "sigmoid" for u in gl.users):
            raise _Reject("shared-expert gate is not a sigmoid")
        spec["gate"] = "sigmoid"
        bind["shared_gate_w"] = gw
    if out not in _fx.descendants(down, region) and out is not down:
        raise _Reject("the shared expert does not reach the block output")
    return dict(spec=SharedExpertSpec(**spec), bind=bind)


# ------------------------------------------------------------------------------------------------ numeric check
def _verify(ctx: _Context, candidates, bindings, x_root, x_in, out, region, support):
    """Cut the region into a GraphModule and compare it with the reference for each candidate spec."""
    spec0 = candidates[0]
    ph = {n.name: n for n in ctx.placeholders}
    # token budget: a block that gathers whole expert matrices per (token, slot) (batched_mm style) materialises
    # T * k of them; keep that under VERIFY_GATHER_BYTES
    per_expert = 0
    for k in ("w13", "w2"):
        v = _fx.meta_val(ph[bindings[k]])
        if isinstance(v, torch.Tensor):
            per_expert += (v.numel() // v.shape[0]) * v.element_size()
    target = VERIFY_TOKENS
    if _gathers(region | support, [ph[bindings["w13"]], ph[bindings["w2"]]]):
        target = min(target, VERIFY_GATHER_BYTES // max(1, spec0.top_k * per_expert))
    if target < 4:
        if len(candidates) > 1:
            raise _Reject("experts too large for the numeric check and the structure leaves choices open")
        return spec0, "skipped: gathered expert weights would exceed VERIFY_GATHER_BYTES"

    nodes = region | support
    sub, inputs = _extract(ctx, nodes, x_root, out)
    errs = []
    for vals in _sym_values(x_root, target, per_expert * spec0.top_k if target < VERIFY_TOKENS else 0):
        gen = torch.Generator(device="cpu").manual_seed(0x6D6F65)
        args, x_val = _make_inputs(ctx, inputs, x_root, gen, vals)
        tensors = {}
        for k in MOE_ARGS:
            p = ph[bindings[k]] if bindings[k] is not None else None
            tensors[k] = None if p is None else args[inputs.index(p)] if p in inputs else _value(ctx, p, gen)
        with torch.no_grad():
            try:
                got = _run_disabled(sub, args)
            except Exception as e:  # noqa: BLE001
                errs.append(f"the block's own graph failed to run ({type(e).__name__}: {str(e)[:200]})")
                continue
            got = got.float()
            xin = x_val if x_in is x_root else x_val.reshape(got.shape)
            for spec in candidates:
                try:
                    want = reference.moe_forward(xin, **tensors, spec=spec).float()
                except Exception as e:  # noqa: BLE001
                    errs.append(f"{spec.describe()}: reference failed ({e})")
                    continue
                ok, msg = _close(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]), x_val.dtype)
                if ok:
                    T = x_val.numel() // x_val.shape[-1]
                    return spec, f"numeric, {T} tokens ({msg})"
                errs.append(f"{spec.describe()}: {msg}")
        break  # the graph ran: its verdict stands
    raise _Reject("numeric check failed: " + "; ".join(errs))


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> tuple[bool, str]:
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = want.abs().max().clamp_min(1e-6)
    err = ((got - want).abs().max() / scale).item()
    if dtype in (torch.float32, torch.float64):
        return err <= 1e-4, f"max rel err {err:.2e}"
    tok_scale = want.abs().amax(-1).clamp_min(1e-3 * scale.item())
    tok_err = (got - want).abs().amax(-1) / tok_scale
    frac = (tok_err <= 3e-2).float().mean().item()
    return frac >= 0.9, f"{frac:.0%} tokens within 3e-2 (max rel err {err:.2e})"


@torch._dynamo.disable
def _run_disabled(sub, args):
    return sub(*args)


def _extract(ctx: _Context, nodes: set, x_root, out):
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
        if _fx.is_inplace(n) and _base_tensor(_fx.mutated_arg(n)) in needed | extra:
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
                raise _Reject(f"region is not self-contained at {n.name}")
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return fx.GraphModule(ctx.gm, g), inputs


def _gathers(nodes, weights) -> bool:
    """Does the block index a 3-D expert weight with a tensor (``w13[ids]``)?"""
    for n in nodes:
        if op_name(n) in ("getitem", "index_select") and _weight_base(n) in weights:
            idx = n.args[1] if len(n.args) > 1 else None
            items = idx if isinstance(idx, (tuple, list)) else (idx,)
            if any(isinstance(i, fx.Node) for i in items) or op_name(n) == "index_select":
                return True
    return False


def _sym_values(x_root, target: int, bytes_per_token: int = 0) -> list[dict]:
    """Values for the free symbols of x's shape: the smallest that give ``target`` tokens, then the traced hints
    (when the first fail to run and the hints stay within budget)."""
    xs = _fx.shape_of(x_root)
    free, hints = [], {}
    for d in xs:
        if isinstance(d, torch.SymInt):
            node = d.node
            env = getattr(node.shape_env, "backed_var_to_val", None) or node.shape_env.var_to_val
            for sym in node.expr.free_symbols:
                if sym not in hints:
                    free.append(sym)
                    hints[sym] = int(env.get(sym, 2))
    if not free:
        return [{}]

    def tokens(vals):
        n = 1
        for d in xs[:-1]:
            n *= int(d.node.expr.xreplace(vals)) if isinstance(d, torch.SymInt) else int(d)
        return n

    out = []
    for v in range(2, 4097):
        vals = {sym: v for sym in free}
        if tokens(vals) >= target:
            out.append(vals)
            break
    if hints not in out and (not bytes_per_token or tokens(hints) * bytes_per_token <= VERIFY_GATHER_BYTES):
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
    if T >= 4:
        flat[: T // 4] = flat[T // 4]  # a crowd of identical tokens: one expert gets many
    x = x.to(device=dev, dtype=dt)
    args = [x]
    for p in inputs[1:]:
        mv = _fx.meta_val(p)
        if isinstance(mv, torch.SymInt):
            args.append(int(mv.node.expr.xreplace(vals)))
        elif isinstance(ctx.values.get(p), (int, torch.SymInt)) and not isinstance(mv, torch.Tensor):
            args.append(int(ctx.values[p]))
        else:
            args.append(_value(ctx, p, gen))
    return args, x


def _value(ctx: _Context, p, gen):
    v = ctx.values.get(p)
    if isinstance(v, torch.Tensor) and not _fx.is_fake(v):
        return v
    mv = _fx.meta_val(p)
    if isinstance(mv, torch.Tensor):
        if mv.dim() == 0:
            raise _Reject(f"the value of scalar input {p.name} is unknown (pass example inputs)")
        fan = mv.shape[-1] if mv.dim() else 1
        t = torch.randn(tuple(int(d) for d in mv.shape), generator=gen) / math.sqrt(max(1, fan))
        return t.to(dtype=mv.dtype)
    if isinstance(v, (int, float)):
        return v
    raise _Reject(f"no value for input {p.name}")
