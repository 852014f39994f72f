"""The ``moecomp`` torch.compile backend: MoE blocks -> ``torch.ops.moecomp.moe_forward``, the rest -> Inductor.

    model = torch.compile(model, backend="moecomp")                            # static shapes (default)
    model = torch.compile(model, backend="moecomp", mode="reduce-overhead")    # Inductor mode options
    model = torch.compile(model, backend="moecomp", dynamic=True)              # one graph for every token count

Registration: torch finds the name through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), which
imports this module on the first lookup of "moecomp" (``import moecomp`` does not import Dynamo); importing this
module registers it too (a source checkout without the installed entry point).

Static and dynamic shapes are handled alike: the passes tell weights from the call's inputs by where Dynamo says
each graph input came from (see ``recognise/fx/graph.is_call_input``), not by whether its shape is static.

For every graph Dynamo hands it, the backend runs

1. ``fx.detect_moe.detect_moe(gm, example_inputs)``: find and prove each MoE block (see that module),
2. ``fx.rewrite_moe.rewrite_moe(gm, matches)``: one ``moe_forward`` per block (shared expert folded in),
3. ``fx.fse.fuse_shared_gate(gm)``: router + shared-gate GEMM fusion, when the op supports it,

and hands the result to ``torch._inductor.compile_fx.compile_fx`` (``mode=`` / ``options=`` of torch.compile are
honoured as for the inductor backend; torch.compile refuses ``mode=`` together with ``options=``, so with a mode
set the inner compiler comes from ``config.inner``). Counts land in ``moecomp.counters``; the last graphs' match
descriptions and rejection reasons in ``moecomp.api.backend.last_results``.

Caching: the passes' identity is part of Inductor's cache key. The backend installs a post-grad custom pass
(``torch._inductor.config.post_grad_custom_post_pass``, chaining any pass the user set) whose ``uuid()`` hashes the
source files of the passes, so a changed pass never reuses a stale compiled graph.

Autograd: ``moe_forward`` has no backward. When grad mode is on and a block's weights or its input (hidden states
that require grad, e.g. ``inputs_embeds`` for input attribution with frozen weights) require grad, the block is left
alone (counted as ``counters["backend"]["skipped_autograd"]``); run inference under ``torch.no_grad()`` /
``torch.inference_mode()``. Weights are graph inputs here (never copied), so weight changes after compiling are
what Dynamo's guards and the graph inputs make of them, as for any compiled model.

HF ``eager`` experts: transformers' eager experts loop cannot be traced into one graph. While Dynamo traces for this
backend, HF experts configured as ``eager`` trace as transformers' equivalent ``grouped_mm`` path instead
(``moecomp.recognise.capture.traceable_experts``), so those blocks are matched too; other backends and eager runs are
unaffected.

FP8 models (transformers' ``FP8Experts`` / ``FP8Linear``, whose own forwards need the hub's kernel): once
transformers' FP8 integration is imported, every entry of its ``FP8ExpertsInterface`` (and "eager") and
``FP8Linear.forward`` trace as moecomp's plain-PyTorch FP8 forwards while Dynamo traces for this backend
(``moecomp.formats.fp8.install_trace_forwards``; transformers' own path otherwise). The blocks then become
``moe_forward`` with their scales (``recognise/fx/moe_quant.py``), the other FP8 linears ``moecomp.fp8_linear``
(``recognise/fx/fp8_linear.py``; ``counters["fp8_linear"]["replaced"]``).
"""

from __future__ import annotations

import functools
import glob
import os

import torch

from ..recognise import capture as _capture
from ..hf import experts_interface as _experts_interface
from ..core.counters import counters
from ..recognise.fx.detect_moe import detect_moe
from ..recognise.fx.fp8_linear import rewrite_fp8_linears
from ..recognise.fx.fse import fuse_shared_gate
from ..recognise.fx.rewrite_moe import rewrite_moe
from ..core.reject import Reject, RejectCode

