"""End-to-end ``generate()`` on one GPU: every way a user can run an HF MoE model, side by side.

Models are built on the device from config (real layer sizes, random weights N(0, 0.02), bf16, depth cut to fit;
no downloads). Prompt of ``--prompt`` random tokens (no padding), ``--new`` new tokens, greedy, ``min_new_tokens``
= ``--new`` so every path decodes the same number of steps.

Paths (each timed after one untimed warm-up call with the same arguments, which also compiles / captures):
  hf                 transformers' default generate (dynamic cache, eager)
  experts_impl       experts_implementation="moecomp" (the routed experts on moecomp's op, routing HF's)
  optimize_hf        moecomp.optimize(model), then transformers' own generate (moecomp_fast=False)
  hf_static          static cache: transformers' auto torch.compile (mode="reduce-overhead")
  hf_static_moecomp  static cache + CompileConfig(backend="moecomp", mode="reduce-overhead")
  optimize_static    moecomp.optimize(model) + generate(cache_implementation="static") (transformers' compile)
  one_liner          moecomp.optimize(model) + generate(): moecomp's static cache and whole-step CUDA graphs

Timing: for transformers' loops a stopping criterion that synchronizes and reads the clock after every token (the
loop synchronizes there anyway to test for the end): prefill = start -> first token, decode = mean of the following
steps. For the one-liner, CUDA events around the prefill and around the decode loop (``model.generate.last``).
tokens/s = batch / decode step.

Floor per decode step = bytes the step must read / the copy rate measured in this run: every weight except the
embedding table (B rows of it) and the routed experts (only the distinct experts the batch's routing touched, counted
in the ``hf`` run with hooks on the experts modules), plus the KV cache at the mean context length. Prefill floor =
max(bytes / copy rate, FLOPs / matmul rate) with every expert the prompt touched.

Tokens: each path's greedy tokens are compared with the ``hf`` path's (``match``: share of identical tokens; bf16
paths diverge after the first near-tie, so ``first_diff`` gives the step of the first difference).

    PYTHONPATH=. python3 benchmarks/bench_generate.py                       # all models, batches, paths
    PYTHONPATH=. python3 benchmarks/bench_generate.py --models qwen3 --batches 1,32 --profile
    python3 benchmarks/bench_generate.py --device cpu --tiny                # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_moe import _save, _slug, environment, git_commit  # noqa: E402
from gen_optimize import NotOptimized, generate_replaced, optimize_checked, require_generate  # noqa: E402,F401
import gen_profile  # noqa: E402
from gen_run import ONE_LINER_WARM, run_hf_loop, run_one_liner  # noqa: E402,F401  (re-exported)

MODELS = {
    "qwen3": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", 12, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, norm_topk_prob=True)),
    "qwen2": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", 12, dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts=60, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
        norm_topk_prob=False)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", 8, dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=None)),
    "deepseek": ("DeepseekV3ForCausalLM", "DeepseekV3Config", 3, dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, head_dim=64, vocab_size=129280, first_k_dense_replace=0)),
}
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, q_lora_rank=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
ALL_PATHS = ("hf", "experts_impl", "optimize_hf", "hf_static", "hf_static_moecomp", "optimize_static", "one_liner")
# the engine with one of its parts off or changed (--variants): path -> (environment variable, value, default)
ENGINE_OPTIONS = {"one_liner_no_overlap": ("MOECOMP_NO_OVERLAP", "1", "0"),
                  "one_liner_no_fse": ("MOECOMP_NO_FSE", "1", "0"),
                  "one_liner_eager_layers": ("MOECOMP_GENERATE_COMPILE", "0", "1"),
                  "one_liner_eager_prefill": ("MOECOMP_GENERATE_COMPILE_PREFILL", "0", "1"),
                  "one_liner_sdpa": ("MOECOMP_DECODE_ATTENTION", "0", "1"),
                  "one_liner_align64": ("MOECOMP_ALIGN_SMALL_P", "64", "256"),
                  # the prefill (issue 41): uncaptured (today's), or its graph with Inductor per bucket / eager layers
                  "one_liner_no_prefill_graph": ("MOECOMP_GENERATE_PREFILL_GRAPH", "0", "1"),
                  "one_liner_prefill_static": ("MOECOMP_GENERATE_PREFILL_LAYERS", "static", "dynamic"),
                  "one_liner_prefill_eager_layers": ("MOECOMP_GENERATE_PREFILL_LAYERS", "eager", "dynamic"),
                  # the fused decode launches (issue 41): each alone, and the two opt-in ones together
                  "one_liner_fuse_linears": ("MOECOMP_FUSE_LINEARS", "1", "0"),
                  "one_liner_skinny_pdl": ("MOECOMP_SKINNY_PDL", "1", "0"),
                  "one_liner_fuse_norm": ("MOECOMP_FUSE_NORM", "1", ""),  # every graph (default: auto, rows <= 2)
                  "one_liner_no_fuse_norm": ("MOECOMP_FUSE_NORM", "0", ""),
                  "one_liner_fuse_oproj": ("MOECOMP_FUSE_OPROJ", "1", "0"),  # o_proj + add + post-attention norm
                  "one_liner_fuse_qkrope": ("MOECOMP_FUSE_QKROPE", "1", "0"),  # q / k norms, rotary, cache writes
                  "one_liner_attn1": ("MOECOMP_ATTN_ONE_LAUNCH", "1", "0"),  # decode attention in one launch
                  "one_liner_fused": (("MOECOMP_FUSE_LINEARS", "1", "0"), ("MOECOMP_SKINNY_PDL", "1", "0"))}
EXTRA_PATHS = tuple(ENGINE_OPTIONS)
COMPILED = ("hf_static", "hf_static_moecomp", "optimize_static")


def log(msg: str):
    print(msg, flush=True)


# ================================================================================================ models
def build(name: str, device, dtype, layers: int | None, tiny: bool, seed: int):
    import transformers

    cls_name, cfg_name, depth, sizes = MODELS[name]
    sizes = dict(sizes)
    if tiny:
        sizes.update({k: v for k, v in TINY.items() if k in sizes or k in ("head_dim",)})
        for k in ("num_experts", "n_routed_experts"):
            if k in sizes:
                sizes[k] = 8
        if name == "qwen2":
            sizes["num_experts"] = 6
        if name == "deepseek":
            sizes.update(n_group=4, topk_group=2, num_key_value_heads=4, head_dim=16, num_attention_heads=4)
        depth = 2
    cfg = getattr(transformers, cfg_name)(num_hidden_layers=layers or depth, max_position_embeddings=4096,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, cls_name)._from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "correction_bias" in n:
                p.normal_(0.0, 0.01)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


def experts_modules(model):
    return [m for n, m in model.named_modules() if n.endswith(".experts") and hasattr(m, "gate_up_proj")]


def param_bytes(model) -> dict:
    emb = model.get_input_embeddings().weight
    expert = sum(p.numel() * p.element_size() for m in experts_modules(model) for p in m.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    per_expert = sum(p[0].numel() * p.element_size() for m in experts_modules(model)[:1] for p in m.parameters())
    return dict(total=total, expert=expert, embedding=emb.numel() * emb.element_size(), per_expert=per_expert,
                row=emb.shape[1] * emb.element_size(), moe_layers=len(experts_modules(model)))


def kv_bytes_per_token(model, device) -> int:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    n = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


class RoutingCounter:
    """Forward pre-hooks on the experts modules: distinct experts per call, split by call size."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []  # (tokens, distinct experts)
        self.handles = [m.register_forward_pre_hook(self._hook) for m in experts_modules(model)]

    def _hook(self, mod, args):
        if len(args) >= 2 and isinstance(args[1], torch.Tensor):
            self.calls.append((args[0].shape[0], int(args[1].unique().numel())))

    def remove(self):
        for h in self.handles:
            h.remove()

    def mean_distinct(self, decode: bool) -> float:
        big = max(t for t, _ in self.calls)
        xs = [d for t, d in self.calls if (t < big) == decode] or [d for _, d in self.calls]
        return sum(xs) / len(xs)


