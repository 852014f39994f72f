"""detect_moe: find Mixture-of-Experts blocks in Dynamo's torch-level FX graph and describe each as a MoESpec.

The matched subgraph (names are roles, not node names; ``[..]`` optional, ``|`` alternatives)::

        x ──[view/reshape]──[.float()]──► linear(·, router_w [E,H], [router_b]) = logits [T,E]
                                                     │
            score_then_topk:  softmax | sigmoid | sqrt(softplus) | none ──► scores
                              [+ correction_bias [E] | [1,E].squeeze()] ──► choice
                              [view(T,G,E/G) ─ topk(2).sum | amax ─ topk(topk_group) ─ mask
                                 ─ masked_fill(-inf | 0.0 (group_mask_zero))]
                              topk(choice, k) ──► ids ;  weights = topk values | scores.gather(ids)
            bias_on_logits:   topk(logits + correction_bias, k) ──► ids ;
                              weights = sigmoid(logits.gather(ids)) | scores.gather(ids)   (elementwise: same)
            topk_then_score:  topk(logits, k) ──► ids ; weights = softmax(values)
                                                     │
                  [weights /= max(weights.sum(-1) (+eps), renorm_min)] [* or / scalar] [.to(model dtype)]
                                                     │
        x ──► dispatch by ids ──► GEMM(w13 [E,2I,H] | [E,H,2I]) [+ b13[ids]]
                 ──► act(gate) * up | act(gate.clamp(max=L)) * up.clamp(-L, L) | swiglu_oai | act | relu(·)**2
                 ──► GEMM(w2 [E,H,I] | [E,I,H]) [+ b2[ids]] ──► * weights ──► combine over k
                 ──► [* routed_scaling (scalar constant / attribute, folded into routed_scaling_factor)]
                                                     │
        x ──► [shared: down(act(gate_proj x) * up_proj x) | clamped | swiglu_oai(chunk(gate_up_proj x)) | act(up x)
               [* sigmoid(shared_gate x)]] ──(+)──► [view] ──► out (the MoE output) ──► [tail, e.g. a norm] ──►

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
   A clamp in the activation is either a clamped SwiGLU (gate ``clamp(max=L)`` into the activation, up
   ``clamp(-L, L)`` into the product: ``activation_clamp``) or part of swiglu_oai; any other clamp is rejected.
   A scalar multiply (or divide) of the combined routed output that every path from the expert GEMMs to the output
   passes through, before any shared-expert add, is folded into ``routed_scaling_factor``.
   Scalar module attributes that Dynamo lifts to 0-d inputs (``routed_scaling_factor``, gpt-oss ``alpha`` /
   ``limit``) are read from the example inputs the backend receives and baked into the spec (Dynamo does not guard
   on them; the match records which spec field came from which placeholder in ``MoEMatch.baked``).
   The region may contain only deterministic ops and may mutate only tensors it created.
3. **Output.** The MoE output is the region's result, or, when the block applies a tail to it (AXK1's
   ``post_mlp_layernorm``; in a whole-model graph the next layer's norm), the latest node before it through which
   everything the experts compute passes (tried latest first, at most ``MAX_OUTPUT_CANDIDATES``; the first the
   numeric check accepts is taken). ``MoEMatch.output`` is that node, ``MoEMatch.block_output`` the region's
   result, ``MoEMatch.tail`` the nodes between (left in the graph), ``MoEMatch.output_is_final`` whether there is
   no tail.
4. **Numerics.** The region is cut out as its own GraphModule and run on random tokens (a quarter of them copies of
   one token, so one expert gets crowded: capacity limits would show) against ``moecomp.reference.moe_forward``
   with the derived spec and the real weights. fp32/fp64 blocks must agree to 1e-4 (relative to the output's max);
   lower-precision blocks per token to 3e-2, on at least 90% of tokens (routing near-ties may flip). Only where the
   graph leaves a discrete choice open (e.g. weight layout when every dim equals H) are the few candidates tried in
   turn; the first that agrees is taken. The check (``passes/_numeric.py``) runs on about ``VERIFY_TOKENS`` tokens
   (the graph's symbolic sizes are set accordingly; the traced sizes are the fallback). A block that gathers whole expert matrices per
   token (``w13[ids]``) would materialise T * k of them: when even 4 tokens exceed ``VERIFY_GATHER_BYTES`` the check
   is skipped, the match rests on the structure alone and says so (``MoEMatch.verified``). A spec that clamps
   (swiglu_oai, ``activation_clamp``, in routed or shared experts) is checked again with the clamped projections'
   weights scaled up until the clamps bind (random weights seldom reach a limit such as 10).

Blocks routed by a table lookup of token ids (hash routing, ``tid2eid[input_ids]``) have no top-k; they are reported
in ``rejected`` with that reason.

Anything not recognised is left alone and reported in ``DetectResult.rejected`` as ``(where, reason)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..ops.common import MOE_ARGS
from ..spec import MoESpec, SharedExpertSpec, SpecError
from . import _fx
from ._context import Context as _Context
from ._fx import arg, op_name
from ._numeric import Reject as _Reject
from ._numeric import verify as _verify

_base_tensor = _fx.base_tensor
_weight_base = _fx.weight_base


_RANDOM_OPS = frozenset(
    {
        "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "uniform_", "normal_",
        "bernoulli", "bernoulli_", "multinomial", "exponential_", "random_", "cauchy_", "log_normal_",
        "geometric_", "normal", "poisson", "native_dropout",
    }
)
_SCORE_OPS = {"softmax": "softmax", "sigmoid": "sigmoid"}


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
    # the node where the block's own result leaves the matched region: ``output`` itself, or the end of a tail of
    # ops computed from it (e.g. AXK1's post_mlp_layernorm) that the rewrite leaves in place
    block_output: fx.Node | None = None
    tail: frozenset = frozenset()  # the tail's nodes (not in ``nodes``: they stay)
    arg_shapes: dict[str, tuple] = field(default_factory=dict)  # MOE_ARGS name -> shape the op needs it viewed as

    def __post_init__(self):
        if self.block_output is None:
            self.block_output = self.output

    @property
    def output_is_final(self) -> bool:
        """Is the MoE output the block's own result (no tail after it)?"""
        return self.block_output is self.output

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
) -> DetectResult:
    """Find the MoE blocks of ``gm`` (a Dynamo torch-level graph).

    ``example_inputs``: the values the backend received, in placeholder order. They give the real values of scalar
    attributes (baked into the spec) and the weights for the numeric check; without them the check uses random
    weights of the recorded shapes, and blocks that need a scalar attribute's value are rejected.
    ``verify``: run the numeric check (see the module docstring).
    """
    ctx = _Context(gm, example_inputs, verify=verify)
    _hash_routed(ctx)
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


