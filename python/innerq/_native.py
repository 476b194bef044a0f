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


def read_text(stream, what: str, line: bool = False) -> str:
    """The text of a binary stream (a line of it with line=True; "" at its end), at most
    innerq_max_text_bytes(): past that an InvalidArgumentError, not a read that never ends
    (/dev/zero). Bytes that are not UTF-8 become U+FFFD."""
    limit = lib.innerq_max_text_bytes()
    data = stream.readline(limit + 1) if line else stream.read(limit + 1)
    if len(data) > limit:
        raise InvalidArgumentError(f"{what} is larger than {limit >> 20} MiB, the most innerq reads as one text")
    return data.decode("utf-8", errors="replace")


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
    def load(cls, path, use_mmap: bool = True, n_gpu_layers: int = 0, progress=None,
             vocab_only: bool = False) -> "ModelHandle":
        """progress(fraction) -> bool | None is called while loading; returning False cancels.
        vocab_only: the tokenizer and hyper-parameters only (no weights; no context can be made)."""
        params = ffi.new("innerq_model_params *", lib.innerq_model_default_params())
        params.use_mmap = bool(use_mmap)
        params.vocab_only = bool(vocab_only)
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

    @classmethod
    def init(cls, model: ModelHandle, **params) -> "ContextHandle":
        """A context on model; params are context_params' keyword arguments."""
        p, keep = context_params(**params)
        out = ffi.new("innerq_context **")
        check(lib.innerq_context_init(model.ptr, p, out))
        del keep
        ctx = cls(out[0], model)
        ctx.n_batch = p.n_batch  # the most tokens of one step (the library has no getter for it)
        return ctx

    def decode(self, tokens) -> None:
        tokens = list(tokens)
        check(lib.innerq_decode(self.ptr, ffi.new("int32_t[]", tokens), len(tokens)))

    def logits(self, i: int = -1):
        """A copy of the logits of token i of the last decode (n_vocab floats)."""
        import numpy as np

        ptr = lib.innerq_get_logits_ith(self.ptr, as_int("i", i))
        if ptr == ffi.NULL:
            raise InvalidArgumentError(last_error())
        return np.frombuffer(ffi.buffer(ptr, 4 * lib.innerq_model_n_vocab(self.model.ptr)), dtype=np.float32).copy()

    def n_past(self) -> int:
        return lib.innerq_n_past(self.ptr)

    def decode_batch(self, tokens, seqs, logits=None, pos=None) -> None:
        """innerq_decode_batch: token i to sequence seqs[i] (an int, or a list of ids: the first
        evaluates it, the others get copies); logits[i]: keep its logits (None: the last only);
        pos[i]: its position (None: each sequence's next)."""
        n = len(tokens)
        ids = [[s] if isinstance(s, int) else list(s) for s in seqs]
        if len(ids) != n or (logits is not None and len(logits) != n) or (pos is not None and len(pos) != n):
            raise InvalidArgumentError("decode_batch: tokens, seqs, logits and pos must have one entry per token")
        b = ffi.new("innerq_batch *")
        keep = [ffi.new("innerq_token[]", [as_int("token", t) for t in tokens]),
                ffi.new("int32_t[]", [len(x) for x in ids]),
                ffi.new("int32_t *[]", n)]
        b.n_tokens, b.token, b.n_seq_id, b.seq_id = n, keep[0], keep[1], keep[2]
        for i, x in enumerate(ids):
            keep.append(ffi.new("int32_t[]", [as_int("seq", v) for v in x]))
            b.seq_id[i] = keep[-1]
        if logits is not None:
            keep.append(ffi.new("int8_t[]", [1 if f else 0 for f in logits]))
            b.logits = keep[-1]
        if pos is not None:
            keep.append(ffi.new("int32_t[]", [as_int("pos", p) for p in pos]))
            b.pos = keep[-1]
        check(lib.innerq_decode_batch(self.ptr, b))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        check(lib.innerq_seq_rm(self.ptr, as_int("seq", seq), as_int("p0", p0), as_int("p1", p1)))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        check(lib.innerq_seq_cp(self.ptr, as_int("src", src), as_int("dst", dst), as_int("p0", p0), as_int("p1", p1)))

    def seq_keep(self, seq: int) -> None:
        check(lib.innerq_seq_keep(self.ptr, as_int("seq", seq)))

    def seq_pos_max(self, seq: int) -> int:
        return lib.innerq_seq_pos_max(self.ptr, as_int("seq", seq))

    def pool(self) -> dict:
        """The KV pool: pages, tokens per page, pages in use, sequences with tokens, tokens, bytes."""
        out = ffi.new("innerq_kv_pool_info *")
        check(lib.innerq_kv_pool(self.ptr, out))
        return {"n_pages": out.n_pages, "page_tokens": out.page_tokens, "n_pages_used": out.n_pages_used,
                "n_seq": out.n_seq, "n_tokens": out.n_tokens, "bytes": out.bytes}

    def save_seq_state(self, seq: int) -> bytes:
        """One sequence's state (its tokens as stored), for load_seq_state."""
        size = lib.innerq_state_seq_size(self.ptr, as_int("seq", seq))
        buf = ffi.new("char[]", max(size, 1))
        written = ffi.new("size_t *")
        check(lib.innerq_state_seq_save(self.ptr, seq, buf, size, written))
        return ffi.unpack(buf, written[0])

    def load_seq_state(self, seq: int, data) -> None:
        data = bytes(data)
        check(lib.innerq_state_seq_load(self.ptr, as_int("seq", seq), ffi.from_buffer(data), len(data)))

    def set_batch_mode(self, logits_all: bool = False, decode_semantics: bool = False) -> None:
        check(lib.innerq_set_batch_mode(self.ptr, bool(logits_all), bool(decode_semantics)))

    def truncate(self, n_keep: int) -> int:
        """Drops the tokens at positions >= n_keep; returns how many were kept (<= n_keep: the
        caller evaluates tokens [kept, n_keep) again; docs/INNERQ.md, "Rewinding the cache")."""
        n_kept = ffi.new("int32_t *")
        check(lib.innerq_cache_truncate(self.ptr, as_int("n_keep", n_keep, 0), n_kept))
        return n_kept[0]

    def kv_memory(self) -> dict:
        """The cache's memory (innerq_context_kv_memory): kv_memory_dict's keys."""
        out = ffi.new("innerq_kv_memory *")
        check(lib.innerq_context_kv_memory(self.ptr, out))
        return kv_memory_dict(out)

    def layer_info(self, layer: int) -> dict:
        """Layer's cache now: bits_k, bits_v (0: a plain cache), n_quant (tokens quantized),
        sym_k, sym_v (share of the stored groups on the symmetric grid; -1: none stored) and
        err_k, err_v (kv_bits: the relative attention-output error measured at 2, 3, 4, 5 bits)."""
        out = ffi.new("innerq_kv_layer_info *")
        check(lib.innerq_cache_layer_info(self.ptr, as_int("layer", layer), out))
        return {"bits_k": out.bits_k, "bits_v": out.bits_v, "n_quant": out.n_quant, "sym_k": out.sym_k,
                "sym_v": out.sym_v, "err_k": list(out.err_k), "err_v": list(out.err_v)}

    def state_size(self) -> int:
        return lib.innerq_state_size(self.ptr)

    def save_state(self) -> bytes:
        """The sequence (cache as stored, counters, last logits) as bytes for load_state."""
        size = lib.innerq_state_size(self.ptr)
        buf = ffi.new("char[]", size)
        written = ffi.new("size_t *")
        check(lib.innerq_state_save(self.ptr, buf, size, written))
        return ffi.unpack(buf, written[0])

    def load_state(self, data) -> None:
        """Restores a save_state() of a context of the same model and cache configuration;
        StateMismatchError otherwise, FormatError for damaged data (the context is unchanged)."""
        data = bytes(data)
        check(lib.innerq_state_load(self.ptr, ffi.from_buffer(data), len(data)))

    def embeddings(self, i: int | None = None):
        """The last decode call's embeddings (a context made with embeddings=True), copied (the C
        array changes with the next decode): token i's (n_embd floats); or, i None, the pooled
        vector (n_embd floats), or with pooling NONE every token's ([n_tokens, n_embd])."""
        import numpy as np

        n_embd = lib.innerq_model_n_embd(self.model.ptr)
        rows = 1
        if i is not None:
            ptr = lib.innerq_get_embeddings_ith(self.ptr, as_int("i", i))
        else:
            ptr = lib.innerq_get_embeddings(self.ptr)
            if lib.innerq_pooling_type(self.ptr) == lib.INNERQ_POOLING_NONE:
                rows = lib.innerq_embeddings_rows(self.ptr)
        if ptr == ffi.NULL:
            raise InvalidArgumentError(last_error())
        out = np.frombuffer(ffi.buffer(ptr, 4 * n_embd * rows), dtype=np.float32).copy()
        return out if rows == 1 and (i is not None or lib.innerq_pooling_type(self.ptr) != lib.INNERQ_POOLING_NONE) \
            else out.reshape(rows, n_embd)


