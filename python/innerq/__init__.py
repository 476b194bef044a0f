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
    "LlamaState": "llama",
    "LogitsProcessorList": "llama",
    "StoppingCriteriaList": "llama",
    "MinTokensLogitsProcessor": "llama",
    "LlamaGrammar": "llama_grammar",
    "LlamaCache": "llama_cache",
    "LlamaRAMCache": "llama_cache",
    "LlamaDiskCache": "llama_cache",
    "BaseLlamaCache": "llama_cache",
    "Model": "gguf_model",
    "Sequences": "sequences",
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

# Modules named as llama-cpp-python names its own, so that `import innerq as llama_cpp` serves a
# script written for it (innerq.llama_types, innerq.llama_chat_format, ...).
_MODULES = {"models", "llama_types", "llama_chat_format", "llama_grammar", "llama_speculative", "llama_cache"}

__all__ = sorted(_LAZY) + ["version", "cpu_isa", "cuda_device_count", "devices"]


def __getattr__(name):
    import importlib

    if name in _MODULES:  # the known-models catalogue and the type modules need no native library
        return importlib.import_module(f".{name}", __name__)
    mod = _LAZY.get(name)
    if mod is not None:
        return getattr(importlib.import_module(f".{mod}", __name__), name)
    # llama-cpp-python's top level also holds the request and response types of llama_types
    types = importlib.import_module(".llama_types", __name__)
    if not name.startswith("_") and hasattr(types, name):
        return getattr(types, name)
    raise AttributeError(f"module 'innerq' has no attribute {name!r}")


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


def devices() -> list[dict]:
    """The devices present (innerq_device_get): the CPU first, then each usable CUDA device; each
    a dict of type ("cpu" / "gpu"), name, description, memory_free, memory_total (bytes, 0:
    unknown), and its KV cache defaults kv_group and kv_align."""
    from ._ffi import ffi, lib
    from ._native import check

    out = []
    info = ffi.new("innerq_device_info *")
    for i in range(lib.innerq_device_count()):
        check(lib.innerq_device_get(i, info))
        out.append({"type": "gpu" if info.type == lib.INNERQ_DEVICE_GPU else "cpu",
                    "name": ffi.string(info.name).decode(),
                    "description": ffi.string(info.description).decode(errors="replace"),
                    "memory_free": int(info.memory_free), "memory_total": int(info.memory_total),
                    "kv_group": int(info.kv_group), "kv_align": int(info.kv_align)})
    return out