def _hash_routed(ctx: _Context) -> None:
    """Blocks whose expert ids are looked up in an integer table by token ids (DeepSeek-V4's ``tid2eid[input_ids]``
    hash routing) have no top-k to start from: report them (``early_rejects``) instead of passing them by silently."""
    ph3 = {p for p in ctx.static_ph if (s := ctx.pshape(p)) is not None and len(s) == 3}
    for p in ctx.static_ph:
        v = _fx.meta_val(p)
        if not (isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point() and v.dtype != torch.bool):
            continue
        for u in p.users:
            if op_name(u) not in ("getitem", "index_select", "embedding", "index"):
                continue
            idx = [a for a in u.all_input_nodes if a is not p]
            if not idx or all(a in ctx.static_ph for a in idx):
                continue
            reach = _fx.descendants(u)
            if any(_weight_base(a) in ph3 for r in reach for a in r.all_input_nodes):
                ctx.early_rejects.append((f"{u.name} ({p.name}[token ids])",
                                          "expert ids are looked up in a table by token ids (hash routing), not "
                                          "chosen by a top-k: not a routing MoESpec can express"))
                break


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
    renorm_min: float = 0.0
    scaling: float = 1.0
    bias_on_logits: bool = False
    group_mask_zero: bool = False
    bias_shape: tuple | None = None  # the correction bias placeholder's shape when it is not (E,) (e.g. [1, E])
    round_weights: bool = False
    router_fp32: bool = False
    weights: fx.Node | None = None
    baked: dict = field(default_factory=dict)


