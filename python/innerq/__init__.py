"""innerq: LLM inference with an InnerQ-quantized KV cache.

    from innerq import Llama
    with Llama("model.gguf", n_ctx=2048) as llm:
        print(llm.generate("Once upon a time", max_tokens=64))
"""
from __future__ import annotations

__version__ = "0.1.0"

# The native library is loaded on first use, so that `innerq.models` (downloads) and
# `innerq.cli_path()` work before anything is built.
_LAZY = {
    "Llama": "llama",
    "Run": "llama",
    "Model": "gguf_model",
    "kv_types": "_native",
    "ChatTemplate": "chat",
    "InnerQError": "errors",
    "InvalidArgumentError": "errors",
    "InnerQIOError": "errors",
    "FormatError": "errors",
    "UnsupportedError": "errors",
    "InnerQMemoryError": "errors",
    "ContextFullError": "errors",
    "BackendError": "errors",
    "StateMismatchError": "errors",
    "ClosedError": "errors",
    "cli_path": "_paths",
    "library_path": "_paths",
}

__all__ = sorted(_LAZY) + ["version", "cpu_isa", "cuda_device_count"]


def __getattr__(name):
    import importlib

    if name == "models":  # the known-models catalogue needs no native library
        return importlib.import_module(".models", __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'innerq' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)


def version() -> str:
    """The C library's version."""
    from ._ffi import ffi, lib

    return ffi.string(lib.innerq_version()).decode()


def cpu_isa() -> str:
    """The CPU kernels in use: "scalar", "avx2" or "avx512"."""
    from ._ffi import ffi, lib

    return ffi.string(lib.innerq_cpu_isa()).decode()


def cuda_device_count() -> int:
    """CUDA devices the library can use (n_gpu_layers=-1); -1 if it was built without CUDA."""
    from ._ffi import lib

    return int(lib.innerq_cuda_device_count())
