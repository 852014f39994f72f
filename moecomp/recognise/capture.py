"""Capture one block with Dynamo and describe it: the stable API between the FX pass and ``moecomp.optimize``.

    from moecomp.recognise.capture import detect_block, DetectError

    m = detect_block(block, example_input)        # example_input: hidden states [B, S, H] (or [T, H])
    m.spec                                        # MoESpec, derived from what the captured graph computes
    m.bindings                                    # {"router_w": "gate.weight", "w13": "experts.gate_up_proj",
                                                  #  "w2": "experts.down_proj", "shared_w1": "shared_expert.gate_proj.weight",
                                                  #  ..., "b13": None, ...}  one key per moecomp.ops.MOE_ARGS name,
                                                  #  a path relative to ``block`` (get it with block.get_parameter /
                                                  #  get_buffer / attrgetter), or None when the op gets None
    m.constants                                   # spec fields read from scalar attributes, field -> path
                                                  #  e.g. {"routed_scaling_factor": "gate.routed_scaling_factor"}
    m.output_index, m.num_outputs                 # where the MoE result sits among the graph's outputs (gpt-oss's
                                                  #  block returns (hidden, router_scores): index 0 of 2)
    m.verified                                    # how the match was checked (see recognise/fx/detect_moe.py)
    m.output_node, m.output_is_graph_output       # the node holding the MoE result; False when the block applies a
    m.tail_ops                                    #  tail (post-MoE norm) before returning it: detect_block raises
                                                  #  then (e.match holds the BlockMatch) unless allow_tail=True
                                                  #  or the tail only reshapes (views: flatten, view, ...)

    try: ...
    except DetectError as e:
        e.reason        # why (one line)
        e.kind          # "capture": Dynamo could not trace the block (e.capture_failed is True), fall back freely
                        # "detect":  traced, but not an MoE we can prove equal (leave the block alone or fall back)
        e.code          # the same as a moecomp.core.reject.RejectCode: CAPTURE_FAILED | NOT_RECOGNISED (test this)

Functions:

* ``capture_block(module, example_input, *, dynamic=True) -> CapturedBlock``: ``torch.compile(fullgraph=True,
  dynamic=True)`` through a backend that records Dynamo's torch-level graph and never runs it. Each placeholder is
  mapped back to a module-relative path: parameters and buffers by tensor identity with the example inputs Dynamo
  passes the backend, scalar attributes (which Dynamo lifts to 0-d inputs) by their Dynamo name, the hidden states
  as ``"<input>"``, SymInts as None. Each call traces a fresh code object, so capturing many blocks of one class
  never hits Dynamo's recompile limit, and nothing is left in the caches of the block's own ``forward``.
* ``detect_block(module, example_input, *, verify=True) -> BlockMatch``: ``capture_block`` + ``detect_moe``; exactly
  one MoE whose input is the block input and whose result is returned by the block, else ``DetectError``.
* ``traceable_experts()``: context manager. transformers' ``eager`` experts path loops over the experts hit
  (``for expert_idx in expert_hit``), which Dynamo cannot trace into one graph. While the context is active, an
  experts module configured as ``eager`` traces as transformers' ``grouped_mm`` path instead (transformers keeps its
  experts implementations interchangeable); outside it nothing changes. ``capture_block`` and the ``moecomp``
  compile backend use it.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from ..formats.fp8 import plain_fp8
from ..ops.moe_op import MOE_ARGS, OP_ARGS
from .fx import graph as _fx
from ..core.derived import Derived
from ..core.args import PEELED
from ..core.match import arg_name, forward_arg
from ..core.reject import Refused, RejectCode
from ..core.spec import MoESpec

__all__ = ["CapturedBlock", "BlockMatch", "DetectError", "capture_block", "detect_block", "traceable_experts"]


class DetectError(Refused):
    """A block could not be captured (``kind == "capture"``, ``code`` ``RejectCode.CAPTURE_FAILED``) or is not an MoE
    we can prove (``kind == "detect"``, ``code`` ``RejectCode.NOT_RECOGNISED``)."""

    def __init__(self, reason: str, kind: str = "detect", rejected: list | None = None):
        if kind not in ("capture", "detect"):
            raise ValueError(f"DetectError kind must be 'capture' or 'detect', not {kind!r}")
        super().__init__(reason, RejectCode.CAPTURE_FAILED if kind == "capture" else RejectCode.NOT_RECOGNISED)
        self.kind = kind
        self.capture_failed = kind == "capture"
        self.rejected = list(rejected or [])
        self.match = None  # a BlockMatch when the MoE was found but the block post-processes its result


@dataclass
class CapturedBlock:
    gm: fx.GraphModule  # Dynamo's torch-level graph of module(example_input)
    example_inputs: list  # what Dynamo passed the backend, in placeholder order
    paths: dict[str, str | None]  # placeholder name -> module-relative path | "<input>" | None (SymInt / unknown)

    def concrete_inputs(self) -> list:
        """``example_inputs`` with SymInts replaced by the sizes they were traced with (to run ``gm``)."""
        out = []
        for v in self.example_inputs:
            if isinstance(v, torch.SymInt):
                node = v.node
                hint = getattr(node, "hint", None)
                if hint is None:
                    env = getattr(node.shape_env, "backed_var_to_val", None) or node.shape_env.var_to_val
                    hint = node.expr.xreplace(env)
                v = int(hint)
            out.append(v)
        return out


@dataclass
class BlockMatch:
    spec: MoESpec
    bindings: dict[str, str | None]  # MOE_ARGS name -> module-relative path (None = the op gets None)
    constants: dict[str, str] = field(default_factory=dict)  # spec field -> path of the scalar attribute it came from
    output_index: int = 0  # position of the MoE result among the block graph's outputs
    num_outputs: int = 1
    verified: str = ""
    captured: CapturedBlock | None = None
    output_node: str = ""  # the graph node holding the MoE result (what moe_forward computes)
    # is the MoE result exactly what the block returns (graph output ``output_index``)? False when the block
    # applies a tail to it first (AXK1's post_mlp_layernorm): ``tail_ops`` lists the tail's ops, in graph order,
    # and ``output_index`` is the graph output carrying the tail's result
    output_is_graph_output: bool = True
    tail_ops: tuple[str, ...] = ()
    # tensors the op reads that the block holds in pieces (per-expert nn.Linear weights: stacked); ``bindings``
    # names them by ``Derived.name``
    derived: list[Derived] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # for the report (how the numeric check fit in memory)

    def describe(self) -> str:
        bound = ", ".join(f"{k}={v}" for k, v in self.bindings.items() if v is not None)
        return f"{self.spec.describe()} [{bound}] ({self.verified})"


# ------------------------------------------------------------------------------------------------- eager experts
class _ExpertsState:
    active = 0  # > 0 while traceable_experts() is entered (a counter: contexts nest)
    installed = False
    predicate = None  # () -> bool, evaluated at Dynamo trace time (the moecomp backend registers one)


_STATE = _ExpertsState()


def register_trace_predicate(fn) -> None:
    """``fn() -> bool`` (a ``torch._dynamo.assume_constant_result`` function): trace eager experts as grouped_mm
    whenever it is true at trace time. The compile backend registers "Dynamo is tracing for moecomp"."""
    _STATE.predicate = fn
    _install()


def _eager_or_grouped(self, *args, **kwargs):
    """Registered as transformers' "eager" experts implementation: the class's own loop unless tracing for moecomp."""
    if _STATE.active or (
        _STATE.predicate is not None and torch.compiler.is_compiling() and _STATE.predicate()
    ):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, *args, **kwargs)
    original = getattr(type(self).forward, "__wrapped__", None)
    if original is None:  # pragma: no cover - the decorator always sets it
        raise RuntimeError(f"{type(self).__name__}.forward has no original eager implementation")
    return original(self, *args, **kwargs)


def _install() -> None:
    if _STATE.installed:
        return
    _STATE.installed = True
    try:
        from transformers.integrations import moe as hf_moe
    except Exception:  # transformers absent: nothing to make traceable
        return
    fns = getattr(hf_moe, "ALL_EXPERTS_FUNCTIONS", None)
    if fns is None or not hasattr(hf_moe, "grouped_mm_experts_forward"):
        return
    try:  # the dispatcher needs the decorator to keep the original forward as __wrapped__
        class _Probe(nn.Module):
            def forward(self, hidden_states, top_k_index, top_k_weights):
                return hidden_states

        probe = hf_moe.use_experts_implementation(_Probe)
        if getattr(probe.forward, "__wrapped__", None) is None:
            return
    except Exception:
        return
    try:
        if "eager" not in getattr(fns, "_local_mapping", {}):
            fns["eager"] = _eager_or_grouped
    except Exception:  # pragma: no cover - an interface we do not know
        pass


def _uninstall() -> None:
    """Give transformers' "eager" entry back, unless the compile backend needs it at its (later) trace time."""
    if not _STATE.installed or _STATE.predicate is not None or _STATE.active:
        return
    _STATE.installed = False
    try:
        from transformers.integrations import moe as hf_moe

        fns = hf_moe.ALL_EXPERTS_FUNCTIONS
        if fns._local_mapping.get("eager") is _eager_or_grouped:
            del fns._local_mapping["eager"]
    except Exception:  # pragma: no cover - an interface we do not know
        pass


