"""Bind a detected MoE block to ``torch.ops.moecomp.moe_forward``: replace its forward, keep everything else.

The new forward looks the block's own tensors up by attribute path on every call (nothing is copied, so
``.to()`` / ``.half()`` / ``.cuda()`` / ``load_state_dict`` after ``optimize`` keep working), calls the op exactly
once, and shapes the result like the original forward did (same shape, or flattened; tuples keep their extra
elements, which are recomputed by calling the router module when the original returned router outputs).

It runs the original forward instead when the op cannot stand in for it:
* training with router / input jitter (``self.training`` and a jitter attribute > 0);
* training with gradients (the op has no backward);
* a forward hook or pre-hook on the router, experts or shared-expert modules is active (this is how transformers
  records ``output_router_logits``; its recording hooks count only while a recording is in progress), or a
  global module hook is registered;
* an extra forward argument the rewrite was not checked with is given (e.g. ``input_ids`` for hash routing).

State lives in ``block._moecomp`` (a plain attribute, not a Module / Parameter / buffer: ``state_dict()`` is
unchanged). Stacked expert weights (ModuleList experts) are non-persistent buffers, rebuilt when a source
tensor changes (new storage or in-place update).
"""

from __future__ import annotations

import inspect
import os
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops.moe_op import MOE_ARGS, call_moe_forward
from ..spec import MoESpec
from .fallback import Derived, ProbeRun, _primary
from .structure import BlockParts, get_path