def floors(pb: dict, kv_tok: int, distinct_decode: float, distinct_prefill: float, B: int, S: int, new: int,
           ceil: dict, active_params_tok: float) -> dict:
    bw, mm = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    dense = pb["total"] - pb["expert"] - pb["embedding"]  # attention, norms, routers, shared experts, lm_head
    dec = dense + B * pb["row"] + pb["moe_layers"] * distinct_decode * pb["per_expert"] + B * (S + new / 2) * kv_tok
    pre = dense + B * S * pb["row"] + pb["moe_layers"] * distinct_prefill * pb["per_expert"] + B * S * kv_tok
    flops = 2 * B * S * active_params_tok
    return dict(decode_ms=dec / bw * 1e3, prefill_ms=max(pre / bw, flops / mm) * 1e3, decode_bytes=dec,
                prefill_bytes=pre, prefill_flops=flops, distinct_experts_decode=distinct_decode,
                distinct_experts_prefill=distinct_prefill)


# ================================================================================================ timing
def compare(out: torch.Tensor, ref: torch.Tensor, S: int) -> dict:
    a, b = out[:, S:], ref[:, S:]
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n])
    diff = (~same).any(0).nonzero()
    return dict(match=float(same.float().mean()), first_diff=int(diff[0]) if len(diff) else None,
                lengths=(int(a.shape[1]), int(b.shape[1])))


