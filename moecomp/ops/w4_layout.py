"""The 4-bit experts' "mma" K-step layout (``kernels/quant4_mma.py``): packed codes re-encoded once so that the
kernel decodes a 32-bit word of 8 codes with shifts, masks and bf16 multiplies only. Still 4 bits a weight, same
shape [..., rows, K / 2] uint8, same scales (a row's ue8m0 / int4 group scales are contiguous along K already, and
the kernel reads them as stored): a pure re-encoding inside each 4-byte word, with an exact inverse.

    packed (moecomp / gpt-oss):  word w of a row (bytes 4w .. 4w + 3, little-endian int32) = columns 8w .. 8w + 7,
                                 column 8w + c in bits 4c .. 4c + 3 as the nibble  s e1 e0 m  (mxfp4) or q (int4)

        bit  31       16 15        0
             [ c7 c6 c5 c4 | c3 c2 c1 c0 ]          c = 4L + j: lane L (16-bit half), slot j = 0..3

    mma (mxfp4): in lane L the 4 codes' magnitudes em = e1 e0 m and signs s are stored apart:

        lane bit  15  14  13  12 | 11..9  8..6  5..3  2..0
                  s0  s1  s2  s3 |  em3   em2   em1   em0          (s_j, em_j: column 8w + 4L + j)

        so slot j of both lanes at once is   t_j = ((r << (6 - 3j)) & 0x01C001C0) | ((r << j) & 0x80008000)
        (a right shift by 3 for j = 3): each 16-bit half is now  s_j << 15 | em_j << 6,  the bf16 bits of
        e2m1 * 2^-126 (e = 0: the subnormal m * 2^-127), and one bf16 multiply by 2^126 gives e2m1 exactly.

    mma (int4): the packed layout itself. Slot j of both lanes is  ((r >> 4j) & 0x000F000F) | 0x64006400:  fp16
        1024 + q in each half (the magic-number conversion); minus 1024 + zero (fp16) is q - zero exactly.

    The kernel joins the 8 values of a word back in column order (c = 4L + j), so the tile it feeds ``tl.dot`` is
    the natural [rows, BLOCK_K] and x needs no permutation.

    relayout(q, quant) -> the mma bytes (a new tensor; int4: ``q`` itself when its rows are 4-byte words already)
    restore(r, quant)  -> the packed bytes (the exact inverse: restore(relayout(q)) == q byte for byte)
    relaid(q, quant)   -> relayout(q), computed once per weight tensor and kept while the tensor lives (what the op
                          calls on packed weights with the form asked: the copy costs another 4 bits a weight)
    relayout_(q, quant) / restore_(r, quant) -> the same in place: each expert's words rewritten in q's own storage
                          (one expert's int32 temporaries at a time; no second copy). What ``optimize`` does once to
                          a ``PackedExperts`` when the form is asked (``QuantSpec.layout`` "mma"): the op then reads
                          the weights as they are (``unpack``: the packed bytes back, a copy, for the torch paths)

Needs K % 8 == 0 (whole words: ``fits``). Chunked over the leading dim (int32 temporaries of one expert).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

_CACHE: dict[tuple, tuple] = {}


def fits(q: torch.Tensor) -> bool:
    """Whether ``q`` [..., rows, K / 2] uint8 can take the layout: K % 8 == 0 (rows of whole 32-bit words)."""
    return q.dtype == torch.uint8 and q.dim() >= 2 and q.shape[-1] % 4 == 0


def _check(q: torch.Tensor, quant, name: str):
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() < 2:
        raise ValueError(f"{name}: expected packed 4-bit codes, a uint8 tensor [..., rows, K / 2]; got "
                         f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}")
    if q.shape[-1] % 4:
        raise ValueError(f"{name}: the mma layout needs K % 8 == 0 (rows of whole 32-bit words); got K / 2 = "
                         f"{q.shape[-1]} bytes a row")
    if getattr(quant, "weight", None) not in ("mxfp4", "int4"):
        raise ValueError(f"quant: expected a 4-bit QuantSpec (weight 'mxfp4' or 'int4'); got {quant!r}")


def _words(q: torch.Tensor) -> torch.Tensor:
    return q.contiguous().view(torch.int32)


def _mx_encode(r: torch.Tensor) -> torch.Tensor:
    """int32 words, packed -> mma (mxfp4)."""
    out = torch.zeros_like(r)
    for c in range(8):
        lane, j = divmod(c, 4)
        n = (r >> (4 * c)) & 15
        out |= (n & 7) << (16 * lane + 3 * j)
        out |= ((n >> 3) & 1) << (16 * lane + 15 - j)
    return out


def _mx_decode(r: torch.Tensor) -> torch.Tensor:
    """int32 words, mma -> packed (mxfp4): the inverse of ``_mx_encode``."""
    out = torch.zeros_like(r)
    for c in range(8):
        lane, j = divmod(c, 4)
        em = (r >> (16 * lane + 3 * j)) & 7
        s = (r >> (16 * lane + 15 - j)) & 1
        out |= (em | (s << 3)) << (4 * c)
    return out


def _map(q: torch.Tensor, fn) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.uint8, device=q.device)
    flat_in, flat_out = q.reshape(-1, *q.shape[-2:]), out.view(-1, *q.shape[-2:])
    for i in range(flat_in.shape[0]):  # one expert's int32 temporaries at a time
        flat_out[i].view(torch.int32).copy_(fn(_words(flat_in[i])))
    return out


def relayout(q: torch.Tensor, quant) -> torch.Tensor:
    """Packed codes [..., rows, K / 2] uint8 -> the mma layout (module docstring), same shape, contiguous."""
    _check(q, quant, "q")
    if quant.weight == "int4":
        aligned = q.stride(-1) == 1 and q.stride(-2) % 4 == 0 and q.data_ptr() % 4 == 0
        return q if aligned else q.contiguous()
    return _map(q, _mx_encode)


def restore(r: torch.Tensor, quant) -> torch.Tensor:
    """The mma layout -> packed codes (``relayout``'s exact inverse)."""
    _check(r, quant, "r")
    if quant.weight == "int4":
        return r.contiguous()
    return _map(r, _mx_decode)


def check_in_place(q: torch.Tensor, quant, name: str) -> None:
    """ValueError naming ``name`` unless ``q`` can be re-laid in place: packed 4-bit codes with K % 8 == 0, contiguous
    and 4-byte aligned (its rows viewed as int32 words)."""
    _check(q, quant, name)
    if not (q.is_contiguous() and q.data_ptr() % 4 == 0):
        raise ValueError(f"{name}: re-laid in place only when contiguous and 4-byte aligned (whole 32-bit words); got "
                         f"strides {tuple(q.stride())}, address % 4 = {q.data_ptr() % 4}")


def _in_place(q: torch.Tensor, quant, name: str, fn) -> torch.Tensor:
    check_in_place(q, quant, name)
    if quant.weight == "mxfp4":  # (int4: the two layouts are the same bytes)
        flat = q.view(-1, *q.shape[-2:])
        for i in range(flat.shape[0]):  # one expert's int32 temporaries at a time
            w = flat[i].view(torch.int32)
            w.copy_(fn(w))
    return q


def relayout_(q: torch.Tensor, quant) -> torch.Tensor:
    """``relayout`` in place: ``q``'s own storage rewritten expert by expert (contiguous, 4-byte aligned); returns
    ``q``."""
    return _in_place(q, quant, "q", _mx_encode)


def restore_(r: torch.Tensor, quant) -> torch.Tensor:
    """``restore`` in place (``relayout_``'s inverse); returns ``r``."""
    return _in_place(r, quant, "r", _mx_decode)


def unpack(q: torch.Tensor, quant) -> tuple:
    """(packed bytes, packed QuantSpec) of weights ``q`` held in ``quant.layout``: ``(q, quant)`` when packed, else
    ``restore(q)`` (a copy of what ``q`` holds: index one expert or a chunk first) and the spec with layout
    "packed". What the torch paths call before ``core.quant.dequantize`` (which reads packed codes only)."""
    if getattr(quant, "layout", "packed") == "packed":
        return q, quant
    return restore(q, quant), dataclasses.replace(quant, layout="packed")


def relaid(q: torch.Tensor, quant) -> torch.Tensor:
    """``relayout(q, quant)``, once per weight tensor: kept (keyed by the tensor's address, shape, strides and
    version, checked against the tensor object itself) until ``q`` is freed or written to."""
    key = (q.data_ptr(), tuple(q.shape), tuple(q.stride()), str(q.device), quant.weight)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is q and hit[1] == q._version:
        return hit[2]
    out = relayout(q, quant)
    ref = weakref.ref(q, lambda r, k=key, c=_CACHE: _forget(c, k, r))  # (c bound: callbacks may run at exit)
    _CACHE[key] = (ref, q._version, out)
    return out


def _forget(cache: dict, key: tuple, ref) -> None:
    """Drop ``key``'s entry when its weight tensor dies (not a newer entry at the same address)."""
    if cache.get(key, (None,))[0] is ref:
        del cache[key]
