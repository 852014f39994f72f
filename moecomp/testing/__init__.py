"""Tools for tests, benchmarks and the demo (a layer above the API: the library itself never imports it).

Here: random inputs for a MoESpec, toy blocks and a per-token clock. Beside it: ``blocks`` (one real-size HF block,
experts drawn and quantized a chunk at a time), ``fp8_convert`` (FP8 block checkpoints and models), ``int4_writer``
(GPTQ / AWQ checkpoints), ``mxfp4_write`` (MXFP4 checkpoints, random packed models).

``random_moe_args(spec, T, ...)`` returns the op's positional arguments (x, then ``MOE_ARGS`` in order), drawn from
N(0, std) so that nothing is zero and routing is not degenerate.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..ops.moe_op import MOE_ARGS
from ..core.spec import MoESpec, SharedExpertSpec


CHUNK_BYTES = 1 << 30  # random_moe_args draws a weight stack over this many fp32 bytes a slice at a time


def random_moe_args(
    spec: MoESpec,
    T: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    std: float = 0.2,
    seed: int | None = None,
) -> tuple:
    device = torch.device(device)
    g = torch.Generator(device=device)  # drawn where they live: GPU-sized weights never pass through the CPU
    g.manual_seed(torch.seed() if seed is None else seed)

    def rnd(*shape, scale=std, dt=dtype):
        if len(shape) < 2 or torch.Size(shape).numel() * 4 <= CHUNK_BYTES:
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dt)
        # a large stack (DeepSeek-V3's w13 is 28 GiB in fp32): drawn in fp32 one leading slice at a time, so the
        # peak is the result plus one slice, not the result plus its fp32 copy (which an 80 GB GPU cannot hold)
        out = torch.empty(*shape, device=device, dtype=dt)
        for i in range(shape[0]):
            out[i] = torch.randn(*shape[1:], generator=g, device=device, dtype=torch.float32) * scale
        return out

    E, H = spec.router_width, spec.hidden_size  # router outputs (the experts, + zero experts)
    # float weights of the spec's shapes (4-bit specs: the unpacked shapes; quantize_moe_args packs them)
    shapes = (dataclasses.replace(spec, quant=None) if spec.quant is not None and spec.quant.packed
              else spec).expert_weight_shapes()
    t = dict.fromkeys(MOE_ARGS)
    x = rnd(T, H, scale=1.0)
    t["router_w"] = rnd(E + spec.gamma_rows, H, scale=1.0 / H**0.5 * 2)  # + the shared experts' gamma rows
    if spec.has_router_bias:
        t["router_b"] = rnd(E, scale=0.5)
    if spec.has_correction_bias:
        t["correction_bias"] = rnd(E, scale=0.05, dt=torch.float32)
    for name in ("w13", "w2", "b13", "b2"):
        if name in shapes:
            t[name] = rnd(*shapes[name], scale=std if name.startswith("w") else 0.5)
    sh = spec.shared
    if sh is not None:
        for name, shape in sh.weight_shapes(H).items():  # [S, ...] when stacked
            t[name] = rnd(*shape)
        if sh.gate == "sigmoid":
            t["shared_gate_w"] = rnd(1, H, scale=1.0 / H**0.5)
    return (x,) + tuple(t[n] for n in MOE_ARGS)


def random_weight_scale(spec: MoESpec, device: str | torch.device = "cpu", seed: int = 0) -> dict:
    """{"weight_scale": a [1] fp32 tensor in [0.5, 1.5)} with ``spec.has_weight_scale``, else {} (an op keyword)."""
    if not spec.has_weight_scale:
        return {}
    g = torch.Generator().manual_seed(seed)
    return {"weight_scale": (torch.rand(1, generator=g) + 0.5).to(device)}


def random_latent_args(spec: MoESpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       seed: int | None = None) -> dict:
    """The latent projections of ``spec`` (``spec.latent_shapes()``; {} without ``latent_size``), as keyword
    arguments of the op and the reference: ``moe_forward(*random_moe_args(spec, T), spec.key, **latent)``. Weights
    N(0, 1 / fan_in) (the projections keep the scale of what they read), biases N(0, 0.1)."""
    device = torch.device(device)
    g = torch.Generator(device=device)
    g.manual_seed(torch.seed() if seed is None else seed)
    out = {}
    for name, shape in spec.latent_shapes().items():
        scale = 1.0 / shape[1] ** 0.5 if len(shape) == 2 else 0.1
        out[name] = (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
    return out


def random_hash_args(spec: MoESpec, T: int, vocab: int = 37, device: str | torch.device = "cpu",
                     seed: int = 0, distinct: bool = True) -> dict:
    """Hash routing's op arguments (``spec.hash_routing``): {"hash_table": [vocab, k] int64 expert ids (each row k
    distinct experts, or ``distinct=False`` drawn with repeats), "token_ids": [T] int64 in [0, vocab)}."""
    g = torch.Generator().manual_seed(seed)
    E, k = spec.num_experts, spec.top_k
    if distinct:
        table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)])
    else:
        table = torch.randint(0, E, (vocab, k), generator=g)
    tok = torch.randint(0, vocab, (T,), generator=g)
    return {"hash_table": table.to(device), "token_ids": tok.to(device)}


def quantize_moe_args(spec: MoESpec, args: tuple, seed: int = 0) -> tuple[tuple, dict]:
    """The op's arguments of ``random_moe_args`` with the weights the spec quantizes replaced by their fp8 (or packed
    4-bit) form: (positional args, {scale / zero argument: tensor}) to call ``moe_forward(*args, spec.key, **scales)``. Static
    activation scales are calibrated on ``x``: each expert's max|x| and max|h| over every token (as if each token
    went to every expert) over 448, times U(1, 1.5) (so nothing saturates)."""
    from ..core import quant as q8

    t = dict(zip(MOE_ARGS, args[1:]))
    scales = {}
    if spec.quant is not None and spec.quant.packed:  # 4-bit: packed codes, group scales (and zeros)
        for name in ("w13", "w2"):
            t[name], scales[f"{name}_scale"], zero = q8.quantize_4bit(t[name], spec.quant)
            if zero is not None:
                scales[f"{name}_zero"] = zero
    elif spec.quant is not None:
        qs = spec.quant
        halves = 2 if spec.gated else 1
        t["w13"], scales["w13_scale"] = _quantize_experts(t["w13"], qs, halves)
        t["w2"], scales["w2_scale"] = _quantize_experts(t["w2"], qs)
        if qs.activation == "static":
            from ..oracle import reference

            g = torch.Generator(device=args[0].device).manual_seed(seed)
            E, dev = spec.num_experts, args[0].device
            x = args[0].reshape(-1, spec.hidden_size).float()
            amax_h = torch.empty(E, device=dev)
            for e0, e1 in _expert_chunks(t["w13"]):
                w13 = q8.dequantize(t["w13"][e0:e1], scales["w13_scale"][e0:e1], qs, halves)  # [e, N, H]
                h = reference._gate_up((x @ w13.transpose(1, 2)).reshape(-1, w13.shape[1]), spec)  # [e * T, I]
                amax_h[e0:e1] = h.reshape(e1 - e0, -1).abs().amax(-1)
            scales["a13_scale"] = (torch.rand(E, generator=g, device=dev) * 0.5 + 1) * x.abs().max() / q8.FP8_MAX
            scales["a2_scale"] = (torch.rand(E, generator=g, device=dev) * 0.5 + 1) * amax_h / q8.FP8_MAX
    sh = spec.shared
    if sh is not None and sh.quant is not None:
        for name in ("shared_w1", "shared_w3", "shared_w2"):
            if t[name] is not None:
                t[name], scales[f"{name}_scale"] = q8.quantize(t[name], sh.quant)
    return (args[0],) + tuple(t[n] for n in MOE_ARGS), scales


def _expert_chunks(w: torch.Tensor, max_bytes: int = 1 << 30):
    """[(e0, e1)] covering w's experts, each chunk at most ``max_bytes`` in fp32 (one expert at least)."""
    per = max(1, max_bytes // max(1, w[0].numel() * 4))
    return [(e0, min(e0 + per, w.shape[0])) for e0 in range(0, w.shape[0], per)]


def _quantize_experts(w: torch.Tensor, qs, halves: int = 1):
    """``quant.quantize`` of [E, rows, cols] a chunk of experts at a time (the same numbers: scales are per expert),
    so that a DeepSeek-V3 w13 (7.5e9 elements) never has a whole fp32 copy."""
    from ..core import quant as q8

    chunks = _expert_chunks(w)
    if len(chunks) == 1:
        return q8.quantize(w, qs, halves)
    q, s = torch.empty(w.shape, dtype=q8.FP8, device=w.device), None
    for e0, e1 in chunks:
        qc, sc = q8.quantize(w[e0:e1], qs, halves)
        if s is None:
            s = torch.empty((w.shape[0], *sc.shape[1:]), dtype=sc.dtype, device=w.device)
        q[e0:e1], s[e0:e1] = qc, sc
    return q, s


def capture_moe_forward(static_x: torch.Tensor, args, spec: MoESpec, sync_check: bool = False,
                        extra: dict | None = None):
    """(graph, static_out): ``torch.ops.moecomp.moe_forward(static_x, *args, spec.key, **extra)`` warmed up twice on a
    side stream (kernels compiled, derived weights built) and captured in a CUDA graph; replay after writing new
    inputs into ``static_x``. ``sync_check``: a host sync on the captured path raises
    (``torch.cuda.set_sync_debug_mode``). ``extra``: keyword tensors (scales, latent projections)."""
    extra = extra or {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            torch.ops.moecomp.moe_forward(static_x, *args, spec.key, **extra)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            static_out = torch.ops.moecomp.moe_forward(static_x, *args, spec.key, **extra)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
    return graph, static_out


# Real layer sizes of the families the benchmarks and GPU tests use (bf16 on the GPU).
LAYER_PRESETS = {
    "mixtral_8x7b": MoESpec(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    "qwen3_30b_a3b": MoESpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, round_weights=True),
    "qwen15_moe_a27b": MoESpec(num_experts=60, top_k=4, hidden_size=2048, intermediate_size=1408, renormalize=False,
                               round_weights=True, shared=SharedExpertSpec(5632, gate="sigmoid")),
    "olmoe_1b_7b": MoESpec(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=1024, renormalize=False,
                           round_weights=True),
    "deepseek_v3": MoESpec(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, scoring="sigmoid",
                           has_correction_bias=True, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                           renorm_eps=1e-20, router_fp32=True, shared=SharedExpertSpec(2048)),
    # Llama 4 Scout (issue 21): top-1 sigmoid of the chosen logit applied to the expert's input, [E, H, 2I] experts,
    # an ungated-by-router shared expert of the same width (the spec the FX pass reads from Llama4TextMoe)
    "llama4_scout": MoESpec(num_experts=16, top_k=1, hidden_size=5120, intermediate_size=8192, scoring="sigmoid",
                            score_order="topk_then_score", renormalize=False, weight_on_input=True, round_weights=True,
                            w_layout="in_out", shared=SharedExpertSpec(8192, layout="separate")),
}


# ----------------------------------------------------------------------------------------------- timing
def host_us(fn, n: int = 200) -> float:
    """Host time of one CUDA call in us: n back-to-back calls without a sync, over n (after one warm call)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


class StepClock:
    """A transformers stopping criterion that stops nothing: it synchronizes (on CUDA) and reads the clock after
    every generated token, so decode steps are timed inside one ``generate()`` call."""

    def __init__(self, cuda: bool):
        self.cuda, self.times = cuda, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


# ----------------------------------------------------------------------------------------------- toy blocks
def count_calls(monkeypatch, module, names) -> list:
    """Wrap each function ``names`` of ``module`` (pytest's ``monkeypatch``) so that every call appends its name to
    the returned list, then runs it: tests that a path (a launcher) really ran, in order."""
    calls = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    return calls


# Plain-PyTorch MoE blocks in layouts transformers' families do not use, for tests of detection and binding.
class LinearExpert(torch.nn.Module):
    """One expert MLP of ``nn.Linear``s (the transformers-4 / remote-code layout of a ModuleList of experts)."""

    def __init__(self, H: int, I: int):
        super().__init__()
        self.w1 = torch.nn.Linear(H, I, bias=False)
        self.w3 = torch.nn.Linear(H, I, bias=False)
        self.w2 = torch.nn.Linear(I, H, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class SplitExperts(torch.nn.Module):
    """Experts with separate 3-D ``gate_proj`` [E, I, H] and ``up_proj`` [E, I, H] (no gate_up_proj)."""

    def __init__(self, E: int, H: int, I: int):
        super().__init__()
        self.num_experts = E
        self.gate_proj = torch.nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.up_proj = torch.nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I) * 0.2)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x, ids, w):  # x [T, H], ids / w [T, k]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                h = self.act_fn(x[tok] @ self.gate_proj[e].T) * (x[tok] @ self.up_proj[e].T)
                out.index_add_(0, tok, (h @ self.down_proj[e].T) * w[tok, slot, None])
        return out


class SplitBlock(torch.nn.Module):
    """Softmax top-k routing (renormalised) over :class:`SplitExperts`."""

    def __init__(self, E: int = 6, H: int = 32, I: int = 24, k: int = 2):
        super().__init__()
        self.top_k = k
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = SplitExperts(E, H, I)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w = torch.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(w, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, w).view(b, s, h)


def rewrite_block_graph(block: torch.nn.Module, example: torch.Tensor, blocks: int = 1):
    """A block captured by Dynamo, detected and rewritten in place (the compile backend's steps, inner compiler
    left out): asserts exactly ``blocks`` rewrites and returns ``(gm, before, after)``, the graph's first output
    before and after the rewrite on the captured inputs (no grad)."""
    import copy

    from ..recognise.capture import capture_block
    from ..recognise.fx import detect_moe as dm
    from ..recognise.fx.rewrite_moe import rewrite_moe

    cap = capture_block(block, example)
    res = dm.detect_moe(cap.gm, cap.example_inputs)
    gm, inputs = cap.gm, cap.concrete_inputs()
    with torch.no_grad():
        before = copy.deepcopy(gm)(*inputs)
        n = rewrite_moe(gm, res.matches)
        assert n == blocks, f"rewrote {n} blocks, expected {blocks}"
        after = gm(*inputs)
    first = lambda y: y[0] if isinstance(y, (tuple, list)) else y  # noqa: E731
    return gm, first(before), first(after)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b`` (in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_replays(graph, static_x: torch.Tensor, static_out: torch.Tensor, inputs, reference_fn, tol: float) -> None:
    """Replay a captured moe_forward (``capture_moe_forward``) on each of ``inputs`` (copied into ``static_x``; the
    output NaN-poisoned first) and assert a finite result within ``tol`` of ``reference_fn(static_x)``."""
    for x in inputs:
        static_x.copy_(x.to(static_x.dtype))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(static_out, reference_fn(static_x))
        assert torch.isfinite(static_out).all() and err < tol, err


def random_norm_args(spec: MoESpec, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     seed: int | None = None) -> dict:
    """The norms' weights of ``spec`` (``spec.norm_shapes()``: ``latent_norm_w`` / ``expert_norm_w``; {} without
    norms), as keyword arguments of the op and the reference. N(0, 0.3): (1 + w) forms stay well away from 0."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(1234 if seed is None else seed)
    return {n: (0.3 * torch.randn(s, generator=g, device=device)).to(dtype) for n, s in spec.norm_shapes().items()}


def check_op(args, extra: dict, spec: MoESpec, tol: float) -> torch.Tensor:
    """``moe_forward`` on ``args`` (x and MOE_ARGS' tensors) plus the named ``extra`` tensors against
    ``reference.moe_forward``: same shape, finite, max |diff| / max |ref| below ``tol``. Returns the op's output."""
    from ..oracle import reference  # noqa: PLC0415

    out = torch.ops.moecomp.moe_forward(*args, spec.key, **extra)
    ref = reference.moe_forward(*args, spec, **extra)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < tol, f"{spec.describe()}: rel err {err:.2e}"
    return out


def routing_near_ties(opt: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: positions of ``seq`` where some rewritten MoE block's expert (or group) choice sits within a bf16
    rounding of a tie (``reference.near_tie_tokens`` on each block's input and the router tensors its op reads).
    ``opt``: an optimized model (``moecomp.optimize``). Two implementations' router GEMMs may round such a position's
    logits apart and pick different experts, so token-level comparisons in bf16 leave these positions out."""
    from ..oracle import reference
    from ..bind.bind import resolve as _resolve
    from ..api.optimize import TIE_REL, rewritten_blocks

    seen = []
    hooks = [b.register_forward_pre_hook(lambda mod, a, kw: seen.append((mod, a[0] if a else kw["hidden_states"])),
                                         with_kwargs=True) for b in rewritten_blocks(opt).values()]
    try:
        with torch.no_grad():
            opt(seq)
    finally:
        for h in hooks:
            h.remove()
    near = torch.zeros(seq.shape, dtype=torch.bool, device=seq.device)
    for mod, x in seen:
        st = mod._moecomp
        spec = st.op_spec or st.spec
        t = [None if p is None else _resolve(mod, p) for p in st.paths[:3]]
        with torch.no_grad():
            near |= reference.near_tie_tokens(x.reshape(-1, x.shape[-1]), *t, spec,
                                              TIE_REL[torch.bfloat16]).reshape(seq.shape)
    return near


# ------------------------------------------------------------------------------------------------ memory
class PeakMemory:
    """The most bytes held above those held on entry, while the context is active: ``with PeakMemory(device) as m:
    ...``, then ``m.peak`` (and ``m.end``: what was still held on exit). What ``moecomp.optimize`` / ``scan`` /
    the compile backend may hold beyond one plain forward is ``policy.RECOGNITION_MEMORY_BYTES``
    (``benchmarks/mem_optimize.py``, ``tests/test_memory.py``).

    CUDA: the caching allocator's statistics (``torch.cuda.max_memory_allocated`` after a reset, less the bytes
    allocated on entry). CPU: every allocation and free of the CPU allocator while active, from the profiler's
    memory events, summed in time order. Unlike a ``TorchDispatchMode``, which sees only what the ops it
    intercepts return, these see the temporaries inside custom ops (``dequant_4bit``) and composite kernels too."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak = self.end = 0
        self._prof = None
        self._base = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.end = torch.cuda.memory_allocated(self.device) - self._base
            return False
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        live = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            live += e.nbytes()  # (a free: negative; frees of what was held on entry are not reported)
            peak = max(peak, live)
        self.peak, self.end = peak, live
        self._prof = None
        return False


def forward_peak(block: torch.nn.Module, x: torch.Tensor, **kwargs) -> int:
    """Peak bytes of one plain (no-grad) forward of ``block`` on ``x`` above what was held before: the working
    memory ``policy.RECOGNITION_MEMORY_BYTES`` is counted on top of."""
    with torch.no_grad(), PeakMemory(x.device) as m:
        out = block(x, **kwargs)
        del out
    return m.peak
