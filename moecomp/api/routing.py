"""Routing replay and recording: ``moecomp.replay_routing``, ``moecomp.record_routing``, on transformers' own forward
and on blocks ``moecomp.optimize`` rewrote (the op path).

    with moecomp.record_routing(model) as rec:      # plain forwards (or transformers' generate)
        model(input_ids)
    routes = rec.routes                             # [layers, batch, tokens, k] int64
    with moecomp.replay_routing(routes):            # every MoE block uses these expert ids
        loss = model(input_ids, labels=labels).loss
        loss.backward()                             # gradients reach the model's parameters

``layers`` are the model's MoE blocks in module order: the blocks ``moecomp.scan(model).blocks`` reports, less the
candidates that are no block (``RejectCode.NOT_A_BLOCK``). Each block is recognised and verified as ``optimize``
does (:func:`moecomp.recognise.recognise.match_block`: by what it computes, on probes; cached per block while its
structure is unchanged), and, while a replay is active, runs :func:`moecomp.api.replay_forward.replay_block` on its
own parameters: the given ids, weights = the router's scores at those ids renormalised as its spec says, shared
experts unchanged. A token whose row is all -1 (padding) routes as the block would. A block whose spec has a
feature the replay does not compute (``replay_forward.refusals``), or that recognition refuses, is a ValueError
naming the block and why.

A block ``moecomp.optimize`` bound is planned from its bound state (no recognition again) and keeps its bound
forward: both context managers set a routing session (``core/replay.py``, a ContextVar) which that forward reads.
Replay passes the block's [T, k] ids to the op as ``routes_in``; padding rows (all -1) take the block's own choice,
computed beside the op from the block's router (the op has no notion of padding). Recording calls
``moe_forward_routes``: the ids the op chose, written by its routing kernel into an int32 buffer. Where the bound
forward runs no op (training with autograd: the op has no backward; hooks on the router / experts), replay runs
:func:`moecomp.api.replay_forward.replay_block` with the routes (never transformers' forward, which would lose them;
a spec it cannot compute is a ValueError at that call), and recording recomputes the ids beside the original
forward. A block holding a shard of its experts (``moecomp.shard_experts``) replays and records through the parallel
op the same way: its ids are global expert ids (every rank routes its own tokens before the exchange); it has no
torch forward to fall back to (its other experts are on the other ranks: a RuntimeError at such a call). Refused on
this path: the op's own refusals (``ops/routes.refusal``: sparsemixer, hash routing), experts-only rewrites. Compiled (``torch.compile``) bound forwards do not read the session. One session is
active at a time: a record around a replay sees the bound blocks only outside the replay.

Recording recomputes each block's selection from the block's input with the block's spec (correction bias and
expert groups included), beside the block's own forward, which runs unchanged: the recorded ids are the block's
own up to exact ties between scores.

On exit every forward is restored exactly (the instance ``forward`` the block had, or none) and the hooks removed.
Gradient checkpointing recomputes forwards during ``backward``: call ``backward`` inside the replay then.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..core.match import apply_epilogue, reshape_to
from ..core.derived import get_path
from ..core.reject import Refused
from ..core import replay as session_var
from ..ops.routes import refusal as op_refusal
from ..recognise.recognise import match_block, structure_key
from ..recognise.structure import iter_blocks
from ..bind.bind import forward_params, hooks_active
from . import replay_forward as rf


@dataclass
class BlockPlan:
    """One recognised block, as the replay runs it."""

    name: str
    block: nn.Module
    spec: object  # MoESpec
    bindings: dict
    derived: list
    contract: object  # core.match.Contract
    epilogue: tuple
    router_path: str
    hidden_name: str
    op: bool = False  # bound by moecomp.optimize: the op replays / records (routes_in / moe_forward_routes)
    why_not_torch: tuple = ()  # why replay_forward cannot run it (the op's fallback then refuses at the call)


_PLANS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # block -> (structure, Verified)


def _sharded(mod: nn.Module) -> bool:
    """Whether ``mod`` is a block ``moecomp.shard_experts`` sharded (its experts no longer match its router's E)."""
    return getattr(getattr(mod.__dict__.get("_moecomp"), "op_spec", None), "parallel", None) is not None


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE blocks of ``model`` in module order (what the routes' first dimension indexes): those the structure
    finds, and the blocks holding a shard of their experts (whose shapes the structure no longer reads as a block)."""
    found = {name for name, _, parts, _ in iter_blocks(model) if parts is not None}
    sharded = [name for name, mod in model.named_modules() if _sharded(mod)]
    found -= {n for n in found for s in sharded if n == "" or s.startswith(n + ".")}  # (an ancestor of a shard)
    found.update(sharded)
    return [(name, mod) for name, mod in model.named_modules() if name in found]


def _verified(block: nn.Module, cache: dict):
    key = structure_key(block)
    got = _PLANS.get(block)
    if got is not None and got[0] == key:
        return got[1]
    with torch.no_grad():
        v = match_block(block, cache=cache)
    _PLANS[block] = (key, v)
    return v


def _op_plan(name: str, block: nn.Module) -> tuple[BlockPlan | None, str | None]:
    """A block ``moecomp.optimize`` bound: its plan from the bound state (the op replays / records), or why not."""
    st = block._moecomp
    if not hasattr(st, "contract"):  # an experts-only binding (the experts module called by the block's own router)
        return None, "rewritten experts-only by moecomp.optimize (moecomp.unoptimize(model) first)"
    op_spec = st.op_spec or st.spec
    why = op_refusal(st.spec)
    if why is not None:
        return None, why
    epi = tuple(".".join(p) for p in st.epilogue)
    no_torch = tuple(rf.refusals(st.spec))
    if op_spec.parallel is not None:  # the parallel op replays / records (global ids); the torch forward cannot run
        no_torch += (f"sharded experts ({op_spec.parallel.describe()}: the other experts are on the other ranks)",)
    return BlockPlan(name, block, st.spec, st.bindings, st.derived, st.contract, epi, st.router_path,
                     st.hidden_name, op=True, why_not_torch=no_torch), None


def plan(model: nn.Module, blocks: list | None = None) -> list[BlockPlan]:
    """Each MoE block's plan, in order (``blocks``: ``moe_blocks(model)`` when known); a ValueError naming every block
    that cannot be replayed and why. Recognised once per block while its structure is unchanged; the FX pass once per
    distinct structure (each block still verified on its own weights). A block ``moecomp.optimize`` bound is planned
    from its bound state: the op replays and records it."""
    plans, refused, cache = [], [], {}
    for name, block in moe_blocks(model) if blocks is None else blocks:
        label = name or "<root>"
        if getattr(block, "_moecomp", None) is not None:
            p, why = _op_plan(name, block)
            if why is not None:
                refused.append(f"{label}: {why}")
            else:
                plans.append(p)
            continue
        try:
            v = _verified(block, cache)
        except Refused as e:
            refused.append(f"{label}: not recognised ({e.reason})")
            continue
        m = v.match
        why = rf.refusals(m.spec)
        if why:
            refused.append(f"{label}: {'; '.join(why)}")
            continue
        plans.append(BlockPlan(name, block, m.spec, m.bindings, m.derived, v.contract, tuple(v.epilogue),
                               m.parts.router_module if m.parts is not None else "", forward_params(block)[0]))
    if refused:
        raise ValueError("moecomp routing replay: these MoE blocks cannot be replayed:\n  "
                         + "\n  ".join(refused))
    return plans


def _hidden(p: BlockPlan, args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs[p.hidden_name]


# ------------------------------------------------------------------------------------------------------ replay
def check_routes(routes) -> torch.Tensor:
    """``routes`` as given, checked for what needs no model: a 4-D integer tensor of ids >= -1."""
    if not isinstance(routes, torch.Tensor):
        raise ValueError(f"routes: expected a tensor [layers, batch, tokens, k] of expert ids, got "
                         f"{type(routes).__name__}")
    if routes.dim() != 4 or routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise ValueError(f"routes: expected an integer tensor [layers, batch, tokens, k], got {routes.dtype} "
                         f"{list(routes.shape)}")
    if routes.numel():
        if int(routes.min()) < -1:
            raise ValueError(f"routes: expected expert ids >= 0 (-1: padding), got {int(routes.min())}")
        pad = routes < 0
        if bool((pad.any(-1) & ~pad.all(-1)).any()):
            raise ValueError("routes: a padded token is all -1 (its k ids); expected no row mixing -1 and ids")
    return routes


def check_fit(routes: torch.Tensor, plans: list[BlockPlan]) -> None:
    """The routes against the model's blocks: layer count, k, ids in [0, E)."""
    if routes.shape[0] != len(plans):
        raise ValueError(f"routes: expected {len(plans)} layers (the model's MoE blocks: "
                         f"{', '.join(p.name for p in plans[:4])}{' ...' if len(plans) > 4 else ''}), got "
                         f"{routes.shape[0]}")
    for i, p in enumerate(plans):
        if routes.shape[-1] != p.spec.top_k:
            raise ValueError(f"routes: expected k = {p.spec.top_k} (top_k of {p.name}), got {routes.shape[-1]}")
        if routes[i].numel() and int(routes[i].max()) >= p.spec.num_experts:
            raise ValueError(f"routes[{i}] ({p.name}): expected ids in [0, {p.spec.num_experts}), got "
                             f"{int(routes[i].max())}")


def _call_ids(p: BlockPlan, layer: int, r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """This call's ids [T, k], checked against the input's batch and tokens."""
    B, S = r.shape[1], r.shape[2]
    lead = tuple(x.shape[:-1])
    if (len(lead) >= 2 and lead[-2:] != (B, S)) or (len(lead) < 2 and x.numel() // x.shape[-1] != B * S):
        want = f"batch {lead[-2]} and tokens {lead[-1]}" if len(lead) >= 2 else f"batch x tokens = {lead[0]}"
        raise ValueError(f"routes {list(r.shape)}: expected {want} ({p.name} got hidden states {list(x.shape)}), "
                         f"got batch {B} and tokens {S}")
    return r[layer].reshape(-1, r.shape[-1])


class ReplayForward:
    """A block's forward while a replay is active (see the module docstring)."""

    def __init__(self, p: BlockPlan, layer: int, routes: torch.Tensor):
        self.p, self.layer, self.routes = p, layer, routes
        self.calls = 0

    def __call__(self, *args, **kwargs):
        p = self.p
        self.calls += 1
        x = _hidden(p, args, kwargs)
        ids = _call_ids(p, self.layer, self.routes, x)
        t = rf.block_tensors(p.block, p.bindings, p.derived)
        x2 = x.reshape(-1, x.shape[-1])
        y, _ = rf.replay_block(p.spec, t, x2, ids)
        router = get_path(p.block, p.router_path) if p.router_path else None
        called = p.contract.is_tuple and any(e[0] != "none" for e in p.contract.extras)  # (finish calls it)
        if router is not None and not called and hooks_active([router]):
            # a hook records the router's output (transformers' output_router_logits, its aux loss): called as the
            # block calls it; the replay's own logits are computed from the same weights
            router(x if p.contract.router_call == "x" else x2)
        return finish(p, x, x2, y)


def finish(p: BlockPlan, x: torch.Tensor, x2: torch.Tensor, y: torch.Tensor):
    """The block's result from the combined output y [T, H], as the verified contract says."""
    c = p.contract
    y = y.reshape(x.shape) if c.primary == "same" else y
    y = apply_epilogue(p.block, p.epilogue, y)
    if c.primary == "flat1d":
        y = y.reshape(-1)
    if not c.is_tuple:
        return y
    outs, rout = [y], None
    for e in c.extras:
        if e[0] == "none":
            outs.append(None)
            continue
        if rout is None:
            rout = get_path(p.block, p.router_path)(x if c.router_call == "x" else x2)
        outs.append(reshape_to(rout if e[1] == -1 else rout[e[1]], e[2]))
    return tuple(outs)


class Session:
    """The routing session bound blocks read (``core/replay.py``): block -> its handle."""

    def __init__(self):
        self.handles: dict = {}

    def get(self, block):
        return self.handles.get(block)


def own_ids(p: BlockPlan, x2: torch.Tensor) -> torch.Tensor:
    """The block's own choice [T, k] int64 for x2 [T, H] (no gradient)."""
    with torch.no_grad():
        t = rf.block_tensors(p.block, p.bindings, p.derived)
        x2 = x2.detach()
        return rf.select(p.spec, rf.router_logits(p.spec, t, x2), t.get("correction_bias"))


class OpReplay:
    """A bound block's replay (the op takes the ids as ``routes_in``). Padding rows (all -1) take the block's own
    choice, computed beside the op from the block's router (the op itself has no notion of padding)."""

    def __init__(self, p: BlockPlan, layer: int, routes: torch.Tensor):
        self.p, self.layer, self.routes = p, layer, routes
        self.torch_forward = ReplayForward(p, layer, routes)
        self.op_calls = 0

    @property
    def calls(self) -> int:
        return self.op_calls + self.torch_forward.calls

    def ids(self, x: torch.Tensor) -> torch.Tensor:
        self.op_calls += 1
        ids = _call_ids(self.p, self.layer, self.routes, x).to(x.device).long()
        pad = ids[:, 0] < 0
        if bool(pad.any()):
            ids = torch.where(pad.unsqueeze(1), own_ids(self.p, x.reshape(-1, x.shape[-1])), ids)
        return ids

    def fallback(self, x, rest, kwargs, call_original):
        if self.p.why_not_torch:
            raise ValueError(f"moecomp.replay_routing: {self.p.name} needs its torch forward for this call (e.g. "
                             f"training with autograd: the op has no backward), which cannot compute "
                             f"{'; '.join(self.p.why_not_torch)}")
        return self.torch_forward(x, *rest, **kwargs)


class replay_routing:  # noqa: N801 (a context manager used like a function)
    """``with moecomp.replay_routing(routes[, model]): model(...)``: every MoE block of the model uses the given expert
    ids (the module docstring). ``routes``: integer [layers, batch, tokens, k]; a token's row all -1: padding, routed
    as the block would. ``model``: the model to replay on; without it, the first module called inside the context
    that holds MoE blocks (the model you call) is the one, found at that call. Routes that do not fit (layer count,
    k, an id >= E; batch / tokens at each block's call) are a ValueError naming what was expected."""

    def __init__(self, routes: torch.Tensor, model: nn.Module | None = None):
        self.routes = check_routes(routes)
        self.model = model
        self._saved: list = []  # (block, the instance forward it had or None)
        self._hook = None
        self._no_blocks: weakref.WeakSet = weakref.WeakSet()
        self.plans: list[BlockPlan] = []
        self._session, self._token = Session(), None

    def __enter__(self):
        self._token = session_var.activate(self._session)
        if self.model is not None:
            self._install(self.model)
        else:
            self._hook = nn.modules.module.register_module_forward_pre_hook(self._on_call)
        return self

    def _on_call(self, module, args):
        if module in self._no_blocks:
            return None
        blocks = moe_blocks(module)
        if not blocks:
            self._no_blocks.add(module)
            return None
        self._hook.remove()
        self._hook = None
        self._install(module, blocks)
        return None

    def _install(self, model: nn.Module, blocks: list | None = None) -> None:
        plans = plan(model, blocks)
        check_fit(self.routes, plans)
        for i, p in enumerate(plans):
            if p.op:  # the bound forward reads the session
                self._session.handles[p.block] = OpReplay(p, i, self.routes)
                continue
            self._saved.append((p.block, p.block.__dict__.get("forward")))
            p.block.forward = ReplayForward(p, i, self.routes)
        self.plans = plans

    def __exit__(self, exc_type, *exc):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._token is not None:
            session_var.deactivate(self._token)
            self._token = None
        runs = {b: b.forward for b, _ in self._saved}
        runs.update(self._session.handles)
        idle = [b for b, r in runs.items() if r.calls == 0]
        if exc_type is None and idle:
            names = ", ".join(p.name for p in self.plans if p.block in idle)
            warnings.warn(f"moecomp.replay_routing: the forward of {len(idle)} of {len(runs)} MoE block(s) "
                          f"({names}) was never called inside the context: their routes were not replayed (the "
                          f"model reaches their router / experts another way, or was not called)", UserWarning,
                          stacklevel=2)
        for block, fwd in reversed(self._saved):
            if fwd is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = fwd
        self._saved.clear()
        self._session.handles.clear()
        return False


# ------------------------------------------------------------------------------------------------------ record
class OpRecord:
    """A bound block's recording: the op writes its ids (``moe_forward_routes``); where the block's original forward
    runs instead (autograd while training, hooks), the ids are recomputed beside it as on transformers' path."""

    def __init__(self, rec, i: int, p: BlockPlan):
        self.rec, self.i, self.p = rec, i, p

    def ids(self, x):
        return None

    def store(self, ids: torch.Tensor, x: torch.Tensor) -> None:
        self.rec.store(self.i, self.p, ids, x)

    def fallback(self, x, rest, kwargs, call_original):
        self.rec.store(self.i, self.p, own_ids(self.p, x.reshape(-1, x.shape[-1])), x)
        return call_original()


class record_routing:  # noqa: N801
    """``with moecomp.record_routing(model) as rec: model(...)``: the expert ids every MoE block routes to, in
    ``rec.calls`` (one [layers, batch, tokens, k] int64 tensor per forward) and ``rec.routes`` (the calls joined
    along the tokens: a prompt's forward and the decode steps after it, as transformers' generate makes them). A
    block whose forward was never called gets -1 rows (and a UserWarning at exit names it).
    The model's forward runs unchanged; the ids are recomputed beside it (the module docstring)."""

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._hooks: list = []
        self._ids: list[list[torch.Tensor]] = []
        self.plans: list[BlockPlan] = []
        self._session, self._token = Session(), None

    def __enter__(self):
        self.plans = plan(self.model)
        self._ids = [[] for _ in self.plans]
        for i, p in enumerate(self.plans):
            if p.op:  # the bound forward records the op's own ids (moe_forward_routes)
                self._session.handles[p.block] = OpRecord(self, i, p)
                continue
            self._hooks.append(p.block.register_forward_pre_hook(self._recorder(i, p), with_kwargs=True))
        self._token = session_var.activate(self._session)
        return self

    def store(self, i: int, p: BlockPlan, ids: torch.Tensor, x: torch.Tensor) -> None:
        """Layer i's ids [T, k] for the block's input x, kept as [batch, tokens, k] int64."""
        lead = tuple(x.shape[:-1]) if x.dim() >= 3 else (1, ids.shape[0])
        self._ids[i].append(ids.long().reshape(lead[-2:] + (p.spec.top_k,)))

    def _recorder(self, i: int, p: BlockPlan):
        def hook(module, args, kwargs):
            x = _hidden(p, args, kwargs)
            self.store(i, p, own_ids(p, x.reshape(-1, x.shape[-1])), x)
            return None

        return hook

    def __exit__(self, exc_type, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._token is not None:
            session_var.deactivate(self._token)
            self._token = None
        self._session.handles.clear()
        idle = [p.name for p, c in zip(self.plans, self._ids) if not c]
        if exc_type is None and idle and len(idle) < len(self.plans):
            warnings.warn(f"moecomp.record_routing: the forward of {len(idle)} of {len(self.plans)} MoE block(s) "
                          f"({', '.join(idle)}) was never called: their rows are -1 (e.g. a modality's experts no "
                          f"token reached, or a model that reaches their router / experts another way)", UserWarning,
                          stacklevel=2)
        return False

    @property
    def calls(self) -> list[torch.Tensor]:
        """One [layers, batch, tokens, k] tensor per forward; a block never called: -1 rows (padding)."""
        ran = [c for c in self._ids if c]
        if not ran:
            return []
        n = min(len(c) for c in ran)
        return [torch.stack([c[j] if c else torch.full_like(ran[0][j], -1) for c in self._ids]) for j in range(n)]

    @property
    def routes(self) -> torch.Tensor:
        calls = self.calls
        if not calls:
            raise ValueError("record_routing: nothing recorded (no forward of the model ran inside the context)")
        if len({c.shape[1] for c in calls}) != 1:
            raise ValueError(f"record_routing: the forwards had different batch sizes "
                             f"({[c.shape[1] for c in calls]}); read rec.calls")
        return torch.cat(calls, 2)


def engine_blocks(model: nn.Module) -> tuple[list | None, str | None]:
    """generate's engine records routes in its steps (``generate/routes.py``) when every MoE block is bound whole by
    ``moecomp.optimize`` with routes the op records, all with one top-k: (the blocks in module order, None); else
    (None, why not), and transformers' loop records under :class:`record_routing`."""
    blocks = moe_blocks(model)
    if not blocks:
        return None, "no MoE block found"
    ks = set()
    for name, block in blocks:
        label = name or "<root>"
        if getattr(block, "_moecomp", None) is None:
            return None, f"{label} is not rewritten by moecomp.optimize"
        p, why = _op_plan(name, block)
        if why is not None:
            return None, f"{label}: {why}"
        ks.add(p.spec.top_k)
    if len(ks) != 1:
        return None, f"the blocks route to different numbers of experts ({sorted(ks)})"
    return [b for _, b in blocks], None


def _register() -> None:
    from ..generate.hf_generate import FastGenerate

    FastGenerate.recorder = record_routing
    FastGenerate.engine_blocks = staticmethod(engine_blocks)


_register()
