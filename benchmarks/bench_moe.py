#!/usr/bin/env python3
"""Time one MoE block per model family: HF eager, HF grouped_mm, torch.compile, vLLM's fused-MoE kernel (when it is
available) and moecomp's custom op.

Each block is built from transformers' own class with a config of the family's sizes, directly on the device
in bf16 (``--dtype``), weights drawn from N(0, 0.02) in place (never zeros). moecomp calls
``torch.ops.moecomp.moe_forward`` on the block's own parameters with the ``MoESpec`` and tensors moecomp's
recogniser finds in the block (``moecomp.recognise.match_block``: what ``moecomp.optimize`` would bind; the script
has no spec of its own, and a block moecomp refuses is reported with its reject code, gets no moecomp timing, and
the exit status is 3).
Before timing, every path's output is compared with the HF block (per-expert eager loop) on the same random
input; moecomp's relative error is the "check" column, the vLLM peer's "check_vllm" (flagged loudly when above
``--tol``, the run keeps going).

The vLLM peer ("vllm") is vLLM's Triton fused-MoE kernel, loaded from a standalone copy (``--vllm-peer DIR``, the
directory holding ``vllm_fused_moe.py``) or from an installed ``vllm``; the block's own HF router module computes
the routing around it and the shared expert (where the family has one) runs in plain torch. On CPU the copy runs
under the Triton interpreter in fp32 (a smoke run; its times mean nothing there).

``--routing`` picks the routing: ``real`` (default) lets the random router weights route; ``uniform`` / ``zipf`` /
``one-hot`` draw the expert ids from that distribution and plant them: the router rows are set to orthonormal
vectors and each token's input is chosen so that its router logits rank the drawn experts first (by >= 2 logits),
so every path still runs the whole block and routes through the same router to the same ids (checked per cell).

Every path is timed with plain launches and, where it can be captured (T <= 1024), as a CUDA-graph replay;
the table shows the better, the JSON both. Times are ``triton.testing.do_bench`` medians in ms. The floor
per cell is max(bytes / copy rate, FLOPs / matmul rate) with bytes counted from the experts the batch's
routing actually touched, and both ceilings measured at the start of the same run; each path's achieved
TB/s and TFLOP/s (the floor's bytes and FLOPs over its time) sit next to those ceilings.

    python3 benchmarks/bench_moe.py                      # everything (~4-6 min on an H200)
    python3 benchmarks/bench_moe.py --families qwen3,olmoe --tokens 1,128 --peers hf_grouped_mm,moecomp
    python3 benchmarks/bench_moe.py --vllm-peer .peers/vllm_fused_moe --routing zipf
    python3 benchmarks/bench_moe.py --quick --vllm-peer .peers/vllm_fused_moe --dtype fp16
    python3 benchmarks/bench_moe.py --families qwen3,olmoe --tokens 1,16 --breakdown qwen3:1,olmoe:1
    python3 benchmarks/bench_moe.py --device cpu --tiny  # a smoke run on CPU (tiny sizes, host timer)

``--dtype bf16|fp16`` (default bf16) runs everything in that dtype (blocks, inputs, every peer, the floor's bytes, the
ceilings); fp16's default tolerance is tighter (``default_tolerance``). ``--breakdown family:T,...`` profiles
moecomp's op (and the vLLM peer where it was timed) in those cells with ``torch.profiler`` once every timing of the
run is done: per-kernel device time, calls and share of the op's wall time, and the gaps (wall - kernels).

Output: ``benchmarks/results/<gpu>-<date>-<commit>.json`` (and a copy under ``$OUT`` when set), written after
every family; the markdown table is printed last. ``benchmarks/report.py`` turns JSONs into BENCHMARKS.md.
Depends only on torch, triton, transformers and the stdlib (plus moecomp from this repository).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):  # report.py (table) and moecomp (this checkout) without installing anything
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py)
from moecomp import policy  # noqa: E402  (tolerances and the near-tie window: moecomp/policy.py)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype: blocks, inputs, every peer, the floor's bytes
DTYPE = torch.bfloat16  # the run's dtype (``run`` sets it from --dtype for the run and restores it after)
INIT_STD = 0.02
CORRECTION_BIAS_STD = 0.01  # DeepSeek's e_score_correction_bias: small, random (it only steers the selection)
GRAPH_CONSISTENCY_TOL = policy.BENCH_GRAPH_CONSISTENCY_TOL  # graph replay vs plain call on a fresh input
ALL_TOKENS = (1, 16, 128, 1024, 8192)
TINY_TOKENS = (1, 16, 128)
ALL_PEERS = ("hf_eager", "hf_grouped_mm", "compile", "vllm", "moecomp")
PEER_ALIASES = {"eager": "hf_eager", "grouped_mm": "hf_grouped_mm", "grouped": "hf_grouped_mm",
                "torch_compile": "compile", "ours": "moecomp", "vllm_fused_moe": "vllm", "vllm_kernel": "vllm"}
ROUTING_MODES = ("real", "uniform", "zipf", "one-hot")
ZIPF_EXPONENT = 1.2  # zipf: expert of popularity rank r (1 = most popular) is drawn with probability ~ r^-1.2
PLANT_CHOSEN = (4.0, 6.0)  # synthetic routing: planted router logits of the drawn experts, uniform in this range,
PLANT_OTHER_STD = 0.3  # ... and of the others N(0, 0.3): the k-th and (k+1)-th logits are >= ~2 apart
VLLM_INSTALLED_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"  # fused_experts(x, w1, w2, tw, ti)
BREAKDOWN_PATHS = ("moecomp", "vllm")  # --breakdown profiles these paths (vllm only where it was timed)
BREAKDOWN_REPS = 5  # calls per profiled session (after one warm-up call)
BREAKDOWN_NAME_CHARS = 200  # kernel names kept in the JSON (the log table shortens them further)


def dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def default_tolerance(dtype: torch.dtype) -> float:
    """The check's default tolerance in ``dtype``: ``policy.BENCH_TOLERANCE`` is the bf16 rule (whole-tensor norms of
    bf16 roundings); other dtypes scale it as the policy's verify tolerances scale (fp16 keeps 11 significant bits
    against bf16's 8: its verify tolerance is a third of bf16's, so is this, 2e-2 / 3 ~ 6.7e-3)."""
    return policy.BENCH_TOLERANCE * policy.verify_tolerance(dtype) / policy.verify_tolerance(torch.bfloat16)


class FatalCudaError(RuntimeError):
    """The CUDA context is no longer usable (a sticky error): stop timing, keep what we have."""


# ======================================================================================= model families
@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # key used by --families and in PEERS_MD
    label: str
    module: str  # transformers module holding config + block classes
    config_cls: str
    block_cls: str
    full: dict  # config kwargs at the real sizes
    tiny: dict  # config kwargs for --tiny (CPU smoke runs)
    aliases: tuple = ()


def _attn(heads, kv, **extra):
    return dict(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, **extra)


FAMILIES = {
    f.name: f
    for f in (
        Family("mixtral", "Mixtral-8x7B", "transformers.models.mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
               dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    router_jitter_noise=0.0, **_attn(32, 8)),
               dict(hidden_size=64, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                    router_jitter_noise=0.0, **_attn(4, 2))),
        Family("qwen3", "Qwen3-30B-A3B", "transformers.models.qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
               dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                    norm_topk_prob=True, **_attn(32, 4, head_dim=128)),
               dict(hidden_size=64, moe_intermediate_size=32, num_experts=32, num_experts_per_tok=8,
                    norm_topk_prob=True, **_attn(4, 2, head_dim=16)),
               ("qwen3_moe", "qwen3-30b-a3b")),
        Family("qwen2", "Qwen1.5-MoE-A2.7B", "transformers.models.qwen2_moe", "Qwen2MoeConfig",
               "Qwen2MoeSparseMoeBlock",
               dict(hidden_size=2048, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                    num_experts_per_tok=4, norm_topk_prob=False, **_attn(16, 16)),
               dict(hidden_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=96, num_experts=12,
                    num_experts_per_tok=4, norm_topk_prob=False, **_attn(4, 2)),
               ("qwen2_moe", "qwen1.5", "qwen15")),
        Family("olmoe", "OLMoE-1B-7B", "transformers.models.olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
               dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                    norm_topk_prob=False, **_attn(16, 16)),
               dict(hidden_size=64, intermediate_size=32, num_experts=16, num_experts_per_tok=8,
                    norm_topk_prob=False, **_attn(4, 4))),
        Family("deepseek", "DeepSeek-V3 layer", "transformers.models.deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
               dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                    first_k_dense_replace=0, **_attn(128, 128)),
               # tiny: the shared expert's width (48) differs from E (32): the FX pass reads [E, H] tensors used in
               # the block as per-expert biases, so shared weights of [E, H] would make it refuse the block
               dict(hidden_size=64, moe_intermediate_size=48, n_routed_experts=32, num_experts_per_tok=8,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                    first_k_dense_replace=0, **_attn(4, 4)),
               ("deepseek_v3", "deepseek-v3", "dsv3")),
    )
}


def _resolve(names: str, table: dict, aliases: dict, what: str) -> list[str]:
    if names in ("all", ""):
        return list(table)
    out = []
    for n in names.split(","):
        n = n.strip().lower()
        if not n:
            continue
        n = aliases.get(n, n)
        if n not in table:
            raise SystemExit(f"unknown {what} {n!r}; choose from {', '.join(table)}")
        if n not in out:
            out.append(n)
    return out


def build_block(fam: Family, tiny: bool, device: torch.device, seed: int):
    """The HF block on ``device`` in bf16 (router / bias buffers keep the dtype the class gives them),
    every floating parameter and the correction bias drawn in place (never zeros)."""
    mod = importlib.import_module(fam.module)
    cfg = getattr(mod, fam.config_cls)(**(fam.tiny if tiny else fam.full))
    block_cls = getattr(mod, fam.block_cls, None)
    if block_cls is None:  # older layouts export the block from modeling_* only
        block_cls = getattr(importlib.import_module(f"{fam.module}.modeling_{fam.module.rsplit('.', 1)[1]}"),
                            fam.block_cls)
    try:  # set before construction too (some versions may read it in __init__)
        set_experts_impl(None, cfg, "grouped_mm")
    except Exception:
        pass
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            block = block_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    block.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.requires_grad_(False)
            if p.is_floating_point():
                p.normal_(0.0, INIT_STD, generator=gen)
        for name, b in block.named_buffers():
            if b.is_floating_point() and "bias" in name:
                b.normal_(0.0, CORRECTION_BIAS_STD, generator=gen)
    return cfg, block


def set_experts_impl(block, cfg, impl: str) -> None:
    """Select transformers' experts path ("eager" | "grouped_mm") on this block, across 5.17 .. 5.24 APIs.

    Both versions dispatch on ``experts.config._experts_implementation`` at call time; newer ones also have
    ``set_experts_implementation`` on PreTrainedModel (not on a bare block), used when a module offers it."""
    ex = getattr(block, "experts", None) if block is not None else None
    for obj in (block, ex):
        f = getattr(obj, "set_experts_implementation", None) if obj is not None else None
        if callable(f):
            try:
                f(impl)
            except Exception:
                pass
    configs = [cfg]
    ex_cfg = getattr(ex, "config", None)
    if ex_cfg is not None and ex_cfg is not cfg:
        configs.append(ex_cfg)
    for c in configs:
        c._experts_implementation = impl
    got = getattr(ex_cfg if ex_cfg is not None else cfg, "_experts_implementation", None)
    if got != impl:
        raise RuntimeError(f"could not select experts implementation {impl!r} (config says {got!r})")


# ------------------------------------------------------------------------------------- MoESpec from moecomp
class BlockRefused(RuntimeError):
    """moecomp's recogniser refused a family's block: the benchmark has no spec of its own to fall back to."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"moecomp refused the block [{code}]: {reason}")
        self.code, self.reason = code, reason


