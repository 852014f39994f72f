"""detect_moe: find Mixture-of-Experts blocks in Dynamo's torch-level FX graph and describe each as a MoESpec.

This module is the entry point and the per-top-k orchestration; each part of the subgraph has its own module:
``moe_routing`` (router to routing weights), ``moe_region`` (the block input and region), ``moe_experts`` (stacked
expert GEMMs, layout, gate split, biases), ``moe_per_expert`` (experts kept as per-expert modules),
``moe_activation`` (activation and clamps), ``moe_shared`` (the shared expert), ``moe_output`` (where the MoE result
is, output scaling), ``numeric`` (the numeric check), ``refuse`` (why a candidate is refused: a
``moecomp.core.reject.RejectCode`` and a message).

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
                              | full(-inf).scatter(ids, values) ─► sigmoid | softmax   (dense [T, E]: Llama 4)
            sparsemixer:      ids = cat(k argmax rounds), weights = cat(k thresholded softmaxes)   (PhiMoE;
                              proven on probe logits: ``moe_sparsemixer``)
            hash routing:     table[token_ids] (a static [V, k] integer table, the call's integer token ids)
                              ──► ids ; weights = scores.gather(ids)            (DeepSeek-V4 hash_moe: moe_hash)
                                                     │
                  [weights /= max(weights.sum(-1) (+eps), renorm_min)] [* or / scalar] [.to(model dtype)]
                                                     │
        x ──► dispatch by ids ──► GEMM(w13 [E,2I,H] | [E,H,2I]) [+ b13[ids]]
                 ──► act(gate) * up | act(gate.clamp(max=L)) * up.clamp(-L, L) | swiglu_oai | act | relu(·)**2
                 ──► GEMM(w2 [E,H,I] | [E,I,H]) [+ b2[ids]] ──► * weights ──► combine over k
                 (weight_on_input: the weights scale x before the first GEMM instead, combine unweighted: Llama 4)
                 (zero experts: the stacked weights hold E < the router's E + Z experts; ids >= E add weights * x,
                  LongCat-Flash: zero_experts = Z, proven by the numeric check on tokens some of which pick them)
                 ──► [* routed_scaling (scalar constant / attribute, folded into routed_scaling_factor)]
                 (latent, NemotronH: the experts read linear(x, Wi [L, H]) and work on L; their combined output
                  goes through linear(·, Wo [H, L]) here, before the shared add: ``moe_latent``)
                                                     │
        x ──► [shared: down(act(gate_proj x) * up_proj x) | clamped | swiglu_oai(chunk(gate_up_proj x)) | act(up x)
               [* sigmoid(shared_gate x)]] ──(+)──► [* c | / c: constant, scales routed and shared (shared.scale)]
                                                     ──► [view] ──► out (the MoE output) ──► [tail, e.g. a norm] ──►

    dispatch / GEMM / combine may be spelled as transformers' ``grouped_mm`` path (sort, histc, cumsum,
    ``transformers::grouped_mm_fallback`` | ``torch._grouped_mm`` | ``F.grouped_mm``, inverse permutation,
    ``view(T,k,H).sum(1)``), its ``batched_mm`` path (``repeat_interleave``, ``w[ids]``, ``bmm``), an expert-indexed
    einsum / bmm / matmul (``w1[expert_indices]``), or an unrolled per-expert loop (``w13[e]``, ``index_add_``).
    A stacked weight may be held flat: one 2-D matrix [E * n, C] / [R, E * n] that the block views as [E, ., .] or
    takes E row / column ranges of (``moe_flat``), and the two weights may be stored one [out, in], the other
    [in, out]; the op then reads a view of the same storage (``MoEMatch.arg_views``: no copy).

    Experts kept as per-expert modules (``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` of 2-D weights, no
    [E, ., .] weight in the block), the loop over the experts unrolled (``capture_block(..., real_values=True)``
    follows the example's ``if tok.numel():`` branches)::

        ids ─► ids == e | one_hot(ids)[e] | scatter(zeros, 1, ids, weights)[:, e]  (for e = 0 .. E-1, constants)
          sparse: ─► tok, slot = where(·) ─► x[tok] ─► expert_e ─► * weights[tok, slot] ─► out.index_add_(0, tok, ·)
          dense:  x ─► expert_e ─► * (weights * (ids == e)).sum(-1, keepdim=True) ─► out += ·
          expert_e: down_e(act(gate_e x) * up_e x) | down_e(act(gate_up_e x)) | down_e(act(up_e x)) [+ biases],
                    each a linear of a 2-D [out, in] weight                  ──► MoEMatch.stacked (w13, w2, b13, b2)

How a match is proven (nothing is matched on class or module names):

1. **Region.** From each top-k whose indices select slices of 3-D ``[E, ., .]`` weights (or are compared with
   expert constants: per-expert modules), walk back to the router linear and its input ``x``. The block is the set
   of nodes computable from ``x`` plus weights (placeholders of static shape that are state, i.e. parameters,
   buffers, scalar attributes, but not the arguments the compiled call was made with: ``graph.is_call_input``, from
   Dynamo's record of each input's source) that descend from ``x``; its output is the one node of that set that
   depends on the expert GEMMs and is read outside it (or returned).
   Under static shapes the token ids / hidden states a model is called with have static shapes too: were they
   taken for weights, everything after the first block (residual stream included) would be "computable from x
   plus weights" and one region would swallow every later block.
2. **Structure.** Every spec field is read from the nodes: scoring op, top-k ``k``, correction-bias add, group view
   and group top-k, renormalising sum/div and its eps, scaling multiplier, casts (router in fp32, weights rounded to
   the model dtype), GEMM operand order / transposes (weight layout), the gate's chunk or stride-2 slices and
   activation (and swiglu alpha / limit), per-expert biases, shared-expert linears and their sigmoid gate.
   Per-expert modules are grouped into experts by the ``ids == e`` / one-hot slice that dispatches their tokens or
   weights their output (never by module names); every expert 0..E-1 must be there once, all of one structure
   (``moe_per_expert``), and the op's stacked tensors are named per expert in ``MoEMatch.stacked``.
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
   one token, so one expert gets crowded: capacity limits would show) against ``moecomp.oracle.reference.moe_forward``
   with the derived spec and the real weights. fp32/fp64 blocks must agree to 1e-4 (relative to the output's max);
   lower-precision blocks per token to 3e-2, on at least 90% of tokens (routing near-ties may flip). Only where the
   graph leaves a discrete choice open (e.g. weight layout when every dim equals H) are the few candidates tried in
   turn; the first that agrees is taken. The check (``recognise/fx/numeric.py``; its tolerances and budgets are
   ``moecomp.core.policy.FX_CHECK_*``) runs on about ``FX_CHECK_TOKENS`` tokens (the graph's symbolic sizes are set
   accordingly; the traced sizes are the fallback). A block that gathers whole expert matrices per token
   (``w13[ids]``) would materialise T * k of them: the tokens are cut to what ``policy.WORKING_MEMORY_BYTES`` holds,
   and when not even one token fits the check is skipped, the match rests on the structure alone and says so
   (``MoEMatch.verified``). A check that runs out of memory is tried again smaller, then on the CPU. A spec that clamps
   (swiglu_oai, ``activation_clamp``, in routed or shared experts) is checked again with the clamped projections'
   weights scaled up until the clamps bind (random weights seldom reach a limit such as 10).

Blocks routed by a table lookup of token ids (hash routing, ``tid2eid[input_ids]``) have no top-k: each such lookup
whose ids reach a 3-D weight is a candidate like a top-k (``moe_hash``); the spec gets ``hash_routing``, the
bindings ``hash_table`` (the table placeholder) and ``token_ids`` (the call input it is indexed by), and the numeric
check draws token ids in [0, V). Forms no spec expresses are refused with ``UNSUPPORTED_ROUTING``.

Anything not recognised is left alone and reported in ``DetectResult.rejected`` as ``(where, moecomp.core.reject.Reject)``:
``NOT_RECOGNISED`` (the structure is not one the pass knows), ``UNSUPPORTED_ROUTING`` (a routing no spec expresses),
``SPEC_INVALID`` (the derived spec is invalid), ``VERIFICATION_FAILED`` (the numeric check disagrees; ``CHECK_ERROR``
when the block's own graph could not run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...core.args import OP_ARGS
from ...core.reject import Reject as RejectRecord
from ...core.reject import RejectCode, StageError
from ...core.spec import MoESpec, SpecError, expert_bias_fields
from . import graph as _fx
from .context import Context
from .graph import op_name  # noqa: F401  (read by tests as detect_moe.op_name)
from .numeric import Block, verify
from .refuse import NotACandidate, Reject
from .moe_experts import Experts, stacked_experts, weights_on_input
from .moe_latent import Latent, check_scales, latent_out
from .moe_norms import expert_norm, latent_norm, per_expert_norm, shared_norm, with_norms
from .moe_output import MAX_OUTPUT_CANDIDATES, block_output, common_scale, output_candidates, output_scale
from .moe_per_expert import Unselected, per_expert, selector_topks
from .moe_region import Region, check_ops, find_region, pick_input
from .moe_hash import hash_lookups, hash_routing
from .moe_routing import Routing, routing
from .moe_sparsemixer import routing as sparsemixer_routing
from .moe_sparsemixer import selectors as sparsemixer_selectors
from .moe_shared import Shared, shared


@dataclass
class MoEMatch:
    """One MoE block found in a graph."""

    spec: MoESpec
    bindings: dict[str, str | None]  # OP_ARGS name -> placeholder node name (None = absent, or in ``stacked``)
    x: fx.Node  # the op's input: the block input (a view of it with the output's shape)
    output: fx.Node  # the node the op replaces
    nodes: frozenset  # every node of the block (DCE candidates; nodes also read elsewhere stay)
    region: frozenset  # the nodes that descend from x (``nodes`` adds weight-only helpers, which blocks may share)
    router: fx.Node  # the router linear
    topk: fx.Node  # the final top-k (hash routing: the looked-up ids)
    baked: dict[str, str] = field(default_factory=dict)  # spec field -> placeholder its value was read from
    verified: str = ""  # "numeric (max rel err ...)" or "skipped: why"
    output_dtype: torch.dtype | None = None  # dtype of ``output`` when it differs from x's
    # the node where the block's own result leaves the matched region: ``output`` itself, or the end of a tail of
    # ops computed from it (e.g. AXK1's post_mlp_layernorm) that the rewrite leaves in place
    block_output: fx.Node | None = None
    tail: frozenset = frozenset()  # the tail's nodes (not in ``nodes``: they stay)
    arg_shapes: dict[str, tuple] = field(default_factory=dict)  # MOE_ARGS name -> shape the op needs it viewed as
    # MOE_ARGS name -> the op reads the first n rows of its placeholder (zero experts: w13 [E + Z, ...] read as [E])
    arg_rows: dict[str, int] = field(default_factory=dict)
    # experts kept as per-expert modules: MOE_ARGS name (w13, w2, b13, b2) -> per expert 0..E-1, the placeholder
    # names whose tensors, concatenated on dim 0, are that expert's slice of the op's stacked tensor (the op
    # argument is ``torch.stack([torch.cat(expert, 0) for expert in stacked[k]])``; ``bindings[k]`` is None)
    stacked: dict[str, list[list[str]]] = field(default_factory=dict)
    # MOE_ARGS name -> the op reads a view of its placeholder (``moe_flat.FlatView``: experts held flat in a 2-D
    # matrix, a weight stored transposed, a flat 1-D bias); no copy
    arg_views: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # for the report: how the numeric check fit in memory

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
        bound = [f"{k}={v}" for k, v in self.bindings.items() if v is not None]
        bound += [f"{k}=stack({len(per)} experts x {len(per[0])})" for k, per in self.stacked.items()]
        return f"{self.where}: {self.spec.describe()} [{', '.join(bound)}] ({self.verified})"


@dataclass
class DetectResult:
    """Matches plus ``rejected``: (where, ``moecomp.core.reject.Reject``) for every candidate left alone (its ``code``
    for control flow; ``str()`` of it is the message). Iterates like the match list."""

    matches: list[MoEMatch] = field(default_factory=list)
    rejected: list[tuple[str, RejectRecord]] = field(default_factory=list)
    # candidates whose check raised rather than refused (out of memory after its retries): (where, StageError);
    # also in ``rejected``, as CHECK_ERROR with the exception named
    failures: list[tuple[str, StageError]] = field(default_factory=list)

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
    ctx = Context(gm, example_inputs, verify=verify)
    result = DetectResult()
    claimed: set = set()
    stacked_topks = ctx.final_topks()
    selecting = {t: v for t, v in selector_topks(ctx).items() if t not in stacked_topks}  # per-expert modules only
    by_selectors = list(selecting)
    mixers = sparsemixer_selectors(ctx)  # ids = cat of k argmax rounds (sparsemixer), not a top-k
    hashed = dict(hash_lookups(ctx))  # ids node -> the lookup (hash routing)
    for t in sorted(stacked_topks + by_selectors + mixers + list(hashed), key=ctx.order.get):
        where = (f"hash lookup {t.name}" if t in hashed else
                 f"{'topk' if op_name(t) == 'topk' else 'argmax rounds'} {t.name}")
        try:
            m = _match_at(ctx, t, hashed.get(t))
        except Reject as e:
            # else: no expert reads its ids, not a router; a top-k of a router-shaped linear without selectors is
            # reported only when per-expert linears are there (Unselected)
            quiet = t in selecting and (isinstance(e, NotACandidate) or not selecting[t])
            if not quiet or isinstance(e, Unselected):
                result.rejected.append((where, e.record()))
            continue
        except SpecError as e:
            result.rejected.append((where, RejectRecord(RejectCode.SPEC_INVALID, f"derived spec is invalid: {e}")))
            continue
        except StageError as e:  # the check raised (out of memory after its retries): the other blocks go on
            result.failures.append((where, e))
            result.rejected.append((where, RejectRecord(RejectCode.CHECK_ERROR, e.describe(), e.describe())))
            continue
        if m.region & claimed:
            result.rejected.append((where, RejectRecord(RejectCode.NOT_RECOGNISED, "overlaps a block matched before")))
            continue
        claimed |= m.region
        result.matches.append(m)
    return result


# ------------------------------------------------------------------------------------------- one top-k's block
@dataclass
class _Candidate:
    """The block around one top-k, matched up to where its MoE output is."""

    topk: fx.Node
    routing: Routing
    region: Region
    experts: Experts
    block_out: fx.Node  # the region's result


def _match_at(ctx: Context, t: fx.Node, hashed: dict | None = None) -> MoEMatch:
    """The block whose routing ends in top-k ``t`` (argmax rounds: sparsemixer; ``hashed``: hash routing's
    looked-up ids ``t``)."""
    if hashed:
        r = hash_routing(ctx, t, hashed)
    else:
        r = routing(ctx, t) if op_name(t) == "topk" else sparsemixer_routing(ctx, t)
    region = find_region(ctx, r.x_router, r.hash)
    if t not in region.nodes:
        raise Reject("the top-k is not computed from the router input alone")
    check_ops(region.all, region.x_root)
    ex = _experts(ctx, r, region)
    c = _Candidate(t, r, region, ex, block_output(region.nodes, ex.g2))
    # The MoE output is the block's result, or (when a tail such as a post-MoE norm follows the combine) the latest
    # node before it through which everything the experts compute passes: tried latest first, the first one whose
    # value the spec reproduces is taken; the tail stays in the graph.
    errors = []
    for out in output_candidates(ctx, region.nodes, ex.g2_all, c.block_out, r.H)[:MAX_OUTPUT_CANDIDATES]:
        try:
            return _match_output(ctx, c, out)
        except Reject as e:
            errors.append((out, e))
    why = errors[0][1].message
    if len(errors) > 1:
        why += (f" (also tried {len(errors) - 1} earlier node(s) as the MoE output, followed by a tail: "
                + "; ".join(f"{o.name}: {e.message[:160]}" for o, e in errors[1:3]) + ")")
    raise Reject(why, errors[0][1].code)


def _experts(ctx: Context, r: Routing, region: Region) -> Experts:
    """Stacked 3-D expert weights; else per-expert modules (``NotACandidate`` when neither is there)."""
    ex = stacked_experts(ctx, r, region)
    ex = ex if ex is not None else per_expert(ctx, r, region)
    ex.weight_on_input = weights_on_input(ctx, r, ex, region.all)
    return ex


def _match_output(ctx: Context, c: _Candidate, out: fx.Node) -> MoEMatch:
    """The match whose MoE output is ``out`` (``c.block_out``, or an earlier node followed by a tail)."""
    r = dataclasses.replace(c.routing, baked=dict(c.routing.baked))
    ex = c.experts
    tail = _fx.descendants(out, c.region.nodes) if out is not c.block_out else set()
    core = c.region.nodes - tail
    lat = latent_out(ctx, r, ex.latent, core, ex.g2_all, out) if ex.latent is not None else None
    routed_w = frozenset(p for p in (ex.w13, ex.w2) if p is not None)  # never a stacked shared expert's weight
    sh = shared(ctx, r, core, c.region.x_root, out, ex.linears | (lat.linears if lat else frozenset()) | routed_w)
    if r.gamma_rows and (sh is None or sh.spec.count != r.gamma_rows):
        raise Reject(f"the router has {r.gamma_rows} shared-expert gamma rows but the block has "
                     f"{0 if sh is None else sh.spec.count} shared experts", RejectCode.NOT_RECOGNISED)
    x_in = pick_input(c.region, out)
    _fold_output_scale(ctx, r, core, ex, out, sh)
    if lat is not None:
        check_scales(ctx, lat, core, out, sh.down if sh else None)
    x_dtype = _fx.dtype_of(x_in)
    if x_dtype in (torch.bfloat16, torch.float16) and _fx.dtype_of(r.weights) == x_dtype:
        r.round_weights = True  # the weights reach the experts in the model dtype (e.g. a softmax with dtype=bf16)
    lnorm, enorm, norm_baked = _norms(ctx, core, r, ex, sh, lat, out)
    candidates = with_norms(_spec_candidates(r, ex, sh, lat), lnorm, enorm)
    bindings = _bindings(r, ex, sh, lat)
    bindings.update(latent_norm_w=lnorm.w.name if lnorm else None, expert_norm_w=enorm.w.name if enorm else None)
    blk = Block(x_root=c.region.x_root, x_in=x_in, out=out, nodes=core | c.region.support,
                bindings=bindings, stacked={k: [[p.name for p in e] for e in per]
                                                         for k, per in ex.stacked.items()},
                arg_shapes={"correction_bias": (r.E,)} if r.bias_shape is not None else {}, arg_rows=dict(ex.rows),
                arg_views=dict(ex.views))
    spec, verified, notes = _prove(ctx, candidates, blk, has_tail=out is not c.block_out)
    out_dtype = _fx.dtype_of(out)
    return MoEMatch(
        spec=spec, bindings=blk.bindings, x=x_in, output=out, nodes=frozenset(blk.nodes), region=frozenset(core),
        router=r.logits_linear, topk=c.topk,
        baked={**r.baked, **ex.baked, **(sh.baked if sh else {}), **norm_baked},
        verified=verified, output_dtype=out_dtype if out_dtype != x_dtype else None, block_output=c.block_out,
        tail=frozenset(tail), arg_shapes=blk.arg_shapes, stacked=blk.stacked, arg_rows=blk.arg_rows,
        arg_views=blk.arg_views, notes=notes,
    )


def _norms(ctx: Context, core: set, r: Routing, ex: Experts, sh: Shared | None, lat: Latent | None, out: fx.Node):
    """(latent norm, expert-output norm, {spec field: eps placeholder}) of the block (``moe_norms``); a shared
    expert's norm goes into ``sh`` (its spec's ``norm`` / ``norm_eps``, its weight bound as ``shared_norm_w``)."""
    lnorm = latent_norm(ctx, core, lat.lin_in, ex.g1, lat.L) if lat is not None else None
    skip = {lat.lin_out} if lat else set()
    enorm = expert_norm(ctx, core, ex.g2_all, out, lat.L if lat else r.H, skip)
    pnorm = per_expert_norm(ctx, core, ex.g2_all, out, ex.out_scales, skip)
    if enorm is not None and pnorm is not None:
        raise Reject(f"two norms of the expert outputs ({enorm.w.name}, per expert {pnorm.w.name})")
    enorm = enorm or pnorm
    snorm = shared_norm(ctx, core, sh.down, ex.g2_all, out, r.H) if sh is not None else None
    if snorm is not None:
        sh.spec = dataclasses.replace(sh.spec, norm=snorm.forms[0], norm_eps=snorm.eps)
        sh.bind["shared_norm_w"] = snorm.w
    baked = {f: n.eps_src for f, n in (("latent_norm_eps", lnorm), ("expert_norm_eps", enorm),
                                       ("shared.norm_eps", snorm)) if n is not None and n.eps_src}
    return lnorm, enorm, baked


def _fold_output_scale(ctx: Context, r: Routing, core: set, ex: Experts, out: fx.Node, sh: Shared | None) -> None:
    """A scalar multiply of the routed output before the shared add is routed scaling (``r.scaling``); a constant
    one after it, common to routed and shared, scales both (``r.scaling`` and the shared spec's ``scale``). Not with
    the weights on the expert input: routed scaling scales the input then, and the experts are not linear."""
    if sh is not None:  # (routed + shared) * c: both scaled by c (Cohere2-MoE's "average", c = 1/2)
        c = common_scale(ctx, core, ex.g2_all, out, sh.down)
        if c != 1.0 and ex.weight_on_input:
            raise Reject(f"the MoE output is scaled by {c:g} while the routing weights scale the expert input: "
                         "not a form MoESpec expresses", RejectCode.NOT_RECOGNISED)
        if c != 1.0:
            r.scaling *= c
            sh.spec = dataclasses.replace(sh.spec, scale=sh.spec.scale * c)
    scale, scale_baked = output_scale(ctx, core, ex.g2_all, out, sh.down if sh else None)
    if scale == 1.0:
        return
    if ex.weight_on_input:
        raise Reject(f"the routed output is scaled by {scale:g} while the routing weights scale the expert input: "
                     "not a form MoESpec expresses", RejectCode.NOT_RECOGNISED)
    r.scaling *= scale
    if "routed_scaling_factor" in scale_baked and "routed_scaling_factor" in r.baked:
        raise Reject("routed scaling read from two scalar attributes (router and block output)")
    r.baked.update(scale_baked)


def _spec_fields(r: Routing, ex: Experts, sh: Shared | None, lat: Latent | None = None) -> dict:
    """Every MoESpec field the structure determines (layout, gate split and activation are the candidates')."""
    fields = dict(
        num_experts=r.E - ex.zero_experts, zero_experts=ex.zero_experts, top_k=r.top_k, hidden_size=r.H,
        intermediate_size=ex.I, scoring=r.scoring,
        score_order=r.score_order, jitter_eps=r.jitter_eps, renormalize=r.renormalize, renorm_eps=r.renorm_eps,
        renorm_min=r.renorm_min,
        routed_scaling_factor=r.scaling, n_group=r.n_group, topk_group=r.topk_group, group_score=r.group_score,
        has_correction_bias=r.correction_bias is not None, bias_on_logits=r.bias_on_logits,
        group_mask_zero=r.group_mask_zero, has_router_bias=r.router_b is not None, router_fp32=r.router_fp32,
        round_weights=r.round_weights, gated=ex.gated, activation_clamp=ex.act.clamp,
        **expert_bias_fields(ex.has_b13, ex.has_b2),
        shared=sh.spec if sh else None, quant=ex.quant, weight_on_input=ex.weight_on_input,
        latent_size=lat.L if lat else 0, latent_bias=lat is not None and lat.b_in is not None,
        hash_routing=r.hash is not None, router_scale=r.logit_scale,
        shared_gamma="joint_renorm" if r.gamma_rows else "none", has_weight_scale=r.weight_scale is not None,
    )
    if ex.act.alpha is not None:
        fields["activation_alpha"] = ex.act.alpha
    if ex.act.limit is not None:
        fields["activation_limit"] = ex.act.limit
    fields.update(ex.act.fields())
    return fields


def _spec_candidates(r: Routing, ex: Experts, sh: Shared | None, lat: Latent | None = None) -> list[MoESpec]:
    """One MoESpec per choice the graph leaves open (weight layout x gate split x activation), valid ones only."""
    base = _spec_fields(r, ex, sh, lat)
    candidates, last_err = [], None
    for layout in ex.layouts:
        for gate_up in ex.gate_ups:
            for act in ex.act.names:
                try:
                    candidates.append(MoESpec(**base, w_layout=layout, gate_up=gate_up, activation=act))
                except SpecError as e:
                    last_err = e
    if not candidates:
        raise Reject(f"no valid spec: {last_err}", RejectCode.SPEC_INVALID)
    return candidates


def _bindings(r: Routing, ex: Experts, sh: Shared | None, lat: Latent | None = None) -> dict[str, str | None]:
    """OP_ARGS name -> placeholder name (None: absent, or built from per-expert placeholders: ``ex.stacked``); the
    scales of quantized weights and the latent projections included (``moe_quant``, ``moe_latent``)."""
    nodes = dict(router_w=r.router_w, router_b=r.router_b, correction_bias=r.correction_bias, w13=ex.w13,
                 w2=ex.w2, b13=ex.b13, b2=ex.b2)
    if r.hash is not None:
        nodes.update(hash_table=r.hash["table"], token_ids=r.hash["tokens"])
    if r.weight_scale is not None:
        nodes["weight_scale"] = r.weight_scale
    if sh:
        nodes.update(sh.bind)
    if lat:
        nodes.update(lat.bindings)
    nodes.update(ex.scales)
    bindings = {k: None for k in OP_ARGS}
    bindings.update({k: (v.name if v is not None else None) for k, v in nodes.items()})
    return bindings


def _prove(ctx: Context, candidates: list, blk: Block, has_tail: bool):
    """(spec, how it was verified, notes): the numeric check, or without it the only candidate (and no tail to
    place)."""
    if ctx.verify:
        return verify(ctx, candidates, blk)
    if len(candidates) > 1:
        raise Reject("the graph leaves the weight layout / gate split / activation open and verify=False")
    if has_tail:
        raise Reject("a tail follows the MoE result: only the numeric check can place the MoE output (verify=False)")
    return candidates[0], "skipped: verify=False", []
