"""Fast ``generate()`` for optimized HF models: static KV cache and whole-decode-step CUDA graphs (see engine.py)."""

from .hf_generate import FastGenerate, install, uninstall  # noqa: F401