def block_spec(block, record: dict | None = None):
    """(MoESpec, {MOE_ARGS name: tensor or None}) for ``block``, from moecomp's own recogniser and verify stage
    (``moecomp.recognise.match_block``, as ``moecomp.optimize`` sees the block, without binding it); the tensors are
    the block's own (``moecomp.hf.bind.bound_tensors``). The block is put in eval mode first. Raises
    :class:`BlockRefused` (with the reject code) when moecomp does not take the block. ``record``, when given, receives
    how the block was recognised (for the JSON)."""
    from moecomp import reject
    from moecomp.hf.bind import bound_tensors
    from moecomp.ops.common import MOE_ARGS
    from moecomp.recognise import match_block

    block.eval()
    t0 = time.perf_counter()
    try:
        v = match_block(block)
    except reject.Refused as e:
        code = getattr(e.code, "name", None) or str(e.code)
        if record is not None:
            record.update(refused=dict(code=code, reason=e.reason))
        raise BlockRefused(code, e.reason) from e
    m = v.match
    tensors = dict(zip(MOE_ARGS, bound_tensors(block, m.spec, m.bindings, m.derived)))
    if record is not None:
        record.update(method=m.evidence.method, checked=m.evidence.checked, verify_max_rel_err=v.max_rel_err,
                      bindings={k: p for k, p in m.bindings.items() if p is not None},
                      derived=[d.name for d in m.derived], notes=list(m.evidence.notes),
                      seconds=round(time.perf_counter() - t0, 2))
    return m.spec, tensors


def family_label(fam: Family, spec) -> str:
    sh = "-"
    if spec.shared is not None:
        sh = str(spec.shared.intermediate_size) + (" gated" if spec.shared.gate != "none" else "")
    topk = str(spec.top_k)
    if spec.n_group > 1:
        topk += f" grouped {spec.n_group}/{spec.topk_group}"
    return (f"{fam.label} ({spec.hidden_size}, {spec.intermediate_size}, {spec.num_experts}, {topk}, {sh})")


# ================================================================================================ floor
def floor_of(spec, T: int, ids: torch.Tensor, tensors: dict, ceilings: dict) -> dict:
    """Roofline floor from the routing actually taken (distinct experts touched by this batch)."""
    H, I, E, k = spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k
    w_item = tensors["w13"].element_size()
    distinct = int(torch.unique(ids).numel())
    nbytes = distinct * spec.bytes_per_expert(w_item)
    flops = 2 * T * k * (spec.w13_rows + I) * H
    rw = tensors["router_w"]
    nbytes += rw.numel() * rw.element_size()
    flops += 2 * T * H * E
    if tensors.get("correction_bias") is not None:
        nbytes += tensors["correction_bias"].numel() * tensors["correction_bias"].element_size()
    if spec.shared is not None:
        for n in ("shared_w1", "shared_w3", "shared_w2", "shared_gate_w"):
            t = tensors.get(n)
            if t is not None:
                nbytes += t.numel() * t.element_size()
                flops += 2 * T * t.numel()
    act_item = torch.finfo(DTYPE).bits // 8
    nbytes += 2 * T * H * act_item  # x in, out
    bytes_ms = nbytes / ceilings["copy_bytes_per_s"] * 1e3
    flops_ms = flops / ceilings["matmul_flops_per_s"] * 1e3
    return dict(floor_ms=max(bytes_ms, flops_ms), bytes=nbytes, flops=flops, bytes_ms=bytes_ms, flops_ms=flops_ms,
                bound="memory" if bytes_ms >= flops_ms else "compute", distinct_experts=distinct)


def achieved_of(fl: dict, ms: float | None, ceilings: dict) -> dict | None:
    """What a path achieved in a cell: the floor's bytes and FLOPs over its time, and the share of the ceilings."""
    if not ms or ms <= 0 or not fl:
        return None
    tbs = fl["bytes"] / ms / 1e9  # bytes / (ms * 1e-3 s) / 1e12
    tfs = fl["flops"] / ms / 1e9
    return dict(tb_per_s=tbs, tflop_per_s=tfs, copy_ceiling_frac=tbs * 1e12 / ceilings["copy_bytes_per_s"],
                matmul_ceiling_frac=tfs * 1e12 / ceilings["matmul_flops_per_s"])


# ======================================================================================= routing modes
ROUTING_METHOD = (
    "real: the router's random weights route (N(0, 0.02) rows; inputs randn). uniform / zipf / one-hot: expert ids "
    "are drawn per token (k distinct experts, weighted sampling without replacement; grouped routers: at most "
    "topk_group groups per token), then planted: the router rows are set to orthonormal vectors and each token's input "
    f"x = (randn projected off the router rows) + the part that makes its router logits U{PLANT_CHOSEN} for the drawn "
    f"experts and N(0, {PLANT_OTHER_STD}) for the others. Every path runs the whole block and routes through the same "
    "router, so all see the same ids; the ids the router actually picks are checked against the drawn ones per cell "
    "(routing.planned_match) and the floor counts those.")