@contextlib.contextmanager
def traceable_experts():
    """While active, HF experts configured as ``eager`` trace as the (equivalent) ``grouped_mm`` path (transformers'
    "eager" entry is ours only meanwhile, or while the compile backend is registered)."""
    _install()
    _STATE.active += 1
    try:
        yield
    finally:
        _STATE.active -= 1
        _uninstall()


# ------------------------------------------------------------------------------------------------------- capture
class _Captured(Exception):
    pass


_ids = itertools.count()


def _fresh_entry():
    """``lambda mod, x, kw: mod(x, **kw)`` with a code object of its own (its own Dynamo cache, no recompile
    limit). ``kw``: further forward arguments (hash routing's token ids), usually empty."""

    def entry(mod, x, kw):
        return mod(x, **kw)

    code = entry.__code__.replace(co_name=f"moecomp_capture_{next(_ids)}")
    return types.FunctionType(code, entry.__globals__, code.co_name)


def _dynamo_name(prefix: str, path: str) -> str:
    """Dynamo's placeholder name for ``L['mod']._modules[a]._modules[b].attr`` (non-tensor attribute)."""
    parts = path.split(".")
    s = prefix + "".join(f"modules_{p}_" for p in parts[:-1]) + parts[-1]
    return s


@contextlib.contextmanager
def _real_values():
    """Trace with real values beside the fake ones: a branch on a data-dependent value (``if tok.numel():`` in a
    per-expert loop) takes the way the example input takes instead of breaking the graph. The graph is then the
    block's computation *for branches the example took*: the caller checks that every expert was reached."""
    import logging

    import torch._functorch.config as functorch_config
    import torch.fx.experimental._config as fx_config

    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    patches = [functorch_config.patch(fake_tensor_propagate_real_tensors=True),
               torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)]
    if hasattr(fx_config, "soft_pending_unbacked_not_found_error"):
        patches.append(fx_config.patch(soft_pending_unbacked_not_found_error=True))
    patches += _parameter_values_patch() + _unbacked_offset_patch()
    log.setLevel(logging.ERROR)  # one warning per data-dependent branch otherwise
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield
    finally:
        log.setLevel(level)


