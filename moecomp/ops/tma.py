"""Host side of the TMA kernels (``kernels/grouped_gemm_tma.py``, ``kernels/grouped_gemm_tma_fp8.py``): Triton's
tensor descriptors, the operand rules TMA imposes, and the persistent grid size. Shared by the 16-bit launchers
(``triton_moe``) and the FP8 ones (``triton_fp8_tma``)."""

from __future__ import annotations

import functools

import torch

from ..core.spec import MoESpec
from .common import sm_count as _sm_count


def tma_rows(t: torch.Tensor) -> bool:
    """TMA copies rows of whole 16-byte units from a 16-byte aligned base."""
    return t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def tma_device(t: torch.Tensor) -> bool:
    """t's device has a tensor memory accelerator (CUDA compute capability 9+; the interpreter's CPU emulates one)."""
    return t.device.type != "cuda" or _capability(t.device.index or 0) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def tensor_descriptor_class():
    """Triton's host-side TMA descriptor class, or None where this Triton has none (looked up once)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def tma_desc(t: torch.Tensor, rows: int, block: list):
    """A TMA descriptor of t read as a [rows, t.shape[-1]] row-major matrix, with tiles of ``block``."""
    return tensor_descriptor_class()(t, [rows, t.shape[-1]], [t.shape[-1], 1], block)


def w13_desc(w13: torch.Tensor, gated: bool, bn: int, bk: int):
    """gemm1's weight descriptor: gated w13 [E, 2I, H] read as [E, 2, I, H] (one box = the gate and the up rows of
    BLOCK_N columns), else [E, I, H]."""
    E, n_rows, H = w13.shape
    if gated:
        I = n_rows // 2
        return tensor_descriptor_class()(w13, [E, 2, I, H], [2 * I * H, I * H, H, 1], [1, 2, bn, bk])
    return tensor_descriptor_class()(w13, [E, n_rows, H], [n_rows * H, H, 1], [1, bn, bk])


def persistent_programs(device: torch.device, tiles: int, per_sm: int = 1) -> int:
    """Persistent grid: ``per_sm`` programs per SM (4 SMs under the interpreter), never more than the worst-case tile
    count. Two per SM let one program's register work (the FP8 kernels' per-step scaling) run while the other's
    tensor-core steps do, where registers and shared memory hold both (a config's "per_sm")."""
    return max(1, min(per_sm * _sm_count(device), tiles))


def tma_ok(spec: MoESpec, h: torch.Tensor, w2: torch.Tensor) -> bool:
    """The TMA gemm2 (``kernels/grouped_gemm_tma.py``) can take these operands: ``_tma_weights_ok``, and h [S, I]
    contiguous with 16-byte rows (w2 then reads as one 2-D [E * H, I] matrix). Otherwise the pointer gemm2 runs
    (same results)."""
    return _tma_weights_ok(spec, h, w2) and h.is_contiguous() and tma_rows(h)


def tma1_ok(spec: MoESpec, x: torch.Tensor, w13: torch.Tensor) -> bool:
    """The TMA gemm1 can take these operands: ``_tma_weights_ok``, gate/up concatenated (w13 [E, 2I, H] then reads
    as [E, 2, I, H]); x needs only unit-stride rows (it is gathered)."""
    return _tma_weights_ok(spec, x, w13) and (not spec.gated or spec.gate_up == "concat") and x.stride(-1) == 1


def _tma_weights_ok(spec: MoESpec, a: torch.Tensor, w: torch.Tensor) -> bool:
    """What both TMA GEMMs need: this Triton has host tensor descriptors; a and w 16-bit, of one dtype (so fp8
    weights never take them: the quantized GEMMs are the pointer kernels'); w in the [E, out, in] layout, contiguous,
    with 16-byte rows and base."""
    return (tensor_descriptor_class() is not None and tma_device(w) and a.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == a.dtype
            and spec.w_layout == "out_in" and w.is_contiguous() and tma_rows(w))