MAX_OUTPUT_CANDIDATES = 8  # earlier nodes tried as the MoE output when the block's result does not agree


def _match_at(ctx: _Context, t: fx.Node) -> MoEMatch:
    r = _routing(ctx, t)
    x_root, x_chain = _x_root(ctx, r.x_router, r.logits_linear)
    region, support = _region(ctx, x_root)
    if t not in region:
        raise _Reject("the top-k is not computed from the router input alone")
    _check_ops(ctx, region | support, x_root)
    ex = _experts(ctx, r, region, support)
    ex["H"] = r.H
    block_out = _output(ctx, region, ex["g2"])
    # The MoE output is the block's result, or (when a tail such as a post-MoE norm follows the combine) the latest
    # node before it through which everything the experts compute passes: tried latest first, the first one whose
    # value the spec reproduces is taken; the tail stays in the graph.
    errors = []
    for out in _output_candidates(ctx, region, ex, block_out)[:MAX_OUTPUT_CANDIDATES]:
        try:
            return _match_output(ctx, t, r, x_root, x_chain, region, support, ex, out, block_out)
        except _Reject as e:
            errors.append((out, str(e)))
    why = errors[0][1]
    if len(errors) > 1:
        why += (f" (also tried {len(errors) - 1} earlier node(s) as the MoE output, followed by a tail: "
                + "; ".join(f"{o.name}: {w[:160]}" for o, w in errors[1:3]) + ")")
    raise _Reject(why)


def _output_candidates(ctx: _Context, region: set, ex: dict, block_out: fx.Node) -> list:
    """``block_out``, then the nodes before it (latest first) that every path from the expert GEMMs to it passes
    through and that hold a [..., H] tensor: the places where the MoE result may end and a tail begin."""
    g2s = set(ex["g2_all"])
    anc = _fx.ancestors(block_out, region, pos=ctx.order)
    path = set()
    for g in g2s:
        path |= _fx.descendants(g, region) & anc
    path |= {block_out}

    def reaches(skip):
        seen, stack = set(), [u for g in g2s for u in g.users if u in path and u is not skip]
        while stack:
            n = stack.pop()
            if n is block_out:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(u for u in n.users if u in path and u is not skip and u not in seen)
        return False

    H = ex.get("H")
    out = [block_out]
    for n in sorted(path - {block_out} - g2s, key=ctx.order.get, reverse=True):
        s = _fx.shape_of(n)
        if not s or (H is not None and _fx.static_int(s[-1]) != H) or _fx.is_inplace(n):
            continue
        if not reaches(n):
            out.append(n)
    return out


def _scalar_operand(ctx: _Context, v):
    """(value, placeholder name or None) when ``v`` is a scalar constant or a scalar attribute, else None."""
    val = _fx.scalar_value(v, ctx.values)
    src = v
    while isinstance(src, fx.Node) and op_name(src) in ("item", "neg"):
        src = arg(src, 0)
    name = src.name if isinstance(src, fx.Node) and src.op == "placeholder" else None
    if val is not None:
        return val, name
    if isinstance(v, fx.Node) and v.op == "placeholder" and v in ctx.static_ph:
        t = ctx.values.get(v)
        if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() and not _fx.is_fake(t):
            return float(t), v.name
    return None