def _parameter_values_patch() -> list:
    """Real values for parameters too: the fake-tensor converter copies a real value only for plain tensors
    (``meta_utils._safe_copy`` skips ``nn.Parameter``), so the router weights would be uninitialised memory and the
    traced branches would follow garbage routing. Private API: without it, no patch (a trace that reaches too few
    experts is refused, never wrong)."""
    import unittest.mock

    try:
        import torch._subclasses.meta_utils as meta_utils
    except ImportError:
        return []
    orig = getattr(meta_utils, "_safe_copy", None)
    if orig is None:
        return []

    def copy_parameters_too(dst, src):
        return orig(dst, src.detach() if isinstance(src, nn.Parameter) else src)

    return [unittest.mock.patch.object(meta_utils, "_safe_copy", copy_parameters_too)]


def _unbacked_offset_patch() -> list:
    """Let a view at a data-dependent index trace with real values: ``w[int(idx.item())]`` (LongCat-Flash's loop
    over the experts hit) gives a select whose storage offset is a fresh unbacked symbol, and the fake-vs-real
    cross check compares that offset before the symbol's real value is recorded (torch 2.13 records it after), so
    Dynamo gives up on a guard it could answer. This skips that one comparison while the offset is unhinted; sizes
    and strides are still compared. Private API: without it, no patch (such blocks then fail to capture, never
    trace wrong)."""
    import unittest.mock

    try:
        import torch._subclasses.fake_utils as fake_utils
    except ImportError:
        return []
    orig = getattr(fake_utils, "_check_fake_real_tensors", None)
    if orig is None:
        return []

    def check(real_out, fake_out, *args, **kwargs):
        off = fake_out.storage_offset()
        if isinstance(off, torch.SymInt) and not off.node.has_hint() and not args:
            torch._prims.utils.compare_tensor_meta(real_out, fake_out, check_sizes=kwargs.get("sizes", True),
                                                   check_strides=kwargs.get("strides", False), allow_rhs_unbacked=True)
            return None
        return orig(real_out, fake_out, *args, **kwargs)

    return [unittest.mock.patch.object(fake_utils, "_check_fake_real_tensors", check)]


