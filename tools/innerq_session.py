"""One model and one context driven through innerq's public C API (the cffi binding), for
tools and tests that need logits rather than the Python package's Llama class.

The library is the one innerq._ffi finds: $INNERQ_LIB, else build/libinnerq.so. Set
INNERQ_LIB before the first Session is made to choose another.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def _api():
    from innerq._ffi import ffi, lib

    return ffi, lib


class InnerqError(RuntimeError):
    pass


class Session:
    """A loaded model with one context. kv_k / kv_v name cache types ("f32", "f16", ...)."""

    def __init__(self, model_path, *, n_ctx=512, n_batch=512, n_threads=2, kv_k="f32", kv_v="f32",
                 logits_all=True, kv_group=0, kv_sink=-1, kv_recent=-1, kv_debias=True,
                 kv_norm_pairs=True, kv_rot=-1, kv_search=True):
        self.ffi, self.lib = ffi, lib = _api()
        self.model = self.ctx = None
        mp = ffi.new("innerq_model_params *")
        mp[0] = lib.innerq_model_default_params()
        out = ffi.new("innerq_model **")
        self._check(lib.innerq_model_load(str(model_path).encode(), mp, out))
        self.model = out[0]
        cp = ffi.new("innerq_context_params *")
        cp[0] = lib.innerq_context_default_params()
        self._names = [ffi.new("char[]", kv_k.encode()), ffi.new("char[]", kv_v.encode())]
        cp.n_ctx, cp.n_batch, cp.n_threads = n_ctx, n_batch, n_threads
        cp.kv_k, cp.kv_v = self._names
        cp.logits_all = logits_all
        cp.kv_group, cp.kv_sink, cp.kv_recent = kv_group, kv_sink, kv_recent
        cp.kv_debias = kv_debias
        cp.kv_norm_pairs = kv_norm_pairs
        cp.kv_rot, cp.kv_search = kv_rot, kv_search
        octx = ffi.new("innerq_context **")
        self._check(lib.innerq_context_init(self.model, cp, octx))
        self.ctx = octx[0]
        self.n_vocab = lib.innerq_model_n_vocab(self.model)

    def _check(self, status):
        if status != self.lib.INNERQ_OK:
            msg = self.ffi.string(self.lib.innerq_last_error()).decode(errors="replace")
            raise InnerqError(f"{self.ffi.string(self.lib.innerq_status_name(status)).decode()}: {msg}")

    def close(self):
        if self.ctx is not None:
            self.lib.innerq_context_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            self.lib.innerq_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tokenize(self, text: str | bytes, add_special=False) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        n = self.ffi.new("int32_t *")
        cap = len(data) + 8
        buf = self.ffi.new("innerq_token[]", cap)
        self._check(self.lib.innerq_tokenize(self.model, data, len(data), add_special, False, buf, cap, n))
        return list(buf[0:n[0]])

    def detokenize(self, tokens) -> str:
        n = self.ffi.new("int32_t *")
        toks = self.ffi.new("innerq_token[]", list(tokens))
        cap = 8 * len(tokens) + 16
        buf = self.ffi.new("char[]", cap)
        status = self.lib.innerq_detokenize(self.model, toks, len(tokens), False, buf, cap, n)
        if status == self.lib.INNERQ_ERR_BUFFER_TOO_SMALL:
            cap = n[0] + 1
            buf = self.ffi.new("char[]", cap)
            status = self.lib.innerq_detokenize(self.model, toks, len(tokens), False, buf, cap, n)
        self._check(status)
        return self.ffi.buffer(buf, n[0])[:].decode("utf-8", errors="replace")

    def decode(self, tokens) -> None:
        toks = self.ffi.new("innerq_token[]", [int(t) for t in tokens])
        self._check(self.lib.innerq_decode(self.ctx, toks, len(tokens)))

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits of token i of the last decode call."""
        ptr = self.lib.innerq_get_logits_ith(self.ctx, i)
        if ptr == self.ffi.NULL:
            raise InnerqError(f"no logits for token {i}")
        return np.frombuffer(self.ffi.buffer(ptr, 4 * self.n_vocab), dtype=np.float32).copy()

    def eval(self, tokens) -> np.ndarray:
        """Decodes tokens in one call; logits of each of them (needs logits_all)."""
        self.decode(tokens)
        return np.stack([self.logits(i) for i in range(len(tokens))])

    def eval_one_by_one(self, tokens) -> np.ndarray:
        """Decodes tokens one call each (decode semantics); logits of each of them."""
        rows = []
        for t in tokens:
            self.decode([t])
            rows.append(self.logits(-1))
        return np.stack(rows)

    def set_batch_mode(self, logits_all: bool, decode_semantics: bool) -> None:
        self._check(self.lib.innerq_set_batch_mode(self.ctx, logits_all, decode_semantics))

    def eval_decode_semantics(self, tokens) -> np.ndarray:
        """Decodes tokens in one call with decode semantics; logits of each of them. Leaves the
        context with logits_all and decode semantics on."""
        self.set_batch_mode(True, True)
        return self.eval(tokens)

    def clear(self) -> None:
        self._check(self.lib.innerq_cache_clear(self.ctx))

    @property
    def n_past(self) -> int:
        return self.lib.innerq_n_past(self.ctx)
