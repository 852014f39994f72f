"""Triton kernels (``@triton.jit`` code only) and their tuned configs (``configs/*.json``)."""
