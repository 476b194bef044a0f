"""innerq: LLM inference with an InnerQ-quantized KV cache."""
from __future__ import annotations

__version__ = "0.1.0"

# The native library is loaded on first use, so that `innerq.models` (downloads) works
# before anything is built.
_LAZY = {"Llama": "llama", "InnerQError": "errors"}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'innerq' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)