# ================================================================================================ paths
def _options(path: str) -> tuple:
    """The (variable, value, default) triples a path sets: one, or a tuple of them."""
    opt = ENGINE_OPTIONS[path]
    return opt if isinstance(opt[0], tuple) else (opt,)


ENGINE_DEFAULTS = {var: default for path in ENGINE_OPTIONS for var, _, default in _options(path)}


def set_path(model, path: str, state: dict):
    """Put the model in the state ``path`` needs (undoing the previous one)."""
    import moecomp

    opt_paths = ("optimize_hf", "optimize_static") + tuple(p for p in ALL_PATHS + EXTRA_PATHS if "one_liner" in p)
    if state.get("optimized") and path not in opt_paths:
        moecomp.unoptimize(model)
        state["optimized"] = False
    want_impl = "moecomp" if path == "experts_impl" else "grouped_mm"
    if state.get("impl", "grouped_mm") != want_impl:
        model.set_experts_implementation(want_impl)
        state["impl"] = want_impl
    # engine options: each variable at its default, except the one this path changes
    want = dict(ENGINE_DEFAULTS)
    for var, val, _ in (_options(path) if path in ENGINE_OPTIONS else ()):
        want[var] = val
    changed = [var for var, val in want.items() if os.environ.get(var, ENGINE_DEFAULTS[var]) != val]
    for var in changed:
        os.environ[var] = want[var]
    if "MOECOMP_NO_FSE" in changed and state.get("optimized"):
        moecomp.unoptimize(model)  # FSE is decided when a block is bound
        state["optimized"] = False
    if path in opt_paths and not state.get("optimized"):
        state["optimize"] = optimize_checked(model)
        state["optimized"] = True
    if changed and "generate" in model.__dict__:
        model.generate.release()  # graphs bake the options in: a fresh engine captures again
        model.generate.engine = None
    if path in COMPILED:
        torch._dynamo.reset()
        model.__dict__.pop("_compiled_call", None)
        model._last_compile_config = None if hasattr(model, "_last_compile_config") else None