def _output_scale(ctx: _Context, region: set, ex: dict, out: fx.Node, shared_down) -> tuple[float, dict]:
    """Scalar multiplies (or divides) of the combined routed output before any shared-expert add
    (``experts(x) * routed_scaling_factor``): as the combine is linear they equal scaling the routing weights."""
    g2s = set(ex["g2_all"])
    anc = _fx.ancestors(out, region, pos=ctx.order) | {out}
    path = set()
    for g in g2s:
        path |= _fx.descendants(g, region) & anc
    after_shared = _fx.descendants(shared_down, region) | {shared_down} if shared_down is not None else set()
    scale, baked = 1.0, {}
    for n in sorted(path, key=ctx.order.get):
        nm = op_name(n)
        if nm not in ("mul", "div") or n in after_shared:
            continue
        a, b = arg(n, 0), arg(n, 1)
        if nm == "mul" and not (isinstance(a, fx.Node) and a in path):
            a, b = b, a
        if not (isinstance(a, fx.Node) and a in path):
            continue
        sc = _scalar_operand(ctx, b)
        if sc is None:
            continue
        # every path from the expert GEMMs to the output passes through n
        seen, stack, hit = set(), [u for g in g2s for u in g.users if u in path and u is not n], False
        while stack:
            m = stack.pop()
            if m is out:
                hit = True
                break
            if m not in seen:
                seen.add(m)
                stack.extend(u for u in m.users if u in path and u is not n and u not in seen)
        if hit or (out is not n and n not in _fx.ancestors(out, region, pos=ctx.order)):
            continue
        v, src = sc
        if nm == "div":
            if v == 0:
                continue
            v = 1.0 / v
        scale *= v
        if src is not None:
            baked["routed_scaling_factor"] = src
    return scale, baked


