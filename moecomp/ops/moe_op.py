"""The custom ops: ``torch.ops.moecomp.moe_forward`` (a whole MoE block) and ``torch.ops.moecomp.moe_experts``
(routed experts only, routing given), each opaque to Dynamo / Inductor through a fake implementation.

Dispatch: CUDA tensors run our Triton kernels (``ops/triton_moe.py``), through per-shape CUDA graphs in eager mode
at small token counts (``ops/graphs.py``). CPU tensors run a vectorised PyTorch path
(``ops/torch_moe.py``), or the same Triton kernels under ``TRITON_INTERPRET=1`` when ``MOECOMP_CPU_BACKEND=triton``
(how the tests exercise the kernels without a GPU).

Argument checks (``check_args``, ``check_routing``, ``check_ids_range``): every bad argument is a ``SpecError`` (a
ValueError) naming it and what was expected, on every entry point: the implementations, the eager entry points, and
the fake implementations, which are also the Meta-key kernels (a tensor on "meta" among real ones dispatches there).
moe_experts' expert ids are range-checked by reading them: always on CPU; on CUDA (a host sync, 60-250 us a call on
an H200) only outside CUDA-graph capture and compilation, not at all with ``MOECOMP_CHECK_IDS=0``, and not for HF
experts modules called by their own router (``call_moe_experts(..., ids_from_topk=True)``: top-k ids are in range).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _get_dispatch_mode

from ..spec import MoESpec, SpecError
from . import graphs, torch_moe
from .common import EXPERT_ARGS, FEATURES, MOE_ARGS, _backend, _on_device, split_fused_gate  # noqa: F401  (re-exported)

# Floating dtypes the kernels compute in (x / hidden_states). float64 only on the vectorised torch path (CPU, or
# MOECOMP_CUDA_BACKEND=torch), which computes the experts in fp32 and returns float64; the Triton GEMMs have no fp64.
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# GEMM operands of the routed and shared experts: tl.dot, grouped_mm and mm take both operands in one dtype, so these
# must have x's dtype. Every other tensor may be any floating dtype: the router GEMM converts router_w / router_b /
# shared_gate_w to its compute dtype (x's, or fp32 with router_fp32: an fp32 router over bf16 experts is the
# DeepSeek-V3 style), and the correction bias and the expert biases are read as fp32.
_SAME_DTYPE = frozenset({"w13", "w2", "shared_w1", "shared_w3", "shared_w2"})
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_X = "x (hidden_states)"
_expected: dict = {}  # (spec.key, with router) -> {argument name: shape}


def _expected_shapes(spec: MoESpec, routed: bool) -> dict:
    """{name: shape} of every tensor the spec uses (cached per spec: check_args runs on every eager call)."""
    key = (spec.key, routed)
    expect = _expected.get(key)
    if expect is not None:
        return expect
    E, H = spec.num_experts, spec.hidden_size
    expect = dict(spec.expert_weight_shapes())
    if routed:
        expect["router_w"] = (E + 1, H) if spec.fused_shared_gate else (E, H)
        if spec.has_router_bias:
            expect["router_b"] = (E,)
        if spec.has_correction_bias:
            expect["correction_bias"] = (E,)
        sh = spec.shared
        if sh is not None:
            Is = sh.intermediate_size
            if sh.gated and sh.layout == "concat":
                expect["shared_w1"] = (2 * Is, H)
            elif sh.gated:
                expect.update(shared_w1=(Is, H), shared_w3=(Is, H))
            else:
                expect["shared_w3"] = (Is, H)
            expect["shared_w2"] = (H, Is)
            if sh.gate == "sigmoid" and not spec.fused_shared_gate:
                expect["shared_gate_w"] = (1, H)
    if len(_expected) > 1024:
        _expected.clear()
    _expected[key] = expect
    return expect


def _differs(shape, want, symbolic: bool) -> bool:
    """shape != want. ``symbolic`` (fake tensors while tracing): dims that are SymInts are left to the run-time check
    (comparing them would add guards, or fail on unbacked sizes)."""
    if not symbolic:
        return tuple(shape) != tuple(want)
    if len(shape) != len(want):
        return True
    return any(type(a) is int and type(b) is int and a != b for a, b in zip(shape, want))


def check_args(x: torch.Tensor, tensors: dict, spec: MoESpec, symbolic: bool = False) -> None:
    """SpecError, naming the argument and what was expected, for tensors that do not fit the spec: presence, device
    (x's), shape, dtype. ``symbolic``: called by the fake implementations (see ``_differs``)."""
    H = spec.hidden_size
    if x.dim() == 0:
        raise SpecError(f"{_X} is 0-D; expected a tensor [..., hidden_size={H}]")
    if _differs(x.shape[-1:], (H,), symbolic):
        raise SpecError(f"{_X} has shape {tuple(x.shape)}: its last dim must be hidden_size={H}")
    dt, dev = x.dtype, x.device
    if dt not in _X_DTYPES and not (dt == torch.float64 and _backend(dev) == "torch"):
        allowed = "float32, float16 or bfloat16" + (" (float64 on the torch path only)" if dt == torch.float64 else "")
        raise SpecError(f"{_X} has dtype {dt}; expected {allowed}")
    expect = _expected_shapes(spec, "router_w" in tensors)
    for name, t in tensors.items():
        want = expect.get(name)
        if want is None:
            if t is not None:
                raise SpecError(f"{name} was given but the spec has no use for it; expected None ({spec.describe()})")
            continue
        if t is None:
            raise SpecError(f"{name} is required by the spec ({spec.describe()}) but was None; expected a tensor "
                            f"of shape {want}")
        if t.device != dev:
            raise SpecError(f"{name} is on {t.device}; expected {dev}, the device of {_X}")
        if _differs(t.shape, want, symbolic):
            raise SpecError(f"{name} has shape {tuple(t.shape)}, the spec needs {want}")
        if name in _SAME_DTYPE:
            if t.dtype != dt:
                raise SpecError(f"{name} has dtype {t.dtype}; expected {dt}, the dtype of {_X} (expert and "
                                f"shared-expert weights are GEMM operands of x)")
        elif not t.is_floating_point():
            raise SpecError(f"{name} has dtype {t.dtype}; expected a floating dtype")


def check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, spec: MoESpec,
                  symbolic: bool = False) -> None:
    """moe_experts' routing arguments: x [T, H], topk_ids (integer) and topk_weights (floating), both [T, k] with
    1 <= k <= num_experts, all on x's device. The ids' values: ``check_ids_range``."""
    E, H = spec.num_experts, spec.hidden_size
    if x.dim() != 2:
        raise SpecError(f"{_X} has shape {tuple(x.shape)}; moe_experts expects 2-D [T, hidden_size={H}] "
                        f"(flatten leading dims first)")
    T = x.shape[0]
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise SpecError(f"{name} is on {t.device}; expected {x.device}, the device of {_X}")
        if t.dim() != 2 or _differs(t.shape[:1], (T,), symbolic):
            raise SpecError(f"{name} has shape {tuple(t.shape)}; expected 2-D [T={T}, k] (T = tokens of {_X})")
    if topk_ids.dtype not in _ID_DTYPES:
        raise SpecError(f"topk_ids has dtype {topk_ids.dtype}; expected an integer dtype (int64 or int32)")
    if not topk_weights.is_floating_point():
        raise SpecError(f"topk_weights has dtype {topk_weights.dtype}; expected a floating dtype")
    if _differs(topk_weights.shape, topk_ids.shape, symbolic):
        raise SpecError(f"topk_weights has shape {tuple(topk_weights.shape)}; expected the shape of topk_ids "
                        f"{tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if type(k) is int and not 1 <= k <= E:
        raise SpecError(f"topk_ids has k={k} columns; expected 1 <= k <= num_experts={E}")


def _check_ids_wanted(topk_ids: torch.Tensor) -> bool:
    """CPU (and other synchronous devices): always. CUDA: reading the ids is a host sync, so only outside CUDA-graph
    capture and compilation, and not with MOECOMP_CHECK_IDS=0 (for callers that vouch for their ids)."""
    if not topk_ids.is_cuda:
        return True
    return (os.environ.get("MOECOMP_CHECK_IDS", "1") != "0" and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling())


def check_ids_range(topk_ids: torch.Tensor, spec: MoESpec) -> None:
    """SpecError unless every id is in [0, num_experts) (an id outside that range would index past the weights)."""
    if topk_ids.numel() == 0 or not _check_ids_wanted(topk_ids):
        return
    if topk_ids.is_cuda:  # one device-to-host read
        lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()
    else:
        lo, hi = torch.aminmax(topk_ids)
        lo, hi = lo.item(), hi.item()
    E = spec.num_experts
    if lo < 0 or hi >= E:
        raise SpecError(f"topk_ids holds ids in [{lo}, {hi}]; expected every id in [0, num_experts={E})")


def _impl(device: torch.device):
    if _backend(device) == "triton":
        # lazy: triton_moe imports Triton and the kernels, which ``import moecomp`` should not pay for; triton_moe
        # never imports this module (no cycle)
        from . import triton_moe as impl
    else:
        impl = torch_moe
    return impl


def _forward(x: torch.Tensor, args: dict, s: MoESpec, spec: str, eager: bool = False) -> torch.Tensor:
    """``eager``: the caller has already established ``plain_eager`` for these tensors."""
    impl = _impl(x.device)
    if x.is_cuda:  # per-shape CUDA graphs in eager mode (ops/graphs.py)
        return _on_device(x, lambda: graphs.run(
            "moe_forward", lambda xx: impl.moe_forward(xx, args, s), (x,), tuple(args.values()), spec, eager))
    return impl.moe_forward(x, args, s)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(tensors) -> bool:
    """True when going through the dispatcher would change nothing: not tracing, no Python dispatch or function
    mode (FakeTensorMode, op counters, opcheck's checkers, ...), plain tensors or parameters (no subclasses such
    as FakeTensor or DTensor), and nothing for autograd to record."""
    if torch.compiler.is_compiling() or _get_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or (grad and t.requires_grad)):
            return False
    return True