def run_path(model, path: str, ids, new: int, cuda: bool) -> dict:
    from transformers import CompileConfig

    kw = {}
    if path in COMPILED:
        kw["cache_implementation"] = "static"
        if path == "hf_static_moecomp":
            kw["compile_config"] = CompileConfig(backend="moecomp", mode="reduce-overhead")
    if path == "optimize_hf":
        kw["moecomp_fast"] = False
    rec = {}
    try:
        from torch._dynamo.utils import counters as dcounters

        skips0 = sum(dcounters["inductor"].get(k, 0) for k in dcounters["inductor"] if "cudagraph_skips" in k)
    except Exception:
        dcounters, skips0 = None, 0
    t = time.perf_counter()
    # warm-up calls: compiled transformers paths need the timed length (the static cache is sized by it); the
    # one-liner needs two of 3 new tokens (the first compiles the step and captures it at step 2, after step 1's
    # eager warm-up; the second compiles the prefill), so that the timed call replays from step 1 (with 2 new
    # tokens no step was captured and the timed call paid an eager step and the capture: up to 0.5 ms per step at
    # 64 tokens, measured on Qwen3 B=1, 5e86cd5); eager paths one short call. Then the timed call.
    warm = [new] if path in COMPILED else [ONE_LINER_WARM, ONE_LINER_WARM] if path.startswith("one_liner") else [2]
    for rep, n in enumerate(warm + [new]):
        if path.startswith("one_liner"):
            out, pre, dec, last = run_one_liner(model, ids, n, cuda)
            rec.update(graphs=last.get("graphs"), layers=last.get("layers"), prefill_layers=last.get("prefill_layers"),
                       attention=last.get("attention"), eager_steps=last.get("eager_steps"),
                       captures=last.get("captures"))
        else:
            out, pre, dec = run_hf_loop(model, ids, n, cuda, **kw)
        if rep == len(warm) - 1:
            rec["warmup_s"] = time.perf_counter() - t
    if dcounters is not None and path in COMPILED:
        rec["cudagraph_skips"] = sum(dcounters["inductor"].get(k, 0) for k in dcounters["inductor"]
                                     if "cudagraph_skips" in k) - skips0
    rec.update(prefill_ms=pre * 1e3, decode_ms=dec * 1e3, tok_s=ids.shape[0] / dec)
    if path.startswith("one_liner"):  # prefill_ms is the device time of the prefill: TTFT is the call's wall time
        rec.update(one_liner_ttft(model, ids, cuda))
    else:  # transformers' loops: the wall time from the call to the first token (StepClock) is the TTFT
        rec["ttft_ms"] = rec["prefill_ms"]
    return rec, out


