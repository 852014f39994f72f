"""Per-shape CUDA graphs for the ops in eager mode: one replay instead of ~8 kernel launches and their host work.

At decode sizes an MoE block runs for tens of microseconds on the GPU while the host spends hundreds launching it;
plain HF `generate()` (no torch.compile, no CUDA graphs of its own) is host-bound. So the CUDA implementations of
``moe_forward`` / ``moe_experts`` go through ``run``:

    key = (op, spec, shapes and dtypes of the per-call tensors, identity of every weight tensor)
    (per-call tensors: x, moe_experts' ids and weights, hash routing's token ids; the hash table is a weight)
    1st call of a key  -> plain launches (warm-up: Triton compiles, derived weights such as the FSE concat are built)
    2nd call           -> capture a CUDA graph over static copies of the per-call tensors, then replay it
    later calls        -> copy inputs into the static buffers, replay, return a copy of the static output

Weights are keyed by identity (object id, data pointer and version counter, checked through weak references), so a
weight that is replaced, moved or updated in place gets a new graph instead of a stale one. All graphs share one
memory pool: they replay one at a time on the caller's stream, so their scratch may overlap.

Memory: per cached shape, a static input and output ([T, H] each) outside the pool, plus the shared pool (about the
largest graph's scratch). Outputs are copied out right after each replay, which is what makes sharing the pool safe
while graphs replay one after another; replays of these graphs from several streams at once are not supported.

Used only for calls from plain eager code: the bound HF blocks and experts modules (``call_moe_forward`` /
``call_moe_experts``), after they checked ``moe_op.plain_eager`` (no tracing, no Python dispatch or function mode,
no tensor subclass, nothing for autograd to record). A call that comes through the dispatcher (compiled code,
``torch.ops.moecomp.*`` called directly) runs plain launches: compiled code may run inside Inductor's CUDA-graph
trees, whose warm-up and recording allocate from the tree's own pool, and a static input or graph kept by this cache
there is a tensor the tree does not track ("tensors in the cudagraph pool not tracked as outputs"). Also plain:
tokens > MOECOMP_OP_GRAPHS_MAX_T (default 256; 0 turns graphs off), a CUDA graph capture already running (the
whole-step graphs of moecomp's generate(), or the user's own), or a key whose capture failed before. A failed
capture can leave CUDA state (the RNG's capture flag) behind, so these checks keep captures to the plain case where
they work.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch

MAX_GRAPHS = 2048  # LRU bound on cached graphs (memory is shared through one pool)
MAX_SEEN = 4096  # LRU bound on keys seen once (not captured yet)
_entries: OrderedDict = OrderedDict()  # key -> _Entry with a graph (or a failed capture)
_seen: OrderedDict = OrderedDict()  # key -> _Entry seen once
_pools: dict = {}  # device index -> memory pool handle shared by that device's graphs
stats = {"plain": 0, "captured": 0, "replayed": 0, "capture_failed": 0}
last_error: str | None = None  # why the last capture failed


def max_tokens() -> int:
    return int(os.environ.get("MOECOMP_OP_GRAPHS_MAX_T", "256"))


class _Entry:
    __slots__ = ("refs", "graph", "inputs", "output", "outs", "failed")

    def __init__(self, static):
        self.refs = tuple(None if t is None else weakref.ref(t) for t in static)
        self.graph = self.inputs = self.output = self.outs = None
        self.failed = False

    def alive(self, static) -> bool:
        return all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(self.refs, static))


def _usable(x: torch.Tensor, eager: bool) -> bool:
    """``eager``: the caller is plain eager code and checked ``moe_op.plain_eager`` (see the module docstring)."""
    limit = max_tokens()
    return (
        eager
        and limit > 0
        and x.is_cuda
        and x.dim() >= 1
        and 0 < x.numel() // max(1, x.shape[-1]) <= limit
        and not torch.cuda.is_current_stream_capturing()
    )


def _pool_handle(device_index):
    """The shared memory pool for the next capture on this device. The caching allocator frees a private pool with
    its last graph, and capturing into a freed pool's handle fails inside the allocator (after the CUDA RNG has
    already been put in capture mode), so a pool is reused only while one of this device's graphs still holds it."""
    pool = _pools.get(device_index)
    if pool is None or not any(e.graph is not None and k[2] == device_index for k, e in _entries.items()):
        pool = _pools[device_index] = torch.cuda.graph_pool_handle()
    return pool


def _capture(fn, inputs, pool):
    """(graph, output) for fn(*inputs) captured into ``pool``."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn(*inputs)
    return g, out


def run(name: str, fn, dynamic: tuple, static: tuple, spec_key: str, eager: bool = False,
        outs: tuple = ()) -> torch.Tensor:
    """fn(*dynamic, *outs) (weights bound inside fn), through a cached CUDA graph when that is safe and pays.
    ``eager``: the caller is plain eager code and checked ``moe_op.plain_eager`` on these tensors; other calls
    always run plain launches. ``outs``: caller-owned tensors fn writes (the routing record, ``ops/routes.py``): a
    graph writes static copies, copied into them after each replay."""
    global last_error
    x = dynamic[0]
    if not _usable(x, eager):
        stats["plain"] += 1
        return fn(*dynamic, *outs)
    key = (
        name,
        spec_key,
        x.device.index,
        tuple((tuple(t.shape), t.dtype) for t in dynamic + outs),
        tuple(None if t is None else (id(t), t.data_ptr(), t._version, t.dtype) for t in static),
    )
    e = _entries.get(key)
    if e is not None and e.alive(static):
        _entries.move_to_end(key)
    else:
        # First sight of a key is tracked apart from the graphs: keys that never repeat (a weight built afresh on
        # every call, e.g. a concatenation inside a compiled graph) then cycle through _seen and never push
        # captured graphs out of _entries.
        first = _seen.pop(key, None)
        if first is None or not first.alive(static):
            _seen[key] = _Entry(static)
            while len(_seen) > MAX_SEEN:
                _seen.popitem(last=False)
            stats["plain"] += 1
            return fn(*dynamic, *outs)
        e = _entries[key] = first
        while len(_entries) > MAX_GRAPHS:
            _entries.popitem(last=False)
    if e.failed:
        stats["plain"] += 1
        return fn(*dynamic, *outs)
    if e.graph is None:
        inputs = tuple(t.clone() for t in dynamic)
        static_outs = tuple(torch.empty_like(t) for t in outs)
        try:
            e.graph, e.output = _capture(fn, inputs + static_outs, _pool_handle(x.device.index))
            e.inputs, e.outs = inputs, static_outs
            stats["captured"] += 1
        except Exception as err:  # capture not possible here (e.g. an op that is not capturable): plain from now on
            last_error = f"{type(err).__name__}: {err}"
            e.failed, e.graph = True, None
            stats["capture_failed"] += 1
            return fn(*dynamic, *outs)
    else:
        for s, d in zip(e.inputs, dynamic):
            s.copy_(d)
        stats["replayed"] += 1
    e.graph.replay()  # (right after a capture, which computes nothing, the static inputs hold this call's data)
    for d, s in zip(outs, e.outs):
        d.copy_(s)
    return e.output.clone()


def clear() -> None:
    """Drop every cached graph (their memory returns to the pool once nothing references it)."""
    _entries.clear()
    _seen.clear()
    for k in stats:
        stats[k] = 0
