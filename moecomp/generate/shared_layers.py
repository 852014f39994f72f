"""One compiled decoder layer for every layer of the same shape, in the engine's compiled steps (warm-up).

torch.compile of each decoder layer module apart traces and compiles every layer again (24 layers: 24 Dynamo
frames per phase and batch class), because two things differ between layers in what Dynamo guards on:

    the cache      transformers' attention calls ``cache.update(k, v, self.layer_idx, ...)``, which indexes a Python
                   list of cache layers by that int: a constant per layer in the trace
    moecomp's forwards  a bound block's instance-level ``forward`` (``BoundForward``, ``ExpertsForward``,
                   ``LinearForward``) is a distinct object per module, guarded by identity

So the engine compiles one function per phase, ``run(layer, *args, **kwargs) = layer(*args, **kwargs)``, and calls
it for every layer with (``SharedLayer``):

    the cache argument replaced by ``LayerCache``, a view of that layer's own cache layer whose ``update`` ignores the
        index it is given (the view's tensors are graph inputs; every layer's view has the same type and shapes)
    moecomp's instance forwards swapped for bound methods of the same functions while the call runs
        (``method_forwards``): Dynamo guards a bound method by its function, shared by every module

Layers that differ in structure (a dense layer among MoE ones, another attention kind) still get entries of their
own; a model whose layers take the cache under another name than the model does, or use other cache methods inside
the layer, keeps working (the view forwards every other attribute to the real cache), only with less sharing.
Each engine compiles its own copy of ``run`` (a new code object), so Dynamo's per-function entry limits count one
model's entries only.
"""

from __future__ import annotations

import contextlib
import types

import torch


def _run(layer, *args, **kwargs):
    return layer(*args, **kwargs)


def later_passes() -> list:
    """The decode-graph passes run after ``fuse_norm``, in order: modules of ``generate/`` with ``enabled()`` (their
    switch) and ``make_pass()`` (a callable taking the ``GraphModule``, changing it in place)."""
    from . import fuse_oproj, fuse_qkrope  # q / k norms, rotary, KV writes; o_proj + add + post-attention norm

    return [fuse_qkrope, fuse_oproj]


def compiled_run(phase: str, backend: str, dynamic):
    """A fresh copy of ``_run`` (its own code object: its own Dynamo cache), compiled. The decode phase's graphs go
    through ``fuse_linears.FusingBackend`` first (sibling skinny linears in one launch with ``MOECOMP_FUSE_LINEARS=1``,
    RMSNorms folded into the linears they feed: ``fuse_norm``, on by default at decode rows <= 2 on CUDA; the others
    opt-in until measured), then the passes of ``later_passes()`` that are enabled, in order; kept as the compiled function's ``fusing``
    attribute."""
    from . import fuse_linears, fuse_norm

    code = _run.__code__.replace(co_name=f"moecomp_{phase}_layer")
    fn = types.FunctionType(code, _run.__globals__, f"moecomp_{phase}_layer")
    linears, norms = fuse_linears.enabled(), fuse_norm.enabled()
    after = [m.make_pass() for m in later_passes() if m.enabled()] if phase == "decode" else []
    fusing = None
    if phase == "decode" and (linears or norms or after):
        norm_pass = fuse_norm.NormPass(auto=fuse_norm.mode() == "auto") if norms else None
        fusing = fuse_linears.FusingBackend(backend, linears=linears, then=norm_pass, after=after)
    compiled = torch.compile(fn, dynamic=dynamic, backend=fusing or backend)
    compiled.fusing = fusing
    return compiled


class LayerCache:
    """One layer's view of a transformers cache: ``update(k, v, layer_idx, ...)`` updates this layer's cache layer
    whatever index it is given; anything else goes to the whole cache."""

    def __init__(self, cache, index: int):
        self.layer = cache.layers[index]
        self.cache = cache

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["cache"], name)


class SharedLayer(torch.nn.Module):
    """Stands in for decoder layer ``index`` during a compiled call: the shared compiled ``run`` on the real layer,
    with the cache argument (``cache_kw``) replaced by that layer's ``LayerCache``."""

    def __init__(self, run, layer: torch.nn.Module, index: int, cache_kw: str):
        super().__init__()
        self.__dict__["layer"] = layer  # not a child module: the model's module tree stays as it is
        self.run, self.index, self.cache_kw = run, index, cache_kw

    def forward(self, *args, **kwargs):
        cache = kwargs.get(self.cache_kw)
        if cache is not None and hasattr(cache, "layers") and len(cache.layers) > self.index:
            kwargs[self.cache_kw] = LayerCache(cache, self.index)
        return self.run(self.__dict__["layer"], *args, **kwargs)


def _linear_method(self, x, *args, **kwargs):
    from ..formats.fp8 import fp8_linear_forward

    return fp8_linear_forward(self, x)


def _method_of(f):
    """The function(self, ...) behind one of moecomp's instance-level forwards, None for any other forward."""
    from ..bind.bind import BoundForward, moecomp_block_forward
    from ..bind.bind_experts import ExpertsForward, experts_block_forward
    from ..formats.fp8 import LinearForward

    if isinstance(f, BoundForward):
        return moecomp_block_forward
    if isinstance(f, ExpertsForward):
        return experts_block_forward
    if isinstance(f, LinearForward):
        return _linear_method
    return None


@contextlib.contextmanager
def method_forwards(layers, skinny: bool = False):
    """While active, moecomp's instance-level forwards under ``layers`` are bound methods of their functions (put
    back on exit, also after an error). ``skinny``: plain ``nn.Linear`` modules under them run
    ``ops.linear16.linear_forward`` too (the skinny kernel at one or two rows: the decode steps)."""
    from ..ops import linear16

    swapped = []
    skinny = skinny and linear16.enabled()
    try:
        for layer in layers:
            for m in layer.modules():
                f = m.__dict__.get("forward")
                fn = _method_of(f) if f is not None else None
                if fn is None and f is None and skinny and type(m) is torch.nn.Linear:
                    fn = linear16.linear_forward
                if fn is not None:
                    m.__dict__["forward"] = types.MethodType(fn, m)
                    swapped.append((m, f))
        yield
    finally:
        for m, f in reversed(swapped):
            if f is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = f
