"""Models loaded by transformers' distributed loading: ``optimize()`` binds their MoE blocks to the parallel op on
the expert shards transformers loaded (no gather, nothing copied).

    torchrun --nproc-per-node 2 ...:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, ep_size=2))
    moecomp.optimize(model)      # each MoE block -> the parallel op on this rank's experts

What transformers' distributed loading (``transformers.distributed``: 5.24, 5.25; none in 5.17) may leave in a block,
read here from the tensors it leaves (DTensor placements, what is local), never from plan names or versions:

    routed experts split by experts (an EP plan: "grouped_gemm" + "ep_dispatch_experts", both versions):
        experts.gate_up_proj / down_proj (and biases) DTensors Shard(0) over a 1-D mesh (local: experts
        [r E / W, (r + 1) E / W)); experts.num_experts the local count; experts.forward its EP dispatch (an
        ``EPImplementation``: "all_reduce" over a batch the group shares, "all_to_all", "auto"), called by the block
        after its router                                                                        -> mode "ep"
    routed experts split by their intermediate columns (5.24's default TP plans; an explicit "packed_colwise" /
        "rowwise" / "moe_tp_experts" plan, deprecated in 5.25): gate_up_proj _StridedShard(1, 2) (gate rows s | up
        rows s), down_proj Shard(2) (columns s), the experts' forward all-reduces               -> mode "tp"
    routed experts whole on every rank (5.25's default TP plans shard attention and the shared / dense MLPs, not the
        routed experts): plain tensors (or DTensors replicated)                                 -> mode "replicated"
        where the block holds DTensors (shared experts sliced); with none, the block is an ordinary one and
        ``optimize`` takes its ordinary path (transformers' TP attention runs around it either way)
    shared experts (TP plans: colwise gate / up, rowwise down): DTensors of this rank's slice of their I (rows s of
        gate / up, columns s of down), or whole
    the router and the rest of the block: plain tensors

``process`` (called by ``optimize`` for such a block, in place of its recognise -> verify -> bind):

    refuse early    DTensors outside the experts / shared experts (FSDP, a sharded router), a mesh that is not 1-D,
                    DTensors over different groups, w13 sharded and w2 whole (or the reverse), an epilogue module (no
                    collective has run: every rank refuses alike)
    recognise       the attribute reader on the block itself, its routing measured on a probe run of the block's own
                    forward (transformers' collectives included; every rank runs the same probe): the spec of the
                    WHOLE block (a DTensor's shape is the global one); TP-sharded shared experts are read from a whole
                    stand-in meanwhile (gathered, then dropped: the reader calls them as one MLP)
    layout          which rows / columns of each bound expert tensor this rank holds, read through a DTensor's own
                    placements on index tensors (no data moved; a plain tensor is held whole), against moecomp's
                    EP / TP / replicated layouts (``slicing.py``; the mode from w13: whole -> replicated, a shard of
                    dim 0 -> EP, else TP): mode, W, rank, the DTensors' process group; EP dispatch "all_reduce" where
                    the group shares one batch (transformers' ``shares_batch``: ep_size == tp_size, whichever
                    EPImplementation it installed: each pair still runs once, on its expert's rank), else
                    "all_to_all"; TP and replicated "all_reduce" (replicated: of the shared experts' slices alone)
    verify          the block's own forward (transformers' sharded path) against ``parallel.forward`` on this rank's
                    local tensors, on the verify probe, within ``policy.verify_tolerance``; every rank of the group
                    agrees on the spec and the verdict (one all-reduce) before anything is bound
    bind            ``bind.bind.bind`` as for any block; then each bound DTensor Parameter becomes a Parameter of its
                    local tensor (``to_local()``: the same storage) and the op spec gets the ParallelSpec, so the
                    block routes once over the global experts and runs moecomp's dispatch; transformers' EP / TP
                    forward of the experts module is no longer called

After binding the block is like one ``shard_experts`` made (it cannot run its original forward nor be unbound), and
transformers' gathering save no longer sees its expert Parameters as DTensors: save before ``optimize``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import zlib

import torch
import torch.distributed as dist
from torch import nn

from ..core import policy
from ..bind import bind as _bind
from ..core.parts import BlockParts
from ..core.derived import get_path
from ..verify.epilogue import block_device_dtype
from ..core.match import Verified, arg_name
from ..core.args import OP_ARGS
from ..probe.block import contract_of, primary, run_probe
from ..recognise.recognise import recognise
from ..core.reject import Reject, RejectCode
from .report import BlockReport, fill_from_spec as _fill_from_spec
from ..core.spec import MoESpec, SpecError
from ..core.spec_parallel import ParallelSpec
from ..core.status import BlockStatus
from ..parallel.comm import group_name
from ..parallel.local import SHARD_ARGS
from ..parallel.op import forward as parallel_forward
from ..parallel.slicing import shard_tensors

_SHARED = ("shared_w1", "shared_w3", "shared_w2")


def _dtensor_type():
    """DTensor's class where torch.distributed.tensor is loaded (no DTensor exists before it is), else None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def sharded(block: nn.Module) -> bool:
    """Does ``block`` hold DTensor parameters (transformers' distributed loading sharded it)?"""
    cls = _dtensor_type()
    return cls is not None and any(isinstance(p, cls) for p in block.parameters())


