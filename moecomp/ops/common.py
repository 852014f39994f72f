"""What the op modules share, one layer below them: backend choice, device placement, the Triton-interpreter
precision flags (the op's argument names are in ``core/args.py``). Imports torch only (no Triton, no kernels), so
that ``moe_op`` (the op definitions), ``torch_moe`` / ``triton_moe`` (the implementations) and ``attention`` can all
import it without importing each other.
"""

from __future__ import annotations

import os

import torch

# What the op implements beyond the base spec; passes check this before relying on it.
FEATURES = ("fused_shared_gate", "weight_on_input", "zero_experts", "sparsemixer", "latent", "hash_routing",
            "router_input", "shared_gamma", "weight_scale", "norms", "expert_bias", "shared_norm")


def split_fused_gate(args: dict, spec) -> dict:
    """FSE arguments (router_w [E + 1, H]) as plain ones: router rows and gate row as views, no copy."""
    if not spec.fused_shared_gate:
        return args
    E = spec.num_experts
    return {**args, "router_w": args["router_w"][:E], "shared_gate_w": args["router_w"][E:]}


def backend_name(device: torch.device) -> str:
    """"triton" or "torch": which implementation runs on ``device`` (MOECOMP_CUDA_BACKEND / MOECOMP_CPU_BACKEND)."""
    if device.type == "cuda":
        return os.environ.get("MOECOMP_CUDA_BACKEND", "triton")
    return os.environ.get("MOECOMP_CPU_BACKEND", "torch")


def on_device(x: torch.Tensor, fn):
    """fn() with x's GPU as the current device: Triton launches (and graph captures) go to the current device, and
    a model spread over several GPUs (device_map="auto") calls blocks on a GPU that need not be current."""
    if x.device.index is None or x.device.index == torch.cuda.current_device():
        return fn()
    with torch.cuda.device(x.device):
        return fn()


def check_ids_wanted(ids: torch.Tensor) -> bool:
    """Read ids on the host to range-check them? CPU (and other synchronous devices): always. CUDA: reading them is a
    host sync, so only outside CUDA-graph capture and compilation, and not with MOECOMP_CHECK_IDS=0 (for callers that
    vouch for their ids)."""
    if not ids.is_cuda:
        return True
    return (os.environ.get("MOECOMP_CHECK_IDS", "1") != "0" and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling())


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_bf16(t: torch.Tensor) -> bool:
    # The Triton interpreter's bf16 dot is wrong (FACTS.md); upcast operands to fp32 inside the kernel there.
    return interpret() and t.dtype == torch.bfloat16


def dot_precision(t: torch.Tensor) -> str:
    # fp32 models get fp32 products (no tf32), like torch's default matmul; 16-bit dots ignore this.
    return "ieee" if t.dtype == torch.float32 or upcast_bf16(t) else "tf32"


def sm_count(device: torch.device) -> int:
    """The device's SM count, looked up once (4 off CUDA: the interpreter runs every program in turn)."""
    if device.type != "cuda":
        return 4
    n = _sm_counts.get(device.index)
    if n is None:
        n = _sm_counts[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


_sm_counts: dict = {}


def w_strides(w: torch.Tensor, layout: str):
    """(stride_e, stride_row_out, stride_col_in) of per-expert matrices in either layout."""
    if layout == "out_in":
        return w.stride(0), w.stride(1), w.stride(2)
    return w.stride(0), w.stride(2), w.stride(1)


def flat_ids(ids: torch.Tensor) -> torch.Tensor:
    """ids [T, k] -> [P] with unit stride (reshape keeps a view with a step, e.g. every other column: copied)."""
    flat = ids.reshape(-1)
    return flat.contiguous() if flat.numel() > 1 and flat.stride(0) != 1 else flat
