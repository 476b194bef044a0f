"""Llama: a model and one context (sequence + KV cache), with generation, completions and
chat completions shaped like llama-cpp-python's."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import completions
from ._ffi import ffi, lib
from ._native import ContextHandle, DetokenizerHandle, as_int, check, context_params, defaults, last_error
from .chat import ChatTemplate
from .errors import ClosedError, InnerQError, InvalidArgumentError, from_status
from .gguf_model import Model
from .progress import ProgressBar
from .sampling import Sampling, StopMatcher, stop_list

# The defaults of the C library (docs/DEFAULTS.md), so that Llama, innerq-cli and the tools agree.
_D = defaults()


@dataclass
class Run:
    """What the last generation did (Llama.last_run)."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" (end of generation or a stop string), "length"; None while running
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)  # the generated ids (an end-of-generation token included)



class _Turns:
    """Which call owns the sequence of a Llama shared between threads.

    A generation owns it from its prompt until its stream ends, is closed or is collected, so
    the token streams of two threads never interleave: a call from another thread waits for
    its turn. A call from the thread that owns it takes it over instead of waiting for itself
    (the earlier stream is then superseded). `lock` is also held around every step that touches
    the C context, so that a superseded stream notices before it touches the sequence again."""

    def __init__(self):
        self.lock = threading.RLock()
        self._turn = threading.Condition(self.lock)
        self._owner: tuple[int, int] | None = None  # (thread id, run id)
        self.run_id = 0

    def take(self) -> int:
        """Waits for the sequence (call with lock held); returns the new run id."""
        me = threading.get_ident()
        while self._owner is not None and self._owner[0] != me:
            self._turn.wait()
        self.run_id += 1
        self._owner = (me, self.run_id)
        return self.run_id

    def give_back(self, run_id: int) -> None:
        with self.lock:
            if self._owner is not None and self._owner[1] == run_id:
                self._owner = None
                self._turn.notify_all()


class _Stream:
    """A generation's text pieces; gives the sequence back when they end, on close(), or when
    collected (a generator never started would not run its finally clause)."""

    def __init__(self, pieces: Iterator[str], give_back):
        self._pieces, self._give_back = pieces, give_back

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._pieces.close()
        self._give_back()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class _LogitsView:
    """Exposes C-owned logits to numpy; the array keeps this (and so the context) alive."""

    def __init__(self, ctx: ContextHandle, ptr, n: int):
        self.ctx = ctx
        self.__array_interface__ = {"version": 3, "shape": (n,), "typestr": "<f4",
                                    "data": (int(ffi.cast("uintptr_t", ptr)), True)}