def capture_block(module: nn.Module, example_input: torch.Tensor, *, dynamic: bool = True,
                  real_values: bool = False, call_args: dict | None = None) -> CapturedBlock:
    """Dynamo's torch-level graph of ``module(example_input)``, with placeholders mapped to module paths.

    ``real_values``: trace with real values propagated (:func:`_real_values`): data-dependent branches follow the
    example input. For per-expert loops that skip experts without tokens.
    ``call_args``: further forward arguments by name (``module(example_input, **call_args)``), e.g. token ids for a
    hash-routed block; their placeholders map to ``match.forward_arg(name)``."""
    call_args = dict(call_args or {})
    box: dict = {}

    def backend(gm, example_inputs):
        if "gm" in box:
            raise RuntimeError("block traced into more than one graph")
        # which placeholders are call arguments (Dynamo drops its record of sources once this returns)
        _fx.record_input_roles(gm)
        box["gm"], box["inputs"] = gm, list(example_inputs)

        def never(*args):
            raise _Captured()

        return never

    entry = _fresh_entry()
    compiled = torch.compile(entry, backend=backend, fullgraph=True, dynamic=dynamic)
    try:
        # FP8 modules trace as their plain-PyTorch forwards (formats/fp8.py: transformers' need the hub's kernel)
        with traceable_experts(), plain_fp8(module), torch.no_grad(), (
                _real_values() if real_values else contextlib.nullcontext()):
            compiled(module, example_input, call_args)
    except _Captured:
        pass
    except Exception as e:  # Dynamo raises many types (Unsupported, UserError, ...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DetectError(f"Dynamo could not capture the block: {type(e).__name__}: {msg[:300]}{_root(e)}",
                          "capture") from e
    finally:
        del compiled
    if "gm" not in box:
        raise DetectError("Dynamo produced no graph for the block", "capture")
    gm, inputs = box["gm"], box["inputs"]
    box.clear()  # Dynamo's cache keeps the backend (and so ``box``) alive: it must not keep the block's tensors too
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    by_id: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    for name, b in module.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), name)
    scalar_names: dict[str, str] = {}
    for mname, sub in module.named_modules():
        for attr, v in vars(sub).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not attr.startswith("_"):
                path = f"{mname}.{attr}" if mname else attr
                scalar_names[_dynamo_name("", path).lower()] = path

    paths: dict[str, str | None] = {}
    for n, v in zip(placeholders, inputs):
        given = [k for k, t in call_args.items() if v is t]
        if v is example_input:
            paths[n.name] = "<input>"
        elif given:
            paths[n.name] = forward_arg(given[0])
        elif isinstance(v, torch.Tensor) and id(v) in by_id:
            paths[n.name] = by_id[id(v)]
        elif isinstance(v, torch.Tensor) and v.dim() == 0:
            key = n.name.lower()
            hit = None
            for enc, path in scalar_names.items():
                if key.endswith("_" + enc) or key == enc:
                    if hit is None or len(enc) > len(hit[0]):
                        hit = (enc, path)
            paths[n.name] = hit[1] if hit else None
        else:
            paths[n.name] = None
    return CapturedBlock(gm=gm, example_inputs=inputs, paths=paths)


