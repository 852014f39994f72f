"""Bind a detected MoE block to ``torch.ops.moecomp.moe_forward``: replace its forward, keep everything else.

The new forward looks the block's own tensors up by attribute path on every call (nothing is copied, so
``.to()`` / ``.half()`` / ``.cuda()`` / ``load_state_dict`` after ``optimize`` keep working), calls the op exactly
once, and shapes the result like the original forward did (same shape, or flattened; tuples keep their extra
elements, which are recomputed by calling the router module when the original returned router outputs).

It runs the original forward instead when the op cannot stand in for it:
* training with router / input jitter (``self.training`` and a jitter attribute > 0), and any training-mode call
  of a sparsemixer block (``score_order == "sparsemixer"``: it samples its experts while training);
* training with gradients (the op has no backward);
* gradients needed in eval mode: grad mode is on and the hidden states or a tensor the op would read (or one a
  stacked weight is built from) requires grad, e.g. ``model(ids, labels=ids).loss.backward()`` after
  ``from_pretrained`` or input attribution through ``inputs_embeds``; the original forward gives exact gradients.
  Warned once per process. ``torch.no_grad()`` / ``torch.inference_mode()`` calls keep the op;
* an attribute the spec was derived from changed after binding (see "Attributes" below); warned once per block;
* a forward hook or pre-hook on the router, experts or shared-expert modules is active (this is how transformers
  records ``output_router_logits``; its recording hooks count only while a recording is in progress), or a
  global module hook is registered;
* more tokens than the recogniser proved the op for (``Match.max_tokens``: the dispatch reader saw no expert
  capacity drop up to that many, so one beyond cannot be ruled out);
* an extra forward argument the rewrite was not checked with is given (e.g. ``input_ids`` of a block that ignores
  them only when they are None); or an argument the op reads (hash routing's token ids, bound to a forward
  argument: ``match.forward_arg``) is missing.

Hash routing (``MoESpec.hash_routing``): the op's ``token_ids`` are the forward argument the binding names (a
decoder layer passes ``input_ids`` to DeepSeek-V4's MoE block), read from every call, so eager calls, compiled code
(the argument is a graph input) and CUDA-graph replays (the kernels read it from its memory) all route by the call's
tokens; the table is a block buffer, checked once at bind time (every entry in [0, E): ``hash_routing.check_table``).

State lives in ``block._moecomp`` (a plain attribute, not a Module / Parameter / buffer: ``state_dict()`` is
unchanged).

Derived weights (``moecomp.core.derived.Derived``). A ModuleList of expert MLPs has no ``[E, 2I, H]`` tensor for the op: one
is built as a non-persistent buffer and the experts' Parameters are re-pointed at its slices (``param.data =
stacked[i, rows]``, same Parameter objects), so the weights are held once and every in-place write, ``.data``
writes included (EMA loops), reaches the op. Each call checks that every source is still a view of the buffer at
its offset (a pointer compare per source) and rebuilds + re-shares when one was replaced (new Parameter,
``.data = other``, ``.to()`` / ``.half()``, ``to_empty`` + ``load_state_dict``, ``load_state_dict(assign=True)``).
The router + shared-expert-gate rows of the fused-gate router buffer are shared the same way. Tensors whose
sources cannot be contiguous slices of one buffer (separate 3-D gate / up weights, fp32 copies of a 16-bit router)
stay copies, rebuilt when a source's identity, storage, version (in-place writes under ``no_grad``), dtype or
device changes; a write through ``.data`` bumps no version and is *not* seen there until
``moecomp.optimize(model)`` is called again (it rebuilds every copy of the blocks it finds already bound). A tensor
object that is a source of two bound blocks is shared by the first only (the second keeps a copy).
Under ``torch.compile`` the graph reads the buffer: in-place and ``.data`` writes to shared weights are seen;
replacing shared Parameters or converting the model after compiling is picked up by the next eager call (or
``moecomp.optimize(model)``), not by the compiled code.

Attributes. At bind time the binder snapshots what the spec was derived from: the plain scalar attributes (int,
float, bool, str, None, dtype; public names) and the callables (functions, methods, any name) in the ``__dict__``
of the block and of every module under it, and the identity of every child module (``experts.act_fn``,
``gate``, each expert). ``training``, moecomp's own attributes, the jitter attributes (read at call time) and
``nn.Linear`` / ``nn.Identity`` scalars (their forwards read none) are left out; so are other objects (configs,
lists, tensors that are plain attributes). A sparsemixer block's jitter attributes are watched all the same,
wherever they are (one of them is its threshold). Each eager call compares the snapshot (C-level tuple compares,
about 1-2 us for a transformers-5 block); on a change the block runs its original forward, warns once naming the
attribute, and ``moecomp.optimize(model)`` re-binds it. Under ``torch.compile`` the same comparison is traced:
Dynamo guards on those attributes and recompiles when one changes, and the recompiled graph runs the original
forward.
"""
from __future__ import annotations