def _match_output(ctx, t, r0, x_root, x_chain, region, support, ex, out, block_out) -> MoEMatch:
    r = dataclasses.replace(r0, baked=dict(r0.baked))
    tail = _fx.descendants(out, region) if out is not block_out else set()
    core = region - tail
    sh = _shared(ctx, r, core, x_root, out, ex)
    x_in = _pick_input(ctx, x_root, x_chain, out, core)
    scale, scale_baked = _output_scale(ctx, core, ex, out, sh["down"] if sh else None)
    if scale != 1.0:
        r.scaling *= scale
        if "routed_scaling_factor" in scale_baked and "routed_scaling_factor" in r.baked:
            raise _Reject("routed scaling read from two scalar attributes (router and block output)")
        r.baked.update(scale_baked)
    out_dtype = _fx.dtype_of(out)
    x_dtype = _fx.dtype_of(x_in)
    if x_dtype in (torch.bfloat16, torch.float16) and _fx.dtype_of(r.weights) == x_dtype:
        r.round_weights = True  # the weights reach the experts in the model dtype (e.g. a softmax with dtype=bf16)

    oai_or_clamp = ex["clamp"] or "swiglu_oai" in ex["activations"]
    base = dict(
        num_experts=r.E,
        top_k=r.top_k,
        hidden_size=r.H,
        intermediate_size=ex["I"],
        scoring=r.scoring,
        score_order=r.score_order,
        renormalize=r.renormalize,
        renorm_eps=r.renorm_eps,
        renorm_min=r.renorm_min,
        routed_scaling_factor=r.scaling,
        n_group=r.n_group,
        topk_group=r.topk_group,
        group_score=r.group_score,
        has_correction_bias=r.correction_bias is not None,
        bias_on_logits=r.bias_on_logits,
        group_mask_zero=r.group_mask_zero,
        has_router_bias=r.router_b is not None,
        router_fp32=r.router_fp32,
        round_weights=r.round_weights,
        gated=ex["gated"],
        activation_clamp=ex["clamp"],
        activation_alpha=ex.get("alpha", 1.702) if "swiglu_oai" in ex["activations"] else 1.702,
        activation_limit=ex.get("limit", 7.0) if oai_or_clamp else 7.0,
        has_expert_bias=ex["b13"] is not None,
        shared=sh["spec"] if sh else None,
    )
    baked = dict(r.baked)
    baked.update(ex.get("baked", {}))
    if sh:
        baked.update(sh["baked"])
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
    arg_shapes = {"correction_bias": (r.E,)} if r.bias_shape is not None else {}

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

    nodes = frozenset((core | support) - tail)
    verified = "skipped: verify=False"
    spec = candidates[0]
    if ctx.verify:
        spec, verified = _verify(ctx, candidates, bindings, x_root, x_in, out, core, support, arg_shapes)
    elif len(candidates) > 1:
        raise _Reject("the graph leaves the weight layout / gate split / activation open and verify=False")
    elif out is not block_out:
        raise _Reject("a tail follows the MoE result: only the numeric check can place the MoE output (verify=False)")
    return MoEMatch(
        spec=spec,
        bindings=bindings,
        x=x_in,
        output=out,
        nodes=nodes,
        region=frozenset(core),
        router=r.logits_linear,
        topk=t,
        baked=baked,
        verified=verified,
        output_dtype=out_dtype if out_dtype != x_dtype else None,
        block_output=block_out,
        tail=frozenset(tail),
        arg_shapes=arg_shapes,
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
    mask_zero = False
    lin = None
    while True:
        name = op_name(cur)
        if name in _fx.CAST_OPS:
            cur = arg(cur, 0)
            continue
        if name == "masked_fill" and mask_fill is None and scoring is None:
            mask_fill = cur
            v = arg(cur, 2)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
                mask_zero = True  # dropped groups' experts get 0.0 (Mistral-4); only with group routing (_groups)
            elif not (isinstance(v, float) and v == -math.inf):
                raise _Reject(f"top-k input is masked with {v!r}, neither -inf nor 0.0")
            cur = arg(cur, 0)
            continue
        if name == "add" and bias is None and scoring is None:
            a, b = arg(cur, 0), arg(cur, 1)
            pa, pb = _bias_ph(ctx, a, E), _bias_ph(ctx, b, E)
            if pb is not None:
                bias, cur = pb, a
                continue
            if pa is not None:
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
    bias_on_logits = scoring is None and bias is not None  # topk(logits + bias): the scores come after the gather

    R = _Routing(
        logits_linear=lin, x_router=x_router, router_w=w, router_b=b, correction_bias=bias,
        scoring=scoring or "none", score_order="score_then_topk", top_k=k, E=E, H=H, router_fp32=router_fp32,
        bias_on_logits=bias_on_logits,
    )
    if bias is not None and ctx.pshape(bias) != (E,):
        R.bias_shape = ctx.pshape(bias)
    if mask_fill is not None:
        _groups(ctx, R, mask_fill, lin)
        R.group_mask_zero = mask_zero

    vals = [u for u in t.users if op_name(u) == "getitem" and u.args[1] == 0]
    ids = [u for u in t.users if op_name(u) == "getitem" and u.args[1] == 1]
    ids = ids[0]
    # where the weights come from
    w0 = None
    if bias_on_logits:
        w0 = _weights_after_biased_logits(ctx, R, ids, lin)
    for u in ids.users if w0 is None else ():
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


def _bias_ph(ctx: _Context, n, E: int):
    """``n`` as a per-expert bias: a static placeholder with E elements ([E], or [1, E] squeezed / viewed), through
    views and casts; else None."""
    base = _fx.strip_views_casts(n)
    if not (isinstance(base, fx.Node) and base.op == "placeholder" and base in ctx.static_ph):
        return None
    s = ctx.pshape(base)
    if s is None or E not in s or math.prod(s) != E:
        return None
    return base


def _weights_after_biased_logits(ctx: _Context, R: _Routing, ids: fx.Node, lin: fx.Node) -> fx.Node:
    """``topk(logits + bias)`` (Kolibri-1): the weights are the scores of the chosen experts, scored before or after
    the gather (an elementwise scoring commutes with it): ``sigmoid(logits.gather(ids))`` or
    ``sigmoid(logits).gather(ids)``. Sets ``R.scoring``; returns the weights node."""
    found = []
    for u in ids.users:
        if op_name(u) != "gather":
            continue
        if arg(u, 1) not in (1, -1):
            raise _Reject("weights gathered over a dim other than the experts")
        src = _fx.strip_views_casts(arg(u, 0), views=False)
        if src is lin:
            after = [v for v in u.users if op_name(v) in ("sigmoid", "softmax", "sqrt", "softplus")]
            if not after:
                found.append(("none", u))
            elif len(after) == 1 and op_name(after[0]) == "sigmoid":
                found.append(("sigmoid", after[0]))
            else:
                raise _Reject(f"biased top-k of the logits, then '{op_name(after[0])}' of the gathered logits: "
                              "not a scoring the spec knows (only an elementwise sigmoid commutes with the gather)")
        elif op_name(src) in ("sigmoid", "softmax") and _fx.strip_views_casts(arg(src, 0), views=False) is lin:
            if op_name(src) == "softmax" and arg(src, 1, default=None) not in (-1, len(_fx.shape_of(src)) - 1):
                raise _Reject("softmax over a dim other than the experts")
            found.append((op_name(src), u))
    if len(found) != 1:
        raise _Reject("top-k of the biased logits: the weights are not the scores of the chosen experts "
                      f"({len(found)} candidate gathers)")
    R.scoring = found[0][0]
    return found[0][1]


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
    # (only nodes after the router: descendants() follows in-place writes back to the tensors they alias, which in
    # a whole-model graph can reach the residual stream and the attention before the block)
    after_lin = {n for n in _fx.descendants(lin) if ctx.order[n] > ctx.order[lin]}
    anc = _fx.ancestors(arg(mask_fill, 1), after_lin, pos=ctx.order)
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
                eps, lo = 0.0, 0.0
                if op_name(d) in _CLAMPS:  # max(sum (+ eps), min): ERNIE-4.5's clamp(sum, min=norm_min)
                    lo_v, hi_v = _clamp_bounds(ctx, d, R.baked, "renorm_min")
                    if hi_v is not None or lo_v is None:
                        raise _Reject("renormalisation denominator clamped from above")
                    lo, d = lo_v, arg(d, 0)
                if op_name(d) == "add" and arg(d, 0) in sums:
                    e = _fx.scalar_value(arg(d, 1), ctx.values)
                    if e is None:
                        raise _Reject("renormalisation eps is not a constant")
                    eps, d = e, arg(d, 0)
                if op_name(d) in _CLAMPS and arg(d, 0) in sums:
                    raise _Reject("renormalisation denominator clamped before the eps is added (max(sum, m) + eps)")
                if d in sums:
                    if R.renormalize:
                        raise _Reject("weights renormalised twice")
                    R.renormalize, R.renorm_eps, R.renorm_min, nxt = True, eps, lo, u
                    break
            if name in ("div", "div_") and arg(u, 0) is cur:  # weights / scalar (e.g. `router_scores / top_k`)
                v = _fx.scalar_value(arg(u, 1), ctx.values)
                if v is not None and v != 0 and math.isfinite(v):
                    R.scaling /= v
                    nxt = u
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
               g2_all=g2, b13=None, b2=None, baked={})

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
    act = _activation(ctx, between, gated, res["baked"], "expert")
    res.update(activations=act["activations"], clamp=act["clamp"])
    if "alpha" in act:
        res["alpha"] = act["alpha"]
    if "limit" in act:
        res["limit"] = act["limit"]

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


