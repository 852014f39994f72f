"""The custom ops: ``torch.ops.moecomp.moe_forward`` (a whole MoE block) and ``torch.ops.moecomp.moe_experts``
(routed experts only, routing given), each opaque to Dynamo / Inductor through a fake implementation.

Dispatch: CUDA tensors run our Triton kernels (``ops/triton_moe.py``), through per-shape CUDA graphs in eager mode
at small token counts (``ops/graphs.py``). CPU tensors run a vectorised PyTorch path
(``ops/torch_moe.py``), or the same Triton kernels under ``TRITON_INTERPRET=1`` when ``MOECOMP_CPU_BACKEND=triton``
(how the tests exercise the kernels without a GPU).

Routing record and replay (issue 43, ``ops/routes.py``): ``moe_forward``'s last argument ``routes_in`` (int32 / int64
[T, k], the ids to use instead of the op's own top-k; None by default, at no cost), and the recording op
``torch.ops.moecomp.moe_forward_routes(routes_out, route_weights_out, <moe_forward's arguments>)``: the same block,
writing int32 ids [T, k] into ``routes_out`` and (where not None) the fp32 weights [T, k] into ``route_weights_out``,
both declared mutated. A second op, not optional mutated arguments on moe_forward: Inductor (torch 2.13) fails on a
custom op whose optional mutated arguments are all None ("getitem is not an OpOverload"), which every compiled call
without a record would be. moe_experts takes none of them: it does not route (its ids are given).

Hash routing's table and token ids (``HASH_ARGS``): ``ops/hash_routing.py`` checks them (their values as the ids
below) and the implementations clamp them (memory safety where the values cannot be read).

Argument checks (``check_args``, ``check_routing``, ``check_ids_range``): every bad argument is a ``SpecError`` (a
ValueError) naming it and what was expected, on every entry point: the implementations, the eager entry points, and
the fake implementations, which are also the Meta-key kernels (a tensor on "meta" among real ones dispatches there).
moe_experts' expert ids are range-checked by reading them: always on CPU; on CUDA (a host sync, 60-250 us a call on
an H200) only outside CUDA-graph capture and compilation, not at all with ``MOECOMP_CHECK_IDS=0``, and not for HF
experts modules called by their own router (``call_moe_experts(..., ids_from_topk=True)``: top-k ids are in range).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _get_dispatch_mode

from ..core.args import (  # noqa: F401  (re-exported)
    EXPERT_ARGS, EXPERT_QUANT_ARGS, HASH_ARGS, LATENT_ARGS, MOE_ARGS, NORM_ARGS, OP_ARGS, QUANT_ARGS, ROUTER_IN_ARGS,
    SCALE_ARGS, SHARED_NORM_ARGS, ZERO_ARGS)
from ..core.spec import MoESpec, SpecError
from . import graphs, hash_routing, routes, torch_moe
from .backend import Backend
from .common import (  # noqa: F401  (re-exported)
    FEATURES, backend_name as _backend, check_ids_wanted as _check_ids_wanted, on_device as _on_device,
    split_fused_gate)

# Floating dtypes the kernels compute in (x / hidden_states). float64 only on the vectorised torch path (CPU, or
# MOECOMP_CUDA_BACKEND=torch), which computes the experts in fp32 and returns float64; the Triton GEMMs have no fp64.
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# GEMM operands of the routed and shared experts: tl.dot, grouped_mm and mm take both operands in one dtype, so these
# must have x's dtype. Every other tensor may be any floating dtype: the router GEMM converts router_w / router_b /
# shared_gate_w to its compute dtype (x's, or fp32 with router_fp32: an fp32 router over bf16 experts is the
# DeepSeek-V3 style), and the correction bias and the expert biases are read as fp32. The latent projections'
# weights are GEMM operands of x too (their biases are converted).
_SAME_DTYPE = frozenset({"w13", "w2", "shared_w1", "shared_w3", "shared_w2", "latent_in_w", "latent_out_w"})
_FP8 = torch.float8_e4m3fn
# scale argument -> the tensor it scales (a13 / a2: the activations of w13's and w2's GEMMs; zeros: int4's zero points)
_SCALE_OF = {"w13_scale": "w13", "w2_scale": "w2", "a13_scale": "w13", "a2_scale": "w2",
             "w13_zero": "w13", "w2_zero": "w2",
             "shared_w1_scale": "shared_w1", "shared_w3_scale": "shared_w3", "shared_w2_scale": "shared_w2"}


def _quant_of(name: str, spec: MoESpec):
    return spec.shared.quant if name.startswith("shared") else spec.quant


def _quantized(spec: MoESpec) -> frozenset:
    """Weight arguments the spec stores quantized."""
    names = set()
    if spec.quant is not None:
        names |= {"w13", "w2"}
    if spec.shared is not None and spec.shared.quant is not None:
        names |= {"shared_w1", "shared_w3", "shared_w2"}
    return frozenset(names)


def _scale_dtype(name: str, spec: MoESpec) -> torch.dtype:
    from ..core import quant as q8  # torch only

    return q8.scale_dtype(_quant_of(name, spec))


def _scale_layout(name: str, spec: MoESpec) -> str:
    q = _quant_of(name, spec)
    if name in ("a13_scale", "a2_scale"):
        return "static activation"
    if q.scale == "group":
        return f"{q.weight} per-row group-{q.block_k}" + (" zero-point" if name.endswith("_zero") else "")
    return f"{q.block_n}x{q.block_k} block" if q.scale == "block" else f"per-{q.scale}"


def _weight_dtype(name: str, spec: MoESpec) -> torch.dtype:
    """The stored dtype of a quantized weight: e4m3, or uint8 bytes of two 4-bit codes."""
    return torch.uint8 if _quant_of(name, spec).packed else _FP8


_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_X = "x (hidden_states)"
_expected: dict = {}  # (spec.key, with router) -> {argument name: shape}


def _expected_shapes(spec: MoESpec, routed: bool) -> dict:
    """{name: shape} of every tensor the spec uses (cached per spec: check_args runs on every eager call)."""
    key = (spec.key, routed)
    expect = _expected.get(key)
    if expect is not None:
        return expect
    R, H = spec.router_width, spec.hidden_size  # router outputs: E experts (+ zero experts)
    expect = dict(spec.expert_weight_shapes())
    expect.update(spec.quant_shapes())
    if routed:
        expect.update(spec.latent_shapes())
        expect.update(spec.norm_shapes())
        expect.update(spec.shared_quant_shapes())
        expect["router_w"] = (R + int(spec.fused_shared_gate) + spec.gamma_rows, H)  # + gate / gamma rows
        if spec.has_router_bias:
            expect["router_b"] = (R,)
        if spec.has_correction_bias:
            expect["correction_bias"] = (R,)
        if spec.has_weight_scale:
            expect["weight_scale"] = (1,)
        sh = spec.shared
        if sh is not None:
            expect.update(sh.weight_shapes(H))  # [S, ...] when stacked
            if sh.gate == "sigmoid" and not spec.fused_shared_gate:
                expect["shared_gate_w"] = (1, H)
        if spec.router_in_scale:
            expect["router_in_scale"] = (H,)
        if spec.expert_scale:
            expect["expert_scale"] = (R,)
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
    if "router_w" in tensors:
        hash_routing.check_args(x, tensors.get("hash_table"), tensors.get("token_ids"), spec, symbolic)
    if "router_w" in tensors:
        _check_router_x(x, tensors.get("router_x"), spec, symbolic)
        routes.check(x, tensors, spec, symbolic)
    for name, t in tensors.items():
        if name in HASH_ARGS or name == "router_x" or name in routes.ROUTE_ARGS:
            continue
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
            if name in _SCALE_OF:
                w = tensors.get(_SCALE_OF[name])
                raise SpecError(f"{name} has shape {tuple(t.shape)}; {_scale_layout(name, spec)} scales for "
                                f"{_SCALE_OF[name]} {tuple(w.shape) if w is not None else ''} need {want}")
            raise SpecError(f"{name} has shape {tuple(t.shape)}, the spec needs {want}")
        if name in _quantized(spec):
            want_dt = _weight_dtype(name, spec)
            if t.dtype != want_dt:
                packed = " (two 4-bit codes a byte)" if want_dt == torch.uint8 else ""
                raise SpecError(f"{name} has dtype {t.dtype}; the spec's quantized weights ({spec.describe()}) "
                                f"are {want_dt}{packed}")
        elif name in ZERO_ARGS:
            if t.dtype != torch.uint8:
                raise SpecError(f"{name} has dtype {t.dtype}; int4 zero points are torch.uint8 (one per byte, 0..15)")
        elif name in _SCALE_OF and name.startswith(("w", "shared")):
            want_dt = _scale_dtype(name, spec)
            if t.dtype != want_dt:
                raise SpecError(f"{name} has dtype {t.dtype}; {_SCALE_OF[name]}'s scales are {want_dt} "
                                f"(scale_dtype {_quant_of(name, spec).scale_dtype!r})")
        elif name in ("a13_scale", "a2_scale"):
            if t.dtype != torch.float32:
                raise SpecError(f"{name} has dtype {t.dtype}; static activation scales are torch.float32")
        elif name in _SAME_DTYPE:
            if t.dtype != dt:
                raise SpecError(f"{name} has dtype {t.dtype}; expected {dt}, the dtype of {_X} (expert and "
                                f"shared-expert weights are GEMM operands of x)")
        elif not t.is_floating_point():
            raise SpecError(f"{name} has dtype {t.dtype}; expected a floating dtype")
    for name, want in expect.items():  # scales, latent and norm tensors are passed only where given: a missing one
        if (name in _SCALE_OF or name in LATENT_ARGS or name in ROUTER_IN_ARGS or name in SCALE_ARGS
                or name in NORM_ARGS or name in SHARED_NORM_ARGS) and tensors.get(name) is None:
            what = (f"the zero points of {_SCALE_OF[name]}" if name in ZERO_ARGS else
                    f"the scales of {_SCALE_OF[name]}" if name in _SCALE_OF else "a latent projection of the experts"
                    if name in LATENT_ARGS else "the routing weights' learned scale" if name in SCALE_ARGS
                    else "a norm's weight" if name in NORM_ARGS + SHARED_NORM_ARGS
                    else "the router's input scale / per-expert weight scale")
            raise SpecError(f"{name} is required by the spec ({spec.describe()}) but was None; expected a tensor "
                            f"of shape {want} ({what})")


def _check_router_x(x: torch.Tensor, r: torch.Tensor | None, spec: MoESpec, symbolic: bool) -> None:
    """``router_x`` (``spec.router_input``): the router's own input, x's shape, dtype and device; None otherwise."""
    if not spec.router_input:
        if r is not None:
            raise SpecError(f"router_x was given but the spec's router reads x (router_input=False); expected None "
                            f"({spec.describe()})")
        return
    if r is None:
        raise SpecError(f"router_x is required by the spec (router_input=True: the router reads its own input) but "
                        f"was None; expected a tensor of the shape of {_X} {tuple(x.shape)}")
    if r.device != x.device:
        raise SpecError(f"router_x is on {r.device}; expected {x.device}, the device of {_X}")
    if _differs(r.shape, x.shape, symbolic):
        raise SpecError(f"router_x has shape {tuple(r.shape)}; expected the shape of {_X} {tuple(x.shape)}")
    if r.dtype != x.dtype:
        raise SpecError(f"router_x has dtype {r.dtype}; expected {x.dtype}, the dtype of {_X}")


def check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, spec: MoESpec,
                  symbolic: bool = False) -> None:
    """moe_experts' routing arguments: x [T, H], topk_ids (integer) and topk_weights (floating), both [T, k] with
    1 <= k <= num_experts (+ zero_experts), all on x's device. The ids' values: ``check_ids_range``."""
    E, H = spec.router_width, spec.hidden_size
    if spec.expert_norm != "none":
        raise SpecError(f"moe_experts has no expert_norm_w argument; this spec normalises each expert's output "
                        f"(expert_norm={spec.expert_norm!r}): call moe_forward")
    if spec.latent_size:
        raise SpecError(f"moe_experts runs routed experts on their own input; this spec has latent projections "
                        f"(latent_size={spec.latent_size}): pass its experts_spec() (hidden_size={spec.latent_size}, "
                        f"no projections) and x [T, {spec.latent_size}]")
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
        raise SpecError(f"topk_ids has k={k} columns; expected 1 <= k <= {_width(spec)}")


def check_ids_range(topk_ids: torch.Tensor, spec: MoESpec) -> None:
    """SpecError unless every id is in [0, num_experts (+ zero_experts)) (an id outside that range would index past
    the weights; ids >= num_experts are the zero experts')."""
    if topk_ids.numel() == 0 or not _check_ids_wanted(topk_ids):
        return
    if topk_ids.is_cuda:  # one device-to-host read
        lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()
    else:
        lo, hi = torch.aminmax(topk_ids)
        lo, hi = lo.item(), hi.item()
    if lo < 0 or hi >= spec.router_width:
        raise SpecError(f"topk_ids holds ids in [{lo}, {hi}]; expected every id in [0, {_width(spec)})")


def _width(spec: MoESpec) -> str:
    """The ids' range bound, in words."""
    E, Z = spec.num_experts, spec.zero_experts
    return f"num_experts={E}" + (f" + zero_experts={Z}" if Z else "")


def implementation(device: torch.device) -> Backend:
    """The op's implementation on ``device`` (``ops/backend.Backend``): the Triton kernels or the torch path, as
    ``common.backend_name`` says."""
    if _backend(device) == "triton":
        # lazy: triton_moe imports Triton and the kernels, which ``import moecomp`` should not pay for; triton_moe
        # never imports this module (no cycle)
        from . import triton_moe as impl
    else:
        impl = torch_moe
    return impl


def _forward(x: torch.Tensor, args: dict, s: MoESpec, spec: str, eager: bool = False) -> torch.Tensor:
    """``eager``: the caller has already established ``plain_eager`` for these tensors. The token ids of hash
    routing are per-call inputs like x (copied into the op's eager graphs on every replay, never keyed by identity);
    the table is a weight."""
    impl = implementation(x.device)
    tok = args.get("token_ids")
    if s.hash_routing:
        hash_routing.check_values(args["hash_table"], tok, s)
    routes.check_values(args.get("routes_in"), s)
    if x.is_cuda:  # per-shape CUDA graphs in eager mode (ops/graphs.py); per-call inputs copied in like x, the
        # routing's output buffers (routes_out / route_weights_out) copied out after each replay
        per_call = [n for n in ("token_ids", "router_x", "routes_in") if args.get(n) is not None]
        outs = [n for n in routes.OUTS if args.get(n) is not None]
        if not per_call and not outs:
            return _on_device(x, lambda: graphs.run(
                "moe_forward", lambda xx: impl.moe_forward(xx, args, s), (x,), tuple(args.values()), spec, eager))
        rest = {k: v for k, v in args.items() if k not in per_call and k not in outs}
        return _on_device(x, lambda: graphs.run(
            "moe_forward", lambda xx, *pc: impl.moe_forward(xx, {**rest, **dict(zip(per_call + outs, pc))}, s),
            (x, *(args[n] for n in per_call)), tuple(rest.values()), spec, eager, outs=tuple(args[n] for n in outs)))
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


def call_moe_forward(x: torch.Tensor, tensors, spec: MoESpec, routes_out: torch.Tensor | None = None,
                     route_weights_out: torch.Tensor | None = None,
                     routes_in: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.moecomp.moe_forward(x, *tensors, spec.key)`` for eager callers (the bound HF blocks; ``tensors``
    in ``OP_ARGS`` order, the quantization scales and latent projections optional at the end): the same
    computation, without the custom-op dispatcher's host cost (tens of microseconds a call) where that dispatcher
    would change nothing (``_plain_eager``); through the op otherwise. ``routes_out`` / ``route_weights_out`` /
    ``routes_in``: routing record and replay (``ops/routes.py``)."""
    tensors = tuple(tensors)
    rt = dict(zip(routes.ROUTE_ARGS, (routes_out, route_weights_out, routes_in)))
    if plain_eager((x,) + tensors + tuple(rt.values())):
        args = dict(zip(OP_ARGS, tensors))
        args.update({n: t for n, t in rt.items() if t is not None})
        check_args(x, args, spec)
        return _forward(x, args, spec, spec.key, eager=True)
    n, last = len(MOE_ARGS), len(tensors)
    while last > n and tensors[last - 1] is None:  # the optional tail up to the last tensor given
        last -= 1
    rest = tensors[n:last]
    if routes_in is not None:  # after every other argument
        rest = tensors[n:] + (None,) * (len(OP_ARGS) - len(tensors)) + (routes_in,)
    if routes_out is None and route_weights_out is not None:  # weights alone: the ids into a scratch buffer
        routes_out = torch.empty(x.numel() // x.shape[-1], spec.top_k, dtype=torch.int32, device=x.device)
    if routes_out is not None:
        return torch.ops.moecomp.moe_forward_routes(routes_out, route_weights_out, x, *tensors[:n], spec.key, *rest)
    return torch.ops.moecomp.moe_forward(x, *tensors[:n], spec.key, *rest)


def call_moe_experts(x, topk_ids, topk_weights, w13, b13, w2, b2, spec: MoESpec,
                     ids_from_topk: bool = False, **scales) -> torch.Tensor:
    """``torch.ops.moecomp.moe_experts(...)`` for eager callers, without the dispatcher where it changes nothing.
    ``ids_from_topk``: the caller's ids come from a top-k over ``num_experts`` scores (an HF experts module called by
    its own router), so they are in range by construction and CUDA skips the range check's host sync."""
    q = tuple(scales.get(n) for n in EXPERT_QUANT_ARGS)
    if set(scales) - set(EXPERT_QUANT_ARGS):
        raise TypeError(f"unknown scale argument(s) {sorted(set(scales) - set(EXPERT_QUANT_ARGS))}")
    if plain_eager((x, topk_ids, topk_weights, w13, b13, w2, b2) + q):
        return _experts(x, topk_ids, topk_weights, _expert_args(w13, b13, w2, b2, *q), spec, spec.key,
                        eager=True, check_ids=not (ids_from_topk and topk_ids.is_cuda))
    return torch.ops.moecomp.moe_experts(x, topk_ids, topk_weights, w13, b13, w2, b2, spec.key, *q)


def _expert_args(w13, b13, w2, b2, *scales) -> dict:
    """moe_experts' tensors by name; the scale names only where given (unquantized calls keep the old four)."""
    args = dict(zip(EXPERT_ARGS, (w13, b13, w2, b2)))
    args.update({n: t for n, t in zip(EXPERT_QUANT_ARGS, scales) if t is not None})
    return args


def _op_args(tensors, scales, latent=(), hashed=(), router_in=(), wscale=(), norms=(), zeros=(),
             shared_norm=(), route=()) -> dict:
    """moe_forward's tensors by name; the scale, latent, hash-routing, router-input, weight-scale and norm names only
    where given."""
    args = dict(zip(MOE_ARGS, tensors))
    args.update({n: t for n, t in zip(QUANT_ARGS, scales) if t is not None})
    args.update({n: t for n, t in zip(LATENT_ARGS, latent) if t is not None})
    args.update({n: t for n, t in zip(HASH_ARGS, hashed) if t is not None})
    args.update({n: t for n, t in zip(ROUTER_IN_ARGS, router_in) if t is not None})
    args.update({n: t for n, t in zip(SCALE_ARGS, wscale) if t is not None})
    args.update({n: t for n, t in zip(NORM_ARGS, norms) if t is not None})
    args.update({n: t for n, t in zip(ZERO_ARGS, zeros) if t is not None})
    args.update({n: t for n, t in zip(SHARED_NORM_ARGS, shared_norm) if t is not None})
    args.update({n: t for n, t in zip(routes.ROUTE_ARGS, route) if t is not None})
    return args


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
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    shared_w1_scale: torch.Tensor | None = None,
    shared_w3_scale: torch.Tensor | None = None,
    shared_w2_scale: torch.Tensor | None = None,
    latent_in_w: torch.Tensor | None = None,
    latent_in_b: torch.Tensor | None = None,
    latent_out_w: torch.Tensor | None = None,
    latent_out_b: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    router_x: torch.Tensor | None = None,
    router_in_scale: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    latent_norm_w: torch.Tensor | None = None,
    expert_norm_w: torch.Tensor | None = None,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
    shared_norm_w: torch.Tensor | None = None,
    routes_in: torch.Tensor | None = None,
) -> torch.Tensor:
    s = MoESpec.from_key(spec)
    args = _op_args((router_w, router_b, correction_bias, w13, b13, w2, b2, shared_w1, shared_w3, shared_w2,
                     shared_gate_w), (w13_scale, w2_scale, a13_scale, a2_scale, shared_w1_scale, shared_w3_scale,
                                      shared_w2_scale), (latent_in_w, latent_in_b, latent_out_w, latent_out_b),
                    (hash_table, token_ids), (router_x, router_in_scale, expert_scale), (weight_scale,),
                    (latent_norm_w, expert_norm_w), (w13_zero, w2_zero), (shared_norm_w,), (None, None, routes_in))
    check_args(x, args, s)
    return _forward(x, args, s, spec)


