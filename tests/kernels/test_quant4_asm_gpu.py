"""The inline-PTX e2m1 decode (``kernels/quant4.e2m1x2``, FORM 3 "asm") on the GPU (skipped without CUDA: the
interpreter cannot run PTX): every byte 0..255 decodes to exactly the oracle's two values (``moecomp.core.quant.E2M1``:
low nibble, high nibble), in bf16 and in fp16, signs of zero included."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moecomp.core import quant as q8
from moecomp.kernels import quant4

pytestmark = pytest.mark.gpu


@triton.jit
def _decode_all(p_ptr, lo_ptr, hi_ptr, F16: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    lo, hi = quant4.e2m1x2(tl.load(p_ptr + offs), F16)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inline PTX)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1x2_every_byte(dtype):
    p = torch.arange(256, dtype=torch.uint8, device="cuda")
    lo = torch.full((256,), float("nan"), dtype=dtype, device="cuda")
    hi = torch.full((256,), float("nan"), dtype=dtype, device="cuda")
    _decode_all[(1,)](p, lo, hi, F16=dtype == torch.float16, N=256)
    table = torch.tensor(q8.E2M1, dtype=torch.float32)
    want_lo, want_hi = table[torch.arange(256) & 15], table[torch.arange(256) >> 4]
    assert torch.equal(lo.float().cpu(), want_lo) and torch.equal(hi.float().cpu(), want_hi)
    assert torch.equal(torch.signbit(lo.float().cpu()), torch.signbit(want_lo))  # -0 stays -0
    assert torch.equal(torch.signbit(hi.float().cpu()), torch.signbit(want_hi))