def bound_shard(block: nn.Module) -> bool:
    """Is ``block`` bound to the parallel op (``shard_experts``, or ``process``)? Its experts are a shard then, which
    no longer matches its router: the structure reader does not take it for a block, ``optimize`` reports it bound."""
    st = block.__dict__.get("_moecomp")
    return getattr(getattr(st, "op_spec", None), "parallel", None) is not None


def shares_batch(experts: nn.Module) -> bool | None:
    """Whether the ranks of the experts' EP group hold one batch: the ``shares_batch`` of the ``EPImplementation``
    transformers installed (its forward's closure), else its config's ``distributed_config`` (ep_size == tp_size);
    None when neither says."""
    fwd = experts.__dict__.get("forward")
    for cell in getattr(fwd, "__closure__", None) or ():
        try:
            v = getattr(cell.cell_contents, "shares_batch", None)
        except ValueError:  # an empty cell
            continue
        if isinstance(v, bool):
            return v
    dc = getattr(getattr(experts, "config", None), "distributed_config", None)
    ep, tp = getattr(dc, "ep_size", None), getattr(dc, "tp_size", None)
    return ep == tp if isinstance(ep, int) and isinstance(tp, int) else None


# ------------------------------------------------------------------------------------------------ layout
def _dtensors(block: nn.Module) -> list:
    """(name, DTensor) of the block's DTensor parameters and buffers."""
    return [(n, t) for n, t in (*block.named_parameters(), *block.named_buffers()) if is_dtensor(t)]


def _early_refusal(block: nn.Module, parts: BlockParts) -> str:
    """Why the block cannot be bound, seen without running anything ("" when nothing is seen)."""
    if parts.kind != "fused" or not parts.w13:
        return "sharded by transformers' distributed loading, with experts that are not 3-D expert tensors"
    if parts.extra_modules:
        return f"sharded by transformers' distributed loading, beside {', '.join(parts.extra_modules)}"
    allowed = tuple(p + "." for p in (parts.experts, parts.shared.path if parts.shared else None) if p)
    ranks = None
    for n, p in _dtensors(block):
        if not n.startswith(allowed):
            return (f"{n} is a DTensor (sharded by transformers' distributed loading, e.g. FSDP): only the routed "
                    f"and shared experts may be sharded for moecomp's parallel op")
        if p.device_mesh.ndim != 1 or len(p.placements) != 1:
            return f"{n} is sharded over a {p.device_mesh.ndim}-D device mesh; expected one mesh dimension"
        r = dist.get_process_group_ranks(p.device_mesh.get_group())
        if ranks is not None and r != ranks:
            return f"{n} is sharded over ranks {r}, other DTensors of the block over {ranks} (one group must hold all)"
        ranks = r
    w13, w2 = get_path(block, parts.w13), get_path(block, parts.w2) if parts.w2 else None
    if w2 is not None and _whole(w13) != _whole(w2):
        return (f"{parts.w13} is {_held_text(w13)} but {parts.w2} is {_held_text(w2)}: moecomp's layouts split the "
                f"routed experts' tensors alike (EP: experts; TP: intermediate columns) or hold them whole")
    return ""