_CLAMPS = ("clamp", "clamp_min", "clamp_max")


def _clamp_bounds(ctx: _Context, n: fx.Node, baked: dict | None = None, field: str | None = None):
    """(min, max) of a clamp node as floats, None where open; rejects bounds whose value cannot be read."""
    nm = op_name(n)
    if nm == "clamp":
        lo, hi = arg(n, 1, "min"), arg(n, 2, "max")
    elif nm == "clamp_min":
        lo, hi = arg(n, 1, "min"), None
    else:
        lo, hi = None, arg(n, 1, "max")
    out = []
    for b in (lo, hi):
        if b is None:
            out.append(None)
            continue
        v = _fx.scalar_value(b, ctx.values)
        if v is None:
            raise _Reject(f"clamp bound of {n.name} is not readable (a tensor, or no example inputs)")
        if baked is not None and field and isinstance(b, fx.Node):
            src = b
            while isinstance(src, fx.Node) and op_name(src) in ("neg", "item"):
                src = arg(src, 0)
            if isinstance(src, fx.Node) and src.op == "placeholder":
                baked[field] = src.name
        out.append(v)
    return out[0], out[1]


def _strip_gate_clamp(n):
    """``n`` through views / casts and an upper-only clamp (the gate side of a clamped SwiGLU)."""
    n = _fx.strip_views_casts(n)
    if isinstance(n, fx.Node) and op_name(n) in ("clamp", "clamp_max") and (
            op_name(n) == "clamp_max" or arg(n, 1, "min") is None):
        n = _fx.strip_views_casts(arg(n, 0))
    return n