class SamplerHandle(Handle):
    _free_fn = "innerq_sampler_free"


class DetokenizerHandle(Handle):
    _free_fn = "innerq_detokenizer_free"

    def push(self, token: int) -> bytes:
        return read_sized(lambda buf, size, n: lib.innerq_detokenizer_push(self.ptr, token, buf, size, n), 64)

    def flush(self) -> bytes:
        return read_sized(lambda buf, size, n: lib.innerq_detokenizer_flush(self.ptr, buf, size, n), 64)


def kv_types() -> list[str]:
    """The names kv_type / kv_k / kv_v accept: the preset "innerq" (the default: innerq3 keys,
    innerq2 values), then the cache types."""
    return [ffi.string(lib.innerq_kv_type_name(i)).decode() for i in range(lib.innerq_kv_type_count())]


def _f32(x: float) -> float:
    """A C float as the number it was written as (0.8f is 0.800000011920929 in double)."""
    return float(f"{x:.6g}")


def defaults() -> dict:
    """Every default the faces of innerq share, read from the C library (docs/DEFAULTS.md):
    innerq_model_default_params, innerq_context_default_params, innerq_sampler_default_params
    and innerq_default_n_predict. kv_type None is the default cache, the innerq preset; seed
    -1 is "from the clock"."""
    m, c, s = lib.innerq_model_default_params(), lib.innerq_context_default_params(), lib.innerq_sampler_default_params()
    return {
        "n_ctx": c.n_ctx, "n_batch": c.n_batch, "n_threads": c.n_threads,
        "kv_type": None, "kv_group": c.kv_group, "kv_sink": c.kv_sink, "kv_recent": c.kv_recent,
        "kv_hybrid": bool(c.kv_hybrid), "kv_norm": bool(c.kv_norm), "kv_debias": bool(c.kv_debias),
        "kv_norm_pairs": bool(c.kv_norm_pairs), "kv_rot": c.kv_rot, "kv_search": bool(c.kv_search),
        "kv_value_scales": c.kv_value_scales, "kv_params8": c.kv_params8, "kv_key_levels": c.kv_key_levels, "kv_bits": _f32(c.kv_bits), "n_seq_max": c.n_seq_max, "kv_rewind_exact": bool(c.kv_rewind_exact),
        "n_gpu_layers": m.n_gpu_layers, "use_mmap": bool(m.use_mmap),
        "n_predict": lib.innerq_default_n_predict(),
        "temperature": _f32(s.temperature), "top_k": s.top_k, "top_p": _f32(s.top_p), "min_p": _f32(s.min_p),
        "repeat_penalty": _f32(s.repeat_penalty), "repeat_last_n": s.repeat_last_n,
        "seed": -1 if s.seed == DEFAULT_SEED else s.seed,
    }


