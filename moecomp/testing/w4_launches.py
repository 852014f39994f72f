"""What the routed experts' Triton launches were given, for the 4-bit tests: one spy on ``triton_moe.gemm1`` /
``gemm2`` / ``decode_down`` (the positions of their 4-bit kwargs ``q`` and weight tensors written once here)."""

from __future__ import annotations

from ..ops import triton_moe

LAUNCHES = ("gemm1", "gemm2", "decode_down")


def _q(fn: str, a: tuple, kw: dict) -> dict | None:
    """The launch's ``quant4_kwargs`` (None: not 4-bit)."""
    if fn == "gemm1":
        return a[8]
    if fn == "gemm2":
        return a[9]
    return kw.get("q", a[11] if len(a) > 11 else None)


def record_w4_forms(monkeypatch, with_weights: bool = False) -> list[tuple]:
    """Patch the three launches (through ``monkeypatch``) to record, per call, ``(name, W4_FORM)`` (0 for a launch
    without 4-bit kwargs), or with ``with_weights`` ``(name, W4_FORM, weight.data_ptr())``; returns the list they
    append to. Each call still runs."""
    seen: list[tuple] = []
    for fn in LAUNCHES:
        real = getattr(triton_moe, fn)

        def spy(*a, _real=real, _fn=fn, **kw):
            form = (_q(_fn, a, kw) or {}).get("W4_FORM", 0)
            seen.append((_fn, form, a[1].data_ptr()) if with_weights else (_fn, form))
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, fn, spy)
    return seen