class RoutingPlan:
    """Synthetic expert ids for one family: ``ids(T)`` -> [T, k] int64 on the CPU.

    uniform: every expert equally likely; zipf: the expert of popularity rank r drawn with probability ~ r^-s
    (``ZIPF_EXPONENT``; which expert has which rank is a random permutation, fixed per family); one-hot: the same k
    experts (drawn once per family, uniformly) for every token. Each token gets k distinct experts (Gumbel-top-k:
    sequential sampling without replacement in proportion to the probabilities); for grouped routers
    (``n_group > 1``) the draw keeps to at most ``topk_group`` groups per token, as the router itself would."""

    def __init__(self, mode: str, spec, seed: int):
        if mode not in ROUTING_MODES or mode == "real":
            raise ValueError(f"no synthetic routing for {mode!r}")
        self.mode, self.spec = mode, spec
        E, k = spec.num_experts, spec.top_k
        self.gen = torch.Generator().manual_seed(seed)
        if mode == "zipf":
            rank = torch.randperm(E, generator=self.gen)  # rank[e] = popularity rank of expert e (0 = most popular)
            logp = -ZIPF_EXPONENT * torch.log((rank + 1).double())
        else:
            logp = torch.zeros(E, dtype=torch.float64)
        self.probs = torch.softmax(logp, -1)  # per-draw probabilities (before "without replacement")
        self.grouped = spec.n_group > 1 and spec.score_order != "topk_then_score"
        if self.grouped and spec.topk_group * (E // spec.n_group) < k:
            raise ValueError(f"topk_group {spec.topk_group} x {E // spec.n_group} experts per group < top-k {k}")
        self.fixed = self._draw(1) if mode == "one-hot" else None

    def _draw(self, n: int) -> torch.Tensor:
        spec = self.spec
        E, k = spec.num_experts, spec.top_k
        u = torch.rand(n, E, generator=self.gen, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        keys = torch.log(self.probs)[None, :] - torch.log(-torch.log(u))  # + Gumbel noise
        ids = torch.empty(n, k, dtype=torch.long)
        taken = torch.zeros(n, E, dtype=torch.bool)
        rows = torch.arange(n)
        if self.grouped:
            G, per = spec.n_group, E // spec.n_group
            used = torch.zeros(n, G, dtype=torch.bool)
        for j in range(k):
            allowed = ~taken
            if self.grouped:
                full = used.sum(-1, keepdim=True) >= spec.topk_group
                allowed &= ~full | used.repeat_interleave(per, dim=1)
            e = keys.masked_fill(~allowed, -math.inf).argmax(-1)
            ids[:, j] = e
            taken[rows, e] = True
            if self.grouped:
                used[rows, e // per] = True
        return ids

    def ids(self, T: int) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed.expand(T, -1).clone()
        return self._draw(T)

    def describe(self) -> dict:
        d = dict(mode=self.mode, group_limit=self.grouped)
        if self.fixed is not None:
            d["one_hot_experts"] = [int(i) for i in self.fixed[0]]
        if self.mode == "zipf":
            top = torch.topk(self.probs, min(4, self.probs.numel()))
            d.update(zipf_exponent=ZIPF_EXPONENT, most_popular_experts=[int(i) for i in top.indices],
                     their_draw_probs=[round(float(v), 4) for v in top.values])
        return d


def router_rows(tensors: dict, spec) -> torch.Tensor:
    """The router weight rows [E, H] (a view of the block's own parameter)."""
    rw = tensors["router_w"]
    return rw[: spec.num_experts] if spec.fused_shared_gate else rw


def plant_router(tensors: dict, spec, seed: int) -> None:
    """Set the router rows (in place, the block's own parameter) to orthonormal vectors, so that any wanted logits
    can be planted through the input. Needs E <= H (true of every family here)."""
    w = router_rows(tensors, spec)
    E, H = w.shape
    if E > H:
        raise ValueError(f"cannot plant routing: {E} experts > hidden size {H}")
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(H, E, generator=g, dtype=torch.float64))
    with torch.no_grad():
        w.copy_(q.T.to(device=w.device, dtype=w.dtype))


def planted_input(ids: torch.Tensor, tensors: dict, spec, gen: torch.Generator, device, dtype) -> torch.Tensor:
    """x [1, T, H] whose router logits are U(PLANT_CHOSEN) on ``ids`` [T, k] and N(0, PLANT_OTHER_STD) elsewhere
    (exactly, before x is rounded to ``dtype``); the rest of x is randn projected off the router rows."""
    T, k = ids.shape
    A = router_rows(tensors, spec).float()  # [E, H], as stored (after rounding)
    E, H = A.shape
    logits = torch.randn(T, E, device=device, generator=gen) * PLANT_OTHER_STD
    lo, hi = PLANT_CHOSEN
    logits.scatter_(1, ids.to(device), lo + (hi - lo) * torch.rand(T, k, device=device, generator=gen))
    if tensors.get("router_b") is not None:
        logits -= tensors["router_b"].float()[: E]
    base = torch.randn(T, H, device=device, generator=gen)
    corr = torch.linalg.solve(A @ A.T, (logits - base @ A.T).T).T  # [T, E]: A (base + corr A)^T = logits
    return (base + corr @ A).to(dtype).view(1, T, H)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] bool: row t of ``a`` and ``b`` ([T, k] ids) name the same experts."""
    return (a.long().sort(-1).values == b.long().sort(-1).values.to(a.device)).all(-1)


def routing_stats(ids: torch.Tensor, E: int) -> dict:
    """Distinct experts touched, the share of tokens the busiest expert serves, and its load over the mean load."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    T, k = ids.shape
    return dict(distinct_experts=int((counts > 0).sum()), busiest_expert_token_frac=round(float(counts.max()) / T, 4),
                busiest_over_mean_load=round(float(counts.max()) * E / (T * k), 3))


# =========================================================================================== vLLM peer
def load_vllm_peer(peer_dir: str | None, device: torch.device) -> tuple[object | None, dict]:
    """(fused(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k]) -> [T, H], info).

    ``peer_dir``: a directory holding the standalone copy ``vllm_fused_moe.py`` (vLLM's code, Apache-2.0, imported
    and timed, nothing of it copied here); without it, an installed ``vllm``'s ``fused_experts`` when importable (CUDA
    only). On CPU the copy's Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` is set for the rest of
    the process (Triton reads it when a kernel is created and at each launch; moecomp's CPU path is torch, unaffected).
    Returns (None, info with "error") when neither is there."""
    if peer_dir:
        path = os.path.join(os.path.abspath(peer_dir), "vllm_fused_moe.py")
        if not os.path.isfile(path):
            return None, dict(source=peer_dir, error=f"--vllm-peer {peer_dir}: no vllm_fused_moe.py there")
        interpret = device.type != "cuda"
        info = dict(source=os.path.relpath(path, REPO) if path.startswith(REPO) else path,
                    triton_interpret=interpret)
        name = "_bench_vllm_fused_moe" + ("_interp" if interpret else "")
        if interpret:  # read when the kernels are created and again at every launch: stays set for the process
            os.environ["TRITON_INTERPRET"] = "1"
        mod = sys.modules.get(name)
        if mod is None:
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            except Exception as e:
                sys.modules.pop(name, None)
                return None, dict(info, error=f"importing {path}: {_root_msg(e)}")
        fused = getattr(mod, "fused_moe", None)
        if fused is None:
            return None, dict(info, error=f"{path} has no fused_moe")
        first = (mod.__doc__ or "").strip().splitlines()
        info["doc"] = first[0] if first else None
        return fused, info
    if importlib.util.find_spec("vllm") is None:
        return None, dict(source=None, error="vLLM is not installed and no --vllm-peer DIR was given")
    if device.type != "cuda":
        return None, dict(source="vllm (installed)", error="the installed vLLM's kernel needs CUDA")
    try:
        import vllm

        mod = importlib.import_module(VLLM_INSTALLED_MODULE)
        fused = mod.fused_experts
    except Exception as e:
        return None, dict(source="vllm (installed)", error=f"importing {VLLM_INSTALLED_MODULE}: {_root_msg(e)}")

    def fused_installed(x, w13, w2, tw, ti, _f=fused):
        return _f(x, w13, w2, tw, ti)

    return fused_installed, dict(source=f"vllm {getattr(vllm, '__version__', '?')} (installed): "
                                        f"{VLLM_INSTALLED_MODULE}.fused_experts")


def vllm_unsupported(spec, tensors: dict) -> str | None:
    """Why vLLM's kernel cannot run this block (it takes gated SiLU experts, w13 [E, 2I, H] gate rows first, w2
    [E, H, I], no expert biases), or None."""
    why = []
    if not spec.gated or spec.activation != "silu" or spec.activation_clamp:
        why.append(f"activation {'clamped ' if spec.activation_clamp else ''}{spec.activation}"
                   f"{'' if spec.gated else ' (not gated)'}, the kernel does silu(gate) * up")
    if spec.gate_up != "concat":
        why.append(f"gate/up {spec.gate_up}, the kernel wants gate rows then up rows")
    if spec.w_layout != "out_in":
        why.append(f"weights {spec.w_layout}, the kernel wants [E, 2I, H] / [E, H, I]")
    if spec.has_expert_bias or tensors.get("b13") is not None or tensors.get("b2") is not None:
        why.append("expert biases")
    if not why:
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        w13, w2 = tensors["w13"], tensors["w2"]
        if tuple(w13.shape) != (E, 2 * I, H) or tuple(w2.shape) != (E, H, I):
            why.append(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}, not [E, 2I, H] / [E, H, I]")
        elif not (w13.is_contiguous() and w2.is_contiguous()):
            why.append("expert weights not contiguous")
    return "; ".join(why) or None


def hf_router(block, bindings: dict, spec, device) -> tuple[object | None, str]:
    """The block's own router module (the module that owns the recognised router weight, e.g. ``gate``) when it
    returns (logits, weights [T, k], ids [T, k]) as transformers' routers do; else (None, why)."""
    name = (bindings or {}).get("router_w")
    if not name or "." not in name:
        return None, f"router weight bound as {name!r}, no router module to call"
    owner = name.rsplit(".", 1)[0]
    try:
        mod = block.get_submodule(owner)
        probe = torch.randn(3, spec.hidden_size, device=device, dtype=DTYPE)
        with torch.no_grad():
            out = mod(probe)
    except Exception as e:
        return None, f"calling {owner!r}: {_root_msg(e)}"
    k = spec.top_k
    if (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
            and tuple(out[1].shape) == (3, k) and tuple(out[2].shape) == (3, k) and not out[2].is_floating_point()):
        return mod, owner
    return None, f"{owner!r} does not return (logits, weights [T, k], ids [T, k])"


def torch_shared_expert(spec, tensors: dict):
    """The shared expert in plain torch (F.linear, the activation, the sigmoid gate where the family has one), in the
    model dtype, on the block's own weights; None when the family has none."""
    sh = spec.shared
    if sh is None:
        return None
    import torch.nn.functional as F

    from moecomp import reference
    from moecomp.ops.common import split_fused_gate

    t = split_fused_gate(tensors, spec)
    w1, w3, w2, gw = t["shared_w1"], t["shared_w3"], t["shared_w2"], t["shared_gate_w"]

    def shared(x2):
        if sh.gated:
            g, u = F.linear(x2, w1).chunk(2, dim=-1) if sh.layout == "concat" else (F.linear(x2, w1), F.linear(x2, w3))
            h = reference.gated_activation(g, u, sh.activation, sh.activation_alpha, sh.activation_limit,
                                           sh.activation_clamp)
        else:
            h = reference.activation(F.linear(x2, w3), sh.activation)
        y = F.linear(h, w2)
        if sh.gate == "sigmoid":
            y = y * torch.sigmoid(F.linear(x2, gw))
        return y * sh.scale if sh.scale != 1.0 else y

    return shared


def make_vllm_fn(fused, spec, tensors: dict, router, compute_dtype: torch.dtype):
    """x [1, T, H] -> [1, T, H]: the router (the block's own module, else moecomp.reference.route on the recognised
    spec), vLLM's fused experts, plus the shared expert in torch. ``compute_dtype`` != the weights' dtype (fp32 on the
    CPU interpreter) runs the kernel on copies of x / w13 / w2 in that dtype and casts its output back."""
    from moecomp import reference
    from moecomp.ops.common import split_fused_gate

    H = spec.hidden_size
    w13, w2 = tensors["w13"], tensors["w2"]
    if w13.dtype != compute_dtype:
        w13, w2 = w13.to(compute_dtype).contiguous(), w2.to(compute_dtype).contiguous()
    rt = split_fused_gate(tensors, spec)
    shared = torch_shared_expert(spec, tensors)

    def vllm_fn(x):
        x2 = x.reshape(-1, H)
        if router is not None:
            _, tw, ti = router(x2)
        else:
            logits = reference.router_logits(x2, rt["router_w"], rt["router_b"], spec)
            tw, ti = reference.route(logits, rt["correction_bias"], spec)
            if spec.round_weights:
                tw = tw.to(x.dtype)
        if tw.dtype != torch.float32:
            tw = tw.float()
        tw, ti = tw.contiguous(), ti.contiguous()  # (no-ops for HF's routers; reference.route returns slices)
        xin = x2 if x2.dtype == compute_dtype else x2.to(compute_dtype)
        out = fused(xin.contiguous(), w13, w2, tw, ti)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if shared is not None:
            out = out + shared(x2)
        return out.view(x.shape)

    return vllm_fn


# =============================================================================================== timing
class Timer:
    def __init__(self, device: torch.device, quick: bool):
        self.cuda = device.type == "cuda"
        self.quick = quick
        if self.cuda:
            import triton.testing

            self._do_bench = triton.testing.do_bench

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once_ms(self, call) -> float:
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            call()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t = time.perf_counter()
        call()
        return (time.perf_counter() - t) * 1e3

    def bench(self, call, est_ms: float) -> float:
        """Median ms. do_bench's warmup / rep are in ms; slow paths get a few calls only."""
        est_ms = max(est_ms, 1e-3)
        if not self.cuda:
            n = 3 if self.quick else max(3, min(15, int(200 / est_ms)))
            call()
            ts = []
            for _ in range(n):
                t = time.perf_counter()
                call()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        warmup, rep = (5.0, 30.0) if self.quick else (25.0, 100.0)
        if est_ms > 5:  # do_bench already runs 5 estimate calls; add 1 warm-up and ~4-8 timed calls
            warmup = est_ms
            rep = min(max(rep, (4 if self.quick else 8) * est_ms), 600.0 if self.quick else 1500.0)
        return float(self._do_bench(call, warmup=warmup, rep=rep, return_mode="median"))


def measure_ceilings(device: torch.device, timer: Timer) -> dict:
    if device.type == "cuda":
        n = 1 << 29  # 1 GiB of bf16 each way: 2 GiB moved per copy
        src = torch.randn(n, device=device, dtype=DTYPE)
        dst = torch.empty_like(src)
        t = timer.bench(lambda: dst.copy_(src), 1.0)
        copy = 2 * n * src.element_size() / (t * 1e-3)
        del src, dst
        m = 8192
    else:
        n = 1 << 22
        src = torch.randn(n, dtype=DTYPE)
        dst = torch.empty_like(src)
        t = timer.bench(lambda: dst.copy_(src), 1.0)
        copy = 2 * n * src.element_size() / (t * 1e-3)
        del src, dst
        m = 256
    a = torch.randn(m, m, device=device, dtype=DTYPE)
    b = torch.randn(m, m, device=device, dtype=DTYPE)
    c = torch.empty(m, m, device=device, dtype=DTYPE)
    t2 = timer.bench(lambda: torch.matmul(a, b, out=c), 1.0)
    mm = 2 * m**3 / (t2 * 1e-3)
    del a, b, c
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(copy_bytes_per_s=copy, copy_ms=t, copy_bytes=2 * n * torch.finfo(DTYPE).bits // 8,
                matmul_flops_per_s=mm, matmul_ms=t2, matmul_size=m, matmul_dtype=dtype_name(DTYPE))


# =============================================================================================== checks
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    num, den = (a - b).norm().item(), b.norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def bad_token_frac(a: torch.Tensor, b: torch.Tensor, thresh: float = policy.BENCH_BAD_TOKEN_REL) -> float:
    """Fraction of tokens whose own relative error exceeds ``thresh`` (routing flips show up here)."""
    a, b = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    per = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    return float((~(per <= thresh)).float().mean().item())


def routing_ambiguous(logits: torch.Tensor, correction_bias, spec, fp32_router: bool) -> torch.Tensor:
    """[T] bool: tokens whose expert choice could legitimately differ between two correct implementations.

    bf16 routers round the logits to bf16, so exact ties at the top-k boundary are common (~10% of tokens at
    E=128), and ``torch.topk`` and our kernels may break them differently; two GEMMs summing in different orders
    can also land one bf16 ulp apart. Each ranking key gets an interval from the logit +- d; a token is ambiguous
    when the worst selected key's lower end does not clear the best rejected key's upper end (likewise for the
    group choice). The window d is ``moecomp.policy.bench_tie_window`` (fp32 routers: 2e-5 relative; bf16: half an
    ulp each side)."""
    from moecomp import reference

    l = logits.float()
    d = policy.bench_tie_window(l, fp32_router)
    T, E, k = l.shape[0], spec.num_experts, spec.top_k
    if spec.score_order == "topk_then_score" or (spec.scoring == "softmax" and not spec.has_correction_bias):
        lo, hi, key = l - d, l + d, l  # softmax ranks like its logits
    elif spec.scoring == "softmax":
        p = torch.softmax(l, -1)
        lo, hi, key = p * torch.exp(-2 * d), p * torch.exp(2 * d), p
    else:
        lo, hi, key = reference.score(l - d, spec.scoring), reference.score(l + d, spec.scoring), \
            reference.score(l, spec.scoring)
    if spec.has_correction_bias and spec.score_order != "topk_then_score":
        b = correction_bias.float()
        lo, hi, key = lo + b, hi + b, key + b
    amb = torch.zeros(T, dtype=torch.bool, device=l.device)
    allowed = torch.ones(T, E, dtype=torch.bool, device=l.device)
    if spec.n_group > 1 and spec.score_order != "topk_then_score":
        G = spec.n_group

        def gscore(v):
            v = v.view(T, G, E // G)
            return v.topk(2, -1).values.sum(-1) if spec.group_score == "top2_sum" else v.max(-1).values

        gk, glo, ghi = gscore(key), gscore(lo), gscore(hi)
        keep = gk.topk(spec.topk_group, -1).indices
        kmask = torch.zeros(T, G, dtype=torch.bool, device=l.device).scatter_(1, keep, True)
        if spec.topk_group < G:
            worst_kept = glo.masked_fill(~kmask, math.inf).min(-1).values
            best_dropped = ghi.masked_fill(kmask, -math.inf).max(-1).values
            amb |= ~(worst_kept > best_dropped)
        allowed = kmask[:, :, None].expand(T, G, E // G).reshape(T, E)
    if k < E:
        masked = key.masked_fill(~allowed, -math.inf)
        sel = masked.topk(k, -1).indices
        smask = torch.zeros(T, E, dtype=torch.bool, device=l.device).scatter_(1, sel, True)
        worst_sel = lo.masked_fill(~smask, math.inf).min(-1).values
        best_rej = hi.masked_fill(smask | ~allowed, -math.inf).max(-1).values
        amb |= ~(worst_sel > best_rej)
    return amb


def rel_err_rows(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> float | None:
    a, b = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    if not bool(rows.any()):
        return None
    return rel_err(a[rows], b[rows])


def _root_msg(e: BaseException, n: int = 160) -> str:
    seen, cur = [], e
    while cur is not None and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    root = seen[-1]
    msg = " ".join(str(root).split()) or "?"
    return f"{type(root).__name__}: {msg}"[:n]


def cuda_healthy(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(2, device=device).add_(1).sum().item() == 4.0
    except Exception:
        return False


# ================================================================================================ paths
@dataclasses.dataclass
class Path:
    name: str
    fn: object  # x [1, T, H] -> [1, T, H]
    prepare: object = None  # called before this path's calls (selects HF's experts implementation)
    skip: str | None = None  # fn is None: why the path does not run here (recorded as "skipped", not an error)
    error: str | None = None  # fn is None: why it could not be set up (recorded as an error)


def check_output(out: torch.Tensor, ref: torch.Tensor, amb: torch.Tensor | None, tol: float) -> dict:
    """rel err vs the HF block over all tokens and over the tokens with an unambiguous routing; ok when finite
    and the unambiguous part is within ``tol`` (tie flips are legitimate, see ``routing_ambiguous``)."""
    rel = rel_err(out, ref)
    c = dict(rel_err_vs_hf=rel)
    judged = rel
    if amb is not None:
        n_amb = int(amb.sum().item())
        c["ambiguous_tokens"] = n_amb
        if n_amb:
            u = rel_err_rows(out, ref, ~amb)
            c["rel_err_unambiguous"] = u
            if u is not None:
                judged = u
                keep = ~amb
                c["bad_token_frac_unambiguous"] = bad_token_frac(out.reshape(-1, out.shape[-1])[keep],
                                                                 ref.reshape(-1, ref.shape[-1])[keep])
    c["check_ok"] = bool(math.isfinite(rel) and judged <= tol)
    return c


def check_record(rec: dict, tol: float, ref_path: str | None, hf_grouped_mm_rel_err: float | None) -> dict:
    """A path's verdict against the HF block (the "check" columns): rel err, ok, and the tie-aware parts."""
    chk = dict(tolerance=tol, against=ref_path)
    if rec.get("rel_err_vs_hf") is not None:
        chk["rel_err"] = rec["rel_err_vs_hf"]
        chk["ok"] = bool(rec.get("check_ok"))
        for k_ in ("ambiguous_tokens", "rel_err_unambiguous", "bad_token_frac_unambiguous"):
            if k_ in rec:
                chk[k_] = rec[k_]
    else:
        chk["rel_err"] = None
        chk["ok"] = False
        chk["error"] = rec.get("error", "no output")
    if hf_grouped_mm_rel_err is not None:
        chk["hf_grouped_mm_rel_err"] = hf_grouped_mm_rel_err  # bf16 noise level between HF's own two paths
    return chk


def run_path(path: Path, x: torch.Tensor, ref: torch.Tensor, timer: Timer, args, device, tol: float,
             amb: torch.Tensor | None = None) -> dict:
    rec: dict = dict(plain_ms=None, graph_ms=None, best_ms=None, best_mode=None)
    T = x.shape[1]
    try:
        if path.prepare:
            path.prepare()
        t0 = time.perf_counter()
        out = path.fn(x)
        timer.sync()
        rec["first_call_s"] = round(time.perf_counter() - t0, 4)
        rec.update(check_output(out, ref, amb, tol))
        est = timer.once_ms(lambda: path.fn(x))
        rec["plain_ms"] = timer.bench(lambda: path.fn(x), est)
    except torch.cuda.OutOfMemoryError as e:
        rec["error"] = _root_msg(e)
        out = None
        gc.collect()
        torch.cuda.empty_cache()
    except Exception as e:
        rec["error"] = _root_msg(e)
        out = None
        if not cuda_healthy(device):
            raise FatalCudaError(f"{path.name}: {rec['error']}") from e
        if args.verbose:
            traceback.print_exc()
    # ---- CUDA graph replay
    if device.type != "cuda":
        rec["graph_note"] = "n/a (cpu)"
    elif args.no_graph:
        rec["graph_note"] = "n/a (--no-graph)"
    elif T > args.graph_max_t:
        rec["graph_note"] = f"n/a (T > {args.graph_max_t})"
    elif out is None:
        rec["graph_note"] = "n/a (plain call failed)"
    else:
        rec.update(time_graph(path, x, out, timer, est, device))
    cands = [(v, m) for v, m in ((rec["plain_ms"], "plain"), (rec["graph_ms"], "graph")) if v is not None]
    if cands:
        rec["best_ms"], rec["best_mode"] = min(cands)
    return rec


def time_graph(path: Path, x, out_plain, timer: Timer, est: float, device) -> dict:
    g = xs = gout = None
    main_stream = torch.cuda.current_stream()
    try:
        xs = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream (allocator / autotune / compile)
            for _ in range(2):
                path.fn(xs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = path.fn(xs)
        torch.cuda.synchronize()
    except Exception as e:
        reason = _root_msg(e, 120)
        # torch.cuda.graph's __exit__ skips restoring the stream when capture_end raises: restore it here
        torch.cuda.set_stream(main_stream)
        del g, gout
        gc.collect()
        if not cuda_healthy(device):
            raise FatalCudaError(f"{path.name} graph capture: {reason}") from e
        return dict(graph_ms=None, graph_note=f"n/a (capture failed: {reason})")
    try:
        g.replay()
        torch.cuda.synchronize()
        same = rel_err(gout, out_plain)
        # A graph that baked in host-side decisions (e.g. which experts run) would pass on the capture input
        # and fail here: replay on a fresh input and compare with a plain call on it.
        x_new = torch.randn_like(x)
        xs.copy_(x_new)
        g.replay()
        want = path.fn(x_new)
        torch.cuda.synchronize()
        fresh = rel_err(gout, want)
        xs.copy_(x)
        if not (fresh <= GRAPH_CONSISTENCY_TOL and same <= GRAPH_CONSISTENCY_TOL):
            return dict(graph_ms=None, graph_note=f"n/a (replay disagrees with plain call: rel err {same:.2g} on the "
                                                  f"capture input, {fresh:.2g} on a fresh input)",
                        graph_rel_err=fresh)
        ms = timer.bench(g.replay, est)
        return dict(graph_ms=ms, graph_note="ok", graph_rel_err=max(same, fresh))
    except Exception as e:
        reason = _root_msg(e, 120)
        if not cuda_healthy(device):
            raise FatalCudaError(f"{path.name} graph replay: {reason}") from e
        return dict(graph_ms=None, graph_note=f"n/a (replay failed: {reason})")
    finally:
        del g, gout, xs
        gc.collect()


# ============================================================================================ environment
def git_commit() -> str:
    """MOECOMP_COMMIT when set (a snapshot run from inside another checkout would otherwise report that checkout's
    HEAD), else the repository's HEAD (+ "-dirty")."""
    if os.environ.get("MOECOMP_COMMIT"):
        return os.environ["MOECOMP_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            sha = r.stdout.strip()
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=20)
            return sha + ("-dirty" if d.returncode == 0 and d.stdout.strip() else "")
    except Exception:
        pass
    return os.environ.get("MOECOMP_COMMIT", "unknown") or "unknown"


def environment(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_v = triton.__version__
    except Exception:
        triton_v = None
    env = dict(torch=torch.__version__, triton=triton_v, transformers=transformers.__version__,
               python=platform.python_version(), cuda=torch.version.cuda, device=device.type)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), capability=".".join(map(str, (props.major, props.minor))),
                   sm_count=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / 2**30, 1))
    else:
        env.update(gpu=f"cpu ({platform.processor() or platform.machine()})")
    return env


def peer_hygiene() -> dict:
    """What the HF / compile peers actually dispatch to once moecomp is imported (kept in the JSON)."""
    h = {}
    try:
        from transformers.integrations import moe as hf_moe

        fns = hf_moe.ALL_EXPERTS_FUNCTIONS
        for name in ("eager", "grouped_mm"):
            f = fns.get(name, None) if hasattr(fns, "get") else None
            h[f"experts_{name}"] = None if f is None else f"{getattr(f, '__module__', '?')}.{f.__qualname__}"
    except Exception as e:
        h["experts"] = _root_msg(e)
    try:
        import torch._inductor.config as iconfig

        h["inductor_post_grad_custom_post_pass"] = repr(iconfig.post_grad_custom_post_pass)
        h["inductor_post_grad_custom_pre_pass"] = repr(iconfig.post_grad_custom_pre_pass)
    except Exception as e:
        h["inductor"] = _root_msg(e)
    return h


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


# =================================================================================================== run
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="all", help=f"comma list of {', '.join(FAMILIES)} (default all)")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1,16,128,1024,8192; tiny: 1,16,128)")
    ap.add_argument("--peers", default="all",
                    help=f"comma list of {', '.join(ALL_PEERS)} (default all; vllm only when its kernel is found)")
    ap.add_argument("--vllm-peer", metavar="DIR", default=None,
                    help="directory holding the standalone vllm_fused_moe.py (vLLM's kernel, timed as the peer "
                         "'vllm'); default: the installed vllm package when importable, else no vllm peer")
    ap.add_argument("--routing", choices=ROUTING_MODES, default="real",
                    help="real (default): random router weights route; uniform / zipf / one-hot: expert ids drawn "
                         "from that distribution and planted through the router (every path sees the same ids)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                    help="dtype of the whole run: blocks, inputs, every peer, the floor's bytes, the ceilings "
                         "(default bf16; the JSON name gets -<dtype> when not bf16)")
    ap.add_argument("--breakdown", metavar="CELLS", default="",
                    help="family:T,... (e.g. qwen3:1,mixtral:8192): after every timing of the run, profile "
                         "moecomp's op (and the vLLM peer where timed) in those cells with torch.profiler: per-kernel "
                         "device time and the gaps (wall - kernels), in the JSON (cell.breakdown) and the log")
    ap.add_argument("--quick", action="store_true", help="shorter do_bench warmup / rep (noisier)")
    ap.add_argument("--no-graph", action="store_true", help="skip CUDA-graph capture")
    ap.add_argument("--graph-max-t", type=int, default=1024, help="capture graphs up to this T (default 1024)")
    ap.add_argument("--via-optimize", action="store_true",
                    help="also time moecomp.optimize(block) (needs moecomp.optimize); direct binding stays")
    ap.add_argument("--moecomp-backend", choices=("triton", "torch"), default=None,
                    help="sets MOECOMP_CUDA_BACKEND for the op (default: the op's own default)")
    ap.add_argument("--tol", type=float, default=None,
                    help=f"moecomp vs HF rel-error tolerance (default: bf16 {default_tolerance(torch.bfloat16):g}, "
                         f"fp16 {default_tolerance(torch.float16):.2g}; see default_tolerance)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke runs); no PEERS.md column")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="start no new cell after this many seconds (default 540: the table still prints inside a "
                         "10-minute limit); skipped cells are marked in the JSON")
    ap.add_argument("--out-json", default=None,
                    help="result path (default benchmarks/results/<gpu>-<date>-<commit>.json)")
    ap.add_argument("--no-save", action="store_true", help="write no JSON")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing paths")
    return ap.parse_args(argv)


def _save(result: dict, path: str | None):
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)
    out_dir = os.environ.get("OUT")
    if out_dir and os.path.isdir(out_dir) and os.path.abspath(os.path.dirname(path)) != os.path.abspath(out_dir):
        with open(os.path.join(out_dir, os.path.basename(path)), "w") as f:
            json.dump(result, f, indent=1, default=str)


