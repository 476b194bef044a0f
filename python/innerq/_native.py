"""Owners of the C handles, and the call conventions of innerq.h turned into Python.

Each handle frees its C object exactly once: explicitly or when it is garbage-collected.
A context handle keeps its model handle alive, and a numpy view of the logits keeps its
context handle alive, so no order of close(), `del` or collection can free memory that is
still reachable from Python.
"""
from __future__ import annotations

import operator
import os

from ._ffi import ffi, lib
from .errors import InvalidArgumentError, from_status

DEFAULT_SEED = 0xFFFFFFFF  # the sampler seeds itself from the clock
INT32_MAX = 2**31 - 1


def last_error() -> str:
    return ffi.string(lib.innerq_last_error()).decode("utf-8", errors="replace")


def check(status: int) -> None:
    """Raises the InnerQError subclass for a failing innerq_status, with the C message."""
    if status != lib.INNERQ_OK:
        msg = last_error() or ffi.string(lib.innerq_status_name(status)).decode()
        raise from_status(status, msg)


def as_int(name: str, value, lo: int = -2**31, hi: int = INT32_MAX) -> int:
    """An int argument in [lo, hi], or InvalidArgumentError saying which one is wrong."""
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}") from None
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} = {value} is out of range ({lo} .. {hi})")
    return value


def as_float(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}") from None


def utf8(name: str, text: str) -> bytes:
    """text as UTF-8, or InvalidArgumentError where it can't be (a lone surrogate, e.g. from
    os.fsdecode or a JSON escape, has no UTF-8 form)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{name} is not valid Unicode: {e.reason} {text[e.start:e.end]!r} "
                                   f"at position {e.start}") from None


def c_string(name: str, value, path: bool = False) -> bytes:
    """A str (or, for a path, also os.PathLike or bytes, encoded as the file system does) as
    the bytes of a C string. C stops at the first NUL, so a NUL inside would silently cut the
    value: refused, as open() does."""
    if path:
        value = os.fsencode(value)
    elif isinstance(value, str):
        value = utf8(name, value)
    if not isinstance(value, bytes):
        raise InvalidArgumentError(f"{name} must be a string, got {value!r}")
    if b"\0" in value:
        raise InvalidArgumentError(f"{name} contains a NUL byte: {value!r}")
    return value


def read_sized(call, size: int = 256) -> bytes:
    """Calls call(buf, size, n_out) until buf is large enough; the innerq_status convention
    where BUFFER_TOO_SMALL reports the size needed in *n_out."""
    n = ffi.new("int32_t *")
    while True:
        buf = ffi.new("char[]", size)
        st = call(buf, size, n)
        if st == lib.INNERQ_ERR_BUFFER_TOO_SMALL and n[0] >= size:
            size = n[0] + 1
            continue
        check(st)
        return ffi.unpack(buf, n[0])


def read_string(call, size: int = 256) -> bytes | None:
    """Calls call(buf, size) -> needed length (-1: absent); the metadata convention."""
    while True:
        buf = ffi.new("char[]", size)
        need = call(buf, size)
        if need < 0:
            return None
        if need < size:
            return ffi.string(buf, need)
        size = need + 1


class Handle:
    """An owned C pointer; free() is idempotent and runs at collection at the latest."""

    _free_fn = ""

    def __init__(self, ptr):
        self.ptr = ptr

    def free(self) -> None:
        ptr, self.ptr = self.ptr, ffi.NULL
        if ptr:
            getattr(lib, self._free_fn)(ptr)

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


class ModelHandle(Handle):
    _free_fn = "innerq_model_free"

    @classmethod
    def load(cls, path, use_mmap: bool = True, n_gpu_layers: int = 0, progress=None) -> "ModelHandle":
        """progress(fraction) -> bool | None is called while loading; returning False cancels."""
        params = ffi.new("innerq_model_params *", lib.innerq_model_default_params())
        params.use_mmap = bool(use_mmap)
        params.n_gpu_layers = as_int("n_gpu_layers", n_gpu_layers, -1)
        raised = []
        if progress is not None:
            def on_error(exc_type, exc, tb):
                raised.append(exc)
                return False

            def on_progress(fraction, _user):
                return progress(fraction) is not False

            params.progress = cb = ffi.callback("bool(float, void *)", on_progress, onerror=on_error)
        out = ffi.new("innerq_model **")
        st = lib.innerq_model_load(c_string("model path", path, path=True), params, out)
        if raised:  # e.g. Ctrl-C inside the progress callback: the load was cancelled
            if out[0]:
                lib.innerq_model_free(out[0])
            raise raised[0]
        check(st)
        return cls(out[0])


class ContextHandle(Handle):
    _free_fn = "innerq_context_free"

    def __init__(self, ptr, model: ModelHandle):
        super().__init__(ptr)
        self.model = model  # the C context points into the model: keep it alive


class SamplerHandle(Handle):
    _free_fn = "innerq_sampler_free"


class DetokenizerHandle(Handle):
    _free_fn = "innerq_detokenizer_free"

    def push(self, token: int) -> bytes:
        return read_sized(lambda buf, size, n: lib.innerq_detokenizer_push(self.ptr, token, buf, size, n), 64)

    def flush(self) -> bytes:
        return read_sized(lambda buf, size, n: lib.innerq_detokenizer_flush(self.ptr, buf, size, n), 64)


# kv_type names that stand for a pair of cache types (as innerq-cli's --kv).
KV_PRESETS = {"innerq": ("iq3", "iq2")}  # the reference InnerQ configuration: 3-bit keys, 2-bit values


def kv_pair(kv_type):
    """(keys, values) cache types for a kv_type: a preset's pair, or the type for both."""
    return KV_PRESETS.get(kv_type, (kv_type, kv_type)) if isinstance(kv_type, str) else (kv_type, kv_type)


def kv_types() -> list[str]:
    """The KV cache type names this build accepts (kv_k / kv_v)."""
    return [ffi.string(lib.innerq_kv_type_name(i)).decode() for i in range(lib.innerq_kv_type_count())]


def context_params(n_ctx=0, n_batch=512, n_threads=None, kv_k=None, kv_v=None, kv_group=0, kv_sink=None,
                   kv_recent=None, kv_hybrid=True, kv_norm=True, kv_debias=True, kv_norm_pairs=True,
                   logits_all=False):
    """An innerq_context_params (and the C strings it points to, which must outlive it)."""
    p = ffi.new("innerq_context_params *", lib.innerq_context_default_params())
    p.n_ctx = as_int("n_ctx", n_ctx)
    p.n_batch = as_int("n_batch", n_batch)
    p.n_threads = as_int("n_threads", 0 if n_threads is None else n_threads)
    keep = []
    for field, value in (("kv_k", kv_k), ("kv_v", kv_v)):
        if value is not None:
            if not isinstance(value, str):
                raise InvalidArgumentError(f"{field} must be a cache type name, got {value!r}")
            s = ffi.new("char[]", c_string(field, value))
            keep.append(s)
            setattr(p, field, s)
    p.kv_group = as_int("kv_group", kv_group)
    if kv_sink is not None:
        p.kv_sink = as_int("kv_sink", kv_sink)
    if kv_recent is not None:
        p.kv_recent = as_int("kv_recent", kv_recent)
    p.kv_hybrid = bool(kv_hybrid)
    p.kv_norm = bool(kv_norm)
    p.kv_debias = bool(kv_debias)
    p.kv_norm_pairs = bool(kv_norm_pairs)
    p.logits_all = bool(logits_all)
    return p, keep