class BindError(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------------- return contract
@dataclass(frozen=True)
class Contract:
    """How the original forward shaped its result.

    ``primary``: "same" (like the input), "flat2d" ([T, H]) or "flat1d" ([T*H]).
    ``extras``: for a tuple result, one entry per further element: ("router", j, shape_mode) = element j of the
    router module's output reshaped ("same" / "flat1d" / "rows"), or ("none",).
    """

    primary: str = "same"
    is_tuple: bool = False
    extras: tuple = ()
    router_call: str = "x2"  # the router was called with the flattened input ("x2") or the input as given ("x")


def _shape_mode(t: torch.Tensor, ref: torch.Tensor) -> str | None:
    if t.shape == ref.shape:
        return "same"
    if t.dim() == 1 and t.numel() == ref.numel():
        return "flat1d"
    if t.dim() == 2 and t.numel() == ref.numel() and ref.dim() >= 1 and t.shape[-1] == ref.shape[-1]:
        return "rows"
    return None


def _reshape(t: torch.Tensor, mode: str, like: torch.Tensor | None = None):
    if mode == "same":
        return t if like is None else t.reshape(like.shape)
    if mode == "flat1d":
        return t.reshape(-1)
    return t.reshape(-1, t.shape[-1])


def infer_contract(run: ProbeRun, parts: BlockParts) -> Contract:
    x = run.x
    out = run.output
    H = x.shape[-1]
    prim = _primary(out)
    if not isinstance(prim, torch.Tensor):
        raise BindError(f"forward returns {type(prim).__name__}, not a tensor")
    if prim.shape == x.shape:
        pmode = "same"
    elif prim.dim() == 2 and prim.shape == (x.numel() // H, H):
        pmode = "flat2d"
    elif prim.dim() == 1 and prim.numel() == x.numel():
        pmode = "flat1d"
    else:
        raise BindError(f"output shape {tuple(prim.shape)} does not follow the input {tuple(x.shape)}")
    if not isinstance(out, (tuple, list)):
        return Contract(pmode)
    if isinstance(out, list):
        raise BindError("forward returns a list")
    extras = []
    router_call = "x2"
    rout = run.router_out
    rouf = list(rout) if isinstance(rout, (tuple, list)) else [rout]
    for e in out[1:]:
        if e is None:
            extras.append(("none",))
            continue
        hit = None
        if isinstance(e, torch.Tensor):
            for j, r in enumerate(rouf):
                if isinstance(r, torch.Tensor):
                    mode = _shape_mode(e, r)
                    if mode and torch.equal(_reshape(r, mode, e), e):
                        hit = ("router", j if isinstance(rout, (tuple, list)) else -1, mode)
                        break
        if hit is None:
            raise BindError("forward returns extra outputs that are not the router's outputs")
        extras.append(hit)
    if any(x[0] == "router" for x in extras):
        if run.router_calls != 1 or run.router_args is None:
            raise BindError("extra outputs come from a router that was not called exactly once")
        args, kw = run.router_args
        if kw or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise BindError("extra outputs come from a router called with more than the hidden states")
        a = args[0]
        if a.shape == x.shape and torch.equal(a, x):
            router_call = "x"
        elif a.shape == (x.numel() // H, H) and torch.equal(a, x.reshape(-1, H)):
            router_call = "x2"
        else:
            raise BindError("extra outputs come from a router called on something other than the input")
    return Contract(pmode, True, tuple(extras), router_call)


# ----------------------------------------------------------------------------------------------- hooks
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


def hooks_active(mods) -> bool:
    g = torch.nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return True
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
    paths: tuple  # per MOE_ARGS: tuple of attribute names, or None
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
    epilogue: tuple = ()  # child module paths applied, in order, to the op's output (AXK1's post_mlp_layernorm)
    versions: dict = field(default_factory=dict)
    op_spec: MoESpec | None = None  # the spec the op is called with (FSE form when the router buffer fuses the gate)
    calls: int = 0  # eager calls only: compiled code must not mutate state Dynamo guards on
    fallbacks: int = 0


def _split(p: str | None):
    return None if p is None else tuple(p.split("."))


def _resolve(root, parts):
    obj = root
    for a in parts:
        obj = getattr(obj, a)
    return obj


def _refresh_derived(block: nn.Module, st: BoundState) -> None:
    for d in st.derived:
        srcs = [get_path(block, p) for p in d.source_paths()]
        ver = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in srcs)
        if st.versions.get(d.name) != ver or getattr(block, d.name, None) is None:
            block.register_buffer(d.name, d.build(block), persistent=False)
            st.versions[d.name] = ver


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


def _needs_original(block: nn.Module, st: BoundState, x, extra: dict) -> str | None:
    if _jitter_on(block, st):
        return "router jitter while training"
    if block.training and torch.is_grad_enabled():
        return "training with gradients"
    mods = [get_path(block, p) for p in st.watch]
    if hooks_active(mods):
        return "hooks on router / experts"
    for k, v in extra.items():
        if v is not None and k not in st.ignored_params:
            return f"argument {k!r}"
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
    why = None if torch.compiler.is_compiling() else _needs_original(self, st, x, extra)
    if why is None and torch.compiler.is_compiling() and (self.training and torch.is_grad_enabled()):
        why = "training"
    if why is not None:
        if not torch.compiler.is_compiling():
            st.fallbacks += 1
        return _call_original(self, st, x, rest, kwargs)
    compiling = torch.compiler.is_compiling()
    if st.derived and not compiling:
        _refresh_derived(self, st)
    tensors = [None if p is None else _resolve(self, p) for p in st.paths]
    if compiling:  # small derived tensors are built in the graph (always fresh, nothing cached across calls)
        for d in st.derived:
            if d.inline:
                tensors[st.paths.index((d.name,))] = d.build(self)
    if st.spec.has_correction_bias and tensors[2] is not None and tensors[2].dim() != 1:
        tensors[2] = tensors[2].reshape(-1)
    if not compiling:
        st.calls += 1
    c = st.contract
    # the op (through the dispatcher where a mode, tracing or autograd needs it; see call_moe_forward)
    y = call_moe_forward(x if c.primary == "same" else x.reshape(-1, x.shape[-1]), tensors, st.op_spec or st.spec)
    for p in st.epilogue:
        y = _resolve(self, p)(y)
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
        outs.append(_reshape(r, e[2]))
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


def bind(block: nn.Module, name: str, spec: MoESpec, bindings: dict, derived: list[Derived], contract: Contract,
         parts: BlockParts, ignored_params=frozenset(), method: str = "fallback", epilogue=()) -> BoundState:
    if getattr(block, "_moecomp", None) is not None:
        raise BindError("already bound")
    missing = [a for a in MOE_ARGS if a not in bindings]
    if missing:
        raise BindError(f"bindings lack {missing}")
    op_spec, op_bindings, derived = router_derived(block, spec, bindings, derived)
    hidden, extra = forward_params(block)
    jitter = []
    for mpath in dict.fromkeys(["", parts.router_module]):
        for attr in ("jitter_noise", "router_jitter_noise", "input_jitter_noise"):
            jitter.append((mpath, attr))
    st = BoundState(
        name=name, spec=spec, spec_key=spec.key, bindings=dict(bindings),
        paths=tuple(_split(op_bindings[a]) for a in MOE_ARGS), derived=list(derived), contract=contract,
        watch=tuple(parts.submodule_paths(block)), router_path=parts.router_module, jitter_attrs=tuple(jitter),
        hidden_name=hidden, extra_params=extra, ignored_params=frozenset(ignored_params),
        original=block.__dict__.get("forward"), method=method, epilogue=tuple(_split(p) for p in epilogue),
        op_spec=op_spec,
    )
    block._moecomp = st
    if st.derived:
        _refresh_derived(block, st)
    block.forward = BoundForward(block)
    return st


def _restore_forward(module: nn.Module, original) -> None:
    """Undo our instance-level ``forward``: put back the instance forward we replaced, or fall back to the class's."""
    if original is not None:
        module.forward = original
    else:
        module.__dict__.pop("forward", None)


def unbind(block: nn.Module) -> bool:
    if unbind_experts(block):
        return True
    st = getattr(block, "_moecomp", None)
    if st is None:
        return False
    _restore_forward(block, st.original)
    for d in st.derived:
        if d.name in block._buffers:
            del block._buffers[d.name]
    del block._moecomp
    return True


def bound_tensors(block: nn.Module, spec: MoESpec, bindings: dict, derived: list[Derived]) -> list:
    """The op's tensors for a not-yet-bound block (derived tensors built on the fly)."""
    built = {d.name: d.build(block) for d in derived}
    out = []
    for a in MOE_ARGS:
        p = bindings.get(a)
        if p is None:
            out.append(None)
        elif p in built:
            out.append(built[p])
        else:
            t = get_path(block, p)
            if a == "correction_bias" and t.dim() != 1:
                t = t.reshape(-1)
            out.append(t)
    return out


# ----------------------------------------------------------------------------------------------- experts only
@dataclass
class ExpertsState:
    """An experts module switched to ``moe_experts`` by ``optimize`` (its block's routing stays HF's)."""

    name: str
    spec: MoESpec
    reason: str  # why the whole block was not rewritten
    original: object  # the instance-level forward we replaced, or None (class forward)
    calls: int = 0
    fallbacks: int = 0


def experts_block_forward(m: nn.Module, *args, **kwargs):
    """Replacement forward of an experts module bound by :func:`bind_experts`."""
    from .experts_interface import moecomp_experts_forward

    st: ExpertsState = m._moecomp_experts
    compiling = torch.compiler.is_compiling()
    a = list(args) + list(kwargs.values())
    if len(a) == 3 and all(isinstance(t, torch.Tensor) for t in a) and a[0].dim() == 2 and a[1].dim() == 2 \
            and not a[1].is_floating_point() and a[2].shape == a[1].shape:
        if not compiling:  # (compiled code must not mutate state Dynamo guards on)
            st.calls += 1
        return moecomp_experts_forward(m, *a)
    if not compiling:
        st.fallbacks += 1
    if st.original is not None:
        return st.original(*args, **kwargs)
    return type(m).forward(m, *args, **kwargs)


class ExpertsForward:
    """``experts.forward`` after an experts-only rewrite: ``moecomp_experts_forward`` for the standard call
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``, the original forward for anything else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return experts_block_forward(self.module, *args, **kwargs)

    def __getstate__(self):
        return {"module": self.module}

    def __setstate__(self, state):
        self.module = state["module"]


def bind_experts(experts: nn.Module, name: str, spec: MoESpec, reason: str) -> ExpertsState:
    if getattr(experts, "_moecomp_experts", None) is not None:
        raise BindError("experts already bound")
    st = ExpertsState(name=name, spec=spec, reason=reason, original=experts.__dict__.get("forward"))
    experts._moecomp_experts = st
    experts.forward = ExpertsForward(experts)
    return st


def unbind_experts(experts: nn.Module) -> bool:
    st = experts.__dict__.get("_moecomp_experts")
    if st is None:
        return False
    _restore_forward(experts, st.original)
    del experts._moecomp_experts
    experts.__dict__.pop("_moecomp_experts_specs", None)
    return True