class Llama:
    """Llama(model_path, n_ctx=4096, ...) loads a GGUF model and creates a context.

    The defaults are the C library's (docs/DEFAULTS.md). n_ctx: tokens the KV cache holds (0:
    the model's training context); n_batch: most tokens evaluated per graph; n_threads: None or
    0 for the number of physical cores (at most 8); seed: default sampling seed (None or -1:
    from the clock); kv_type: the KV cache type of keys and values, None for the default
    preset "innerq" (innerq3 keys, innerq2 values; kv_k / kv_v set them separately;
    innerq.kv_types() lists the names); kv_group, kv_sink, kv_recent, kv_hybrid, kv_norm,
    kv_debias, kv_norm_pairs: InnerQ cache parameters (-1 / 0: the default window / group);
    chat_template: overrides the GGUF's tokenizer.chat_template; verbose: a loading bar and a
    summary line on stderr; progress: callable(fraction) during loading (False cancels);
    prompt_progress: callable(done, total) while a prompt longer than n_batch is evaluated.
    A bad cache type or parameter raises before the model is loaded.

    Use it as a context manager or call close(); a closed Llama raises ClosedError.
    """

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = _D["n_ctx"], n_batch: int = _D["n_batch"],
                 n_threads: int | None = None, seed: int | None = None, kv_type: str | None = _D["kv_type"],
                 kv_k: str | None = None, kv_v: str | None = None, kv_group: int = _D["kv_group"],
                 kv_sink: int | None = _D["kv_sink"], kv_recent: int | None = _D["kv_recent"],
                 kv_hybrid: bool = _D["kv_hybrid"], kv_norm: bool = _D["kv_norm"], kv_debias: bool = _D["kv_debias"],
                 kv_norm_pairs: bool = _D["kv_norm_pairs"], logits_all: bool = False,
                 n_gpu_layers: int = _D["n_gpu_layers"], use_mmap: bool = _D["use_mmap"],
                 chat_template: str | None = None, verbose: bool = False, progress=None, prompt_progress=None):
        self._ctx = None
        self.model_path = os.fspath(model_path)
        self.seed = None if seed is None else as_int("seed", seed, -1, 2**64 - 1)
        # checked before the model is loaded: a bad cache name fails fast
        params, keep = context_params(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                                      kv_k=kv_k if kv_k is not None else kv_type,
                                      kv_v=kv_v if kv_v is not None else kv_type,
                                      kv_group=kv_group, kv_sink=kv_sink, kv_recent=kv_recent,
                                      kv_hybrid=kv_hybrid, kv_norm=kv_norm, kv_debias=kv_debias,
                                      kv_norm_pairs=kv_norm_pairs,
                                      logits_all=logits_all)
        self.n_batch = params.n_batch
        self.prompt_progress = prompt_progress
        bar = contextlib.nullcontext()
        if progress is None and verbose:
            bar = ProgressBar(f"innerq: loading {Path(self.model_path).name}")
            progress = bar.update
        with bar:
            self.model = Model(self.model_path, use_mmap=use_mmap, n_gpu_layers=n_gpu_layers, progress=progress)
        out = ffi.new("innerq_context **")
        st = lib.innerq_context_init(self.model.handle.ptr, params, out)
        del keep
        if st != lib.INNERQ_OK:
            err = from_status(st, last_error())
            self.model.close()
            raise err
        self._ctx = ContextHandle(out[0], self.model.handle)
        self._chat_template_source = chat_template
        self._chat = None
        self._turns = _Turns()
        self.last_run: Run | None = None
        if verbose:
            backend = ffi.string(lib.innerq_model_backend(self.model.handle.ptr)).decode()
            where = backend if backend != "CPU" else f"cpu {ffi.string(lib.innerq_cpu_isa()).decode()}"
            print(f"innerq: {self.model.description}, n_ctx {self.n_ctx()}, KV cache "
                  f"{lib.innerq_cache_size(self._ctx.ptr) / 2**20:.1f} MiB, {where}", file=sys.stderr)

    # ---- lifetime ----

    def _context(self) -> ContextHandle:
        if self._ctx is None:
            raise ClosedError("this Llama is closed")
        return self._ctx

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def close(self) -> None:
        """Releases the model and the context (memory goes once no logits array refers to it)."""
        self._ctx = None
        model = getattr(self, "model", None)
        if model is not None:
            model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_ctx={self.n_ctx()}"
        return f"Llama({self.model_path!r}, {state})"

    # ---- model and tokenizer ----

    def n_ctx(self) -> int:
        return lib.innerq_n_ctx(self._context().ptr)

    def n_vocab(self) -> int:
        return self.model.n_vocab

    def n_embd(self) -> int:
        return self.model.n_embd

    def token_bos(self) -> int:
        return self.model.token_bos()

    def token_eos(self) -> int:
        return self.model.token_eos()

    @property
    def metadata(self) -> dict[str, str]:
        return self.model.metadata

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.model.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens, special: bool = False) -> bytes:
        """The bytes of tokens (.decode() them for text)."""
        return self.model.detokenize(tokens, special=special)

    # ---- evaluation ----

    @property
    def n_past(self) -> int:
        """Tokens in the KV cache."""
        return lib.innerq_n_past(self._context().ptr)

    def reset(self) -> None:
        """Forgets the sequence."""
        with self._turns.lock:
            run_id = self._turns.take()
            try:
                check(lib.innerq_cache_clear(self._context().ptr))
            finally:
                self._turns.give_back(run_id)

    def eval(self, tokens) -> None:
        """Appends tokens to the sequence and evaluates them."""
        ctx = self._context()
        ids = [as_int("token", t) for t in tokens]
        if not ids:
            raise InvalidArgumentError("eval needs at least one token")
        with self._turns.lock:
            run_id = self._turns.take()  # a generation in progress no longer owns the sequence
            try:
                check(lib.innerq_decode(ctx.ptr, ffi.new("innerq_token[]", ids), len(ids)))
            finally:
                self._turns.give_back(run_id)

    @property
    def logits(self) -> np.ndarray:
        """Logits of the last evaluated token: float32 (n_vocab,), a read-only view of the C
        buffer (no copy). It changes with the next evaluation: copy it to keep it."""
        return self.get_logits(-1)

    def get_logits(self, i: int = -1) -> np.ndarray:
        """Logits of token i of the last eval() (needs logits_all=True unless i == -1)."""
        ctx = self._context()
        with self._turns.lock:
            ptr = lib.innerq_get_logits_ith(ctx.ptr, as_int("i", i))
        if ptr == ffi.NULL:
            raise from_status(lib.INNERQ_ERR_INVALID_ARGUMENT, last_error())
        return np.asarray(_LogitsView(ctx, ptr, self.model.n_vocab))

    # ---- generation ----

    def _prompt_tokens(self, prompt, add_bos: bool = True) -> list[int]:
        if isinstance(prompt, (str, bytes)):
            return self.model.tokenize(prompt, add_bos=add_bos, special=True)
        try:
            return [as_int("token", t) for t in prompt]
        except TypeError:
            raise InvalidArgumentError(f"prompt must be text or a list of token ids, got {prompt!r}") from None

    def _start(self, ids: list[int], max_tokens, sampling: Sampling, stop) -> tuple[Run, Iterator[str]]:
        """Evaluates the prompt now (so errors surface at the call, streaming or not) and
        returns the run record and the iterator of generated text pieces."""
        ctx = self._context()
        stops = StopMatcher(stop_list(stop))
        if not ids:
            raise InvalidArgumentError("the prompt is empty")
        if max_tokens is None or as_int("max_tokens", max_tokens) <= 0:
            max_tokens = self.n_ctx()
        sampler = sampling.sampler(self.n_ctx())
        dt_out = ffi.new("innerq_detokenizer **")
        check(lib.innerq_detokenizer_init(self.model.handle.ptr, False, dt_out))
        detok = DetokenizerHandle(dt_out[0])
        # As innerq-cli does: the detokenizer sees the prompt first, so the first generated
        # piece is rendered as a continuation, not as the start of a text.
        for t in ids:
            detok.push(t)
        with self._turns.lock:
            run_id = self._turns.take()  # held until the stream ends (_Stream)
            try:
                check(lib.innerq_cache_clear(ctx.ptr))
                t0 = time.perf_counter()
                self._decode_prompt(ctx, ids)
            except BaseException:
                self._turns.give_back(run_id)
                raise
        for t in ids:
            lib.innerq_sampler_accept(sampler.ptr, t)
        run = Run(prompt_tokens=len(ids), prompt_seconds=time.perf_counter() - t0)
        self.last_run = run
        pieces = self._sample(run, run_id, ctx, sampler, detok, max_tokens, stops)
        return run, _Stream(pieces, lambda: self._turns.give_back(run_id))

    def _decode_prompt(self, ctx: ContextHandle, ids: list[int]) -> None:
        """innerq_decode of a prompt, in pieces of n_batch when someone watches its progress (the
        same evaluation: innerq_decode cuts it there too)."""
        tokens = ffi.new("innerq_token[]", ids)
        fits = lib.innerq_n_past(ctx.ptr) + len(ids) <= lib.innerq_n_ctx(ctx.ptr)
        if self.prompt_progress is None or len(ids) <= self.n_batch or not fits:
            check(lib.innerq_decode(ctx.ptr, tokens, len(ids)))  # also the context-full error, as is
            return
        for done in range(0, len(ids), self.n_batch):
            self.prompt_progress(done, len(ids))
            check(lib.innerq_decode(ctx.ptr, tokens + done, min(self.n_batch, len(ids) - done)))
        self.prompt_progress(len(ids), len(ids))

    def _check_current(self, run_id: int) -> None:
        self._context()
        if run_id != self._turns.run_id:
            raise InnerQError("this generation was superseded by a later call on the same Llama")

    def _step(self, run_id: int, ctx: ContextHandle, sampler, tok) -> bool:
        """Samples the next token into tok; False at an end-of-generation token."""
        with self._turns.lock:
            self._check_current(run_id)
            logits = lib.innerq_get_logits(ctx.ptr)
            if logits == ffi.NULL:
                raise from_status(lib.INNERQ_ERR_INVALID_ARGUMENT, last_error())
            check(lib.innerq_sampler_sample(sampler.ptr, logits, self.model.n_vocab, tok))
        lib.innerq_sampler_accept(sampler.ptr, tok[0])
        return not lib.innerq_token_is_eog(ctx.model.ptr, tok[0])

    def _advance(self, run_id: int, ctx: ContextHandle, tok) -> bool:
        """Evaluates tok; False where the context is full."""
        with self._turns.lock:
            self._check_current(run_id)
            if lib.innerq_n_past(ctx.ptr) >= lib.innerq_n_ctx(ctx.ptr):
                return False
            check(lib.innerq_decode(ctx.ptr, tok, 1))
        return True

    def _sample(self, run: Run, run_id: int, ctx: ContextHandle, sampler, detok, max_tokens: int,
                stops: StopMatcher) -> Iterator[str]:
        tok = ffi.new("innerq_token *")
        t0 = time.perf_counter()
        try:
            while True:
                more = self._step(run_id, ctx, sampler, tok)
                run.tokens.append(tok[0])
                if not more:
                    run.finish_reason = "stop"
                    break
                run.completion_tokens += 1
                text = stops.feed(detok.push(tok[0]).decode("utf-8", errors="replace"))
                if text:
                    yield text
                if stops.stopped:
                    run.finish_reason = "stop"
                    return
                if run.completion_tokens >= max_tokens or not self._advance(run_id, ctx, tok):
                    run.finish_reason = "length"
                    break
            text = stops.feed(detok.flush().decode("utf-8", errors="replace")) + stops.finish()
            if text:
                yield text
        finally:
            run.generate_seconds = time.perf_counter() - t0

    def generate(self, prompt, max_tokens: int | None = _D["n_predict"], temperature: float = _D["temperature"],
                 top_k: int = _D["top_k"], top_p: float = _D["top_p"], min_p: float = _D["min_p"],
                 repeat_penalty: float = _D["repeat_penalty"], repeat_last_n: int | None = _D["repeat_last_n"],
                 stop=None, seed: int | None = None,
                 stream: bool = False, add_bos: bool = True):
        """Generates a continuation of prompt (text, parsed with special tokens, or token ids).

        Returns the text, or with stream=True an iterator of text pieces. temperature <= 0 is
        greedy; max_tokens None or <= 0 runs to the end of the context; generation stops at
        an end-of-generation token or before the first stop string."""
        sampling = Sampling(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                            self.seed if seed is None else seed)
        _run, pieces = self._start(self._prompt_tokens(prompt, add_bos), max_tokens, sampling, stop)
        return pieces if stream else "".join(pieces)

    def create_completion(self, prompt, max_tokens: int | None = _D["n_predict"], temperature: float = _D["temperature"],
                          top_p: float = _D["top_p"], min_p: float = _D["min_p"], top_k: int = _D["top_k"],
                          repeat_penalty: float = _D["repeat_penalty"], stop=None,
                          seed: int | None = None, stream: bool = False, echo: bool = False,
                          model: str | None = None):
        """An OpenAI-style text completion dict, or with stream=True an iterator of chunks.

        The defaults are innerq's (docs/DEFAULTS.md): llama-cpp-python's max_tokens is 16 here
        and None (no limit) in create_chat_completion, its chat temperature 0.2."""
        ids = self._prompt_tokens(prompt)
        sampling = Sampling(temperature, top_k, top_p, min_p, repeat_penalty, None, self.seed if seed is None else seed)
        run, pieces = self._start(ids, max_tokens, sampling, stop)
        rid, created = completions.new_id("cmpl")
        name = model or self.model_path
        head = ""
        if echo:
            head = prompt if isinstance(prompt, str) else self.detokenize(ids).decode("utf-8", errors="replace")
        if stream:
            return self._completion_chunks(run, pieces, rid, created, name, head)
        text = head + "".join(pieces)
        return completions.completion(rid, created, name, text, run.finish_reason,
                                      completions.usage(run.prompt_tokens, run.completion_tokens))

    def _completion_chunks(self, run, pieces, rid, created, name, head):
        if head:
            yield completions.completion(rid, created, name, head, None, None)
        for piece in pieces:
            yield completions.completion(rid, created, name, piece, None, None)
        yield completions.completion(rid, created, name, "", run.finish_reason, None)

    __call__ = create_completion

    def _chat_template(self) -> ChatTemplate:
        if self._chat is None:
            m = self.model
            bos = m.token_to_piece(m.token_bos(), special=True).decode("utf-8", "replace") if m.token_bos() >= 0 else ""
            eos = m.token_to_piece(m.token_eos(), special=True).decode("utf-8", "replace") if m.token_eos() >= 0 else ""
            self._chat = ChatTemplate(self._chat_template_source or m.chat_template, bos, eos)
        return self._chat

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template makes of messages."""
        self._context()
        return self._chat_template().render(messages, add_generation_prompt=add_generation_prompt)

    def chat_tokens(self, messages) -> list[int]:
        """The tokens of chat_prompt(messages); BOS is added unless the template wrote it."""
        tpl = self._chat_template()
        text = tpl.render(messages)
        add_bos = not (tpl.bos_token and text.startswith(tpl.bos_token))
        return self._prompt_tokens(text, add_bos)

    def create_chat_completion(self, messages, max_tokens: int | None = _D["n_predict"],
                               temperature: float = _D["temperature"], top_p: float = _D["top_p"],
                               min_p: float = _D["min_p"], top_k: int = _D["top_k"],
                               repeat_penalty: float = _D["repeat_penalty"], stop=None, seed: int | None = None, stream: bool = False, model: str | None = None):
        """An OpenAI-style chat completion dict (or chunks with stream=True); the prompt is
        rendered with the model's chat template."""
        self._context()
        ids = self.chat_tokens(messages)
        sampling = Sampling(temperature, top_k, top_p, min_p, repeat_penalty, None, self.seed if seed is None else seed)
        run, pieces = self._start(ids, max_tokens, sampling, stop)
        rid, created = completions.new_id("chatcmpl")
        name = model or self.model_path
        if stream:
            return self._chat_chunks(run, pieces, rid, created, name)
        content = "".join(pieces)
        return completions.chat_completion(rid, created, name, content, run.finish_reason,
                                           completions.usage(run.prompt_tokens, run.completion_tokens))

    def _chat_chunks(self, run, pieces, rid, created, name):
        yield completions.chat_chunk(rid, created, name, {"role": "assistant"}, None)
        for piece in pieces:
            yield completions.chat_chunk(rid, created, name, {"content": piece}, None)
        yield completions.chat_chunk(rid, created, name, {}, run.finish_reason)