def context_key(p) -> str:
    """A short name of what a context's states depend on: every field of its
    innerq_context_params but the thread count (which changes no state)."""
    import hashlib

    fields = {}
    for name, _ in ffi.typeof("innerq_context_params").fields:
        if name != "n_threads":
            v = getattr(p, name)
            fields[name] = (ffi.string(v).decode() if v else None) if isinstance(v, ffi.CData) else v  # C strings
    return hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=8).hexdigest()


def kv_memory_dict(m) -> dict:
    """An innerq_kv_memory as a dict: bytes and effective bits per element (bits) of the whole
    cache at n_ctx tokens, windows, scales and norms included; quant_bits of the quantized region
    alone (0: a plain cache); group, n_sink, n_recent of a quantized cache (0 otherwise)."""
    return {"bytes": m.bytes, "bits": m.bits, "quant_bits": m.quant_bits, "n_ctx": m.n_ctx, "group": m.group,
            "n_sink": m.n_sink, "n_recent": m.n_recent}


def context_params(n_ctx=None, n_batch=None, n_threads=None, kv_k=None, kv_v=None, kv_group=None, kv_sink=None,
                   kv_recent=None, kv_hybrid=None, kv_norm=None, kv_debias=None, kv_norm_pairs=None,
                   kv_rot=None, kv_search=None, kv_bits=None, kv_layer_bits=None, logits_all=False, embeddings=False,
                   pooling=None, n_seq_max=None, kv_rewind_exact=None, kv_value_scales=None,
                   kv_params8=None, kv_key_levels=None):
    """An innerq_context_params (and the C strings it points to, which must outlive it), checked
    as far as that needs no model. None leaves a field at the C default."""
    p = ffi.new("innerq_context_params *", lib.innerq_context_default_params())
    for field, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_threads", n_threads), ("kv_group", kv_group),
                         ("kv_sink", kv_sink), ("kv_recent", kv_recent), ("kv_rot", kv_rot), ("n_seq_max", n_seq_max),
                         ("kv_value_scales", kv_value_scales), ("kv_params8", kv_params8),
                         ("kv_key_levels", kv_key_levels)):
        if value is not None:
            setattr(p, field, as_int(field, value))
    keep = []
    if kv_bits is not None:
        if isinstance(kv_bits, bool) or not isinstance(kv_bits, (int, float)):
            raise InvalidArgumentError(f"kv_bits must be a number of bits per element, got {kv_bits!r}")
        p.kv_bits = float(kv_bits)
    for field, value in (("kv_k", kv_k), ("kv_v", kv_v), ("kv_layer_bits", kv_layer_bits)):
        if value is not None:
            if not isinstance(value, str):
                raise InvalidArgumentError(f"{field} must be a string, got {value!r}")
            s = ffi.new("char[]", c_string(field, value))
            keep.append(s)
            setattr(p, field, s)
    for field, value in (("kv_hybrid", kv_hybrid), ("kv_norm", kv_norm), ("kv_debias", kv_debias),
                         ("kv_norm_pairs", kv_norm_pairs), ("kv_search", kv_search), ("kv_rewind_exact", kv_rewind_exact)):
        if value is not None:
            setattr(p, field, bool(value))
    p.logits_all = bool(logits_all)
    p.embeddings = bool(embeddings)
    if pooling is not None:  # None: the model's (innerq_pooling UNSPECIFIED)
        p.pooling = as_int("pooling", pooling)
    check(lib.innerq_context_params_check(p))
    return p, keep