import inspect
import operator
import os
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..ops.hash_routing import check_table
from ..ops.moe_op import OP_ARGS, call_moe_forward
from ..parallel.op import call as call_parallel
from ..core.reject import RejectCode
from ..core.spec import MoESpec, SpecError
from ..core.derived import Derived, SharedLayout
from ..core.match import Contract, Verified, arg_name, call_params, reshape_to
from .bind_common import (  # noqa: F401  (re-exported)
    BindError, restore_forward as _restore_forward, warn_grad as _warn_grad, claim)
from .bind_routes import handle as _route_handle, routed_call as _routed_call
from .bind_experts import (  # noqa: F401  (the experts-only rewrite; re-exported: optimize / experts_only use them)
    ExpertsForward, ExpertsState, bind_experts, experts_block_forward, experts_stale, unbind_experts)
from .impl_switch import as_before as _as_before, release as _release_impl, requested as _requested_impl
from .impl_switch import warn_once as _warn_impl
from ..core.names import JITTER_NAMES
from ..core.snapshot import Snapshot, snapshot_changed, snapshot_changed_traced, snapshot_diff, take_snapshot
from ..core.parts import BlockParts
from ..core.derived import get_path


# ----------------------------------------------------------------------------------------------- return contract
def _hook_active(fn) -> bool:
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_name == "output_capturing_hook" and fn.__closure__:
        try:  # transformers' recording hook: active only while its collector (a module global) asks for `key`
            key = fn.__closure__[code.co_freevars.index("key")].cell_contents
            col = fn.__globals__["_active_collector"].get()
        except Exception:
            return True
        return col is not None and key in col
    return True


_FWD_HOOKS = operator.attrgetter("_forward_hooks")
_FWD_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


def hooks_active(mods) -> bool:
    g = torch.nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return True
    if not (any(map(_FWD_HOOKS, mods)) or any(map(_FWD_PRE_HOOKS, mods))):  # the common case, in C
        return False
    for m in mods:
        for d in (m._forward_hooks, m._forward_pre_hooks):
            if d and any(_hook_active(h) for h in d.values()):
                return True
    return False


