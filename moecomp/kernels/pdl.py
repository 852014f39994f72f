"""Programmatic dependent launch (Hopper and later): a kernel launched with ``launch_pdl=True`` is scheduled while
the kernel before it on the stream drains. ``enter`` waits for that kernel's writes (griddepcontrol.wait), then lets
the next kernel start launching; so the decode chain's launch latencies overlap its kernels' tails."""

import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda


@triton.jit
def enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tlcuda.gdc_wait()
        tlcuda.gdc_launch_dependents()