def call_moe_forward(x: torch.Tensor, tensors, spec: MoESpec) -> torch.Tensor:
    """``torch.ops.moecomp.moe_forward(x, *tensors, spec.key)`` for eager callers (the bound HF blocks): the same
    computation, without the custom-op dispatcher's host cost (tens of microseconds a call) where that dispatcher
    would change nothing (``_plain_eager``); through the op otherwise."""
    tensors = tuple(tensors)
    if plain_eager((x,) + tensors):
        args = dict(zip(MOE_ARGS, tensors))
        check_args(x, args, spec)
        return _forward(x, args, spec, spec.key, eager=True)
    return torch.ops.moecomp.moe_forward(x, *tensors, spec.key)


def call_moe_experts(x, topk_ids, topk_weights, w13, b13, w2, b2, spec: MoESpec,
                     ids_from_topk: bool = False) -> torch.Tensor:
    """``torch.ops.moecomp.moe_experts(...)`` for eager callers, without the dispatcher where it changes nothing.
    ``ids_from_topk``: the caller's ids come from a top-k over ``num_experts`` scores (an HF experts module called by
    its own router), so they are in range by construction and CUDA skips the range check's host sync."""
    if plain_eager((x, topk_ids, topk_weights, w13, b13, w2, b2)):
        return _experts(x, topk_ids, topk_weights, dict(zip(EXPERT_ARGS, (w13, b13, w2, b2))), spec, spec.key,
                        eager=True, check_ids=not (ids_from_topk and topk_ids.is_cuda))
    return torch.ops.moecomp.moe_experts(x, topk_ids, topk_weights, w13, b13, w2, b2, spec.key)