def _held_text(t) -> str:
    """What this rank holds of ``t``, in words: "whole (a plain tensor)", or its placements and, for a shard, the
    indices of the sharded dim."""
    if not is_dtensor(t):
        return "whole (a plain tensor)"
    if _whole(t):
        return f"whole (a DTensor, placements {tuple(t.placements)})"
    dim = getattr(t.placements[0], "dim", 0)
    return f"a DTensor, placements {tuple(t.placements)}: indices {_span(_held(t, dim))} of dim {dim} on this rank"


def _group(block: nn.Module):
    """The process group of the block's DTensors (``_early_refusal`` checked they share one)."""
    return _dtensors(block)[0][1].device_mesh.get_group()


def _held(t, dim: int) -> torch.Tensor:
    """The global indices along ``dim`` of the part of ``t`` this rank holds, in its local order: for a DTensor, an
    index tensor (size 1 on the other dims) split by ``t``'s own placements (no communication: ``src_data_rank=None``);
    a plain tensor is held whole."""
    if not is_dtensor(t):
        return torch.arange(t.shape[dim])
    from torch.distributed.tensor import distribute_tensor

    shape = [1] * t.dim()
    shape[dim] = t.shape[dim]
    idx = torch.arange(t.shape[dim]).reshape(shape)
    return distribute_tensor(idx, t.device_mesh, list(t.placements), src_data_rank=None).to_local().reshape(-1).cpu()


def _whole(t) -> bool:
    """Does this rank hold all of ``t`` (a plain tensor, or a DTensor replicated on every rank)?"""
    return not is_dtensor(t) or all(pl.is_replicate() for pl in t.placements)


def _cut_dim(name: str, spec: MoESpec) -> int:
    """The dim moecomp's shard of op argument ``name`` cuts (``slicing.py``)."""
    if name in _SHARED:
        return 1 if name == "shared_w2" else 0
    if spec.parallel.mode in ("ep", "replicated") or name == "b2":
        return 0
    in_out = spec.w_layout == "in_out"
    dims = {"w13": 2 if in_out else 1, "b13": 1, "w2": 1 if in_out else 2}
    if name not in dims:
        raise SpecError(f"{name} is a DTensor of a tensor-parallel plan: sharded quantization tensors are not read "
                        f"(expected the expert weights and biases only)")
    return dims[name]


def _wanted(name: str, t, spec: MoESpec, dim: int, shared_sliced: bool) -> torch.Tensor:
    """The global indices along ``dim`` moecomp's shard of ``name`` holds on this rank (shared experts: this rank's
    slice of their I where ``shared_sliced``, else all of it)."""
    p = spec.parallel
    if name in _SHARED:
        if not shared_sliced:
            return torch.arange(t.shape[dim])
        n = spec.shared.intermediate_size // p.world_size
        return torch.arange(p.rank * n, (p.rank + 1) * n)
    shape = [1] * t.dim()
    shape[dim] = t.shape[dim]
    idx = torch.arange(t.shape[dim]).reshape(shape)
    return shard_tensors({name: idx}, spec)[name].reshape(-1)


def _span(ix: torch.Tensor) -> str:
    """Indices as runs: "[0, 16) + [32, 48)" (the first four runs)."""
    v, runs = ix.tolist(), []
    for i in v:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return " + ".join(f"[{a}, {b})" for a, b in runs[:4]) + (" + ..." if len(runs) > 4 else "") if runs else "none"


def _tensor_at(block: nn.Module, path):
    """The block's tensor a binding names (None for no binding, or a forward argument's)."""
    return get_path(block, path) if isinstance(path, str) and arg_name(path) is None else None


def _mode(w13, spec: MoESpec) -> str:
    """What this rank holds of the routed experts, read from w13: all of it ("replicated": a plain tensor, or a
    DTensor replicated), whole experts (a shard of dim 0: "ep"), else a slice of every expert ("tp"; the index
    comparison in ``read_layout`` says whether it is moecomp's)."""
    if _whole(w13):
        return "replicated"
    return "ep" if getattr(w13.placements[0], "dim", None) == 0 else "tp"