def log(msg: str):
    print(msg, flush=True)


def run(argv=None) -> dict:
    """Run the benchmark; returns the result dict (also saved as JSON). The table is printed last."""
    global DTYPE
    args = parse_args(argv)
    prev = DTYPE
    DTYPE = DTYPES[args.dtype]
    try:
        return _run(args, argv)
    finally:
        DTYPE = prev


def parse_breakdown(text: str, fams: list[str], tokens: list[int]) -> tuple[list[tuple[str, int]], list[str]]:
    """``family:T,...`` -> ([(family, T)] in the run, [the named cells the run does not have])."""
    aliases = {a: f.name for f in FAMILIES.values() for a in f.aliases}
    cells, missing = [], []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, t = item.partition(":")
        if not sep or not t.strip().isdigit():
            raise SystemExit(f"--breakdown {item!r}: expected family:T (e.g. qwen3:1)")
        (fam,) = _resolve(name, FAMILIES, aliases, "family")
        c = (fam, int(t))
        if fam in fams and c[1] in tokens:
            if c not in cells:
                cells.append(c)
        else:
            missing.append(f"{fam}:{c[1]}")
    return cells, missing


def _run(args, argv) -> dict:
    if args.tol is None:
        args.tol = default_tolerance(DTYPE)
    if args.moecomp_backend:
        os.environ["MOECOMP_CUDA_BACKEND"] = args.moecomp_backend
    import moecomp  # registers torch.ops.moecomp.*
    from moecomp import reference
    from moecomp.ops.common import MOE_ARGS, split_fused_gate
    from moecomp.ops.moe_op import check_args

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fams = _resolve(args.families, FAMILIES, {a: f.name for f in FAMILIES.values() for a in f.aliases}, "family")
    peers = _resolve(args.peers, {p: p for p in ALL_PEERS}, PEER_ALIASES, "peer")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TINY_TOKENS if args.tiny else ALL_TOKENS)
    bd_cells, bd_missing = parse_breakdown(args.breakdown, fams, tokens)
    pending_bd = []  # (family, cell, x, [(path name, fn)]): profiled after every timing of the run
    timer = Timer(device, args.quick)
    t_start = time.perf_counter()
    vllm_fused, vllm_info = None, dict(requested=False)
    if "vllm" in peers:
        vllm_fused, vllm_info = load_vllm_peer(args.vllm_peer, device)
        named = args.vllm_peer is not None or args.peers not in ("all", "")
        vllm_info["requested"] = named
        if vllm_fused is None:
            log(f"[bench] vllm peer not timed: {vllm_info['error']}")
            if not named:  # not asked for by name: leave it out (the table keeps the PEERS.md figure)
                peers.remove("vllm")

    env = environment(device)
    commit = git_commit()
    now = datetime.datetime.now(datetime.timezone.utc)
    full_run = (fams == list(FAMILIES) and args.peers in ("all", "") and tokens == list(ALL_TOKENS)
                and not args.quick and not args.tiny and not args.no_graph and args.routing == "real")
    suffix = "" if full_run else ("-tiny" if args.tiny else "-partial")
    if args.routing != "real":
        suffix = f"-{args.routing}{suffix}"
    if args.dtype != "bf16":
        suffix = f"-{args.dtype}{suffix}"
    short = "unknown" if commit == "unknown" else commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    gpu_slug = _slug(env["gpu"]) if device.type == "cuda" else "cpu"
    out_json = None if args.no_save else (
        args.out_json or os.path.join(HERE, "results", f"{gpu_slug}-{now:%Y%m%d}-{short}{suffix}.json"))

    log(f"[bench] {env['gpu']} | torch {env['torch']} triton {env['triton']} transformers {env['transformers']} | "
        f"commit {commit} | families {fams} | T {tokens} | peers {peers} | routing {args.routing} | "
        f"dtype {args.dtype} (tol {args.tol:.3g})")
    if bd_missing:
        log(f"[bench] --breakdown: not in this run (families x T), ignored: {', '.join(bd_missing)}")
    if vllm_fused is not None:
        log(f"[bench] vllm peer: {vllm_info['source']}"
            + (" (Triton interpreter, fp32: a smoke run, its times mean nothing)" if device.type != "cuda" else ""))
    ceilings = measure_ceilings(device, timer)
    log(f"[bench] ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
        f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({ceilings['matmul_size']}^3 {args.dtype})")
    result = dict(schema=2, **env, date=now.strftime("%Y-%m-%d"), timestamp=now.isoformat(timespec="seconds"),
                  commit=commit, argv=sys.argv[1:] if argv is None else list(argv), tiny=args.tiny, quick=args.quick,
                  dtype=args.dtype,
                  moecomp_backend=(os.environ.get("MOECOMP_CUDA_BACKEND", "triton") if device.type == "cuda"
                                   else os.environ.get("MOECOMP_CPU_BACKEND", "torch")),
                  moecomp_version=getattr(moecomp, "__version__", None), tolerance=args.tol,
                  init=dict(weight_std=INIT_STD, correction_bias_std=CORRECTION_BIAS_STD, input="randn (std 1)",
                            dtype=str(DTYPE)),
                  timing=("triton.testing.do_bench median (ms), L2 flushed per call" if device.type == "cuda"
                          else "host perf_counter median (ms), CPU"),
                  ceilings=ceilings, families=[], fatal=None, json_path=out_json,
                  breakdown=dict(cells=[f"{f}:{t}" for f, t in bd_cells], not_in_run=bd_missing,
                                 paths=list(BREAKDOWN_PATHS), reps=BREAKDOWN_REPS) if args.breakdown else None,
                  routing=dict(mode=args.routing, method=ROUTING_METHOD,
                               **(dict(zipf_exponent=ZIPF_EXPONENT) if args.routing == "zipf" else {}),
                               **(dict(plant_chosen_logits=PLANT_CHOSEN, plant_other_logit_std=PLANT_OTHER_STD)
                                  if args.routing != "real" else {})),
                  vllm_peer=dict(vllm_info, timed=vllm_fused is not None and "vllm" in peers,
                                 compute_dtype=None if vllm_fused is None else
                                 str(DTYPE if device.type == "cuda" else torch.float32),
                                 router="the block's own router module (the owner of the recognised router weight), "
                                        "else moecomp.reference.route on the recognised spec; shared expert in torch"))
    result["peer_hygiene"] = peer_hygiene()
    _save(result, out_json)

    fatal = None
    skipped = []
    for fi, fname in enumerate(fams):
        if fatal:
            break
        fam = FAMILIES[fname]
        if time.perf_counter() - t_start > args.budget_s:
            skipped += [f"{fname}:{T}" for T in tokens]
            continue
        t_fam = time.perf_counter()
        frec: dict = dict(name=fam.name, label=fam.label, hf_class=f"{fam.module}.{fam.block_cls}", cells=[],
                          errors=[])
        result["families"].append(frec)
        block = compiled = None
        paths: list[Path] = []
        plan = router_mod = None
        try:
            cfg, block = build_block(fam, args.tiny, device, args.seed + 1000 * fi)
            frec["build_s"] = round(time.perf_counter() - t_fam, 2)
            frec["config"] = {k: getattr(cfg, k, None) for k in sorted(fam.full)}
            spec_err = None
            frec["recognised"] = rec = {}
            try:  # the spec and tensors moecomp.optimize would use for this block: no spec of the benchmark's own
                spec, tensors = block_spec(block, rec)
                frec["label"] = family_label(fam, spec)
                frec["spec"] = spec.key
                frec["spec_describe"] = spec.describe()
                targs = [tensors[n] for n in MOE_ARGS]
                H = spec.hidden_size
                check_args(torch.empty(1, H, device=device, dtype=DTYPE), tensors, spec)
            except BlockRefused as e:  # loud, and no moecomp timing: the benchmark has no spec to fall back to
                spec_err = str(e)
                frec["errors"].append(f"spec: {spec_err}")
                log(f"[bench] !!!!! {fam.name}: {spec_err}")
                spec = None
            except Exception as e:
                spec_err = _root_msg(e)
                frec["errors"].append(f"spec: {spec_err}")
                log(f"[bench] !!!!! {fam.name}: no spec ({spec_err})")
                spec = None
            if spec is not None:  # the block's own router module: for the vllm path and to check the ids
                router_mod, router_note = hf_router(block, rec.get("bindings"), spec, device)
                frec["hf_router"] = router_note if router_mod is not None else None
                if "vllm" in peers:
                    frec["vllm_router"] = (f"HF router module {router_note!r}" if router_mod is not None else
                                           f"moecomp.reference.route on the recognised spec ({router_note})")
            if args.routing != "real":
                if spec is None:
                    raise RuntimeError(f"--routing {args.routing} needs the recognised router weight ({spec_err})")
                plant_router(tensors, spec, args.seed + 1000 * fi + 11)
                plan = RoutingPlan(args.routing, spec, args.seed + 1000 * fi + 13)
                frec["routing_plan"] = plan.describe()
            if "hf_eager" in peers:
                paths.append(Path("hf_eager", block, lambda b=block, c=cfg: set_experts_impl(b, c, "eager")))
            if "hf_grouped_mm" in peers:
                paths.append(Path("hf_grouped_mm", block, lambda b=block, c=cfg: set_experts_impl(b, c, "grouped_mm")))
            if "compile" in peers:
                torch._dynamo.reset()
                set_experts_impl(block, cfg, "grouped_mm")
                compiled = torch.compile(block, dynamic=True)
                paths.append(Path("compile", compiled, lambda b=block, c=cfg: set_experts_impl(b, c, "grouped_mm")))
            if "vllm" in peers:
                if vllm_fused is None:
                    paths.append(Path("vllm", None, error=f"vLLM peer not loaded: {vllm_info.get('error')}"))
                elif spec is None:
                    paths.append(Path("vllm", None, skip=f"no spec to run it from ({spec_err})"))
                else:
                    why = vllm_unsupported(spec, tensors)
                    if why:
                        paths.append(Path("vllm", None, skip=why))
                        log(f"[bench] {fam.name}: vllm peer skipped: {why}")
                    else:
                        cd = DTYPE if device.type == "cuda" else torch.float32  # the interpreter: fp32 only
                        paths.append(Path("vllm", make_vllm_fn(vllm_fused, spec, tensors, router_mod, cd)))
            if "moecomp" in peers:
                if spec is not None:
                    op, key = torch.ops.moecomp.moe_forward, spec.key

                    def moecomp_fn(x, _op=op, _a=tuple(targs), _k=key, _H=H):
                        return _op(x.view(-1, _H), *_a, _k).view(x.shape)

                    paths.append(Path("moecomp", moecomp_fn))
                else:
                    paths.append(Path("moecomp", None))
            keep_inputs = args.via_optimize
            saved = []
            H = cfg.hidden_size
            gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * fi + 7)
            for T in tokens:
                if time.perf_counter() - t_start > args.budget_s:
                    skipped.append(f"{fname}:{T}")
                    continue
                t_cell = time.perf_counter()
                cell: dict = dict(T=T, paths={})
                frec["cells"].append(cell)
                planned = None
                if plan is not None:  # synthetic routing: draw the ids, plant them through the router
                    planned = plan.ids(T)
                    x = planted_input(planned, tensors, spec, gen, device, DTYPE)
                else:
                    x = torch.randn(1, T, H, device=device, dtype=DTYPE, generator=gen)
                with torch.no_grad():
                    ref, ref_path = None, None
                    for impl in ("eager", "grouped_mm"):  # the HF block itself (per-expert loop first)
                        try:
                            set_experts_impl(block, cfg, impl)
                            ref, ref_path = block(x), f"hf_{impl}"
                            break
                        except Exception as e:
                            cell.setdefault("ref_errors", []).append(f"{impl}: {_root_msg(e)}")
                            if not cuda_healthy(device):
                                raise FatalCudaError(f"HF reference: {_root_msg(e)}") from e
                    cell["ref_path"] = ref_path
                    amb = None
                    if spec is not None:
                        rt = split_fused_gate(tensors, spec)  # (router rows only, should a spec ever fuse the gate)
                        logits = reference.router_logits(x.view(-1, H), rt["router_w"], rt["router_b"], spec)
                        _, ids = reference.route(logits, tensors.get("correction_bias"), spec)
                        fl = floor_of(spec, T, ids, tensors, ceilings)
                        cell["floor_ms"] = fl.pop("floor_ms")
                        cell["floor"] = fl
                        amb = routing_ambiguous(logits, tensors.get("correction_bias"), spec, spec.router_fp32)
                        cell["ambiguous_tokens"] = int(amb.sum().item())
                        rrec = dict(mode=args.routing, **routing_stats(ids, spec.num_experts))
                        if planned is not None:  # the router picks the drawn experts (so does every path)
                            rrec["planned_match"] = float(same_sets(ids, planned).float().mean())
                            if rrec["planned_match"] < 1.0:
                                log(f"[bench] !!!!! {fam.name} T={T}: the router picks the drawn experts for only "
                                    f"{rrec['planned_match']:.1%} of the tokens")
                        if router_mod is not None:  # HF's own router module: the same ids?
                            hids = router_mod(x.view(-1, H))[2]
                            rrec["hf_router_match"] = float(same_sets(hids, ids).float().mean())
                        cell["routing"] = rrec
                        del logits, ids
                    if (not args.tiny and args.routing == "real" and args.dtype == "bf16"  # PEERS.md: bf16
                            and fam.name in report.PEERS_MD and T in report.PEERS_MD[fam.name]):
                        cell["peers_md"] = report.peers_md_ref(fam.name, T)
                    for p in paths:
                        if ref is None:
                            cell["paths"][p.name] = dict(error="no HF reference output", best_ms=None)
                            continue
                        if p.fn is None:
                            cell["paths"][p.name] = (dict(skipped=p.skip, best_ms=None) if p.skip else
                                                     dict(error=p.error or f"spec: {spec_err}", best_ms=None))
                            continue
                        cell["paths"][p.name] = run_path(p, x, ref, timer, args, device, args.tol, amb)
                        if p.name == "vllm" and device.type != "cuda":
                            cell["paths"][p.name]["compute_dtype"] = "float32 (Triton interpreter)"
                    g = cell["paths"].get("hf_grouped_mm", {}).get("rel_err_vs_hf")
                    for pname, key, who in (("moecomp", "check", "moecomp"), ("vllm", "check_vllm", "vLLM peer")):
                        pr = cell["paths"].get(pname)
                        if pr is None or "skipped" in pr:
                            continue
                        chk = check_record(pr, args.tol, ref_path, g)
                        cell[key] = chk
                        if not chk["ok"]:
                            log(f"[bench] !!!!! CORRECTNESS FAILURE {fam.name} T={T}: {who} vs {ref_path} "
                                f"rel err {chk['rel_err']} (tol {args.tol}) {chk.get('error', '')}")
                    if cell.get("floor"):
                        cell["achieved"] = {pn: a for pn, pr in cell["paths"].items()
                                            if (a := achieved_of(cell["floor"], pr.get("best_ms"), ceilings))}
                    if (fam.name, T) in bd_cells:  # profiled after every timing of the run (keeps x and the fns)
                        todo = []
                        for p in paths:
                            pr = cell["paths"].get(p.name)
                            if p.name not in BREAKDOWN_PATHS or pr is None:
                                continue
                            if p.fn is not None and pr.get("best_ms") is not None:
                                todo.append((p.name, p.fn))
                            else:
                                cell.setdefault("breakdown", {})[p.name] = dict(skipped="no timing in this cell")
                        pending_bd.append((fam.name, cell, x, todo))
                    if keep_inputs and ref is not None:
                        saved.append((cell, x, ref, amb))
                    else:
                        del x, ref, amb
                cell["wall_s"] = round(time.perf_counter() - t_cell, 2)
                log(_cell_line(fam.name, cell))
                _save(result, out_json)
            if args.via_optimize:
                _run_optimize_path(block, saved, timer, args, device, frec)
                _save(result, out_json)
        except FatalCudaError as e:
            fatal = str(e)
            result["fatal"] = fatal
            frec["errors"].append(f"FATAL: {fatal}")
            log(f"[bench] FATAL CUDA error, stopping: {fatal}")
        except Exception as e:
            frec["errors"].append(_root_msg(e, 300))
            log(f"[bench] {fam.name}: {_root_msg(e, 300)}")
            if args.verbose:
                traceback.print_exc()
            if not cuda_healthy(device):
                fatal = result["fatal"] = f"{fam.name}: {_root_msg(e)}"
        finally:
            frec["wall_s"] = round(time.perf_counter() - t_fam, 1)
            paths = saved = compiled = block = None
            try:
                torch._dynamo.reset()
            except Exception:
                pass
            gc.collect()
            if device.type == "cuda" and not fatal:
                torch.cuda.empty_cache()
        log(f"[bench] {fam.name} done in {frec['wall_s']} s (total {time.perf_counter() - t_start:.0f} s)")
        _save(result, out_json)

    if pending_bd and not fatal:
        fatal = run_breakdowns(pending_bd, device, result, out_json)
    pending_bd = None
    result["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    result["skipped_over_budget"] = skipped
    if skipped:
        log(f"[bench] over the {args.budget_s:g} s budget, skipped: {', '.join(skipped)}")
    _save(result, out_json)
    _print_notes(result)
    if out_json:
        log(f"[bench] JSON: {out_json}" + (f" (copy in $OUT)" if os.environ.get("OUT") else ""))
    log(f"[bench] total {result['total_wall_s']} s\n")
    log(report.render_table(result))
    return result


# ============================================================================================== breakdown
def _device_rows(prof, cuda: bool) -> list[tuple[str, str, int, float]]:
    """[(name, kind, count, us)] of a profile, summed over the session. CUDA: every device activity (kernels, and
    memcpy / memset as their own kinds). CPU (no device): each op's *self* CPU time (children excluded, so nested
    aten ops are not counted twice)."""
    by: dict = {}
    if cuda:
        try:
            evs = [(e.name(), e.duration_ns() / 1e3) for e in prof.profiler.kineto_results.events()
                   if "cuda" in str(e.device_type()).lower()]
        except Exception:
            evs = [(e.name, getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))
                   for e in prof.events() if "cuda" in str(getattr(e, "device_type", "")).lower()]
        for name, us in evs:
            kind = "memcpy" if "memcpy" in name.lower() else "memset" if "memset" in name.lower() else "kernel"
            b = by.setdefault((name[:BREAKDOWN_NAME_CHARS], kind), [0, 0.0])
            b[0] += 1
            b[1] += us
    else:
        for a in prof.key_averages():
            if "cpu" not in str(getattr(a, "device_type", "cpu")).lower() or a.self_cpu_time_total <= 0:
                continue
            b = by.setdefault((a.key[:BREAKDOWN_NAME_CHARS], "op"), [0, 0.0])
            b[0] += a.count
            b[1] += a.self_cpu_time_total
    return [(n, k, c, us) for (n, k), (c, us) in by.items()]


