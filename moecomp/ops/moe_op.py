"""The custom ops: ``torch.ops.moecomp.moe_forward`` (a whole MoE block) and ``torch.ops.moecomp.moe_experts``
(routed experts only, routing given), each opaque to Dynamo / Inductor through a fake implementation.

Dispatch: CUDA tensors run our Triton kernels (``ops/triton_moe.py``), through per-shape CUDA graphs in eager mode
at small token counts (``ops/graphs.py``). CPU tensors run a vectorised PyTorch path
(``ops/torch_moe.py``), or the same Triton kernels under ``TRITON_INTERPRET=1`` when ``MOECOMP_CPU_BACKEND=triton``
(how the tests exercise the kernels without a GPU).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _get_dispatch_mode

from ..spec import MoESpec, SpecError
from . import graphs

# Argument order of moe_forward after x; every entry point binds tensors by these names.
MOE_ARGS = (
    "router_w",
    "router_b",
    "correction_bias",
    "w13",
    "b13",
    "w2",
    "b2",
    "shared_w1",
    "shared_w3",
    "shared_w2",
    "shared_gate_w",
)
EXPERT_ARGS = ("w13", "b13", "w2", "b2")
# What the op implements beyond the base spec; passes check this before relying on it.
FEATURES = ("fused_shared_gate",)


def split_fused_gate(args: dict, spec: MoESpec) -> dict:
    """FSE arguments (router_w [E + 1, H]) as plain ones: router rows and gate row as views, no copy."""
    if not spec.fused_shared_gate:
        return args
    E = spec.num_experts
    return {**args, "router_w": args["router_w"][:E], "shared_gate_w": args["router_w"][E:]}


def _backend(device: torch.device) -> str:
    if device.type == "cuda":
        return os.environ.get("MOECOMP_CUDA_BACKEND", "triton")
    return os.environ.get("MOECOMP_CPU_BACKEND", "torch")


def check_args(x: torch.Tensor, tensors: dict, spec: MoESpec) -> None:
    """Clear errors for tensors that do not fit the spec (shapes, presence, devices, dtypes)."""
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if x.shape[-1] != H:
        raise SpecError(f"hidden_states last dim is {x.shape[-1]}, spec says hidden_size={H}")
    if not x.is_floating_point():
        raise SpecError(f"hidden_states must be floating point, got {x.dtype}")
    expect = dict(spec.expert_weight_shapes())
    if "router_w" in tensors:
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
    for name, t in tensors.items():
        want = expect.get(name)
        if want is None:
            if t is not None:
                raise SpecError(f"{name} was given but the spec has no use for it ({spec.describe()})")
            continue
        if t is None:
            raise SpecError(f"{name} is required by the spec ({spec.describe()}) but was None")
        if tuple(t.shape) != want:
            raise SpecError(f"{name} has shape {tuple(t.shape)}, the spec needs {want}")
        if t.device != x.device:
            raise SpecError(f"{name} is on {t.device}, hidden_states on {x.device}")
        if not t.is_floating_point():
            raise SpecError(f"{name} must be floating point, got {t.dtype}")


def _impl(device: torch.device):
    if _backend(device) == "triton":
        from . import triton_moe as impl
    else:
        from . import torch_moe as impl
    return impl


def _on_device(x: torch.Tensor, fn):
    """fn() with x's GPU as the current device: Triton launches (and graph captures) go to the current device, and
    a model spread over several GPUs (device_map="auto") calls blocks on a GPU that need not be current."""
    if x.device.index is None or x.device.index == torch.cuda.current_device():
        return fn()
    with torch.cuda.device(x.device):
        return fn()


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


def call_moe_experts(x, topk_ids, topk_weights, w13, b13, w2, b2, spec: MoESpec) -> torch.Tensor:
    """``torch.ops.moecomp.moe_experts(...)`` for eager callers, without the dispatcher where it changes nothing."""
    if plain_eager((x, topk_ids, topk_weights, w13, b13, w2, b2)):
        return _experts(x, topk_ids, topk_weights, dict(zip(EXPERT_ARGS, (w13, b13, w2, b2))), spec, spec.key,
                        eager=True)
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


def _experts(x, topk_ids, topk_weights, args: dict, s: MoESpec, spec: str, eager: bool = False) -> torch.Tensor:
    check_args(x, args, s)
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise SpecError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, k]"
        )
    impl = _impl(x.device)
    if x.is_cuda:
        return _on_device(x, lambda: graphs.run(
            "moe_experts", lambda xx, ids, w: impl.moe_experts(xx, ids, w, args, s), (x, topk_ids, topk_weights),
            tuple(args.values()), spec, eager))
    return impl.moe_experts(x, topk_ids, topk_weights, args, s)


@moe_experts.register_fake
def _(x, topk_ids, topk_weights, w13, b13, w2, b2, spec):
    return torch.empty_like(x)