def read_layout(block: nn.Module, spec: MoESpec, bindings: dict, dispatch_hint: bool | None, group) -> tuple:
    """(ParallelSpec, {op argument: bound DTensor path}) of a block whose bound tensors are one of moecomp's
    layouts: routed experts split by experts (EP), by their intermediate columns (TP) or whole on every rank
    (replicated), shared experts whole or this rank's slice of their I; a ``SpecError`` naming the tensor that is
    not (what this rank holds and what moecomp's shard would)."""
    bound = {}
    for a in OP_ARGS:
        path = bindings.get(a)
        t = _tensor_at(block, path)
        if t is None:
            continue
        if is_dtensor(t) and a not in SHARD_ARGS and a not in _SHARED:
            raise SpecError(f"{path} ({a}) is a DTensor; moecomp's parallel op takes it whole on every rank")
        if a in SHARD_ARGS or a in _SHARED:
            bound[a] = (path, t)
    mode = _mode(bound["w13"][1], spec)
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    dispatch = "all_to_all" if mode == "ep" and not dispatch_hint else "all_reduce"
    p = ParallelSpec(mode, W, rank, spec.num_experts, intermediate_size=spec.intermediate_size if mode == "tp" else 0,
                     dispatch=dispatch, group=group_name(group))
    ps = spec.replace(parallel=p)
    shared_sliced = any(not _whole(t) for a, (_, t) in bound.items() if a in _SHARED)
    for a, (path, t) in bound.items():
        dim = _cut_dim(a, ps)
        held, want = _held(t, dim), _wanted(a, t, ps, dim, shared_sliced)
        if not torch.equal(held, want):
            of = "this rank's slice of the shared experts' I" if a in _SHARED else f"moecomp's {p.describe()} shard"
            raise SpecError(f"{path} ({a}): rank {rank} of {W} holds indices {_span(held)} of dim {dim} "
                            f"({'a plain tensor' if not is_dtensor(t) else 'placements ' + str(tuple(t.placements))})"
                            f", {of} is {_span(want)}")
    return p, {a: path for a, (path, t) in bound.items() if is_dtensor(t)}


# ------------------------------------------------------------------------------------------------ process
def _whole_copy(mod: nn.Module) -> nn.Module:
    """A stand-in of ``mod`` that computes it whole on this rank: the same class and attributes, each DTensor
    Parameter gathered (``full_tensor()``: a collective, every rank in the same order), transformers' installed TP
    forwards dropped (the class forward runs)."""
    new = copy.copy(mod)
    new.__dict__.pop("forward", None)
    new._parameters = {n: nn.Parameter(p.full_tensor().detach(), requires_grad=False) if is_dtensor(p) else p
                       for n, p in mod._parameters.items()}
    new._modules = {n: None if c is None else _whole_copy(c) for n, c in mod._modules.items()}
    return new


@contextlib.contextmanager
def _whole_shared(block: nn.Module, parts: BlockParts):
    """While recognising: the shared experts TP-sharded by transformers (DTensors) replaced by a whole stand-in
    (``_whole_copy``: the attribute reader calls and reads them as one MLP); the sharded module is put back after."""
    path = parts.shared.path if parts.shared is not None else ""
    mod = get_path(block, path) if path else None
    if mod is None or not any(is_dtensor(p) for p in mod.parameters()):
        yield
        return
    owner_path, _, attr = path.rpartition(".")
    owner = get_path(block, owner_path) if owner_path else block
    owner._modules[attr] = _whole_copy(mod)
    try:
        yield
    finally:
        owner._modules[attr] = mod