def one_liner_ttft(model, ids, cuda: bool, reps: int = 3) -> dict:
    """TTFT of the one-liner as issue 20 defines it: the wall time of ``generate(..., max_new_tokens=1)`` after
    warm-up (median of ``reps``), with its breakdown from ``model.generate.last``: transformers' generate setup
    before the engine (host), the prefill's launches (host), the prefill on the device, and the rest of the call.
    Where the prefill replayed its CUDA graph (issue 41), its GPU time (CUDA events around the replay) and TTFT over
    it (the target: <= 1.5); ``ttft_prefill_graph`` says what the prefill did ("replayed", "off: why", ...)."""
    walls, parts = [], []
    require_generate(model)
    model.generate.cpu = True
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        parts.append(dict(model.generate.last))
    i = sorted(range(reps), key=walls.__getitem__)[reps // 2]
    last = parts[i]
    ms = lambda k: round(last[k] * 1e3, 3) if last.get(k) is not None else None  # noqa: E731
    gpu = ms("prefill_gpu_s")
    return dict(ttft_ms=walls[i] * 1e3, ttft_host_setup_ms=ms("host_setup_s"), ttft_prefill_host_ms=ms("prefill_host_s"),
                ttft_prefill_device_ms=ms("prefill_s"), ttft_call_ms=ms("call_s"), ttft_prefill_gpu_ms=gpu,
                ttft_over_gpu=walls[i] * 1e3 / gpu if gpu else None, ttft_prefill_graph=last.get("prefill"),
                ttft_prefill_bucket=last.get("prefill_bucket"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--paths", default="all")
    ap.add_argument("--compiled-batches", default="1,32", help="batch sizes for the torch.compile rows (slow)")
    ap.add_argument("--compiled-models", default="qwen3", help="models for the torch.compile rows")
    ap.add_argument("--variants", default="", help="cells that also run engine variants "
                    f"({', '.join(ENGINE_OPTIONS)}): model:batch=path+path,... e.g. "
                    "qwen2:1=one_liner_no_overlap+one_liner_no_fse")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--layers", default="", help="name=depth overrides, e.g. qwen3=12,mixtral=8")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--profile", default="", help="profile decode steps of the first model: path:batch,... "
                    "(e.g. hf:1,one_liner:1,one_liner:32)")
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--repeat", type=int, default=1, help="run the engine's paths (one_liner*) of each cell this many "
                    "times, interleaved, each on a fresh engine; the table adds their median and range")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-json", default=None)
    return ap.parse_args(argv)


def measure_ceilings(device) -> dict:
    if device.type != "cuda":
        return dict(copy_bytes_per_s=2e10, matmul_flops_per_s=1e11, note="CPU: nominal, not measured")
    import triton.testing

    n = 1 << 29
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t2 = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    del src, dst, a, b
    torch.cuda.empty_cache()
    return dict(copy_bytes_per_s=4 * n / (t * 1e-3), matmul_flops_per_s=2 * 8192**3 / (t2 * 1e-3))


def run(argv=None) -> dict:
    args = parse_args(argv)
    args.profile_paths = [(p.split(":")[0], int(p.split(":")[1]) if ":" in p else 1)
                          for p in args.profile.split(",") if p]
    args.variant_cells = {c.split("=")[0]: c.split("=")[1].split("+") for c in args.variants.split(",") if "=" in c}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    models = list(MODELS) if args.models == "all" else args.models.split(",")
    paths = list(ALL_PATHS) if args.paths == "all" else args.paths.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    cbatches = [int(b) for b in args.compiled_batches.split(",")]
    cmodels = args.compiled_models.split(",")
    depth = {k: int(v) for k, v in (x.split("=") for x in args.layers.split(",") if x)}
    S, new = (16, 8) if args.tiny else (args.prompt, args.new)
    t_start = time.perf_counter()
    ceil = measure_ceilings(device)
    result = dict(env=environment(device), commit=git_commit(), date=datetime.date.today().isoformat(),
                  args={k: v for k, v in vars(args).items() if k not in ('profile_paths', 'variant_cells')}, ceilings=ceil, rows=[], profiles=[], errors=[])
    log(f"# {result['env'].get('gpu')} torch {torch.__version__} commit {result['commit']}: copy "
        f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    for name in models:
        if time.perf_counter() - t_start > args.budget_s:
            result["errors"].append(f"{name}: skipped (budget)")
            continue
        model = build(name, device, dtype, depth.get(name), args.tiny, args.seed)
        pb = param_bytes(model)
        kv_tok = kv_bytes_per_token(model, device)
        H = model.config.hidden_size
        n_layers = pb["moe_layers"]
        k = model.config.num_experts_per_tok
        active = (pb["total"] - pb["expert"] - pb["embedding"]) / 2 + n_layers * k * pb["per_expert"] / 2
        log(f"## {name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {n_layers} MoE layers, "
            f"KV {kv_tok} B/token")
        state: dict = {}  # what set_path did to the model (optimized, experts implementation), across batches
        for B in batches:
            if time.perf_counter() - t_start > args.budget_s:
                result["errors"].append(f"{name} B={B}: skipped (budget)")
                continue
            g = torch.Generator().manual_seed(args.seed + B)
            ids = torch.randint(3, model.config.vocab_size, (B, S), generator=g).to(device)
            cell = {"ref": None}  # the "hf" path's tokens, once it ran
            state.pop("floor", None)
            cell_paths = list(paths) + args.variant_cells.get(f"{name}:{B}", [])
            # --repeat N: the engine's paths again, interleaved (A B A B ...), each time on a fresh engine
            order = [(0, p) for p in cell_paths] + [(rep, p) for rep in range(1, args.repeat) for p in cell_paths
                                                    if p.startswith("one_liner")]
            for rep, path in order:
                if path in COMPILED and (B not in cbatches or name not in cmodels):
                    continue
                if rep and "generate" in model.__dict__:
                    model.generate.release()  # a fresh engine: its own capture, compile cache as it is
                    model.generate.engine = None
                if time.perf_counter() - t_start > args.budget_s:
                    result["errors"].append(f"{name} B={B} {path}: skipped (budget)")
                    continue
                row = dict(model=name, batch=B, path=path, prompt=S, new=new, rep=rep)
                try:
                    _measure_path(row, model, path, ids, new, cuda, state, cell, (pb, kv_tok, ceil, active))
                except Exception as e:  # the row records the failure; the run goes on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    result["errors"].append(f"{name} B={B} {path}: {row['error']}")
                    traceback.print_exc()
                    if cuda:
                        try:
                            torch.cuda.synchronize()
                        except Exception:
                            result["errors"].append("CUDA context lost: stopping")
                            result["rows"].append(row)
                            return _finish(result, args)
                result["rows"].append(row)
                log(_row_line(row))
            if state.get("floor"):
                result.setdefault("floors", []).append(dict(model=name, batch=B, **state["floor"]))
        if "optimize" in state:  # what optimize left (moecomp.optimize's report, in short)
            result.setdefault("optimize", {})[name] = state["optimize"]
        if args.profile and name == models[0]:
            profile_paths(model, name, state, args, S, device, result)
        import moecomp

        moecomp.unoptimize(model)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return _finish(result, args)


def profile_paths(model, name: str, state: dict, args, S: int, device, result: dict) -> None:
    """``--profile``: each (path, batch) of ``args.profile_paths`` profiled (``gen_profile.profile_steps``), logged
    and kept."""
    for path, B in args.profile_paths:
        ids = torch.randint(3, model.config.vocab_size, (B, S)).to(device)
        try:
            set_path(model, path, state)
            p = gen_profile.profile_steps(model, path, ids, device.type == "cuda")
            result["profiles"].append(dict(model=name, batch=B, **p))
            top = p.pop("top_kernels_us_per_step")
            log(f"profile {name} B={B} {path}: {p}")
            for t in top[:12]:
                log(f"    {t[0]:8.2f} us/step  x{t[1]:<6g} {t[2]}")
        except Exception as e:
            result["errors"].append(f"profile {path}: {type(e).__name__}: {e}")


def _measure_path(row: dict, model, path: str, ids, new: int, cuda: bool, state: dict, cell: dict, sizes) -> None:
    """One path of one (model, batch) cell timed into ``row``: its tokens compared with the "hf" path's (kept in
    ``cell``), its times over the floor (the "hf" path counts the routing the floor needs, in ``state``)."""
    pb, kv_tok, ceil, active = sizes
    B, S = ids.shape
    set_path(model, path, state)
    if path == "hf":  # routing counted in a short untimed call (its hooks synchronize)
        counter = RoutingCounter(model)
        try:
            run_hf_loop(model, ids, 3, cuda)
        finally:
            counter.remove()
        state["floor"] = floors(pb, kv_tok, counter.mean_distinct(True), counter.mean_distinct(False),
                                B, S, new, ceil, active)
    rec, out = run_path(model, path, ids, new, cuda)
    if path == "hf":
        cell["ref"] = out
    row.update(rec)
    if cell["ref"] is not None:
        row["tokens"] = compare(out, cell["ref"], S)
    fl = state.get("floor")
    if fl is not None:
        row.update(floor_decode_ms=fl["decode_ms"], floor_prefill_ms=fl["prefill_ms"],
                   decode_vs_floor=row["decode_ms"] / fl["decode_ms"],
                   prefill_vs_floor=row["prefill_ms"] / fl["prefill_ms"])


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:8s} B={r['batch']:<4d} {r['path']:18s} ERROR {r['error']}"
    tok = r.get("tokens", {})
    ttft = f"  TTFT {r['ttft_ms']:.1f} ms" if r.get("ttft_ms") is not None else ""
    if r.get("ttft_host_setup_ms") is not None:
        ttft += (f" (setup {r['ttft_host_setup_ms']:.1f} + prefill launch {r['ttft_prefill_host_ms']:.1f} host; "
                 f"prefill {r['ttft_prefill_device_ms']:.1f} device; graph: {r.get('ttft_prefill_graph')}")
        ttft += (f", GPU {r['ttft_prefill_gpu_ms']:.1f} ms, TTFT/GPU {r['ttft_over_gpu']:.2f})"
                 if r.get("ttft_prefill_gpu_ms") else ")")
    return (f"{r['model']:8s} B={r['batch']:<4d} {r['path']:18s} prefill {r['prefill_ms']:8.2f} ms  decode "
            f"{r['decode_ms']:7.3f} ms/step ({r.get('decode_vs_floor', float('nan')):.2f}x floor)  "
            f"{r['tok_s']:8.1f} tok/s  match {tok.get('match', float('nan')):.2f}"
            + (f"  graphs: {r['graphs']}" if r.get("graphs") else "")
            + (f"  cudagraph skips {r['cudagraph_skips']}" if r.get("cudagraph_skips") else "") + ttft)


def _finish(result: dict, args) -> dict:
    path = args.out_json
    if path is None and not args.tiny:
        gpu = _slug(result["env"].get("gpu", "cpu"))
        path = os.path.join(HERE, "results", f"{gpu}-{result['date']}-{result['commit'][:7]}-generate.json")
    if path:
        _save(result, path)
    log("\n" + table(result))
    for line in repeat_summary(result["rows"]):
        log(line)
    for e in result["errors"]:
        log(f"error: {e}")
    return result


def repeat_summary(rows: list) -> list[str]:
    """``--repeat``: per (model, batch, path) run more than once, the median decode ms/step, its range and the median
    against the cell's plain one-liner's median (interleaved runs: drift between engines shows as the range)."""
    runs: dict = {}
    for r in rows:
        if "error" not in r and r.get("decode_ms") is not None:
            runs.setdefault((r["model"], r["batch"], r["path"]), []).append(r["decode_ms"])
    if not any(len(v) > 1 for v in runs.values()):
        return []
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = ["", "| model | B | path | runs | decode ms/step (median) | min - max | / one_liner |", "|---|---|---|---|---|---|---|"]
    for (name, B, path), v in runs.items():
        base = med.get((name, B, "one_liner"))
        ratio = f"{med[(name, B, path)] / base:.3f}" if base else "-"
        out.append(f"| {name} | {B} | {path} | {len(v)} | {med[(name, B, path)]:.3f} | {min(v):.3f} - {max(v):.3f} "
                   f"| {ratio} |")
    return out


def ttft_summary(rows: list) -> list[str]:
    """Per (model, batch): the one-liner's TTFT, its prefill's GPU time and the ratio, beside transformers' best
    TTFT (the faster of transformers' own paths that ran: ``hf`` eager, ``hf_static`` static cache + compile)."""
    out = []
    cells = {}
    for r in rows:
        if "error" not in r and r.get("ttft_ms") is not None:
            cells.setdefault((r["model"], r["batch"]), []).append(r)
    for (name, B), rs in cells.items():
        ours = next((r for r in rs if r["path"] == "one_liner"), None)
        hf = [r for r in rs if r["path"] in ("hf", "hf_static")]  # transformers alone: eager, static + compile
        if ours is None or not hf:
            continue
        best = min(hf, key=lambda r: r["ttft_ms"])
        gpu = (f", prefill GPU {ours['ttft_prefill_gpu_ms']:.2f} ms (TTFT/GPU {ours['ttft_over_gpu']:.2f})"
               if ours.get("ttft_prefill_gpu_ms") else f", prefill {ours.get('ttft_prefill_graph')}")
        out.append(f"TTFT {name} B={B}: one_liner {ours['ttft_ms']:.2f} ms{gpu}; transformers' best "
                   f"{best['ttft_ms']:.2f} ms ({best['path']}): x{ours['ttft_ms'] / best['ttft_ms']:.2f}")
    return out


def table(result: dict) -> str:
    lines = ["| model | B | path | prefill ms | TTFT ms | prefill GPU ms | TTFT / GPU | decode ms/step | x floor "
             "| tok/s | tokens = hf |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['path']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        tok = r.get("tokens", {})
        ttft = f"{r['ttft_ms']:.2f}" if r.get("ttft_ms") is not None else "-"
        gpu = (f"{r['ttft_prefill_gpu_ms']:.2f} | {r['ttft_over_gpu']:.2f}" if r.get("ttft_prefill_gpu_ms")
               else "- | -")
        lines.append(f"| {r['model']} | {r['batch']} | {r['path']} | {r['prefill_ms']:.2f} | {ttft} | {gpu} | "
                     f"{r['decode_ms']:.3f} | {r.get('decode_vs_floor', float('nan')):.2f} | {r['tok_s']:.0f} | "
                     f"{tok.get('match', float('nan')):.2f} |")
    lines += ttft_summary(result["rows"])
    lines += gen_profile.profile_table(result.get("profiles", []))
    for f in result.get("floors", []):
        lines.append(f"floor {f['model']} B={f['batch']}: decode {f['decode_ms']:.3f} ms, prefill "
                     f"{f['prefill_ms']:.2f} ms (distinct experts/layer: decode {f['distinct_experts_decode']:.1f}, "
                     f"prefill {f['distinct_experts_prefill']:.1f})")
    return "\n".join(lines)


if __name__ == "__main__":
    res = run()
    sys.exit(1 if any("error" in r for r in res["rows"]) else 0)