@moe_forward.register_fake
def _(x, router_w, router_b, correction_bias, w13, b13, w2, b2, shared_w1, shared_w3, shared_w2, shared_gate_w,
      spec, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None, shared_w1_scale=None,
      shared_w3_scale=None, shared_w2_scale=None, latent_in_w=None, latent_in_b=None, latent_out_w=None,
      latent_out_b=None, hash_table=None, token_ids=None, router_x=None, router_in_scale=None, expert_scale=None,
      weight_scale=None, latent_norm_w=None, expert_norm_w=None, w13_zero=None, w2_zero=None, shared_norm_w=None,
      routes_in=None):
    # Also the Meta-key kernel: real tensors with one of them on "meta" dispatch here, not to the implementation, so
    # the checks (devices above all) must run here too, or the call returns uninitialised memory.
    args = _op_args((router_w, router_b, correction_bias, w13, b13, w2, b2, shared_w1, shared_w3, shared_w2,
                     shared_gate_w), (w13_scale, w2_scale, a13_scale, a2_scale, shared_w1_scale, shared_w3_scale,
                                      shared_w2_scale), (latent_in_w, latent_in_b, latent_out_w, latent_out_b),
                    (hash_table, token_ids), (router_x, router_in_scale, expert_scale), (weight_scale,),
                    (latent_norm_w, expert_norm_w), (w13_zero, w2_zero), (shared_norm_w,), (None, None, routes_in))
    check_args(x, args, MoESpec.from_key(spec), symbolic=True)
    return torch.empty_like(x)