def _block_paths(cap: CapturedBlock, m) -> tuple[dict, list[Derived]]:
    """The match's placeholder bindings as block-relative paths; per-expert pieces (``m.stacked``) become a
    ``Derived`` stacked tensor, bound by its name."""
    def path_of(k, ph):
        path = cap.paths.get(ph)
        if k == "token_ids" and arg_name(path) is not None:  # hash routing's token ids: a forward argument
            return path
        if path is None or path == "<input>" or arg_name(path) is not None:
            raise DetectError(f"{k} reads {ph}, which is not a parameter or buffer of the block", "detect")
        return path

    bindings: dict[str, str | None] = {}
    derived: list[Derived] = []
    for k in OP_ARGS:
        ph = m.bindings.get(k)
        groups = getattr(m, "stacked", {}).get(k)
        rows = getattr(m, "arg_rows", {}).get(k)
        view = getattr(m, "arg_views", {}).get(k)
        if groups:  # per expert, the pieces of its slice: built as one [E, ...] tensor
            derived.append(Derived(f"_moecomp_{k}", [[path_of(k, p) for p in g] for g in groups]))
            bindings[k] = derived[-1].name
        elif rows is not None and ph is not None:  # the first rows of the tensor (zero experts): a view, no copy
            derived.append(Derived(f"_moecomp_{k}", [[path_of(k, ph)]], kind="rows", rows=rows, inline=True))
            bindings[k] = derived[-1].name
        elif view is not None and ph is not None:  # experts held flat (or stored transposed): a view, no copy
            derived.append(Derived(f"_moecomp_{k}", [[path_of(k, ph)]], kind="view", shape=tuple(view.shape),
                                   perm=tuple(view.perm), inline=True))
            bindings[k] = derived[-1].name
        else:
            bindings[k] = None if ph is None else path_of(k, ph)
    for k in OP_ARGS[len(MOE_ARGS):]:  # scale arguments: named only when the block has quantized weights
        if bindings[k] is None:
            del bindings[k]
    return bindings, derived