BACKEND_NAME = "moecomp"
last_results: list[dict] = []  # newest last; at most _KEEP entries
_KEEP = 16

# every file whose code decides what the pass rewrites: the pass package whole, and the modules it runs through
_PASS_PACKAGE = "moecomp.recognise.fx"
_PASS_MODULES = ("moecomp.api.backend", "moecomp.recognise.capture", "moecomp.core.spec", "moecomp.core.policy",
                 "moecomp.core.reject", "moecomp.formats.fp8")


def _pass_files() -> tuple:
    import importlib.util

    pkg = os.path.dirname(importlib.util.find_spec(_PASS_PACKAGE).origin)
    return tuple(sorted(glob.glob(os.path.join(pkg, "*.py")))) + tuple(
        importlib.util.find_spec(m).origin for m in _PASS_MODULES)


_PASS_FILES = _pass_files()


@functools.lru_cache(maxsize=1)
def passes_hash() -> str:
    """A hash of the passes' source files (the identity Inductor's cache key sees)."""
    import hashlib

    h = hashlib.sha256()
    for f in _PASS_FILES:
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _post_grad_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class MoecompPostGradPass(CustomGraphPass):
        """Carries the passes' hash into Inductor's cache key; runs the user's own post-grad pass, if any."""

        def __init__(self, inner=None):
            self.inner = inner

        def __call__(self, graph):
            if self.inner is not None:
                self.inner(graph)

        def uuid(self):
            inner = None
            if self.inner is not None:
                inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
                if inner is None:
                    return None  # the user's pass opts out of caching: so do we
            return ("moecomp", passes_hash(), inner)

    return MoecompPostGradPass