def _activation(ctx: _Context, between: set, gated: bool, baked: dict, who: str) -> dict:
    """The activation computed by the nodes ``between`` the first GEMM(s) and the down GEMM: candidate activation
    names, and swiglu_oai's alpha / limit or the clamped SwiGLU's limit (``clamp``)."""
    names = {op_name(n) for n in between}
    clamps = [n for n in between if op_name(n) in _CLAMPS]
    if clamps and "sigmoid" in names and gated:
        alpha, limit = _swiglu_consts(ctx, between, baked)
        return dict(activations=["swiglu_oai"], alpha=alpha, limit=limit, clamp=False)
    acts = []
    for n in between:
        nm = op_name(n)
        if nm == "gelu":
            acts.append("gelu_tanh" if arg(n, 1, "approximate", "none") == "tanh" else "gelu")
        elif nm == "relu":
            sq = [u for u in n.users if u in between and (
                op_name(u) == "square" or (op_name(u) == "pow" and arg(u, 1, "exponent") in (2, 2.0))
                or (op_name(u) == "mul" and arg(u, 0) is n and arg(u, 1) is n))]
            acts.append("relu2" if sq else "relu")
        elif nm == "silu":
            acts.append(nm)
        elif nm == "sigmoid":
            acts.append("silu")  # x * sigmoid(x); the numeric check confirms
    acts = sorted(set(acts))
    if len(acts) != 1:
        raise _Reject(f"{who} activation not recognised (ops between the GEMMs: {sorted(names)})")
    res = dict(activations=acts, clamp=False)
    if clamps:
        if not gated:
            raise _Reject(f"{who}: clamp in an ungated activation (not a clamped SwiGLU)")
        res.update(clamp=True, limit=_clamp_limit(ctx, clamps, between, baked, who))
    return res