def _output_position(cap: CapturedBlock, m) -> tuple[int, int, tuple]:
    """(graph output index of the MoE result, number of outputs, tail ops) of the match; the tail is empty when the
    block returns the MoE result itself."""
    out_node = next(n for n in cap.gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    idx = [i for i, o in enumerate(outs) if o is m.output]
    if len(idx) == 1:
        return idx[0], len(outs), ()
    idx = [i for i, o in enumerate(outs) if o is m.block_output] if not m.output_is_final else []
    if len(idx) != 1:
        raise DetectError("the block post-processes the MoE result before returning it", "detect")
    return idx[0], len(outs), tuple(_fx.op_name(n) or n.op for n in cap.gm.graph.nodes
                                    if n in m.tail and not _adds_zero(cap, n))


def _adds_zero(cap: CapturedBlock, node) -> bool:
    """``node`` adds (or subtracts) a block tensor that ``epilogue.Peeled`` zeroed for this capture (an output bias
    bound after the op): an identity here. Only such tensors: an add of a tensor that merely happens to be zero now
    stays a tail (binding without it would go wrong once it is not)."""
    name = _fx.op_name(node)
    if name not in ("add", "sub", "add_", "sub_") or len(node.args) != 2:
        return False
    inputs = dict(zip((n for n in cap.gm.graph.nodes if n.op == "placeholder"), cap.example_inputs))
    operands = node.args[1:] if name.startswith("sub") else node.args
    for ph in operands:
        t = inputs.get(ph) if isinstance(ph, fx.Node) else None
        other = node.args[0] if ph is node.args[1] else node.args[1]
        if (isinstance(t, torch.Tensor) and getattr(t, PEELED, False) and cap.paths.get(ph.name) not in (None, "<input>")
                and not bool(t.count_nonzero()) and _shape(other) is not None and _shape(other) == _shape(node)):
            return True  # (the sum has the other operand's shape: the zeros only broadcast into it)
    return False


def _shape(node):
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _root(e: BaseException) -> str:
    """" (from <type>: <first line>)" of the innermost cause Dynamo chained to ``e`` (an "Observed exception" is
    the block's own error as Dynamo saw it: a KeyError from a ModuleDict key built from a tensor, say); "" if none."""
    c, seen = e.__cause__ or e.__context__, 0
    last = None
    while c is not None and seen < 16:
        last, c, seen = c, c.__cause__ or c.__context__, seen + 1
    if last is None:
        return ""
    text = str(last).strip().splitlines()[0][:160] if str(last).strip() else ""
    return f" (from {type(last).__name__}{': ' + text if text else ''})"


def detect_block(module: nn.Module, example_input: torch.Tensor, *, verify: bool = True,
                 allow_tail: bool = False, real_values: bool = False, call_args: dict | None = None) -> BlockMatch:
    """MoESpec + module-relative bindings of one block, or ``DetectError`` (see the module docstring).

    A block that applies a tail to the MoE result before returning it (a post-MoE norm) raises unless
    ``allow_tail``; the error carries the match as ``e.match`` (``output_is_graph_output`` False, ``tail_ops``).
    A tail of views only (ERNIE-4.5-VL returns ``result.flatten()``) is returned like ``allow_tail`` (check
    ``output_is_graph_output``): the block's output is the op's, reshaped.
    ``real_values``: trace with real values (``capture_block``), for per-expert loops that branch on the routing.
    ``call_args``: further forward arguments (``capture_block``): a hash-routed block's token ids, bound as
    ``token_ids`` -> ``match.forward_arg(name)``."""
    from .fx.detect_moe import detect_moe

    cap = capture_block(module, example_input, real_values=real_values, call_args=call_args)
    res = detect_moe(cap.gm, cap.example_inputs, verify=verify)
    if not res.matches and res.failures:  # not a refusal: the check raised (the caller reports it as such)
        raise res.failures[0][1]
    if not res.matches:
        why = "; ".join(f"{w}: {r}" for w, r in res.rejected) or "no top-k routing over stacked expert weights"
        raise DetectError(f"no MoE recognised: {why}", "detect", res.rejected)
    if len(res.matches) > 1:
        raise DetectError(f"{len(res.matches)} MoE computations in one block", "detect", res.rejected)
    m = res.matches[0]
    x_base = m.x  # the block input itself, or views of it (anything computed from it is not the MoE's input)
    while x_base.op != "placeholder" and _fx.op_name(x_base) in _fx.VIEW_OPS:
        x_base = _fx.arg(x_base, 0)
    if x_base.op != "placeholder" or cap.paths.get(x_base.name) != "<input>":
        raise DetectError("the MoE does not read the block input directly", "detect")
    index, n_out, tail_ops = _output_position(cap, m)
    bindings, derived = _block_paths(cap, m)
    bm = BlockMatch(
        spec=m.spec, bindings=bindings, constants={f: cap.paths.get(ph) or ph for f, ph in m.baked.items()},
        output_index=index, num_outputs=n_out, verified=m.verified, captured=cap, output_node=m.output.name,
        output_is_graph_output=not tail_ops, tail_ops=tail_ops, derived=derived, notes=list(m.notes),
    )
    if tail_ops and not allow_tail and not all(op in _fx.VIEW_OPS for op in tail_ops):
        err = DetectError("the block post-processes the MoE result before returning it (" +
                          ", ".join(tail_ops)[:200] + ")", "detect", res.rejected)
        err.match = bm
        raise err
    return bm