# ----------------------------------------------------------------------------------------------- state
@dataclass
class BoundState:
    name: str
    spec: MoESpec
    spec_key: str
    bindings: dict
    paths: tuple  # per OP_ARGS: tuple of attribute names, or None
    derived: list
    contract: Contract
    watch: tuple  # submodule paths whose hooks force the original forward
    router_path: str
    jitter_attrs: tuple  # (module path, attribute) pairs read at call time
    hidden_name: str
    extra_params: tuple  # other forward parameters
    ignored_params: frozenset  # extra parameters checked to make no difference
    original: object  # the instance-level forward we replaced, or None (class forward)
    method: str = "fallback"
    epilogue: tuple = ()  # applied in order to the op's output: child modules called (AXK1's post_mlp_layernorm),
    # the block's own [H] tensors added (JetMoE's output bias)
    versions: dict = field(default_factory=dict)  # per derived: SharedLayout (shared) or the sources' versions
    op_spec: MoESpec | None = None  # the spec the op is called with (FSE form when the router buffer fuses the gate)
    calls: int = 0  # eager calls only: compiled code must not mutate state Dynamo guards on
    fallbacks: int = 0
    snapshot: Snapshot | None = None  # what the spec was derived from (attributes, child modules)
    watch_mods: tuple | None = None  # the modules at ``watch`` (valid while the snapshot is unchanged)
    warned_stale: bool = False  # (class-level defaults: states pickled before these fields load too)
    impl_config: object = None  # the experts' config transformers dispatches on by name (bind/impl_switch.py)
    impl_prev: str | None = None  # the name it had before binding marked it "moecomp"
    inputs: tuple = ()  # (index in OP_ARGS, forward argument name): op arguments read from each call (token ids)
    max_tokens: int = 0  # > 0: calls of more tokens run the original forward (``Match.max_tokens``)
    route_sink: object = None  # [T, k] int32 the op writes its expert ids into (generate's engine: the recording of
    # return_routed_experts inside the compiled, captured steps; read in the trace, unlike the routing session)


def _split(p: str | None):
    return None if p is None or arg_name(p) is not None else tuple(p.split("."))


def resolve(root, parts):
    obj = root
    for a in parts:
        obj = getattr(obj, a)
    return obj


# A source tensor shared by a bound block (re-pointed at its buffer) -> that block (weakly). A tensor that is a
# source of two blocks (an expert module reused across layers) is shared by the first only: re-pointing it for
# the second would make the first rebuild on every call.
_SHARED_BY = WeakIdKeyDictionary()


def _shared_elsewhere(block: nn.Module, owners, names) -> bool:
    for owner, n in zip(owners, names):
        t = owner._parameters.get(n) if n in owner._parameters else owner._buffers.get(n)
        ref = _SHARED_BY.get(t) if t is not None else None
        other = ref() if ref is not None else None
        if other is not None and other is not block and getattr(other, "_moecomp", None) is not None:
            return True
    return False


def _build_derived(block: nn.Module, st: BoundState, d: Derived) -> None:
    old = block._buffers.get(d.name)
    if old is not None:  # let the old copy go before the new one is made (peak memory)
        block._buffers[d.name] = None
        del old
    plan = d.share_plan(block)
    if plan is not None and not _shared_elsewhere(block, plan.owners, plan.names):
        buf, layout = d.build_shared(block, plan)
        for t in layout.sources():
            _SHARED_BY[t] = weakref.ref(block)
        block.register_buffer(d.name, buf, persistent=False)
        st.versions[d.name] = layout
        return
    srcs = [get_path(block, p) for p in d.source_paths()]
    block.register_buffer(d.name, d.build(block), persistent=False)
    st.versions[d.name] = _versions(srcs)


def _versions(srcs) -> tuple:
    return tuple((id(t), t.data_ptr(), t._version, t.dtype, t.device) for t in srcs)


def refresh_derived(block: nn.Module, st: BoundState, force: bool = False) -> None:
    """Rebuild the derived tensors whose sources changed (``force``: every copy, shared ones only when stale)."""
    for d in st.derived:
        v = st.versions.get(d.name)
        buf = block._buffers.get(d.name)
        if isinstance(v, SharedLayout):
            if v.current(buf):
                continue
        elif not force and buf is not None and v == _versions(get_path(block, p) for p in d.source_paths()):
            continue
        _build_derived(block, st, d)