@torch.library.custom_op("moecomp::moe_forward", mutates_args=())
def moe_forward(
    x: torch.Tensor,
    router_w: torch.Tensor,
    router_b: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    shared_w1: torch.Tensor | None,
    shared_w3: torch.Tensor | None,
    shared_w2: torch.Tensor | None,
    shared_gate_w: torch.Tensor | None,
    spec: str,
) -> torch.Tensor:
    s = MoESpec.from_key(spec)
    args = dict(zip(MOE_ARGS, (router_w, router_b, correction_bias, w13, b13, w2, b2, shared_w1, shared_w3,
                               shared_w2, shared_gate_w)))
    check_args(x, args, s)
    return _forward(x, args, s, spec)


@moe_forward.register_fake
def _(x, router_w, router_b, correction_bias, w13, b13, w2, b2, shared_w1, shared_w3, shared_w2, shared_gate_w,
      spec):
    # Also the Meta-key kernel: real tensors with one of them on "meta" dispatch here, not to the implementation, so
    # the checks (devices above all) must run here too, or the call returns uninitialised memory.
    args = dict(zip(MOE_ARGS, (router_w, router_b, correction_bias, w13, b13, w2, b2, shared_w1, shared_w3,
                               shared_w2, shared_gate_w)))
    check_args(x, args, MoESpec.from_key(spec), symbolic=True)
    return torch.empty_like(x)


@torch.library.custom_op("moecomp::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    spec: str,
) -> torch.Tensor:
    """Routed experts only: x [T, H], topk_ids / topk_weights [T, k] -> [T, H]."""
    s = MoESpec.from_key(spec)
    return _experts(x, topk_ids, topk_weights, dict(zip(EXPERT_ARGS, (w13, b13, w2, b2))), s, spec)


def _experts(x, topk_ids, topk_weights, args: dict, s: MoESpec, spec: str, eager: bool = False,
             check_ids: bool = True) -> torch.Tensor:
    check_routing(x, topk_ids, topk_weights, s)
    check_args(x, args, s)
    if check_ids:
        check_ids_range(topk_ids, s)
    impl = _impl(x.device)
    if x.is_cuda:
        return _on_device(x, lambda: graphs.run(
            "moe_experts", lambda xx, ids, w: impl.moe_experts(xx, ids, w, args, s), (x, topk_ids, topk_weights),
            tuple(args.values()), spec, eager))
    return impl.moe_experts(x, topk_ids, topk_weights, args, s)


@moe_experts.register_fake
def _(x, topk_ids, topk_weights, w13, b13, w2, b2, spec):
    s = MoESpec.from_key(spec)  # the checks: see moe_forward's fake implementation
    check_routing(x, topk_ids, topk_weights, s, symbolic=True)
    check_args(x, dict(zip(EXPERT_ARGS, (w13, b13, w2, b2))), s, symbolic=True)
    return torch.empty_like(x)
