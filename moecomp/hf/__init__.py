"""HuggingFace transformers integration: block detection fallback, binding, patching."""