def refresh(block: nn.Module) -> bool:
    """Bring a bound block's derived tensors up to date now, rebuilding every copy (the way to pick up ``.data``
    writes to weights moecomp copies; see the module docstring). False when the block is not bound."""
    st = getattr(block, "_moecomp", None)
    if st is None:
        return False
    if st.derived:
        refresh_derived(block, st, force=True)
    return True


def is_shared(block: nn.Module, d: Derived) -> bool:
    """Does ``d`` share its sources' storage (bound) / would it (not bound yet)?"""
    st = getattr(block, "_moecomp", None)
    if st is not None and d.name in st.versions:
        return isinstance(st.versions[d.name], SharedLayout)
    return d.share_plan(block) is not None


def stale(block: nn.Module) -> str:
    """Why a bound block's binding no longer fits it ("" when it does): an attribute / child module changed."""
    st = getattr(block, "_moecomp", None)
    snap = getattr(st, "snapshot", None)
    if snap is None or not snapshot_changed(snap):
        return ""
    return snapshot_diff(snap) or "module tree changed"


def _sparsemixer(spec: MoESpec) -> bool:
    """Sparsemixer routing (PhiMoE): in training mode the block draws its experts by Gumbel sampling (the op does
    not), and its eval-mode threshold is a jitter attribute."""
    return spec.score_order == "sparsemixer"


def _jitter_on(block: nn.Module, st: BoundState) -> bool:
    if not block.training:
        return False
    for mpath, attr in st.jitter_attrs:
        try:
            v = getattr(get_path(block, mpath), attr)
        except AttributeError:
            continue
        if isinstance(v, (int, float)) and v > 0:
            return True
    return False


