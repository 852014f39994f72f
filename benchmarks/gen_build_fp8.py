"""FP8 models of the generate benchmarks built directly in FP8 on the device: no 16-bit expert tensor ever exists.

    model, info = build("mixtral", "cuda", torch.bfloat16, layers=32, tiny=False, seed=0)   # Mixtral-8x7B, ~47 GB
    twin, _ = build("mixtral", "cpu", torch.float32, 2, True, 0, fp8=False)  # the same draws, kept in float (tests)

The model is ``bench_generate.build``'s (its config, sizes, depth and generation config) made on the meta device and
turned by ``to_fp8`` into what transformers builds when it loads an FP8 block checkpoint (``FP8Experts`` with e4m3
``gate_up_proj`` / ``down_proj`` and fp32 ``*_scale_inv`` per 128 x 128 block; every other linear an ``FP8Linear``;
routers, ``lm_head`` and the embedding 16-bit), structure only: nothing is allocated. Then every tensor is made on
``device``, in module order:

* 1-D tensors and buffers (norms, biases, rotary frequencies) by the model's own ``_init_weights``, router correction
  biases N(0, 0.01^2) (as ``bench_generate.build``);
* every weight of two or more dimensions drawn N(0, 0.02^2) in fp32 a chunk at a time (``CHUNK_BYTES``: a few experts
  of a stacked tensor, a multiple of 128 rows of a matrix), rounded to the model dtype, and, for an FP8 weight,
  quantized into its place (e4m3, the largest magnitude of each 128 x 128 block at 448) with its scales.

So the build's peak memory is the FP8 model plus one chunk's temporaries (``info["peak_extra_bytes"]`` on CUDA). With
``fp8=False`` the same draws are kept in the model dtype (no ``to_fp8``): ``to_fp8`` of that twin equals the FP8 build
exactly (tests/test_bench_fp8_build.py), i.e. the FP8 model is the FP8 checkpoint of a 16-bit model whose weights
are the draws.
"""

from __future__ import annotations

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_generate as bg  # noqa: E402
from moecomp.core.quant import FP8, quantize  # noqa: E402
from moecomp.core.spec import FP8_MAX  # noqa: E402
from moecomp.testing.fp8_convert import block_quant, to_fp8  # noqa: E402

CHUNK_BYTES = 256 << 20  # fp32 bytes of one draw
STD = 0.02  # bench_generate.build's weights
BLOCK = (128, 128)
WORK_MARGIN = 8 << 30  # what a run needs beside the weights (KV cache, CUDA graph pools, activations)


def meta_model(name: str, layers: int, tiny: bool, dtype=torch.bfloat16):
    """``bench_generate.build``'s model on the meta device (nothing allocated)."""
    return bg.build(name, torch.device("meta"), dtype, layers, tiny, 0)


def bf16_bytes(name: str, layers: int, tiny: bool) -> int:
    """Bytes of the 16-bit model ``bench_generate.build`` would make."""
    return 2 * sum(p.numel() for p in meta_model(name, layers, tiny).parameters())


def bf16_fits(name: str, layers: int, tiny: bool, device) -> tuple[bool, str]:
    """(does the 16-bit model fit the device's free memory with ``WORK_MARGIN`` to spare, why)."""
    device = torch.device(device)
    need = bf16_bytes(name, layers, tiny)
    if device.type != "cuda":
        return True, f"{device.type}: no device memory limit ({need / 1e9:.1f} GB in bf16)"
    free = torch.cuda.mem_get_info(device)[0]
    ok = need + WORK_MARGIN <= free
    return ok, (f"bf16 model {need / 1e9:.1f} GB + {WORK_MARGIN / 2**30:.0f} GiB working memory "
                f"{'fits' if ok else 'does not fit'} {free / 1e9:.1f} GB free")


