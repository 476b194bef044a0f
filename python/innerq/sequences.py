"""Sequences: several sequences of one model decoded together, in one KV cache.

    from innerq import Model, Sequences
    model = Model("model.gguf")
    seqs = Sequences(model, n_seq_max=4, n_ctx=8192)
    seqs.decode(prompt_a + prompt_b, [0] * len(prompt_a) + [1] * len(prompt_b), logits=...)
    seqs.logits(i)                    # token i of the last decode's logits
    seqs.copy(0, 2)                   # sequence 2 shares sequence 0's tokens
    seqs.remove(1, 100)               # sequence 1's tokens from position 100 on

The C library's batch and sequence calls (innerq_decode_batch, innerq_seq_*; docs/DESIGN.md
3.6) with Python values: a sequence gets the same logits whichever others share its steps.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from ._ffi import lib
from ._native import ContextHandle
from .gguf_model import Model


class Sequences:
    """Sequences(model, n_seq_max=4, n_ctx=4096, ...): a context of n_seq_max sequences (0 ..
    n_seq_max - 1) over a Model (or a GGUF path). n_ctx: tokens the KV cache holds, all sequences
    together; n_batch: most tokens of one step; the cache keywords are Llama's (kv_type, kv_k,
    kv_v, kv_group, kv_sink, kv_recent, kv_rewind_exact, ...). decode_semantics: every token is
    evaluated as one-token decoding would (docs/DESIGN.md 3.4), so what a sequence holds does not
    depend on how its tokens were cut into decode calls. Calls are serialised by a lock (one step
    at a time)."""

    def __init__(self, model: Model | str | os.PathLike, *, n_seq_max: int = 4, n_ctx: int | None = None,
                 n_batch: int | None = None, n_threads: int | None = None, kv_type: str | None = None,
                 n_gpu_layers: int = 0, decode_semantics: bool = False, **cache):
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=n_gpu_layers)
        kv_k, kv_v = cache.pop("kv_k", kv_type), cache.pop("kv_v", kv_type)
        self._ctx = ContextHandle.init(self.model.handle, n_seq_max=n_seq_max, n_ctx=n_ctx, n_batch=n_batch,
                                       n_threads=n_threads, kv_k=kv_k, kv_v=kv_v, **cache)
        if decode_semantics:
            self._ctx.set_batch_mode(False, True)
        self.n_seq_max = n_seq_max
        self.n_ctx = lib.innerq_n_ctx(self._ctx.ptr)
        self.n_batch = self._ctx.n_batch
        self.lock = threading.RLock()

    def decode(self, tokens, seq_ids, logits=None) -> None:
        """Evaluates tokens, token i for sequence seq_ids[i] (an id, or a list of ids: the first
        evaluates it, the others become copies of it; docs/DESIGN.md 3.6), each right after the
        tokens its sequence holds; logits[i]: keep token i's logits (None: the last token's)."""
        with self.lock:
            self._ctx.decode_batch(tokens, seq_ids, logits)

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits of token i of the last decode (one with its logits flag set)."""
        with self.lock:
            return self._ctx.logits(i)

    def remove(self, seq: int, p0: int = 0, p1: int = -1) -> int:
        """Removes seq's tokens from position p0 on (seq -1: every sequence's); returns how many
        it holds now (the kept tokens stay as stored: where p0 falls inside a quantized block, the
        block's tokens go too, and the caller evaluates them again)."""
        with self.lock:
            self._ctx.seq_rm(seq, p0, p1)
            return self.n_tokens(seq) if seq >= 0 else 0

    def copy(self, src: int, dst: int, n: int = -1) -> int:
        """Makes dst a copy of src's first n tokens (all with -1), sharing what is stored, kept as
        remove() keeps a sequence's first tokens (so with kv_rewind_exact as a fresh evaluation
        would hold them: maybe fewer); returns how many dst holds."""
        with self.lock:
            # the whole copy, then the cut: innerq_seq_cp keeps the prefix as stored, and
            # innerq_seq_rm applies the context's rewind rule
            self._ctx.seq_cp(src, dst, 0, -1)
            if n >= 0:
                self._ctx.seq_rm(dst, n, -1)
            return self.n_tokens(dst)

    def keep(self, seq: int) -> None:
        """Removes every sequence but seq."""
        with self.lock:
            self._ctx.seq_keep(seq)

    def clear(self) -> None:
        self.remove(-1)

    def n_tokens(self, seq: int) -> int:
        return self._ctx.seq_pos_max(seq) + 1

    def pool(self) -> dict:
        """The KV cache's pool: n_pages, page_tokens, n_pages_used, n_seq (sequences with tokens),
        n_tokens (all sequences'), bytes."""
        with self.lock:
            return self._ctx.pool()

    def save_state(self, seq: int) -> bytes:
        """One sequence's state (its tokens as stored), for load_state on any sequence of a
        context of the same model and cache configuration."""
        with self.lock:
            return self._ctx.save_seq_state(seq)

    def load_state(self, seq: int, data: bytes) -> None:
        with self.lock:
            self._ctx.load_seq_state(seq, data)