def _grad_needed(block: nn.Module, st: BoundState, x) -> str:
    """What requires grad among the op's inputs (the hidden states, its tensors, derived tensors' sources), or ""
    (only asked with grad mode on)."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return "the hidden states"
    for p in st.paths:
        if p is not None:
            t = resolve(block, p)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return ".".join(p)
    for d in st.derived:
        v = st.versions.get(d.name)
        if isinstance(v, SharedLayout) and not torch.compiler.is_compiling():
            srcs = v.sources()
        else:
            srcs = (get_path(block, p) for p in d.source_paths())
        for t in srcs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return "the expert weights"
    return ""


def _attrs_stale(block: nn.Module, st: BoundState) -> bool:
    snap = st.snapshot
    if snap is None or not snapshot_changed(snap):
        return False
    if not st.warned_stale:
        st.warned_stale = True
        what = snapshot_diff(snap) or "the module tree changed"
        warnings.warn(
            f"moecomp: {what} in {st.name or type(block).__name__!r} after moecomp.optimize; the rewritten block was "
            f"derived from the old value, so it runs its original forward from now on. Call moecomp.optimize(model) "
            f"again to re-detect and re-bind it.", UserWarning, stacklevel=4)
    return True


def _too_long(st: BoundState, x) -> bool:
    """More tokens than the recogniser proved the op for (``max_tokens``; a shape check: guarded when compiled)."""
    limit = getattr(st, "max_tokens", 0)
    return bool(limit) and isinstance(x, torch.Tensor) and x.dim() > 0 and x.numel() // x.shape[-1] > limit


def _needs_original(block: nn.Module, st: BoundState, x, extra: dict) -> str | None:
    impl = _requested_impl(getattr(st, "impl_config", None))
    if impl is not None:
        _warn_impl(impl)
        return f"experts implementation {impl!r}"
    if _jitter_on(block, st):
        return "router jitter while training"
    if block.training and _sparsemixer(st.spec):
        return "sparsemixer routing samples its experts while training"
    if block.training and torch.is_grad_enabled():
        return "training with gradients"
    if _too_long(st, x):
        return f"more than {st.max_tokens} tokens (the op was proven up to that many)"
    if _attrs_stale(block, st):
        return "attributes changed"
    mods = st.watch_mods if st.watch_mods is not None else [get_path(block, p) for p in st.watch]
    if hooks_active(mods):
        return "hooks on router / experts"
    read = {n for _, n in getattr(st, "inputs", ())}
    for k, v in extra.items():
        if v is not None and k not in st.ignored_params and k not in read:
            return f"argument {k!r}"
    for k in read:
        if extra.get(k) is None:
            return f"argument {k!r} missing (the op reads it)"
    if torch.is_grad_enabled():
        what = _grad_needed(block, st, x)
        if what:
            _warn_grad(what)
            return "gradients"
    return None


def _needs_original_traced(block: nn.Module, st: BoundState, x) -> str | None:
    """Under torch.compile: the checks Dynamo can trace and guard on (grad mode, requires_grad, attributes)."""
    if _requested_impl(getattr(st, "impl_config", None)) is not None:
        return "experts implementation"
    if block.training and (torch.is_grad_enabled() or _sparsemixer(st.spec)):
        return "training"
    if _too_long(st, x):
        return "more tokens than proven"
    if st.snapshot is not None and snapshot_changed_traced(block, st.snapshot):
        return "attributes changed"
    if torch.is_grad_enabled() and _grad_needed(block, st, x):
        return "gradients"
    return None


def moecomp_block_forward(self: nn.Module, *args, **kwargs):
    """Replacement forward of a bound MoE block (see module docstring)."""
    st: BoundState = self._moecomp
    if args:
        x, rest = args[0], args[1:]
    else:
        x = kwargs.pop(st.hidden_name)
        rest = ()
    extra = dict(zip(st.extra_params, rest))
    extra.update(kwargs)
    compiling = torch.compiler.is_compiling()
    why = _needs_original_traced(self, st, x) if compiling else _needs_original(self, st, x, extra)
    if why is None and compiling and any(extra.get(n) is None for _, n in getattr(st, "inputs", ())):
        why = "argument missing"
    op_spec = st.op_spec or st.spec
    h = None if compiling else _route_handle(self)  # a routing replay / record (core/replay.py)
    if why is not None:
        if op_spec.parallel is not None:  # the block's own forward would run on this rank's shard of the experts
            raise RuntimeError(f"moecomp: {st.name or type(self).__name__} holds a shard of its experts "
                               f"(moecomp.shard_experts: {op_spec.parallel.describe()}); it cannot run its original "
                               f"forward, which this call needs ({why})")
        if not compiling:
            st.fallbacks += 1
        if h is not None:  # the session's own forward: the routes are not lost
            return h.fallback(x, rest, kwargs, lambda: _call_original(self, st, x, rest, kwargs))
        return _call_original(self, st, x, rest, kwargs)
    if st.derived and not compiling:
        refresh_derived(self, st)
    tensors = [None if p is None else resolve(self, p) for p in st.paths]
    for i, n in getattr(st, "inputs", ()):
        tensors[i] = extra[n]
    if compiling:  # small derived tensors are built in the graph (always fresh, nothing cached across calls)
        for d in st.derived:
            if d.inline:
                tensors[st.paths.index((d.name,))] = d.build(self)
    if st.spec.has_correction_bias and tensors[2] is not None and tensors[2].dim() != 1:
        tensors[2] = tensors[2].reshape(-1)
    if not compiling:
        st.calls += 1
    c = st.contract
    # the op (through the dispatcher where a mode, tracing or autograd needs it; see call_moe_forward); sharded
    # experts (``MoESpec.parallel``, moecomp.shard_experts): the parallel path, collectives included
    run = call_moe_forward if op_spec.parallel is None else call_parallel
    x_op = x if c.primary == "same" else x.reshape(-1, x.shape[-1])
    sink = st.route_sink
    if h is not None:
        y = _routed_call(h, x_op, x, tensors, op_spec)
    elif sink is not None:  # the engine records (a static buffer, written by the routing kernel: no extra launch)
        y = run(x_op, tensors, op_spec, routes_out=sink)
    else:
        y = run(x_op, tensors, op_spec)
    for p in st.epilogue:  # a child module called, or an output bias added (moecomp.verify.epilogue)
        e = resolve(self, p)
        y = y + e if isinstance(e, torch.Tensor) else e(y)
    if c.primary == "flat1d":
        y = y.reshape(-1)
    if not c.is_tuple:
        return y
    rout = None
    outs = [y]
    for e in c.extras:
        if e[0] == "none":
            outs.append(None)
            continue
        if rout is None:
            router = get_path(self, st.router_path)
            rout = router(x if c.router_call == "x" else x.reshape(-1, x.shape[-1]))
        r = rout if e[1] == -1 else rout[e[1]]
        outs.append(reshape_to(r, e[2]))
    return tuple(outs)


class BoundForward:
    """``block.forward`` after binding: calls :func:`moecomp_block_forward` on the block.

    A small callable object rather than a bound method: it survives ``copy.deepcopy`` and ``torch.save`` of the whole
    model (a bound method of a function named other than ``forward`` would not unpickle).
    """

    __slots__ = ("block",)

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, *args, **kwargs):
        return moecomp_block_forward(self.block, *args, **kwargs)

    def __getstate__(self):
        return {"block": self.block}

    def __setstate__(self, state):
        self.block = state["block"]


def _call_original(block, st: BoundState, x, rest, kwargs):
    from ..formats.fp8 import fallback_context

    with _as_before(getattr(st, "impl_config", None), getattr(st, "impl_prev", None)), fallback_context(block):
        if st.original is not None:
            return st.original(x, *rest, **kwargs)
        return type(block).forward(block, x, *rest, **kwargs)


def original_forward(block: nn.Module):
    """The forward the block had before binding (callable with the block's arguments)."""
    st = getattr(block, "_moecomp", None)
    if st is None:
        return block.forward
    if st.original is not None:
        return st.original
    return types.MethodType(type(block).forward, block)


def forward_params(block: nn.Module) -> tuple[str, tuple[str, ...]]:
    fwd = block.__dict__.get("forward") or type(block).forward
    try:
        sig = inspect.signature(fwd)
    except (TypeError, ValueError):
        return "hidden_states", ()
    names = [n for n, p in sig.parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                  p.KEYWORD_ONLY)]
    if not names:
        return "hidden_states", ()
    return names[0], tuple(names[1:])


