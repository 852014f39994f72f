"""What every part of the layer benchmark shares: the run's dtype, tolerances, the fatal-CUDA error, small helpers."""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):  # report.py (tables) and moecomp (this checkout) without installing anything
    if _p not in sys.path:
        sys.path.insert(0, _p)

from moecomp.core import policy  # noqa: E402  (tolerances and the near-tie window: moecomp/core/policy.py)

# --dtype: blocks, inputs, every peer, the floor's bytes. "fp8": the blocks' experts quantized to e4m3 (128x128 fp32
# block scales), activations (and so the blocks as built, the router, the HF reference) in bf16.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
DTYPE = torch.bfloat16  # the run's activation dtype (``bench_moe.run`` sets it from --dtype and restores it after)
INIT_STD = 0.02
CORRECTION_BIAS_STD = 0.01  # DeepSeek's e_score_correction_bias: small, random (it only steers the selection)
GRAPH_CONSISTENCY_TOL = policy.BENCH_GRAPH_CONSISTENCY_TOL  # graph replay vs plain call on a fresh input
ALL_TOKENS = (1, 16, 128, 1024, 8192)
TINY_TOKENS = (1, 16, 128)
ALL_PEERS = ("hf_eager", "hf_grouped_mm", "compile", "vllm", "moecomp")
FP8_PATHS = ("moecomp_fp8", "moecomp_fp8_w8a8", "moecomp_fp8_w8a16", "vllm_fp8", "scaled_grouped_mm")
FP8_PEERS = ("hf_eager", "hf_grouped_mm", "compile") + FP8_PATHS + ("moecomp",)  # --peers all under --dtype fp8
PEER_ALIASES = {"eager": "hf_eager", "grouped_mm": "hf_grouped_mm", "grouped": "hf_grouped_mm",
                "torch_compile": "compile", "ours": "moecomp", "vllm_fused_moe": "vllm", "vllm_kernel": "vllm",
                "fp8": "moecomp_fp8", "w8a8": "moecomp_fp8_w8a8", "w8a16": "moecomp_fp8_w8a16",
                "sgmm": "scaled_grouped_mm", "_scaled_grouped_mm": "scaled_grouped_mm"}


def set_dtype(dtype: torch.dtype) -> torch.dtype:
    """Set the run's activation dtype (read at call time by every module); returns the previous one."""
    global DTYPE
    prev, DTYPE = DTYPE, dtype
    return prev


def dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def default_tolerance(dtype: torch.dtype) -> float:
    """The check's default tolerance in ``dtype``: ``policy.BENCH_TOLERANCE`` is the bf16 rule (whole-tensor norms of
    bf16 roundings); other dtypes scale it as the policy's verify tolerances scale (fp16 keeps 11 significant bits
    against bf16's 8: its verify tolerance is a third of bf16's, so is this, 2e-2 / 3 ~ 6.7e-3)."""
    return policy.BENCH_TOLERANCE * policy.verify_tolerance(dtype) / policy.verify_tolerance(torch.bfloat16)


class FatalCudaError(RuntimeError):
    """The CUDA context is no longer usable (a sticky error): stop timing, keep what we have."""


def root_msg(e: BaseException, n: int = 160) -> str:
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


def resolve(names: str, table: dict, aliases: dict, what: str) -> list[str]:
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


def log(msg: str):
    print(msg, flush=True)
