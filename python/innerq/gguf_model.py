"""Model: a loaded GGUF model, its metadata and its tokenizer (no context, no KV cache)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

from ._ffi import ffi, lib
from ._native import (ModelHandle, as_int, c_string, check, context_params, kv_memory_dict, read_sized, read_string,
                      utf8)
from .errors import ClosedError, InvalidArgumentError


def _text_bytes(text) -> bytes:
    if isinstance(text, str):
        return utf8("text", text)
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise InvalidArgumentError(f"text must be str or bytes, got {type(text).__name__}")


class Model:
    """Model(path) loads a GGUF file (weights are memory-mapped by default).

    close() releases it (the memory goes once nothing else, such as a Llama context, uses it);
    using a closed Model raises ClosedError."""

    def __init__(self, path: str | os.PathLike, *, use_mmap: bool = True, n_gpu_layers: int = 0, progress=None,
                 vocab_only: bool = False):
        """vocab_only: the tokenizer and hyper-parameters only (a vocabulary file such as
        llama.cpp's ggml-vocab-*.gguf; no context can be made on it)."""
        self.path = Path(path)
        self._h = ModelHandle.load(self.path, use_mmap, n_gpu_layers, progress, vocab_only=vocab_only)
        self._metadata = None
        self._token_index = None
        self._token_index_lock = threading.Lock()

    # ---- lifetime ----

    @property
    def handle(self) -> ModelHandle:
        if self._h is None:
            raise ClosedError("this model is closed")
        return self._h

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- shape ----

    def _get(self, fn):
        return fn(self.handle.ptr)

    @property
    def n_vocab(self) -> int:
        return self._get(lib.innerq_model_n_vocab)

    @property
    def n_ctx_train(self) -> int:
        return self._get(lib.innerq_model_n_ctx_train)

    @property
    def n_embd(self) -> int:
        return self._get(lib.innerq_model_n_embd)

    @property
    def n_layer(self) -> int:
        return self._get(lib.innerq_model_n_layer)

    @property
    def n_head(self) -> int:
        return self._get(lib.innerq_model_n_head)

    @property
    def n_head_kv(self) -> int:
        return self._get(lib.innerq_model_n_head_kv)

    @property
    def head_dim(self) -> int:
        return self._get(lib.innerq_model_head_dim)

    @property
    def n_params(self) -> int:
        return self._get(lib.innerq_model_n_params)

    @property
    def size(self) -> int:
        """Bytes of weight data."""
        return self._get(lib.innerq_model_size)

    @property
    def description(self) -> str:
        return ffi.string(self._get(lib.innerq_model_desc)).decode("utf-8", errors="replace")

    # ---- metadata ----

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (arrays summarised), or None if the key is absent."""
        ptr, k = self.handle.ptr, c_string("metadata key", key)
        raw = read_string(lambda buf, size: lib.innerq_model_meta_value(ptr, k, buf, size))
        return None if raw is None else raw.decode("utf-8", errors="replace")

    @property
    def metadata(self) -> dict[str, str]:
        """All GGUF metadata, key -> value as text."""
        if self._metadata is None:
            ptr = self.handle.ptr
            keys = [read_string(lambda buf, size, i=i: lib.innerq_model_meta_key(ptr, i, buf, size))
                    for i in range(lib.innerq_model_meta_count(ptr))]
            self._metadata = {k.decode(): self.meta(k.decode()) for k in keys if k is not None}
        return dict(self._metadata)

    @property
    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    def kv_bytes_per_token(self, kv_k: str | None = None, kv_v: str | None = None, **params) -> float:
        """Bytes of KV cache per token (all layers and heads) for a pair of cache types."""
        p, _keep = context_params(kv_k=kv_k, kv_v=kv_v, **params)
        out = ffi.new("double *")
        check(lib.innerq_kv_bytes_per_token(self.handle.ptr, p, out))
        return out[0]

    def kv_memory(self, kv_k: str | None = None, kv_v: str | None = None, gpu: bool = False, **params) -> dict:
        """The memory a context's cache would take (innerq_kv_memory_of) on the CPU or the GPU
        (gpu=True: a CUDA device's default cache, group and alignment; none needs to be present),
        computed without making it: bytes and effective bits per element at n_ctx, windows
        included (_native.kv_memory_dict)."""
        p, _keep = context_params(kv_k=kv_k, kv_v=kv_v, **params)
        out = ffi.new("innerq_kv_memory *")
        device = lib.INNERQ_DEVICE_GPU if gpu else lib.INNERQ_DEVICE_CPU
        check(lib.innerq_kv_memory_of(self.handle.ptr, p, device, out))
        return kv_memory_dict(out)

    # ---- vocabulary ----

    def token_bos(self) -> int:
        return self._get(lib.innerq_token_bos)

    def token_eos(self) -> int:
        return self._get(lib.innerq_token_eos)

    def is_eog(self, token: int) -> bool:
        return bool(lib.innerq_token_is_eog(self.handle.ptr, as_int("token", token)))

    @property
    def add_bos(self) -> bool:
        return bool(self._get(lib.innerq_vocab_add_bos))

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text. add_bos: prepend BOS if the model asks for it; special: text such
        as "<|im_start|>" becomes its control token."""
        data = _text_bytes(text)
        if len(data) > 2**31 - 16:
            raise InvalidArgumentError("text is too long to tokenize (2 GiB at most)")
        ptr = self.handle.ptr
        n = ffi.new("int32_t *")
        cap = len(data) + 8
        while True:
            toks = ffi.new("innerq_token[]", cap)
            st = lib.innerq_tokenize(ptr, data, len(data), bool(add_bos), bool(special), toks, cap, n)
            if st == lib.INNERQ_ERR_BUFFER_TOO_SMALL and n[0] > cap:
                cap = n[0]
                continue
            check(st)
            return list(ffi.unpack(toks, n[0]))

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (possibly part of a UTF-8 character)."""
        ptr, token = self.handle.ptr, as_int("token", token)
        return read_sized(lambda buf, size, n: lib.innerq_token_to_piece(ptr, token, bool(special), buf, size, n), 32)

    def token_index(self):
        """The vocabulary's pieces indexed for grammar matching (innerq.grammar.TokenIndex),
        made on first use and shared by every generation on this model."""
        from .grammar import TokenIndex

        with self._token_index_lock:
            if self._token_index is None:
                n = self.n_vocab
                self._token_index = TokenIndex([self.token_to_piece(t) for t in range(n)],
                                               {t for t in range(n) if self.is_eog(t)})
            return self._token_index

    def detokenize(self, tokens, special: bool = False) -> bytes:
        """The bytes of a token sequence (bytes, as llama-cpp-python: a slice of a sequence
        may end inside a UTF-8 character)."""
        ptr = self.handle.ptr
        ids = [as_int("token", t) for t in tokens]
        arr = ffi.new("innerq_token[]", ids)
        return read_sized(lambda buf, size, n: lib.innerq_detokenize(ptr, arr, len(ids), bool(special), buf, size, n),
                          8 * len(ids) + 16)
