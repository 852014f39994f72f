"""``torch.ops.moecomp.decode_attention``: attention of one query token per row over a static KV cache.

    q [B, Hq, Dk]   k [B, Hkv, L, Dk]   v [B, Hkv, L, Dv]   keep [B, L] bool   n [] int64   ->   out [B, Hq, Dv]
    optional: sinks [Hq] (fp32 or 16-bit), window (int, 0 = none)

Position j of row b takes part when ``keep[b, j]`` and ``j < n`` (the cache positions written so far), and, with a
``window`` > 0, ``j >= n - window`` (a sliding-window layer: only its window is read). Hq must be a multiple of Hkv
(grouped-query attention: query head i reads kv head i // (Hq / Hkv)). With ``sinks`` (gpt-oss's learned
attention sinks) each query head's softmax gets one more logit, ``sinks[i]``, that has no value vector::

    s_j = scale * q_i . k_j (positions taking part)      m = max(max_j s_j, sinks[i])
    out[b, i] = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[i] - m))

(a row with no position taking part gives zeros, with or without sinks).

CUDA: two Triton kernels (``kernels/decode_attention.py``, launched by ``ops/triton_attention.py``, imported on the
first Triton call): split over the cache length (over the window, with one), each split reading only positions
below ``n``, each kv head read once for its query heads (no repeat of K / V); then a combine over the splits, which
adds the sink (or both in one launch with ``MOECOMP_ATTN_ONE_LAUNCH=1``, opt-in until measured: the split that
finishes last combines; ``ops/triton_attention.py``). No host sync, fixed launch sizes for a given shape:
CUDA-graph capturable. CPU: the same math in torch (grouped view, masked softmax in fp32).
"""

from __future__ import annotations

import torch

from .common import backend_name as _backend, on_device as _on_device


def _check(q, k, v, keep, n, sinks, window):
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"decode_attention: q must be [B, Hq, Dk] and k / v [B, Hkv, L, D], got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Hq, Dk = q.shape
    if k.shape[0] != B or k.shape[3] != Dk or v.shape[:3] != k.shape[:3] or Hq % k.shape[1] != 0:
        raise ValueError(f"decode_attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (k needs [B, Hkv, L, Dk] with Hq a multiple of Hkv; v [B, Hkv, L, Dv])")
    if keep.shape != (B, k.shape[2]) or keep.dtype != torch.bool:
        raise ValueError(f"decode_attention: keep must be a bool [B, L] = {(B, k.shape[2])}, got "
                         f"{keep.dtype} {tuple(keep.shape)}")
    if n.numel() != 1:
        raise ValueError(f"decode_attention: n must hold one value, got shape {tuple(n.shape)}")
    if sinks is not None and (sinks.shape != (Hq,) or not sinks.is_floating_point()):
        raise ValueError(f"decode_attention: sinks must be a float [Hq] = [{Hq}] (one logit per query head), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    if window < 0:
        raise ValueError(f"decode_attention: window must be >= 0 (0: no window), got {window}")
    if len({t.device for t in (q, k, v, keep, n) + ((sinks,) if sinks is not None else ())}) != 1:
        raise ValueError("decode_attention: q, k, v, keep, n and sinks must be on one device")


def _torch(q, k, v, keep, n, scale: float, sinks, window: int) -> torch.Tensor:
    B, Hq, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, -1)  # [B, Hkv, G, Dk]
    s = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale  # [B, Hkv, G, L]
    pos = torch.arange(L, device=q.device)
    ok = keep & (pos < n)  # [B, L]
    if window:
        ok = ok & (pos >= n - window)
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    else:  # one more logit per query head, dropped after the softmax (it has no value)
        sk = sinks.float().reshape(1, Hkv, G, 1).expand(B, Hkv, G, 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :L]
    return torch.einsum("bhgl,bhld->bhgd", p, v.float()).reshape(B, Hq, -1).to(q.dtype)


@torch.library.custom_op("moecomp::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, n: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    _check(q, k, v, keep, n, sinks, window)
    if q.shape[0] == 0:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[3])
    if _backend(q.device) != "triton":  # CPU (or MOECOMP_CUDA_BACKEND=torch): the same math in torch
        return _torch(q, k, v, keep, n, scale, sinks, window)
    # lazy: triton_attention imports Triton and the kernels, which ``import moecomp`` should not pay for
    from .triton_attention import decode_attention_triton as _triton

    if q.is_cuda:
        return _on_device(q, lambda: _triton(q, k, v, keep, n, scale, sinks, window))
    return _triton(q, k, v, keep, n, scale, sinks, window)


@decode_attention.register_fake
def _(q, k, v, keep, n, scale, sinks=None, window=0):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[3])
