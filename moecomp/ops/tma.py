"""Host side of the TMA kernels (``kernels/grouped_gemm_tma.py``, ``kernels/grouped_gemm_tma_fp8.py``): Triton's
tensor descriptors, the operand rules TMA imposes, and the persistent grid size. Shared by the 16-bit launchers
(``triton_moe``) and the FP8 ones (``triton_fp8_tma``)."""

from __future__ import annotations

import functools

import torch

from .common import _sm_count


def _tma_rows(t: torch.Tensor) -> bool:
    """TMA copies rows of whole 16-byte units from a 16-byte aligned base."""
    return t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def tma_device(t: torch.Tensor) -> bool:
    """t's device has a tensor memory accelerator (CUDA compute capability 9+; the interpreter's CPU emulates one)."""
    return t.device.type != "cuda" or _capability(t.device.index or 0) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _TensorDescriptor():
    """Triton's host-side TMA descriptor class, or None where this Triton has none (looked up once)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _desc(t: torch.Tensor, rows: int, block: list):
    """A TMA descriptor of t read as a [rows, t.shape[-1]] row-major matrix, with tiles of ``block``."""
    return _TensorDescriptor()(t, [rows, t.shape[-1]], [t.shape[-1], 1], block)


def _w13_desc(w13: torch.Tensor, gated: bool, bn: int, bk: int):
    """gemm1's weight descriptor: gated w13 [E, 2I, H] read as [E, 2, I, H] (one box = the gate and the up rows of
    BLOCK_N columns), else [E, I, H]."""
    E, n_rows, H = w13.shape
    if gated:
        I = n_rows // 2
        return _TensorDescriptor()(w13, [E, 2, I, H], [2 * I * H, I * H, H, 1], [1, 2, bn, bk])
    return _TensorDescriptor()(w13, [E, n_rows, H], [n_rows * H, H, 1], [1, bn, bk])


def _programs(device: torch.device, tiles: int, per_sm: int = 1) -> int:
    """Persistent grid: ``per_sm`` programs per SM (4 SMs under the interpreter), never more than the worst-case tile
    count. Two per SM let one program's register work (the FP8 kernels' per-step scaling) run while the other's
    tensor-core steps do, where registers and shared memory hold both (a config's "per_sm")."""
    return max(1, min(per_sm * _sm_count(device), tiles))