def _agree(group, spec_key: str, err: float) -> tuple[bool, float]:
    """(every rank of ``group`` has the same spec key, the largest error of any rank): one all-reduce."""
    h = float(zlib.crc32(spec_key.encode()))
    t = torch.tensor([h, -h, err if err == err else float("inf")], dtype=torch.float64)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else t.device
    t = t.to(dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t = t.cpu()
    return bool(t[0] == -t[1]), float(t[2])


def _local_args(block: nn.Module, bindings: dict) -> dict:
    """The op's tensors by name, DTensors as their local tensors."""
    out = {}
    for a in OP_ARGS:
        t = _tensor_at(block, bindings.get(a))
        out[a] = t.to_local() if is_dtensor(t) else t
    return out


def _install_local(block: nn.Module, paths: dict) -> None:
    """Each bound DTensor Parameter becomes a Parameter of its local tensor (the same storage; no grad)."""
    for path in paths.values():
        owner_path, _, attr = path.rpartition(".")
        owner = get_path(block, owner_path) if owner_path else block
        t = getattr(owner, attr)
        local = t.to_local().detach()
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(local, requires_grad=False)
        else:
            setattr(owner, attr, local)


def process(name: str, block: nn.Module, parts: BlockParts, rep: BlockReport, bind_it: bool) -> None:
    """Recognise, verify and bind (``bind_it``) a block transformers' distributed loading sharded (module
    docstring); ``rep`` gets the result or the reason."""
    why = _early_refusal(block, parts)
    if why:
        rep.refuse(RejectCode.UNSUPPORTED_STRUCTURE, why)
        return
    group = _group(block)
    x = policy.probe_input(parts.hidden_size, *block_device_dtype(block, parts))
    try:
        with _whole_shared(block, parts):
            got, notes = recognise(block, parts, x, use_fx=False)
        rep.notes += notes
        if isinstance(got, Reject):
            raise SpecError(got.message)
        m = got
        if m.derived or m.spec.has_capacity:
            raise SpecError("derived tensors or an expert capacity in a block sharded by transformers")
        p, dpaths = read_layout(block, m.spec, m.bindings, shares_batch(get_path(block, parts.experts)), group)
        spec = m.spec.replace(parallel=p)
        key = f"{m.spec.key} {p.mode} {p.world_size} {p.dispatch} {p.group}"  # (the same on every rank)
    except Exception as e:  # noqa: BLE001  (reported; the ranks must still meet in the all-reduce below)
        code = RejectCode.SPEC_INVALID if isinstance(e, SpecError) else RejectCode.CHECK_ERROR
        rep.refuse(code, f"sharded by transformers' distributed loading: {type(e).__name__}: {e}")
        _agree(group, "", float("inf"))  # (the other ranks wait in this all-reduce for this rank's verdict)
        return
    same, _ = _agree(group, key, 0.0)
    if not same:
        rep.refuse(RejectCode.SPEC_INVALID, "the ranks of the group recognised the block differently (or one refused)")
        return
    why, err = "", float("inf")
    try:
        run = run_probe(block, parts, x)  # the block's own forward: transformers' sharded path, its collectives
        contract = contract_of(run)
        ref = primary(run.output).reshape(x.shape).float()
        with torch.no_grad():
            y = parallel_forward(x, _local_args(block, m.bindings), spec).float()
        if torch.isfinite(y).all():
            err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    except Exception as e:  # noqa: BLE001  (reported; the ranks meet in the all-reduce below)
        why = f": {type(e).__name__}: {e}"
    _, err = _agree(group, key, err)
    tol = policy.verify_tolerance(x.dtype, m.spec)
    if not err <= tol:
        rep.refuse(RejectCode.VERIFICATION_FAILED, f"the parallel op differs from the block's sharded forward: max "
                                                   f"rel. err {err:.2e} > {tol:g} (worst rank){why}")
        return
    rep.reason, rep.method, rep.max_rel_err = "", m.method, err
    rep.notes.append(f"sharded by transformers' distributed loading: {p.describe()}; bound to the parallel op on the "
                     f"local tensors (checked against the block's sharded forward: max rel. err {err:.1e})")
    if bind_it:
        st = _bind.bind(block, name, Verified(m, contract, err))
        _install_local(block, dpaths)
        st.op_spec = (st.op_spec or st.spec).replace(parallel=p)
        st.spec_key = st.op_spec.key
        rep.status = BlockStatus.REWRITTEN
    else:
        rep.status = BlockStatus.SUPPORTED
    _fill_from_spec(rep, m.spec, block, m.bindings, m.derived)
