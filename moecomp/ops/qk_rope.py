"""``torch.ops.moecomp.qk_norm_rope_cache``: what a decoder layer's attention does between its q / k / v projections
and the attention kernel, in one launch.

    q [B, T, Hq*D]  k, v [B, T, Hkv*D]  (the projections' outputs, one row per token)
    q_weight, k_weight  None or [D]  (per-head RMSNorm weights: Qwen3's q_norm / k_norm; eps, offset: w or 1 + w)
    cos, sin [B, T, D] or [B, T, D / 2]  (the step's rotary table: transformers' half-split ``rotate_half`` form, or
                                         gpt-oss's chunked form with one value per rotated pair)
    k_cache, v_cache [B, Hkv, L, D]  index [T] int64 (the cache positions the T tokens go to)

    qn = rmsnorm(q head, q_weight) (or q)      kn = rmsnorm(k head, k_weight) (or k)
    k_cache[:, :, index] = rope(kn)            v_cache[:, :, index] = v           (written in place)
    returns rope(qn) [B, Hq, T, D]             (the layout of transformers' ``q_embed``)

    rope(x)[d] = x[d] cos[d] + rot(x)[d] sin[d],  rot(x) = cat(-x[D/2:], x[:D/2])

Rounding (to q's dtype, the model dtype, at each step where the unfused graph rounds in eager mode): the norm's
``x * rsqrt(mean(x^2) + eps)`` then the weight multiply (offset False: transformers' ``w * n.to(dt)``) or once after
``* (1 + w)`` (offset True: Gemma's form); the two rotary products and their sum. fp32 in between. Inductor's fused
kernels of the unfused graph may round less (not at every intermediate): the results then differ by a few units of
dt's roundoff.

The generate engine's decode-step pass (``generate/fuse_qkrope.py``) puts one call where a layer's q / k norms,
rotary and cache writes were (``MOECOMP_FUSE_QKROPE=1``). CUDA: one Triton launch (``kernels/qk_rope.py``, a program
per (row, head) of the q, k and v heads). CPU (or ``MOECOMP_CUDA_BACKEND=torch``): the same steps in torch.
No autograd: a decode-step op.
"""

from __future__ import annotations

import math

import torch

from .common import backend_name as _backend, on_device as _on_device


def _check(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, index) -> tuple[int, int, int]:
    """(Hq, Hkv, D) of valid arguments; ValueError naming the argument otherwise."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"qk_norm_rope_cache: k_cache / v_cache must be one shape [B, Hkv, L, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, Hkv, _, D = k_cache.shape
    if D % 2 or q.dim() != 3 or q.shape[0] != B or q.shape[-1] % D:
        raise ValueError(f"qk_norm_rope_cache: q must be [B={B}, T, Hq*D] with D={D} (even, the cache's last dim), "
                         f"got {tuple(q.shape)}")
    T = q.shape[1]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (B, T, Hkv * D) or t.dtype != q.dtype:
            raise ValueError(f"qk_norm_rope_cache: {name} must be [{B}, {T}, {Hkv * D}] of {q.dtype}, got "
                             f"{tuple(t.shape)} of {t.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"qk_norm_rope_cache: q must be floating, got {q.dtype}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (D,) or not w.dtype.is_floating_point):
            raise ValueError(f"qk_norm_rope_cache: {name} must be None or a floating [{D}], got "
                             f"{tuple(w.shape)} of {w.dtype}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"qk_norm_rope_cache: eps must be a finite number >= 0, got {eps}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape not in ((B, T, D), (B, T, D // 2)) or not t.dtype.is_floating_point:
            raise ValueError(f"qk_norm_rope_cache: {name} must be a floating [{B}, {T}, {D}] or [{B}, {T}, {D // 2}], "
                             f"got {tuple(t.shape)} of {t.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"qk_norm_rope_cache: cos and sin must be one shape, got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if index.shape != (T,) or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"qk_norm_rope_cache: index must be an int [T={T}], got {tuple(index.shape)} of {index.dtype}")
    ts = [q, k, v, cos, sin, k_cache, v_cache, index] + [w for w in (q_weight, k_weight) if w is not None]
    if len({t.device for t in ts}) != 1:
        raise ValueError("qk_norm_rope_cache: every tensor must be on one device")
    return q.shape[-1] // D, Hkv, D


def norm_rope_heads(x, w, eps, offset, cos, sin, H, D):
    """x [B, T, H*D] -> rope(norm(x)) [B, H, T, D] in x's dtype, rounded at the steps the module docstring lists."""
    B, T = x.shape[:2]
    dt = x.dtype
    h = x.reshape(B, T, H, D).transpose(1, 2).float()  # [B, H, T, D]
    if w is not None:
        r = torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
        h = (h * r * (1.0 + w.float())).to(dt) if offset else ((h * r).to(dt).float() * w.float()).to(dt)
        h = h.float()
    c, s = cos.float()[:, None], sin.float()[:, None]  # [B, 1, T, Dc]
    if c.shape[-1] != D:
        c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
    rot = torch.cat([-h[..., D // 2:], h[..., :D // 2]], -1)
    return ((h * c).to(dt).float() + (rot * s).to(dt).float()).to(dt).contiguous()


def _torch(q, k, v, q_weight, k_weight, eps, offset, cos, sin, k_cache, v_cache, index, Hq, Hkv, D):
    kr = norm_rope_heads(k, k_weight, eps, offset, cos, sin, Hkv, D)  # [B, Hkv, T, D]
    B, T = v.shape[:2]
    k_cache.index_copy_(2, index.long(), kr.to(k_cache.dtype))
    v_cache.index_copy_(2, index.long(), v.reshape(B, T, Hkv, D).transpose(1, 2).to(v_cache.dtype))
    return norm_rope_heads(q, q_weight, eps, offset, cos, sin, Hq, D)


@torch.library.custom_op("moecomp::qk_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    Hq, Hkv, D = _check(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, index)
    if not use_kernel(q.device):
        return _torch(q, k, v, q_weight, k_weight, eps, offset, cos, sin, k_cache, v_cache, index, Hq, Hkv, D)
    from .triton_qk_rope import qk_norm_rope_cache_triton as _triton  # lazy: imports Triton

    args = (q, k, v, q_weight, k_weight, eps, offset, cos, sin, k_cache, v_cache, index, Hq, Hkv, D)
    if q.is_cuda:
        return _on_device(q, lambda: _triton(*args))
    return _triton(*args)


def use_kernel(device: torch.device) -> bool:
    """Whether the Triton kernel runs on ``device`` (CUDA unless MOECOMP_CUDA_BACKEND=torch; on CPU with
    MOECOMP_CPU_BACKEND=triton, the interpreter)."""
    return _backend(device) == "triton"


@qk_norm_rope_cache.register_fake
def _(q, k, v, q_weight, k_weight, eps, offset, cos, sin, k_cache, v_cache, index):
    Hq, _, D = _check(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, index)
    return q.new_empty(q.shape[0], Hq, q.shape[1], D)