# ------------------------------------------------------------------------------------------------ quantization
def block_quantize(w: torch.Tensor, halves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``moecomp.core.quant.quantize`` with 128 x 128 block scales, bit for bit, in one reduction where the blocks tile the
    weight (each half of a gated ``gate_up`` a whole number of 128-row blocks; ``quantize``'s scatter takes ~10 s for
    a 30B-weight model), else ``quantize`` itself. ``w`` [..., rows, cols] -> (e4m3, fp32 [..., rows/128, cols/128])."""
    rows, cols = w.shape[-2:]
    bn, bk = BLOCK
    if rows % halves or (rows // halves) % bn or cols % bk:
        return quantize(w, block_quant(BLOCK), halves)
    lead = w.shape[:-2]
    wf = w.float().reshape(*lead, rows // bn, bn, cols // bk, bk)
    s = wf.abs().amax(dim=(-3, -1)).clamp_(min=1e-12) / FP8_MAX  # [..., rows/bn, cols/bk]
    q = (wf / s[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, rows, cols), s


# ------------------------------------------------------------------------------------------------ drawing
def _chunks(shape: tuple, chunk_bytes: int) -> list[tuple[int, int]]:
    """Slices of dim 0 drawn at a time: whole experts of a stacked [E, rows, cols] tensor, a multiple of 128 rows of
    a matrix (so that FP8 blocks never straddle two draws). Depends on the shape only: an FP8 weight and its 16-bit
    twin are drawn alike."""
    if len(shape) < 2:
        return [(0, shape[0] if shape else 1)]
    per = 4 * int(torch.Size(shape[1:]).numel())
    n = max(1, chunk_bytes // per)
    if len(shape) == 2:
        n = max(BLOCK[0], n // BLOCK[0] * BLOCK[0])
    return [(a, min(shape[0], a + n)) for a in range(0, shape[0], n)]


def _draw(shape, g: torch.Generator, device, dtype) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=g, device=device).mul_(STD).to(dtype)


def _fill_float(t: torch.Tensor, g, dtype, chunk_bytes: int) -> None:
    for a, b in _chunks(tuple(t.shape), chunk_bytes):
        t[a:b] = _draw((b - a, *t.shape[1:]), g, t.device, dtype)


def _fill_fp8(q: torch.Tensor, s: torch.Tensor, halves: int, g, dtype, chunk_bytes: int) -> None:
    """Random weights of ``q``'s shape, drawn a chunk at a time in ``dtype`` and quantized into ``q`` / ``s``."""
    for a, b in _chunks(tuple(q.shape), chunk_bytes):
        qc, sc = block_quantize(_draw((b - a, *q.shape[1:]), g, q.device, dtype), halves)
        q[a:b] = qc
        if q.dim() == 2:  # (row chunks: a multiple of 128 rows, their scale rows follow)
            s[a // BLOCK[0]: a // BLOCK[0] + sc.shape[0]] = sc
        else:
            s[a:b] = sc
        del qc, sc


def _halves(m: torch.nn.Module, name: str) -> int:
    return 2 if name == "gate_up_proj" and getattr(m, "has_gate", True) else 1


def _set(m: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    if name in m._parameters:  # (requires_grad as transformers allocates them)
        old = m._parameters[name]
        m._parameters[name] = torch.nn.Parameter(value, requires_grad=bool(
            old is not None and old.requires_grad and value.is_floating_point()))
    else:
        m._buffers[name] = value


def _small_tensors(model, device, g) -> None:
    """Pass 1: every meta tensor of fewer than two dimensions made on ``device`` and initialised by the model's
    ``_init_weights`` (norms at one, biases at zero, rotary frequencies), router correction biases N(0, 0.01^2)."""
    init = model._init_weights
    for mname, m in model.named_modules():
        own = [(n, t) for n, t in list(m._parameters.items()) + list(m._buffers.items())
               if t is not None and t.device.type == "meta" and t.dim() < 2]
        if not own:
            continue
        for n, t in own:
            _set(m, n, torch.zeros(t.shape, dtype=t.dtype, device=device))
        if not any(t is not None and t.dtype == FP8 for t in m._parameters.values()):
            init(m)  # (an FP8 module's only small tensor is its bias: left at zero)
        for n, t in own:
            if "correction_bias" in n:
                getattr(m, n).copy_(torch.randn(t.shape, generator=g, device=device) * 0.01)


def _large_tensors(model, device, dtype, g, chunk_bytes: int) -> None:
    """Pass 2: every weight of two or more dimensions, drawn a chunk at a time; FP8 ones quantized into place."""
    for m in model.modules():
        for n, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is None or t.device.type != "meta" or t.dim() < 2 or n.endswith("_scale_inv"):
                continue
            if t.dtype == FP8:
                sname = f"{n}_scale_inv"
                st = getattr(m, sname)
                q = torch.empty(t.shape, dtype=FP8, device=device)
                s = torch.empty(st.shape, dtype=st.dtype, device=device)
                _fill_fp8(q, s, _halves(m, n), g, dtype, chunk_bytes)
                _set(m, n, q)
                _set(m, sname, s)
            else:
                v = torch.zeros(t.shape, dtype=t.dtype, device=device)
                if t.is_floating_point():
                    _fill_float(v, g, t.dtype, chunk_bytes)
                _set(m, n, v)


def build(name: str, device, dtype, layers: int, tiny: bool, seed: int, *, fp8: bool = True,
          chunk_bytes: int = CHUNK_BYTES):
    """(model, info): ``bench_generate.build``'s model ``name`` at depth ``layers`` as an FP8 block checkpoint loads
    (``fp8=True``) or its 16-bit twin with the same draws (module docstring), made on ``device``. ``info``: build
    seconds, model bytes, and on CUDA the build's peak memory beyond the model."""
    device = torch.device(device)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    model = meta_model(name, layers, tiny, dtype)
    if fp8:
        to_fp8(model, block_size=BLOCK)  # (on meta: the structure and the config's quantization_config only)
    g = torch.Generator(device=device).manual_seed(seed)
    torch.manual_seed(seed)  # (transformers' init draws from the global generators)
    with torch.no_grad():
        _small_tensors(model, device, g)
        _large_tensors(model, device, dtype, g, chunk_bytes)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"build({name!r}): tensors left on the meta device: {left[:5]}")
    model.tie_weights()
    model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    info = dict(build="fp8" if fp8 else str(dtype).replace("torch.", ""), build_s=round(time.perf_counter() - t0, 2),
                model_bytes=nbytes, chunk_bytes=chunk_bytes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        info["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base - nbytes
    return model, info