ROUTER_BUFFER = "_moecomp_router"


def router_derived(block: nn.Module, spec: MoESpec, bindings: dict, derived: list) -> tuple[MoESpec, dict, list]:
    """The op's router argument as a block buffer, so no call converts or concatenates it again:
    ``[router_w; shared_gate_w]`` (FSE: one GEMM gives the logits and the shared-expert gate) and / or its fp32 copy
    (an fp32 router over 16-bit weights). Returns (spec for the op, bindings for the op, derived tensors)."""
    rw_path, gw_path = bindings.get("router_w"), bindings.get("shared_gate_w")
    if rw_path is None or rw_path in {d.name for d in derived}:
        return spec, bindings, derived
    fuse = (spec.can_fuse_shared_gate and gw_path is not None
            and os.environ.get("MOECOMP_NO_FSE") != "1")  # (the knob measures what FSE saves)
    fp32 = spec.router_fp32 and get_path(block, rw_path).dtype != torch.float32
    if not (fuse or fp32):
        return spec, bindings, derived
    d = Derived(ROUTER_BUFFER, [[rw_path] + ([gw_path] if fuse else [])], kind="cat", dim=0, fp32=fp32, inline=True)
    b = {**bindings, "router_w": ROUTER_BUFFER}
    if fuse:
        b["shared_gate_w"] = None
        spec = spec.replace(fused_shared_gate=True)
    return spec, b, list(derived) + [d]


