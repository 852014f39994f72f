"""Programmatic dependent launch (Hopper and later): a kernel launched with ``launch_pdl=True`` is scheduled while
the kernel before it on the stream drains. ``enter`` waits for that kernel's writes (griddepcontrol.wait); the next
kernel may start launching once every program of this one has signalled (griddepcontrol.launch_dependents), or
exited. USE_PDL 1 signals in ``enter``, at once; 2 signals in ``release``, which a GEMM calls after its main loop
(its programs then keep the SMs to themselves until their tiles are done). Either way the next kernel's own
``enter`` waits for this one to finish, so the placement changes timing, never results."""

import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda


@triton.jit
def enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tlcuda.gdc_wait()
    if USE_PDL == 1:
        tlcuda.gdc_launch_dependents()


@triton.jit
def release(USE_PDL: tl.constexpr):
    if USE_PDL == 2:
        tlcuda.gdc_launch_dependents()