_FORWARD_NAMES = tuple(a.name for a in torch.ops.moecomp.moe_forward.default._schema.arguments)


def _routes_schema() -> str:
    """moe_forward_routes' schema: the two mutated buffers, then moe_forward's arguments (read from its schema, so
    the two never drift apart; custom ops take no keyword-only tensors, so the buffers come first)."""
    full = str(torch.ops.moecomp.moe_forward.default._schema)
    args = full[full.index("(") + 1:full.rindex(") ->")]
    return f"(Tensor(a!) routes_out, Tensor(b!)? route_weights_out, {args}) -> Tensor"


def _routes_call(routes_out, route_weights_out, args, kwargs, symbolic: bool):
    """(x, the op's tensors by name, spec, key) of a moe_forward_routes call."""
    bound = {**dict(zip(_FORWARD_NAMES, args)), **kwargs}
    tensors = {n: bound.get(n) for n in MOE_ARGS}
    tensors.update({n: bound[n] for n in OP_ARGS[len(MOE_ARGS):] + ("routes_in",) if bound.get(n) is not None})
    tensors["routes_out"] = routes_out
    if route_weights_out is not None:
        tensors["route_weights_out"] = route_weights_out
    x, key = bound["x"], bound["spec"]
    s = MoESpec.from_key(key)
    check_args(x, tensors, s, symbolic)
    return x, tensors, s, key