def profile_breakdown(fn, x: torch.Tensor, device: torch.device, reps: int = BREAKDOWN_REPS) -> dict:
    """Where one call of ``fn(x)`` spends its time: ``reps`` calls back to back under ``torch.profiler`` (after one
    warm-up call and ``reps`` unprofiled calls), per call: each kernel's device time (CUDA; on CPU each op's self
    time), the op's wall time (host timer around the calls, synchronised at the end) and the gaps = wall - the sum of
    the kernel times (launch overhead, host work, idle device)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        fn(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x)
        sync()
        unprof = (time.perf_counter() - t0) * 1e6 / reps
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            sync()
            wall = (time.perf_counter() - t0) * 1e6 / reps
    rows = sorted(_device_rows(prof, cuda), key=lambda r: -r[3])
    busy = sum(r[3] for r in rows) / reps
    out = dict(activities="cuda" if cuda else "cpu (no device: each op's self CPU time)", reps=reps,
               per="one call of the op (totals over the profiled calls / reps)",
               wall_us=wall, wall_us_unprofiled=unprof, kernel_us=busy, gap_us=wall - busy,
               gap_share=(wall - busy) / wall if wall > 0 else None,
               launches=sum(r[2] for r in rows) / reps,
               rows=[dict(name=n, kind=k, calls=c / reps, total_us=us / reps,
                          share=us / reps / wall if wall > 0 else None) for n, k, c, us in rows])
    if cuda:  # the same kernel times against the unprofiled wall (the profiler slows the host side)
        out["gap_us_unprofiled"] = unprof - busy
        out["kernels"] = sum(r[2] for r in rows if r[1] == "kernel") / reps
    return out


def run_breakdowns(pending: list, device: torch.device, result: dict, out_json: str | None) -> str | None:
    """Profile the queued cells (after every timing of the run, so that no timing follows a profiler session) and
    log a table per cell and path; returns a fatal CUDA error, if one happened."""
    log(f"[bench] breakdowns (torch.profiler, {BREAKDOWN_REPS} calls each; after every timing of the run)")
    for fname, cell, x, todo in pending:
        bd = cell.setdefault("breakdown", {})
        for pname, fn in todo:
            try:
                rec = profile_breakdown(fn, x, device)
            except Exception as e:
                rec = dict(error=_root_msg(e, 300))
                if not cuda_healthy(device):
                    bd[pname] = rec
                    result["fatal"] = f"breakdown {fname}:{cell['T']} {pname}: {rec['error']}"
                    _save(result, out_json)
                    return result["fatal"]
            pr = cell["paths"].get(pname, {})
            rec.update(timed_best_ms=pr.get("best_ms"), timed_best_mode=pr.get("best_mode"),
                       timed_plain_ms=pr.get("plain_ms"))
            bd[pname] = rec
            log(report.render_breakdown(fname, cell["T"], pname, rec))
        for name, rec in bd.items():
            if "skipped" in rec:
                log(f"[breakdown {fname} T={cell['T']} {name}] skipped: {rec['skipped']}")
        _save(result, out_json)
    return None


def _run_optimize_path(block, saved, timer: Timer, args, device, frec: dict):
    """moecomp.optimize on a holder module around the block, timed on the same inputs (after the others,
    since optimize may rewrite the block in place)."""
    import moecomp

    opt = getattr(moecomp, "optimize", None)
    if opt is None:
        frec["errors"].append("--via-optimize: moecomp.optimize does not exist in this checkout")
        return

    class Holder(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x)

    holder = Holder(block)
    try:
        rep = None
        try:
            new, rep = opt(holder, report=True)
        except TypeError:  # an optimize() without report=
            new = opt(holder)
        holder = new if isinstance(new, torch.nn.Module) else holder
        if rep is not None:
            try:
                frec["optimize_report"] = rep.to_dict()
            except Exception:
                frec["optimize_report"] = str(rep)
            if hasattr(rep, "rewritten") and not rep.rewritten:
                why = ""
                try:
                    why = "; ".join(f"{b.name}: {getattr(b, 'reason', '')}" for b in rep.skipped)
                except Exception:
                    pass
                msg = f"moecomp.optimize rewrote no block ({report._short(why or str(rep), 300)})"
                frec["errors"].append(msg)
                for cell, *_ in saved:
                    cell["paths"]["moecomp_opt"] = dict(error=msg, best_ms=None)
                return
        path = Path("moecomp_opt", holder)
        for cell, x, ref, amb in saved:
            with torch.no_grad():
                cell["paths"]["moecomp_opt"] = run_path(path, x, ref, timer, args, device, args.tol, amb)
            log(_cell_line(frec["name"] + " (optimize)", cell))
    except FatalCudaError:
        raise
    except Exception as e:
        frec["errors"].append(f"moecomp.optimize: {_root_msg(e)}")
    finally:
        un = getattr(moecomp, "unoptimize", None)
        if callable(un):
            try:
                un(holder)
            except Exception:
                pass


def _cell_line(name: str, cell: dict) -> str:
    parts = [f"[{name} T={cell['T']}]", f"floor {report._fmt_ms(cell.get('floor_ms'))}"]
    for p, r in cell["paths"].items():
        v = r.get("best_ms")
        if v is None and r.get("skipped"):
            parts.append(f"{p} skipped")
        elif v is None:
            parts.append(f"{p} ERR({report._short(r.get('error', r.get('graph_note', '?')), 60)})")
        else:
            parts.append(f"{p} {report._fmt_ms(v)}{' g' if r.get('best_mode') == 'graph' else ''}")
    ach = (cell.get("achieved") or {}).get("moecomp")
    if ach:
        parts.append(f"moecomp {ach['tb_per_s']:.3g} TB/s {ach['tflop_per_s']:.3g} TFLOP/s")
    for key, who in (("check", "check"), ("check_vllm", "vllm check")):
        chk = cell.get(key)
        if chk:
            parts.append(f"{who} {chk.get('rel_err') if chk.get('rel_err') is None else format(chk['rel_err'], '.1e')}"
                         f"{'' if chk.get('ok') else ' FAIL'}")
    parts.append(f"({cell.get('wall_s', '?')} s)")
    return " | ".join(parts)


def _print_notes(result: dict):
    """Graph-capture notes and errors, before the table (the table is printed last)."""
    notes = {}
    for fam in result["families"]:
        for e in fam.get("errors", []):
            log(f"[bench] error {fam['name']}: {e}")
        for cell in fam["cells"]:
            for p, r in cell["paths"].items():
                n = r.get("graph_note")
                if n and n != "ok" and not n.startswith(("n/a (T >", "n/a (cpu)", "n/a (--no-graph)")):
                    notes.setdefault((p, n), []).append(f"{fam['name']}:{cell['T']}")
                if r.get("error"):
                    notes.setdefault((p, "error: " + r["error"]), []).append(f"{fam['name']}:{cell['T']}")
                if r.get("skipped"):
                    notes.setdefault((p, "skipped: " + r["skipped"]), []).append(f"{fam['name']}:{cell['T']}")
    for (p, n), where in notes.items():
        log(f"[bench] {p}: {n} [{', '.join(where[:6])}{' ...' if len(where) > 6 else ''}]")
    if result.get("fatal"):
        log(f"[bench] FATAL: {result['fatal']}")


def main(argv=None) -> int:
    res = run(argv)
    bad = [c for f in res["families"] for c in f["cells"] if c.get("check") and not c["check"].get("ok")]
    refused = [f["name"] for f in res["families"] if f.get("recognised", {}).get("refused")]
    if res.get("fatal"):
        return 2
    if refused:  # 3: moecomp's recogniser refused a family's block (reason code in the log and the JSON)
        log(f"[bench] moecomp refused the block of: {', '.join(refused)}")
        return 3
    return 1 if bad else 0  # 1: a correctness check failed (see the table)


if __name__ == "__main__":
    sys.exit(main())