def bind(block: nn.Module, name: str, verified: Verified) -> BoundState:
    """Replace ``block``'s forward by one op call, as ``verified`` describes it (the verify stage's result)."""
    m = verified.match
    spec, bindings, derived, parts = m.spec, m.bindings, m.derived, m.parts
    if getattr(block, "_moecomp", None) is not None:
        if not stale(block):
            raise BindError("already bound")
        unbind(block)  # bound from attributes that have changed since: bind afresh
    missing = [a for a in OP_ARGS if a not in bindings]
    if missing:
        raise BindError(f"bindings lack {missing}")
    op_spec, op_bindings, derived = router_derived(block, spec, bindings, derived)
    if spec.hash_routing:
        try:
            check_table(get_path(block, bindings["hash_table"]), spec)
        except SpecError as e:
            raise BindError(str(e), RejectCode.SPEC_INVALID) from None
    hidden, extra = forward_params(block)
    jitter = []
    for mpath in dict.fromkeys(["", parts.router_module]):
        for attr in JITTER_NAMES:
            jitter.append((mpath, attr))
    st = BoundState(
        name=name, spec=spec, spec_key=spec.key, bindings=dict(bindings),
        paths=tuple(_split(op_bindings[a]) for a in OP_ARGS), derived=list(derived), contract=verified.contract,
        watch=tuple(parts.submodule_paths(block)), router_path=parts.router_module, jitter_attrs=tuple(jitter),
        hidden_name=hidden, extra_params=extra, ignored_params=frozenset(verified.ignored_params),
        original=block.__dict__.get("forward"), method=m.method,
        epilogue=tuple(_split(p) for p in verified.epilogue),
        op_spec=op_spec, inputs=tuple((OP_ARGS.index(a), n) for a, n in call_params(op_bindings).items()),
        max_tokens=m.max_tokens,
    )
    block._moecomp = st
    if st.derived:
        refresh_derived(block, st)
    # a sparsemixer block's threshold is a jitter attribute (PhiMoE's router_jitter_noise): watched like any other
    st.snapshot = take_snapshot(block, keep=frozenset(JITTER_NAMES) if _sparsemixer(spec) else frozenset())
    st.watch_mods = tuple(get_path(block, p) for p in st.watch)
    claim(st, st.watch_mods)
    block.forward = BoundForward(block)
    return st


def unbind(block: nn.Module) -> bool:
    if unbind_experts(block):
        return True
    st = getattr(block, "_moecomp", None)
    if st is None:
        return False
    if getattr(getattr(st, "op_spec", None), "parallel", None) is not None:
        raise ValueError(f"moecomp: {st.name or type(block).__name__} holds a shard of its experts "
                         f"(moecomp.shard_experts); its original forward needs every expert, so it cannot be unbound")
    if callable(getattr(st, "unbind", None)):  # a binding of its own kind (hf/bind_pair.PairState)
        st.unbind(block)
        del block._moecomp
        return True
    _restore_forward(block, st.original)
    _release_impl(getattr(st, "impl_config", None), getattr(st, "impl_prev", None))
    for d in st.derived:
        if d.name in block._buffers:
            del block._buffers[d.name]
    del block._moecomp
    return True


def bound_tensors(block: nn.Module, spec: MoESpec, bindings: dict, derived: list[Derived],
                  call_args: dict | None = None) -> list:
    """The op's tensors for a not-yet-bound block (derived tensors built on the fly; forward arguments from
    ``call_args``, {name: tensor})."""
    built = {d.name: d.build(block) for d in derived}
    out = []
    for a in OP_ARGS:
        p = bindings.get(a)
        if p is None:
            out.append(None)
        elif arg_name(p) is not None:
            out.append((call_args or {}).get(arg_name(p)))
        elif p in built:
            out.append(built[p])
        else:
            t = get_path(block, p)
            if a == "correction_bias" and t.dim() != 1:
                t = t.reshape(-1)
            out.append(t)
    return out