def _moe_forward_routes(routes_out, route_weights_out, *args, **kwargs):
    x, tensors, s, key = _routes_call(routes_out, route_weights_out, args, kwargs, False)
    return _forward(x, tensors, s, key)


moe_forward_routes = torch.library.custom_op("moecomp::moe_forward_routes", _moe_forward_routes,
                                             mutates_args=routes.OUTS, schema=_routes_schema())


@moe_forward_routes.register_fake
def _(routes_out, route_weights_out, *args, **kwargs):
    x = _routes_call(routes_out, route_weights_out, args, kwargs, True)[0]  # the checks: see moe_forward's fake
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
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts only: x [T, H], topk_ids / topk_weights [T, k] -> [T, H]."""
    s = MoESpec.from_key(spec)
    return _experts(x, topk_ids, topk_weights, _expert_args(w13, b13, w2, b2, w13_scale, w2_scale, a13_scale,
                                                            a2_scale, w13_zero, w2_zero), s, spec)


def _experts(x, topk_ids, topk_weights, args: dict, s: MoESpec, spec: str, eager: bool = False,
             check_ids: bool = True) -> torch.Tensor:
    check_routing(x, topk_ids, topk_weights, s)
    check_args(x, args, s)
    if check_ids:
        check_ids_range(topk_ids, s)
    impl = implementation(x.device)
    if x.is_cuda:
        return _on_device(x, lambda: graphs.run(
            "moe_experts", lambda xx, ids, w: impl.moe_experts(xx, ids, w, args, s), (x, topk_ids, topk_weights),
            tuple(args.values()), spec, eager))
    return impl.moe_experts(x, topk_ids, topk_weights, args, s)


@moe_experts.register_fake
def _(x, topk_ids, topk_weights, w13, b13, w2, b2, spec, w13_scale=None, w2_scale=None, a13_scale=None,
      a2_scale=None, w13_zero=None, w2_zero=None):
    s = MoESpec.from_key(spec)  # the checks: see moe_forward's fake implementation
    check_routing(x, topk_ids, topk_weights, s, symbolic=True)
    check_args(x, _expert_args(w13, b13, w2, b2, w13_scale, w2_scale, a13_scale, a2_scale, w13_zero, w2_zero), s,
               symbolic=True)
    return torch.empty_like(x)