def _clamp_limit(ctx: _Context, clamps, between: set, baked: dict, who: str) -> float:
    """Clamped SwiGLU (DeepSeek-V4): act(gate.clamp(max=L)) * up.clamp(-L, L). Returns L; rejects anything else."""
    upper, sym = [], []
    for c in clamps:
        lo, hi = _clamp_bounds(ctx, c, baked, "activation_limit")
        if lo is None and hi is not None:
            upper.append((c, hi))
        elif lo is not None and hi is not None and math.isclose(lo, -hi) and hi > 0:
            sym.append((c, hi))
        else:
            raise _Reject(f"{who}: clamp({lo}, {hi}) in the activation is not a clamped SwiGLU's")
    if len(upper) != 1 or len(sym) != 1 or not math.isclose(upper[0][1], sym[0][1]):
        raise _Reject(f"{who}: clamps {[(c.name, v) for c, v in upper + sym]} are not one gate clamp(max=L) and "
                      "one up clamp(-L, L)")
    (cu, limit), (cs, _) = upper[0], sym[0]
    act_in = [n for n in between if op_name(n) in ("silu", "gelu", "relu") and _fx.strip_views_casts(arg(n, 0)) is cu]
    up_in = [n for n in between if op_name(n) == "mul" and any(
        _fx.strip_views_casts(a) is cs for a in (arg(n, 0), arg(n, 1)))]
    if len(act_in) != 1 or not up_in:
        raise _Reject(f"{who}: clamped gate / up do not feed act(gate) * up")
    return limit


def _swiglu_consts(ctx: _Context, between: set, baked: dict):
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
                baked["activation_limit"] = arg(mx, 0).name
        if nm == "sigmoid":
            m = arg(n, 0)
            if op_name(m) == "mul":
                for o in (arg(m, 0), arg(m, 1)):
                    v = _fx.scalar_value(o, ctx.values)
                    if v is not None:
                        alpha = v
                        if isinstance(o, fx.Node) and op_name(o) == "item":
                            baked["activation_alpha"] = arg(o, 0).name
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
    down_anc = _fx.ancestors(down, region, pos=ctx.order)
    between = set()
    for n, _ in mlp_in:
        between |= _fx.descendants(n, region) & down_anc
    # which input projection feeds the activation (through views / casts and a gate clamp(max=L))
    act_of = {}
    for n, w in mlp_in:
        for u in between:
            nm = op_name(u)
            if nm in ("silu", "relu", "gelu") and _strip_gate_clamp(arg(u, 0)) is n:
                act_of[n] = nm
    bind = dict(shared_w1=None, shared_w3=None, shared_w2=wd, shared_gate_w=None)
    baked = {}  # spec fields read from scalar attributes: reported as "shared.<field>"
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
        act = _activation(ctx, between, True, baked, "shared expert")
        spec = dict(intermediate_size=Is, gated=True, layout="separate")
        bind.update(shared_w1=wg, shared_w3=wu)
    elif len(mlp_in) == 1:
        n, w = mlp_in[0]
        s = ctx.pshape(w)
        chunked = any(op_name(u) in ("chunk", "split", "getitem") for u in n.users)
        if s == (2 * Is, H) and chunked:
            if any(op_name(u) == "getitem" and _has_step2(arg(u, 1)) for u in between):
                raise _Reject("shared expert with interleaved gate/up rows is not supported")
            try:
                act = _activation(ctx, between, True, baked, "shared expert (concatenated gate/up)")
            except _Reject as e:
                raise _Reject(f"shared expert (concatenated gate/up): activation not recognised ({e})") from None
            spec = dict(intermediate_size=Is, gated=True, layout="concat")
            bind.update(shared_w1=w)
        elif s == (Is, H) and n in act_of:
            act = _activation(ctx, between, False, baked, "shared expert")
            spec = dict(intermediate_size=Is, gated=False, layout="separate")
            bind.update(shared_w3=w)
        else:
            raise _Reject("shared expert projection not recognised")
    else:
        raise _Reject("more than two shared input projections")
    if len(act["activations"]) != 1:
        raise _Reject(f"shared expert activation is ambiguous: {act['activations']}")
    spec.update(activation=act["activations"][0], activation_clamp=act["clamp"])
    if "alpha" in act:
        spec["activation_alpha"] = act["alpha"]
    if "limit" in act:
        spec["activation_limit"] = act["limit"]
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
    return dict(spec=SharedExpertSpec(**spec), bind=bind, down=down,
                baked={f"shared.{k}": v for k, v in baked.items()})