def _config_patches(mode: str | None, options: dict | None) -> dict:
    import torch._inductor.config as iconfig

    patches: dict = {}
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    if options:
        patches.update(options)
    inner = patches.get("post_grad_custom_post_pass", iconfig.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = _post_grad_pass_class()(inner)
    return patches


def _needs_grad(gm, example_inputs, match) -> bool:
    if not torch.is_grad_enabled():
        return False
    from ..recognise.fx.graph import meta_val

    x = meta_val(match.x)
    if isinstance(x, torch.Tensor) and x.requires_grad:  # the block's input (activations) needs a gradient
        return True
    names = {v for v in match.bindings.values() if v is not None}
    for n, v in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        if n.name in names and isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    return False


def run_passes(gm: torch.fx.GraphModule, example_inputs, *, verify: bool = True, count: bool = True):
    """detect + rewrite + FSE on ``gm`` in place; returns the DetectResult (usable without compiling).

    Matches the backend itself leaves alone (grad mode; experts kept as per-expert modules, whose weights the op would
    need stacked on every call) are added to ``res.rejected`` as ``(where, Reject)`` like the pass's own rejections,
    and to ``res.rejects`` (the backend's own only: what ``_count`` reads).

    ``count=False`` leaves ``moecomp.counters`` alone (the backend counts once the inner compiler succeeded: Dynamo
    retraces a frame when AOTAutograd asks it to, e.g. to specialise float scalars, and the first attempt's matches
    never run)."""
    res = detect_moe(gm, example_inputs, verify=verify)
    keep, rejects = [], []
    for m in res.matches:
        if getattr(m, "stacked", None):
            r = Reject(RejectCode.UNSUPPORTED_STRUCTURE, "experts are per-expert modules: moe_forward would need their "
                                                         "weights stacked on every call (moecomp.optimize binds such "
                                                         "blocks)")
        elif _needs_grad(gm, example_inputs, m):
            r = Reject(RejectCode.GRAD_MODE, "grad mode is on and the weights or the input require grad (moe_forward "
                                             "has no backward)")
        else:
            keep.append(m)
            continue
        rejects.append((m.where, r))
        res.rejected.append((m.where, r))
    res.matches = keep
    res.rejects = rejects
    res.replaced = rewrite_moe(gm, res.matches)
    res.fp8_linears = rewrite_fp8_linears(gm)  # FP8 linears outside the blocks -> moecomp.fp8_linear
    res.fused = fuse_shared_gate(gm, count=False)
    if count:
        _count(gm, res)
    return res


def _count(gm, res) -> None:
    counters["detect_moe"]["matched"] += len(res.matches)
    counters["detect_moe"]["rejected"] += len(res.rejected)
    counters["rewrite_moe"]["replaced"] += res.replaced
    if getattr(res, "fp8_linears", 0):
        counters["fp8_linear"]["replaced"] += res.fp8_linears
    skipped = sum(1 for _, r in getattr(res, "rejects", ()) if r.code is RejectCode.GRAD_MODE)
    if skipped:
        counters["backend"]["skipped_autograd"] += skipped
    for k, v in res.fused.items():
        counters["fse"][k] += v
    last_results.append(
        {
            "matches": [m.describe() for m in res.matches],
            "rejected": list(res.rejected),
            "code": gm.code,
        }
    )
    del last_results[:-_KEEP]


class config:
    """Backend settings. ``inner``: what compiles the rewritten graph: "inductor" (default), "aot_eager" or "eager"
    (no codegen: quick, for tests and debugging). Per call: ``torch.compile(..., options={"moecomp.inner": ...})``."""

    inner = "inductor"
    verify = True  # run detect_moe's numeric check


def moecomp_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The registered backend (``torch.compile(..., backend="moecomp")``)."""
    options = dict(kwargs.get("options") or {})
    inner = options.pop("moecomp.inner", config.inner)
    verify = options.pop("moecomp.verify", config.verify)
    res = run_passes(gm, example_inputs, verify=verify, count=False)
    if inner == "eager":
        compiled = gm.forward
    elif inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        compiled = aot_eager(gm, example_inputs)
    elif inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=_config_patches(kwargs.get("mode"), options))
    else:
        raise ValueError(f"moecomp backend: unknown inner compiler {inner!r}")
    counters["backend"]["graphs"] += 1
    _count(gm, res)
    return compiled


# ------------------------------------------------------------------------------------- HF eager experts, traced
def _is_moecomp_backend(fn, depth: int = 0) -> bool:
    if fn is None or depth > 6:
        return False
    if fn is moecomp_backend:
        return True
    for attr in ("_torchdynamo_orig_backend", "compiler_fn", "func", "__wrapped__"):
        inner = getattr(fn, attr, None)
        if inner is not None and inner is not fn and _is_moecomp_backend(inner, depth + 1):
            return True
    return False


@torch._dynamo.assume_constant_result
def tracing_for_moecomp() -> bool:
    """True while Dynamo traces a frame for this backend (evaluated once at trace time, a constant in the graph)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return _is_moecomp_backend(getattr(getattr(tx, "output", None), "compiler_fn", None))
    except Exception:
        return False


_capture.register_trace_predicate(tracing_for_moecomp)


def _fp8_trace_forwards() -> None:
    from ..formats import fp8

    fp8.install_trace_forwards(tracing_for_moecomp)


_experts_interface.on_fp8_import(_fp8_trace_forwards)  # FP8Experts / FP8Linear trace as plain PyTorch for us


def _register() -> None:
    """Register the backend under "moecomp", unless torch is loading it through the entry point right now."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    current = _COMPILER_FNS.get(BACKEND_NAME)
    if current is moecomp_backend:
        return
    if current is None and _BACKENDS.get(BACKEND_NAME) is not None:
        # the entry point is known to torch: ``lookup_backend`` registers what ``EntryPoint.load()`` returns (this
        # function) right after this import, and registering it here first would be a duplicate name there
        return
    if current is not None:
        del _COMPILER_FNS[BACKEND_NAME]  # a reload of this module: replace the stale function
    register_backend(compiler_fn=moecomp_backend, name=BACKEND_NAME)


_register()
