"""Llama: a model and one context (sequence + KV cache), with llama-cpp-python's high-level API
(token-level eval / sample / generate, completions, chat completions, states, prompt caches,
embeddings, grammars, speculative decoding) and innerq's own text generation."""
from __future__ import annotations

import collections
import contextlib
import os
import random
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import completions
from ._ffi import ffi, lib
from ._native import (ContextHandle, DetokenizerHandle, as_int, check, context_key, context_params, defaults,
                      last_error)
from .chat import ChatTemplate
from .errors import (ClosedError, ContextFullError, FormatError, InnerQError, InnerQIOError, InvalidArgumentError,
                     StateMismatchError, UnsupportedError, from_status)
from .gguf_model import Model
from .llama_cache import common_prefix
from .progress import ProgressBar
from .sampling import Sampling, StopMatcher, TokenSampler, logit_bias_processor, stop_list
from .text_stream import LOGPROB_KEYS, TextStream, logits_to_logprobs, token_logprob, token_text

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


class _VocabOnlyContext:
    """The _ctx of a vocab_only Llama, which has no C context: ctx is the native object its
    calls go to, the model (llama-cpp-python's _ctx.ctx is the C context it calls)."""

    def __init__(self, model_handle):
        self.model = model_handle

    @property
    def ctx(self):
        return self.model.ptr


class _LogitsView:
    """Exposes C-owned logits to numpy; the array keeps this (and so the context) alive."""

    def __init__(self, ctx: ContextHandle, ptr, n: int):
        self.ctx = ctx
        self.__array_interface__ = {"version": 3, "shape": (n,), "typestr": "<f4",
                                    "data": (int(ffi.cast("uintptr_t", ptr)), True)}


# llama-cpp-python's sampling defaults: Llama's llama-cpp-python-shaped methods keep them, so that
# a script written for it behaves the same (docs/DEFAULTS.md, the one deliberate exception).
LCP_DEFAULTS = {"max_tokens": 16, "chat_max_tokens": None, "temperature": 0.8, "chat_temperature": 0.2,
                "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
# innerq's own text generation, generate("text", ...): the shared defaults of the C library.
TEXT_DEFAULTS = {"max_tokens": _D["n_predict"], "temperature": _D["temperature"],
                 "repeat_last_n": _D["repeat_last_n"]}

# ggml's type ids (llama-cpp-python's type_k / type_v) of the KV cache types innerq also has.
_GGML_CACHE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 8: "q8_0"}
_LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "from the clock", as innerq's


def _check_unsupported(**args) -> None:
    """Raises UnsupportedError for llama-cpp-python arguments that ask for a behaviour innerq
    does not have (each given a value that would change the result)."""
    for name, (value, neutral, what) in args.items():
        if value not in neutral:
            raise UnsupportedError(f"{name}={value!r}: {what} is not supported by innerq")


def _sampling_supported(typical_p, tfs_z, mirostat_mode) -> None:
    _check_unsupported(typical_p=(typical_p, (1, 1.0, None), "locally typical sampling"),
                       tfs_z=(tfs_z, (1, 1.0, None), "tail-free sampling"),
                       mirostat_mode=(mirostat_mode, (0, None), "mirostat sampling"))


class LlamaState:
    """A saved context (Llama.save_state): the tokens, their logits rows, and llama_state, the
    C library's state blob (the KV cache in its packed form, logits, a model/cache fingerprint)."""

    def __init__(self, input_ids: np.ndarray, scores: np.ndarray, n_tokens: int, llama_state: bytes,
                 llama_state_size: int, seed):
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed

    def save(self, path: str | os.PathLike) -> None:
        """Writes the state to a file, whole or not at all: an earlier file at path survives a
        crash or kill -9 during the write (llama_cache.write_state_file). InnerQIOError if it
        cannot be written."""
        from .llama_cache import write_state_file

        write_state_file(path, self)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LlamaState":
        """A state save() wrote; FormatError if the file is damaged, cut short or not a state,
        InnerQIOError if it cannot be read."""
        from .llama_cache import read_state_file

        try:
            return read_state_file(path)[1]
        except OSError as e:
            raise InnerQIOError(f"cannot read the state file {path}: {e}") from None


class LogitsProcessorList(list):
    """Callables (input_ids, scores) -> scores, applied in order before sampling."""

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list):
    """Callables (input_ids, logits) -> bool; generation stops when any says True."""

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return any([criterion(input_ids, logits) for criterion in self])


class MinTokensLogitsProcessor:
    """Forbids the end-of-sequence token until min_tokens tokens have been generated."""

    def __init__(self, min_tokens: int, token_eos: int):
        self.min_tokens = min_tokens
        self.token_eos = token_eos
        self.prompt_tokens = None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        if len(input_ids) - self.prompt_tokens < self.min_tokens:
            scores[self.token_eos] = -np.inf
        return scores


class Llama:
    """Llama(model_path, n_ctx=4096, ...) loads a GGUF model and creates a context.

    The signature is llama-cpp-python's Llama (0.3.x) and innerq's own keywords. The defaults
    of the context are the C library's (docs/DEFAULTS.md). n_ctx: tokens the KV cache holds (0:
    the model's training context); n_batch: most tokens evaluated per graph; n_threads: None or
    0 for the CPUs this process may use (its affinity mask and cgroup CPU quota; at most 8);
    seed: default sampling seed (None or -1: from the clock); kv_type: the KV cache type of keys
    and values, None for the default preset "innerq" (innerq3 keys and innerq2 values at least;
    the bytes of its windows go to more bits, docs/INNERQ.md; kv_k / kv_v
    set them separately;
    innerq.kv_types() lists the names; llama-cpp-python's type_k / type_v, ggml type ids, map
    to f32, f16, q4_0 and q8_0); kv_group, kv_sink, kv_recent, kv_hybrid, kv_norm, kv_debias,
    kv_norm_pairs, kv_rot (Hadamard rotation: -1 default, 0 none, 1 keys, 2 values, 3 both),
    kv_search (least-squares group scales), kv_value_scales (value row scales: -1 the default,
    off; 1 on), kv_params8 (group parameters in 8 bits: -1 the default, off; 1 on), kv_key_levels
    (3-bit keys on non-uniform levels: -1 the default, off; 1 on): InnerQ cache parameters (-1 / 0: the default window / group); kv_bits: the InnerQ automatic layout, kv_bits effective bits per element of the whole
    cache at n_ctx (windows included; what they leave is spent per layer on keys and values; 0:
    off; docs/INNERQ.md; Llama.kv_memory shows the figure); kv_layer_bits: InnerQ bits of single
    layers over the types', "LAYER:K:V,..." (not with kv_bits); kv_rewind_exact: a prompt that
    shares a prefix with what the context holds is evaluated on that prefix as a fresh context
    would (the kept prefix cut back to a multiple of n_batch and to what the cache can rebuild
    exactly) rather than on the prefix as it is stored (the default: the prefix kept whole, its
    quantized rows as they are; docs/DESIGN.md 3.6); chat_template:
    overrides the GGUF's tokenizer.chat_template; chat_format / chat_handler: a
    llama_chat_format name or handler (default: the GGUF's template, ChatML without one);
    embedding: a context for embed() / create_embedding(); draft_model: a
    llama_speculative draft model; verbose: a loading bar and a summary line on stderr;
    progress: callable(fraction) during loading (False cancels); prompt_progress:
    callable(done, total) while a prompt longer than n_batch is evaluated.

    Arguments of llama-cpp-python that only tune llama.cpp's backends (numa, main_gpu,
    tensor_split, split_mode, use_mlock, n_ubatch, n_threads_batch, offload_kqv, flash_attn,
    op_offload, swa_full, no_perf, ...) are accepted and change nothing; one that asks for a
    behaviour innerq does not have (LoRA, RoPE scaling, kv_overrides, ...) raises
    UnsupportedError. A bad cache type or parameter raises before the model is loaded.

    Use it as a context manager or call close(); a closed Llama raises ClosedError.
    """

    def __init__(self, model_path: str | os.PathLike, *,
                 # model
                 n_gpu_layers: int = _D["n_gpu_layers"], split_mode: int = 1, main_gpu: int = 0,
                 tensor_split=None, vocab_only: bool = False, use_mmap: bool = _D["use_mmap"],
                 use_mlock: bool = False, kv_overrides=None,
                 # context
                 seed: int | None = None, n_ctx: int = _D["n_ctx"], n_batch: int = _D["n_batch"],
                 n_ubatch: int = 512, n_threads: int | None = None, n_threads_batch: int | None = None,
                 rope_scaling_type: int | None = -1, pooling_type: int = -1, attention_type: int = -1,
                 rope_freq_base: float = 0.0, rope_freq_scale: float = 0.0, yarn_ext_factor: float = -1.0,
                 yarn_attn_factor: float = 1.0, yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0,
                 yarn_orig_ctx: int = 0, logits_all: bool = False, embedding: bool = False,
                 offload_kqv: bool = True, flash_attn: bool = False, op_offload=None, swa_full=None,
                 no_perf: bool = False, last_n_tokens_size: int = 64,
                 lora_base=None, lora_scale: float = 1.0, lora_path=None, numa=False,
                 chat_format: str | None = None, chat_handler=None, draft_model=None, tokenizer=None,
                 type_k: int | None = None, type_v: int | None = None, spm_infill: bool = False,
                 verbose: bool = False,
                 # innerq
                 kv_type: str | None = _D["kv_type"], kv_k: str | None = None, kv_v: str | None = None,
                 kv_group: int = _D["kv_group"], kv_sink: int | None = _D["kv_sink"],
                 kv_recent: int | None = _D["kv_recent"], kv_hybrid: bool = _D["kv_hybrid"],
                 kv_norm: bool = _D["kv_norm"], kv_debias: bool = _D["kv_debias"],
                 kv_norm_pairs: bool = _D["kv_norm_pairs"], kv_rot: int = _D["kv_rot"],
                 kv_search: bool = _D["kv_search"], kv_value_scales: int = _D["kv_value_scales"],
                 kv_params8: int = _D["kv_params8"], kv_key_levels: int = _D["kv_key_levels"],
                 kv_bits: float = _D["kv_bits"], kv_layer_bits: str | None = None,
                 kv_rewind_exact: bool = False, chat_template: str | None = None,
                 progress=None, prompt_progress=None, **kwargs):
        self._ctx = None
        # what pickling a Llama keeps (llama-cpp-python's __getstate__): the arguments to load it again
        self._init_args = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        self._init_args.update(kwargs)
        self.model_path = os.fspath(model_path)
        self.verbose = verbose
        if kwargs:  # llama-cpp-python ignores unknown keywords too; say so rather than stay silent
            warnings.warn(f"Llama: ignored unknown arguments {sorted(kwargs)}", stacklevel=2)
        _check_unsupported(
            lora_path=(lora_path, (None,), "a LoRA adapter"), lora_base=(lora_base, (None,), "a LoRA base model"),
            kv_overrides=(kv_overrides or None, (None,), "overriding GGUF metadata"),
            rope_scaling_type=(rope_scaling_type, (None, -1, 0), "RoPE scaling"),
            rope_freq_base=(rope_freq_base, (0, 0.0), "a RoPE base frequency other than the model's"),
            rope_freq_scale=(rope_freq_scale, (0, 0.0), "RoPE frequency scaling"),
            attention_type=(attention_type, (-1, 0), "non-causal attention"),
            tokenizer=(tokenizer, (None,), "a tokenizer other than the GGUF's"))
        self.seed = None if seed is None else as_int("seed", seed, -1, 2**64 - 1)
        self._seed = None if self.seed in (None, -1) else self.seed
        self.last_n_tokens_size = as_int("last_n_tokens_size", last_n_tokens_size, 0)
        self.draft_model = draft_model
        self.chat_format, self.chat_handler = chat_format, chat_handler
        self.lora_base, self.lora_scale, self.lora_path, self.numa, self.spm_infill = (
            lora_base, lora_scale, lora_path, numa, spm_infill)
        self.tensor_split, self.kv_overrides = tensor_split, kv_overrides
        for name, ggml_type in (("type_k", type_k), ("type_v", type_v)):
            if ggml_type is not None and ggml_type not in _GGML_CACHE_TYPES:
                raise UnsupportedError(f"{name}={ggml_type}: innerq has no KV cache of that ggml type (it has "
                                       f"{', '.join(f'{k} ({v})' for k, v in _GGML_CACHE_TYPES.items())}; "
                                       f"kv_type= names innerq's own)")
        if kv_k is None:
            kv_k = _GGML_CACHE_TYPES[type_k] if type_k is not None else kv_type
        if kv_v is None:
            kv_v = _GGML_CACHE_TYPES[type_v] if type_v is not None else kv_type
        self._logits_all = bool(logits_all)
        # Speculative decoding verifies a draft with the logits of every position of one batch.
        self._keep_all = self._logits_all or draft_model is not None
        self.embedding, self.pooling_type_id = bool(embedding), as_int("pooling_type", pooling_type, -1, 4)
        # checked before the model is loaded: a bad cache name fails fast
        params, keep = context_params(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads or n_threads_batch,
                                      kv_k=kv_k, kv_v=kv_v, kv_group=kv_group, kv_sink=kv_sink,
                                      kv_recent=kv_recent, kv_hybrid=kv_hybrid, kv_norm=kv_norm,
                                      kv_debias=kv_debias, kv_norm_pairs=kv_norm_pairs, kv_rot=kv_rot,
                                      kv_search=kv_search, kv_value_scales=kv_value_scales,
                                      kv_params8=kv_params8, kv_key_levels=kv_key_levels, kv_bits=kv_bits,
                                      kv_layer_bits=kv_layer_bits,
                                      logits_all=self._keep_all, kv_rewind_exact=kv_rewind_exact,
                                      **self._embedding_params())
        self._rewind_exact = bool(kv_rewind_exact)
        config = context_key(params)  # while `keep` holds the strings params points to
        self.n_batch = params.n_batch
        self.prompt_progress = prompt_progress
        bar = contextlib.nullcontext()
        if progress is None and verbose:
            bar = ProgressBar(f"innerq: loading {Path(self.model_path).name}")
            progress = bar.update
        with bar:
            self._model = Model(self.model_path, use_mmap=use_mmap, n_gpu_layers=n_gpu_layers, progress=progress,
                                vocab_only=vocab_only)
        self.model = self._model
        self._vocab_only = bool(vocab_only)
        self._chat_template_source = chat_template
        self._chat = None
        self._turns = _Turns()
        self.last_run: Run | None = None
        self.cache = None
        self._is_recurrent = self._is_hybrid = False  # innerq loads transformer (Llama-family) models only
        if vocab_only:  # a tokenizer only: no context, no KV cache
            self._n_ctx = as_int("n_ctx", n_ctx, 0) or self._model.n_ctx_train
            self._ctx = _VocabOnlyContext(self._model.handle)
            self._init_tokens()
            return
        out = ffi.new("innerq_context **")
        st = lib.innerq_context_init(self._model.handle.ptr, params, out)
        del keep
        if st != lib.INNERQ_OK:
            err = from_status(st, last_error())
            self._model.close()
            raise err
        self._ctx = ContextHandle(out[0], self._model.handle)
        self._n_ctx = lib.innerq_n_ctx(self._ctx.ptr)
        # what prompt-cache keys begin with: states of other models or cache configurations in a
        # shared cache (one folder of a LlamaDiskCache) are never found
        self._cache_name = f"{lib.innerq_model_fingerprint(self._model.handle.ptr):016x}-{config}"
        self._init_tokens()
        if verbose:
            backend = ffi.string(lib.innerq_model_backend(self._model.handle.ptr)).decode()
            where = backend if backend != "CPU" else f"cpu {ffi.string(lib.innerq_cpu_isa()).decode()}"
            off = ffi.new("innerq_model_offload *")
            if lib.innerq_model_get_offload(self._model.handle.ptr, off) == 0 and 0 < off.n_gpu_layers < off.n_layer:
                where += (f", {off.n_gpu_layers}/{off.n_layer} layers on the GPU ({off.gpu_bytes / 2**20:.1f} MiB of "
                          f"weights; {off.cpu_bytes / 2**20:.1f} MiB on the CPU)")
            mem = self._ctx.kv_memory()
            print(f"innerq: {self._model.description}, n_ctx {self.n_ctx()}, KV cache "
                  f"{mem['bytes'] / 2**20:.1f} MiB ({mem['bits']:.2f} bits per element), {where}", file=sys.stderr)

    def _embedding_params(self) -> dict:
        """The context parameters of embedding=True / pooling_type (none without embedding)."""
        if not self.embedding:
            return {}
        return {"embeddings": True, "pooling": None if self.pooling_type_id == -1 else self.pooling_type_id}

    def _init_tokens(self) -> None:
        """llama-cpp-python's view of the sequence: input_ids[:n_tokens] are the tokens the
        context holds; scores holds their logits rows (every row with logits_all, else the row
        of the last evaluated token only)."""
        self.n_tokens = 0
        self.input_ids = np.zeros(self._n_ctx, dtype=np.intc)
        # np.zeros maps pages lazily: only rows written take memory
        self.scores = np.zeros((self._n_ctx if self._keep_all else 1, self._model.n_vocab), dtype=np.float32)
        # The logits at the end of the last few decode calls, by position: a prompt that the
        # context holds whole takes them instead of evaluating its last token again, which would
        # give other logits (the call's tokens read each other unrounded, an evaluation after
        # them reads them as stored: docs/DESIGN.md 3.4)
        self._ends: dict[int, np.ndarray] = {}
        self._requires_eval = True
        self._sampler = None

    # ---- lifetime ----

    def _context(self) -> ContextHandle:
        if self._ctx is None:
            raise ClosedError("this Llama is closed")
        if self._vocab_only:
            raise UnsupportedError("this Llama was loaded with vocab_only=True: it has a tokenizer but no context")
        return self._ctx

    @property
    def ctx(self):
        return self._context().ptr

    @property
    def kv_memory(self) -> dict:
        """The KV cache's memory at n_ctx tokens: bytes, effective bits per element (bits: windows,
        scales and norms included), quant_bits of the quantized region alone, n_ctx, and the
        quantized cache's group, n_sink, n_recent (innerq_context_kv_memory)."""
        return self._context().kv_memory()

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def close(self) -> None:
        """Releases the model and the context (memory goes once no logits array refers to it)."""
        self._ctx = None
        model = getattr(self, "_model", None)
        if model is not None:
            model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_ctx={self.n_ctx()}"
        return f"Llama({self.model_path!r}, {state})"

    def __getstate__(self):
        """A pickled Llama is its arguments: unpickling loads the model again (a new context;
        save_state() keeps a context's tokens)."""
        return dict(self._init_args)

    def __setstate__(self, state):
        self.__init__(**state)

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None, additional_files=None, local_dir=None,
                        local_dir_use_symlinks="auto", cache_dir=None, **kwargs) -> "Llama":
        """Downloads filename (a name or a glob pattern) of a Hugging Face repository with
        huggingface_hub (a file already in its cache is used offline) and loads it."""
        from . import hub

        path = hub.download(repo_id, filename, additional_files, local_dir, cache_dir)
        return cls(model_path=path, **kwargs)

    # ---- model and tokenizer ----

    def n_ctx(self) -> int:
        if self._ctx is None:
            raise ClosedError("this Llama is closed")
        return self._n_ctx

    def n_vocab(self) -> int:
        return self._model.n_vocab

    def n_embd(self) -> int:
        return self._model.n_embd

    def token_bos(self) -> int:
        return self._model.token_bos()

    def token_eos(self) -> int:
        return self._model.token_eos()

    def token_nl(self) -> int:
        ids = self._model.tokenize(b"\n", add_bos=False)
        return ids[-1] if ids else -1

    def pooling_type(self) -> int:
        return self.pooling_type_id

    @property
    def metadata(self) -> dict[str, str]:
        return self._model.metadata

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._model.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        """The bytes of tokens (.decode() them for text): the tokens' pieces one after another,
        as llama-cpp-python's, without the leading space a sentencepiece vocabulary writes
        after a BOS token. prev_tokens is accepted as there, and changes nothing there either."""
        ids = [as_int("token", t) for t in tokens]
        text = b"".join(self._model.token_to_piece(t, special=special) for t in ids)
        if ids and ids[0] == self.token_bos() and text[:1] == b" ":
            return text[1:]
        return text

    def tokenizer(self):
        return self

    def set_cache(self, cache) -> None:
        """A LlamaRAMCache / LlamaDiskCache that completions load states from and save to."""
        self.cache = cache

    def set_seed(self, seed: int) -> None:
        self._seed = None if seed is None or seed == -1 else as_int("seed", seed, 0, 2**64 - 1)

    # ---- evaluation ----

    @property
    def n_past(self) -> int:
        """Tokens in the KV cache."""
        return lib.innerq_n_past(self._context().ptr)

    @property
    def _input_ids(self) -> np.ndarray:
        return self.input_ids[:self.n_tokens]

    @property
    def _scores(self) -> np.ndarray:
        return self.scores[:self.n_tokens] if self._keep_all else self.scores[:min(self.n_tokens, 1)]

    @property
    def eval_tokens(self):
        return collections.deque(self._input_ids.tolist(), maxlen=self._n_ctx)

    @property
    def eval_logits(self):
        return collections.deque(self._scores.tolist(), maxlen=self._n_ctx if self._keep_all else 1)

    def reset(self) -> None:
        """Forgets the sequence."""
        with self._turns.lock:
            run_id = self._turns.take()
            try:
                check(lib.innerq_cache_clear(self._context().ptr))
                self.n_tokens = 0
                self._requires_eval = True
                self._ends = {}
            finally:
                self._turns.give_back(run_id)

    def _rewind(self, n: int, align: bool = False) -> list[int]:
        """Rewinds the C cache to input_ids[:n] (call with the lock held): tokens past n are
        dropped. Returns the tokens of input_ids[:n] the rewind could not keep (by default the
        part of a quantized block the cut falls in; with kv_rewind_exact the tokens an exact
        rebuild could not keep, docs/INNERQ.md "Rewinding the cache"), which the caller evaluates
        in one call with what follows. align (with kv_rewind_exact): keep a multiple of n_batch
        tokens, where a fresh evaluation of a prompt cuts its calls, so that a prompt evaluated on
        a kept prefix gives exactly the logits of a fresh evaluation (a call's tokens attend to
        each other at full precision, so other cuts give other logits)."""
        ctx = self._context()
        kept = min(n, lib.innerq_n_past(ctx.ptr))
        if lib.innerq_n_past(ctx.ptr) > n:
            kept = ctx.truncate(n)
            while align and self._rewind_exact and kept % self.n_batch:
                kept = ctx.truncate(kept - kept % self.n_batch)
        self.n_tokens = kept
        return self.input_ids[kept:n].tolist()

    def _decode(self, ids: list[int], progress=None) -> None:
        """Evaluates ids after input_ids[:n_tokens] (call with the lock held and the cache in
        step), in pieces of n_batch, and records the tokens and their logits rows."""
        ctx = self._context()
        if self.n_tokens + len(ids) > self._n_ctx:
            raise ContextFullError(f"Requested tokens ({self.n_tokens + len(ids)}) exceed context window of "
                                   f"{self._n_ctx}")
        for done in range(0, len(ids), self.n_batch):
            if progress is not None:
                progress(done, len(ids))
            chunk = ids[done:done + self.n_batch]
            check(lib.innerq_decode(ctx.ptr, ffi.new("innerq_token[]", chunk), len(chunk)))
            n = self.n_tokens
            self.input_ids[n:n + len(chunk)] = chunk
            if self._keep_all:
                for i in range(len(chunk)):
                    self.scores[n + i] = ctx.logits(i)
            elif done + self.n_batch >= len(ids):
                self.scores[0] = ctx.logits(-1)
            self.n_tokens = n + len(chunk)
        self._ends = {p: row for p, row in self._ends.items() if p < self.n_tokens - len(ids)}
        if ids and len(self._ends) < 8:
            self._ends[self.n_tokens - 1] = self._row(self.n_tokens - 1).copy()
        if progress is not None and ids:
            progress(len(ids), len(ids))
        self._requires_eval = False

    def eval(self, tokens) -> None:
        """Appends tokens to input_ids[:n_tokens] and evaluates them (what the cache held past
        n_tokens is dropped first, as llama-cpp-python's eval does)."""
        ctx = self._context()
        ids = [as_int("token", t) for t in tokens]
        if not ids:
            raise InvalidArgumentError("eval needs at least one token")
        with self._turns.lock:
            run_id = self._turns.take()  # a generation in progress no longer owns the sequence
            try:
                self._decode(self._rewind(self.n_tokens) + ids)
            finally:
                self._turns.give_back(run_id)
        del ctx

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
        return np.asarray(_LogitsView(ctx, ptr, self._model.n_vocab))

    # ---- token-level sampling and generation (llama-cpp-python's) ----

    def _new_sampler(self, top_k, top_p, min_p, temp, repeat_penalty, frequency_penalty, presence_penalty,
                     logits_processor, grammar, keep_rows: bool = False) -> TokenSampler:
        """A generation's sampler with llama-cpp-python's arguments, seeded by the Llama's seed,
        its penalty history the tokens the context holds."""
        if temp < 0:  # llama-cpp-python: a plain draw from the softmax of the logits
            temp, top_k, top_p, min_p = 1.0, 0, 1.0, 0.0
        seed = None if self._seed is None or self._seed == _LLAMA_DEFAULT_SEED else self._seed
        sampling = Sampling(temp, top_k, top_p, min_p, repeat_penalty, self.last_n_tokens_size, seed)
        return TokenSampler(sampling, self.n_ctx(), last_n=self.last_n_tokens_size,
                            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                            logits_processor=logits_processor, matcher=self._grammar_matcher(grammar),
                            history=self.input_ids[:self.n_tokens], keep_rows=keep_rows)

    def _grammar_matcher(self, grammar):
        from .grammar import GrammarMatcher
        from .llama_grammar import LlamaGrammar

        if grammar is None:
            return None
        if not isinstance(grammar, LlamaGrammar):
            raise InvalidArgumentError(f"grammar must be a LlamaGrammar, got {grammar!r}")
        return GrammarMatcher(grammar.parsed, self._model.token_index())

    def _row(self, idx: int | None) -> np.ndarray:
        """The logits row that predicts the token after position idx (default: the last)."""
        if self.n_tokens <= 0:
            raise InvalidArgumentError("nothing evaluated yet: eval() tokens before sampling")
        idx = self.n_tokens - 1 if idx is None else as_int("idx", idx)
        if not 0 <= idx < self.n_tokens:
            raise InvalidArgumentError(f"idx = {idx} is outside the {self.n_tokens} evaluated tokens")
        if self._keep_all:
            return self.scores[idx]
        if idx != self.n_tokens - 1:
            raise InvalidArgumentError("only the last token's logits are kept; create the Llama with "
                                       "logits_all=True to sample at an earlier position")
        return self.scores[0]

    def sample(self, top_k: int = LCP_DEFAULTS["top_k"], top_p: float = LCP_DEFAULTS["top_p"],
               min_p: float = LCP_DEFAULTS["min_p"], typical_p: float = 1.0,
               temp: float = LCP_DEFAULTS["temperature"], repeat_penalty: float = LCP_DEFAULTS["repeat_penalty"],
               frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
               mirostat_mode: int = 0, mirostat_eta: float = 0.1, mirostat_tau: float = 5.0,
               penalize_nl: bool = True, logits_processor=None, grammar=None, idx: int | None = None) -> int:
        """Samples the token after position idx (default: the last evaluated token)."""
        self._context()
        _sampling_supported(typical_p, tfs_z, mirostat_mode)
        sampler = self._sampler or self._new_sampler(top_k, top_p, min_p, temp, repeat_penalty, frequency_penalty,
                                                     presence_penalty, logits_processor, grammar)
        row = self._row(idx)
        end = self.n_tokens if idx is None else idx + 1
        return sampler.sample(row, self.input_ids[:end])

    def generate(self, tokens, top_k: int = LCP_DEFAULTS["top_k"], top_p: float = LCP_DEFAULTS["top_p"],
                 min_p: float = LCP_DEFAULTS["min_p"], typical_p: float = 1.0,
                 temp: float = LCP_DEFAULTS["temperature"], repeat_penalty: float = LCP_DEFAULTS["repeat_penalty"],
                 reset: bool = True, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None, grammar=None,
                 **text_options):
        """llama-cpp-python's generate: a generator of the token ids that follow tokens (it ends
        only when the caller stops, a stopping criterion says so, or the context is full; send()
        a list of tokens to have them evaluated after the one just yielded).

        innerq's text generation as well: with a text prompt, or with any of max_tokens,
        temperature, stop, seed, stream, add_bos, repeat_last_n, it returns the text of the
        continuation (an iterator of pieces with stream=True), with the shared defaults of
        TEXT_DEFAULTS (docs/DEFAULTS.md): temperature <= 0 is greedy; max_tokens None or <= 0
        runs to the end of the context; it stops at an end-of-generation token or before the
        first stop string."""
        if isinstance(tokens, (str, bytes)) or text_options:
            return self._generate_text(tokens, top_k=top_k, top_p=top_p, min_p=min_p,
                                       repeat_penalty=repeat_penalty, **text_options)
        self._context()
        _sampling_supported(typical_p, tfs_z, mirostat_mode)
        try:
            ids = [as_int("token", t, 0, self.n_vocab() - 1) for t in tokens]
        except TypeError:
            raise InvalidArgumentError(f"generate takes a list of token ids (or a text), got {tokens!r}") from None
        sampler = self._new_sampler(top_k, top_p, min_p, temp, repeat_penalty, frequency_penalty, presence_penalty,
                                    logits_processor, grammar)
        return self._token_stream(ids, sampler, reset, stopping_criteria)

    def _token_stream(self, tokens: list[int], sampler: TokenSampler, reset: bool, stopping_criteria):
        """The loop of llama-cpp-python's generate, with the prefix of the prompt that the
        context already holds kept (the cache rewound to it) rather than evaluated again. The
        generation owns the sequence until it ends (_Turns): a stream of another thread waits."""
        with self._turns.lock:
            run_id = self._turns.take()
        self._sampler = sampler
        try:
            with self._turns.lock:
                self._check_current(run_id)
                if reset and self.n_tokens > 0:
                    prefix = common_prefix(self._input_ids.tolist(), tokens)
                    if (prefix == len(tokens) == self.n_tokens and not self._requires_eval) or self._at_hand(tokens):
                        reset, tokens = False, []  # the logits of the whole prompt are at hand
                    else:
                        keep = self._keep_for(tokens)
                        if keep > 0:
                            tokens = self._rewind(keep, align=True) + tokens[keep:]
                            reset = self.n_tokens == 0
                            self._requires_eval = True
                if reset:
                    check(lib.innerq_cache_clear(self._context().ptr))
                    self.n_tokens = 0
            sample_idx = self.n_tokens + len(tokens) - 1
            verify = False  # a sampled token and its draft
            while True:
                if tokens:
                    with self._turns.lock:
                        self._check_current(run_id)
                        with self._one_at_a_time(verify):
                            self._decode(self._rewind(self.n_tokens) + tokens)
                while sample_idx < self.n_tokens:
                    token = self.sample(idx=sample_idx)
                    sample_idx += 1
                    if stopping_criteria is not None and stopping_criteria(
                            self.input_ids[:sample_idx], self._row(sample_idx - 1)):
                        return
                    sampler.accept(token)
                    more = yield token
                    tokens = [token] + (list(more) if more is not None else [])
                    verify = self.draft_model is not None
                    if sample_idx < self.n_tokens and token != self.input_ids[sample_idx]:
                        # a drafted token the sampler did not pick: drop it and what follows
                        self.n_tokens = sample_idx
                        self._requires_eval = True
                        break
                if self.n_tokens + len(tokens) > self._n_ctx:
                    return  # the context is full
                if self.draft_model is not None and tokens:
                    self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
                    draft = np.asarray(self.draft_model(self.input_ids[:self.n_tokens + len(tokens)]), dtype=np.intc)
                    room = self._n_ctx - self.n_tokens - len(tokens)
                    tokens.extend(int(t) for t in draft[:max(0, room)])
        finally:
            if self._sampler is sampler:
                self._sampler = None
            self._turns.give_back(run_id)

    @contextlib.contextmanager
    def _one_at_a_time(self, on: bool):
        """With on, the calls inside give each token the logits it would get decoded alone
        (decode semantics, innerq_context_params): a speculative draft is verified with exactly
        what plain decoding would compute, so greedy speculative decoding gives greedy decoding's
        tokens."""
        if not on:
            yield
            return
        ctx = self._context()
        ctx.set_batch_mode(self._keep_all, True)
        try:
            yield
        finally:
            ctx.set_batch_mode(self._keep_all, False)

    def _at_hand(self, ids: list[int]) -> bool:
        """Whether the context holds the prompt ids whole with the logits that ended its
        evaluation: then the cache is rewound to it and those logits are the last row (call with
        the lock held)."""
        n = len(ids)
        if n == 0 or n > self.n_tokens or (n - 1) not in self._ends or common_prefix(self._input_ids.tolist(), ids) < n:
            return False
        if self._rewind(n):  # the cache could not keep every token of the prompt
            return False
        if self._keep_all:
            self.scores[n - 1] = self._ends[n - 1]
        else:
            self.scores[0] = self._ends[n - 1]
        self._requires_eval = False
        return True

    def _keep_for(self, ids: list[int]) -> int:
        """How many tokens of the context to keep for a prompt: the common prefix (less one
        where the context holds the whole prompt: its last token is evaluated again, for the
        logits that predict what follows); with kv_rewind_exact, down to a multiple of n_batch
        (_rewind)."""
        prefix = common_prefix(self._input_ids.tolist(), ids)
        if prefix == len(ids):
            prefix -= 1
        return prefix - prefix % self.n_batch if self._rewind_exact else prefix

    # ---- innerq's text generation ----

    def _prompt_tokens(self, prompt, add_bos: bool = True) -> list[int]:
        if isinstance(prompt, (str, bytes)):
            return self._model.tokenize(prompt, add_bos=add_bos, special=True)
        try:
            return [as_int("token", t) for t in prompt]
        except TypeError:
            raise InvalidArgumentError(f"prompt must be text or a list of token ids, got {prompt!r}") from None

    def _generate_text(self, prompt, top_k, top_p, min_p, repeat_penalty,
                       max_tokens: int | None = TEXT_DEFAULTS["max_tokens"],
                       temperature: float = TEXT_DEFAULTS["temperature"],
                       repeat_last_n: int | None = TEXT_DEFAULTS["repeat_last_n"], stop=None,
                       seed: int | None = None, stream: bool = False, add_bos: bool = True):
        sampling = Sampling(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                            self.seed if seed is None else seed)
        _run, pieces = self._start(self._prompt_tokens(prompt, add_bos), max_tokens, sampling, stop)
        return pieces if stream else "".join(pieces)

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
        check(lib.innerq_detokenizer_init(self._model.handle.ptr, False, dt_out))
        detok = DetokenizerHandle(dt_out[0])
        # As innerq-cli does: the detokenizer sees the prompt first, so the first generated
        # piece is rendered as a continuation, not as the start of a text.
        for t in ids:
            detok.push(t)
        with self._turns.lock:
            run_id = self._turns.take()  # held until the stream ends (_Stream)
            try:
                t0 = time.perf_counter()
                if len(ids) > self._n_ctx:
                    raise ContextFullError(f"the prompt ({len(ids)} tokens) does not fit in the context "
                                           f"({self._n_ctx} tokens)")
                if not self._at_hand(ids):
                    keep = self._keep_for(ids)
                    rest = self._rewind(keep, align=True) + ids[keep:]
                    self._decode(rest, self.prompt_progress if len(rest) > self.n_batch else None)
            except BaseException:
                self._turns.give_back(run_id)
                raise
        for t in ids:
            lib.innerq_sampler_accept(sampler.ptr, t)
        run = Run(prompt_tokens=len(ids), prompt_seconds=time.perf_counter() - t0)
        self.last_run = run
        pieces = self._sample(run, run_id, ctx, sampler, detok, max_tokens, stops)
        return run, _Stream(pieces, lambda: self._turns.give_back(run_id))

    def _check_current(self, run_id: int) -> None:
        self._context()
        if run_id != self._turns.run_id:
            raise InnerQError("this generation was superseded by a later call on the same Llama")

    def _step(self, run_id: int, ctx: ContextHandle, sampler, tok) -> bool:
        """Samples the next token into tok; False at an end-of-generation token."""
        with self._turns.lock:
            self._check_current(run_id)
            row = np.ascontiguousarray(self._row(None))  # the last evaluated token's, or a prompt's at hand
            check(lib.innerq_sampler_sample(sampler.ptr, ffi.cast("float *", ffi.from_buffer(row)),
                                            self._model.n_vocab, tok))
        lib.innerq_sampler_accept(sampler.ptr, tok[0])
        return not lib.innerq_token_is_eog(ctx.model.ptr, tok[0])

    def _advance(self, run_id: int, tok) -> bool:
        """Evaluates tok; False where the context is full."""
        with self._turns.lock:
            self._check_current(run_id)
            if self.n_tokens >= self._n_ctx:
                return False
            self._decode([tok[0]])
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
                if run.completion_tokens >= max_tokens or not self._advance(run_id, tok):
                    run.finish_reason = "length"
                    break
            text = stops.feed(detok.flush().decode("utf-8", errors="replace")) + stops.finish()
            if text:
                yield text
        finally:
            run.generate_seconds = time.perf_counter() - t0

    # ---- completions (llama-cpp-python's) ----

    def create_completion(self, prompt, suffix: str | None = None,
                          max_tokens: int | None = LCP_DEFAULTS["max_tokens"],
                          temperature: float = LCP_DEFAULTS["temperature"], top_p: float = LCP_DEFAULTS["top_p"],
                          min_p: float = LCP_DEFAULTS["min_p"], typical_p: float = 1.0, logprobs: int | None = None,
                          echo: bool = False, stop=(), frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = LCP_DEFAULTS["repeat_penalty"],
                          top_k: int = LCP_DEFAULTS["top_k"], stream: bool = False, seed: int | None = None,
                          tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                          mirostat_eta: float = 0.1, model: str | None = None, stopping_criteria=None,
                          logits_processor=None, grammar=None, logit_bias=None):
        """An OpenAI-style text completion dict, or with stream=True an iterator of chunks.

        llama-cpp-python's method and defaults (max_tokens 16, temperature 0.8; docs/DEFAULTS.md).
        The prompt (text, or token ids) reuses what the context holds of it. logprobs=n adds
        the log-probabilities of each token and of the n likeliest (of the prompt's tokens too
        with echo=True, which needs logits_all=True); logit_bias {token: bias} is added to the
        logits; grammar (a LlamaGrammar) constrains the text."""
        _sampling_supported(typical_p, tfs_z, mirostat_mode)
        if suffix is not None:
            raise UnsupportedError("suffix (fill-in-the-middle completion) is not supported by innerq")
        job = _Completion(self, prompt, max_tokens, logprobs, echo, stop, model)
        if logit_bias:
            logits_processor = LogitsProcessorList([*(logits_processor or []),
                                                    logit_bias_processor(logit_bias, self.n_vocab())])
        if seed is not None:
            self.set_seed(seed)
        elif self._seed is not None:  # llama-cpp-python: each call draws the next seed from the last
            self.set_seed(random.Random(self._seed).randint(0, 2**32))
        sampler = self._new_sampler(top_k, top_p, min_p, temperature, repeat_penalty, frequency_penalty,
                                    presence_penalty, logits_processor, grammar, keep_rows=logprobs is not None)
        chunks = job.run(sampler, stopping_criteria, stream)
        if stream:
            return chunks
        *_, final = chunks
        return final

    def __call__(self, prompt, suffix: str | None = None, max_tokens: int | None = LCP_DEFAULTS["max_tokens"],
                 temperature: float = LCP_DEFAULTS["temperature"], top_p: float = LCP_DEFAULTS["top_p"],
                 min_p: float = LCP_DEFAULTS["min_p"], typical_p: float = 1.0, logprobs: int | None = None,
                 echo: bool = False, stop=(), frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 repeat_penalty: float = LCP_DEFAULTS["repeat_penalty"], top_k: int = LCP_DEFAULTS["top_k"],
                 stream: bool = False, seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                 mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                 stopping_criteria=None, logits_processor=None, grammar=None, logit_bias=None):
        """create_completion (llama-cpp-python's __call__)."""
        return self.create_completion(prompt, suffix, max_tokens, temperature, top_p, min_p, typical_p, logprobs,
                                      echo, stop, frequency_penalty, presence_penalty, repeat_penalty, top_k,
                                      stream, seed, tfs_z, mirostat_mode, mirostat_tau, mirostat_eta, model,
                                      stopping_criteria, logits_processor, grammar, logit_bias)

    @staticmethod
    def logits_to_logprobs(logits, axis: int = -1) -> np.ndarray:
        return logits_to_logprobs(logits, axis)

    @staticmethod
    def longest_token_prefix(a, b) -> int:
        return common_prefix(a, b)

    # ---- chat ----

    def _chat_template(self) -> ChatTemplate:
        if self._chat is None:
            self._chat = ChatTemplate.of_model(self._model, self._chat_template_source)
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

    def _chat_completion_handler(self):
        from . import llama_chat_format

        if self.chat_handler is not None:
            return self.chat_handler
        if self.chat_format is not None:
            return llama_chat_format.get_chat_completion_handler(self.chat_format)
        return llama_chat_format.chat_formatter_to_chat_completion_handler(
            llama_chat_format.TemplateChatFormatter(self._chat_template()))

    def create_chat_completion(self, messages, functions=None, function_call=None, tools=None, tool_choice=None,
                               temperature: float = LCP_DEFAULTS["chat_temperature"],
                               top_p: float = LCP_DEFAULTS["top_p"], top_k: int = LCP_DEFAULTS["top_k"],
                               min_p: float = LCP_DEFAULTS["min_p"], typical_p: float = 1.0, stream: bool = False,
                               stop=(), seed: int | None = None, response_format=None,
                               max_tokens: int | None = LCP_DEFAULTS["chat_max_tokens"],
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = LCP_DEFAULTS["repeat_penalty"], tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor=None, grammar=None, logit_bias=None,
                               logprobs: bool | None = None, top_logprobs: int | None = None):
        """An OpenAI-style chat completion dict (or chunks with stream=True).

        llama-cpp-python's method and defaults (no length limit, temperature 0.2). The prompt is
        rendered by chat_handler, else the chat_format's handler, else the model's own chat
        template (chat_template= overrides it; ChatML where the model has none).
        response_format {"type": "json_object"} (optionally with a "schema") or
        {"type": "json_schema", "json_schema": {"schema": ...}} constrains the answer to JSON
        (valid under the schema); logprobs=True with top_logprobs=n adds log-probabilities."""
        self._context()
        handler = self._chat_completion_handler()
        return handler(llama=self, messages=messages, functions=functions, function_call=function_call,
                       tools=tools, tool_choice=tool_choice, temperature=temperature, top_p=top_p, top_k=top_k,
                       min_p=min_p, typical_p=typical_p, logprobs=logprobs, top_logprobs=top_logprobs,
                       stream=stream, stop=stop, seed=seed, response_format=response_format,
                       max_tokens=max_tokens, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, tfs_z=tfs_z,
                       mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                       model=model, logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias)

    def create_chat_completion_openai_v1(self, *args, **kwargs):
        """create_chat_completion, returned as the openai package's types."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise UnsupportedError("create_chat_completion_openai_v1 needs the openai package "
                                   "(pip install openai)") from None
        out = self.create_chat_completion(*args, **kwargs)
        if kwargs.get("stream"):
            return (ChatCompletionChunk(**chunk) for chunk in out)
        return ChatCompletion(**out)

    # ---- embeddings ----

    def embed(self, input, normalize: bool = False, truncate: bool = True, return_count: bool = False):
        """Embeddings of a text (or of each text of a list), as llama-cpp-python's: with a
        pooling (mean, cls, last: pooling_type, or the GGUF's llama.pooling_type) one vector per
        text, without one (every Llama-family LLM GGUF) a vector per token. normalize: each
        vector scaled to unit length; truncate: a text cut at n_batch tokens (else an error)."""
        ctx = self._context()
        if not self.embedding:
            raise InvalidArgumentError("Llama model must be created with embedding=True to call this method")
        texts = [input] if isinstance(input, str) else list(input)
        data, total = [], 0
        with self._turns.lock:
            run_id = self._turns.take()
            try:
                for text in texts:
                    if not isinstance(text, str):
                        raise InvalidArgumentError(f"embed takes text or a list of texts, got {text!r}")
                    tokens = self.tokenize(text.encode("utf-8"))
                    if truncate:
                        tokens = tokens[:self.n_batch]
                    if len(tokens) > self.n_batch:
                        raise InvalidArgumentError(f"Requested tokens ({len(tokens)}) exceed batch size of "
                                                   f"{self.n_batch}")
                    total += len(tokens)
                    # each text alone in the cache, evaluated in one call: its pooling covers it only
                    check(lib.innerq_cache_clear(ctx.ptr))
                    self.n_tokens = 0
                    ctx.decode(tokens)
                    vectors = ctx.embeddings()
                    if normalize:
                        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
                        vectors = vectors / np.where(norms > 0, norms, 1.0)
                    data.append(vectors.tolist())
            finally:
                check(lib.innerq_cache_clear(ctx.ptr))
                self._requires_eval = True
                self._turns.give_back(run_id)
        output = data[0] if isinstance(input, str) else data
        return (output, total) if return_count else output

    def create_embedding(self, input, model: str | None = None) -> dict:
        """An OpenAI-style embeddings response for a text or a list of texts."""
        texts = input if isinstance(input, list) else [input]
        vectors, total = self.embed(texts, return_count=True)
        return {"object": "list", "model": model if model is not None else self.model_path,
                "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": total, "total_tokens": total}}

    # ---- states ----

    def save_state(self) -> LlamaState:
        """The context as a LlamaState: the C state (the KV cache as it is stored, the InnerQ
        regions in their packed form; the logits) with input_ids and the logits rows."""
        ctx = self._context()
        with self._turns.lock:
            blob = ctx.save_state()
        return LlamaState(input_ids=self.input_ids.copy(), scores=self._scores.copy(), n_tokens=self.n_tokens,
                          llama_state=blob, llama_state_size=len(blob), seed=self._seed)

    def load_state(self, state: LlamaState) -> None:
        """Restores a save_state(); a state of another model or cache type is an error (and
        leaves this context as it was)."""
        ctx = self._context()
        if not isinstance(state, LlamaState):
            raise InvalidArgumentError(f"load_state needs a LlamaState, got {type(state).__name__}")
        n = as_int("state.n_tokens", state.n_tokens, 0, self._n_ctx)
        with self._turns.lock:
            run_id = self._turns.take()
            try:
                ctx.load_state(bytes(state.llama_state))
                self.input_ids[:] = 0
                self.input_ids[:n] = np.asarray(state.input_ids, dtype=np.intc)[:n]
                rows = np.asarray(state.scores, dtype=np.float32)
                if self._keep_all and rows.shape[0] >= n and n:
                    self.scores[:n] = rows[:n]
                elif len(rows):
                    self.scores[-1 if not self._keep_all else n - 1] = rows[-1]
                self.n_tokens = n
                self._ends = {n - 1: self._row(n - 1).copy()} if n and len(rows) else {}  # the state's last logits
                self._requires_eval = True
                self._seed = state.seed
            finally:
                self._turns.give_back(run_id)


class _Completion:
    """One create_completion call: the prompt prepared (and checked) at the call, then run()
    yields the chunks of a stream, or one final response."""

    def __init__(self, llama: Llama, prompt, max_tokens, logprobs, echo, stop, model):
        llama._context()
        self.llama = llama
        if isinstance(prompt, (str, bytes)):
            text = prompt.decode("utf-8") if isinstance(prompt, bytes) else prompt
            m = llama._model
            bos = [m.token_bos()] if m.add_bos and m.token_bos() >= 0 else []
            self.ids = bos + (m.tokenize(text, add_bos=False, special=True) if text else [])
            self.prompt_text = text
        else:
            self.ids = llama._prompt_tokens(prompt)
            self.prompt_text = None
        if not self.ids:
            if llama.token_bos() < 0:
                raise InvalidArgumentError("the prompt is empty")
            self.ids = [llama.token_bos()]
        n_ctx = llama.n_ctx()
        if len(self.ids) >= n_ctx:
            raise ContextFullError(f"Requested tokens ({len(self.ids)}) exceed context window of {n_ctx}")
        if max_tokens is None or as_int("max_tokens", max_tokens) <= 0:
            max_tokens = n_ctx - len(self.ids)
        self.max_tokens = min(max_tokens, n_ctx - len(self.ids))
        self.logprobs = None if logprobs is None else as_int("logprobs", logprobs, 0)
        self.echo = bool(echo)
        if self.echo and self.logprobs is not None and not llama._logits_all:
            raise InvalidArgumentError("logprobs with echo=True (the prompt's log-probabilities) needs a Llama "
                                       "created with logits_all=True")
        self.stops = stop_list(list(stop) if isinstance(stop, tuple) else stop)
        self.model = model if model is not None else llama.model_path
        self.id, self.created = completions.new_id("cmpl")

    def _head(self) -> str:
        if not self.echo:
            return ""
        if self.prompt_text is not None:
            return self.prompt_text
        return self.llama.detokenize(self.ids).decode("utf-8", errors="ignore")

    def _load_cached(self) -> None:
        """Loads the cached state that shares the longest prefix with the prompt, where it shares
        more than the context; one that does not load (damaged) is a miss."""
        llama, cache = self.llama, self.llama.cache
        try:
            item = cache[(llama._cache_name, *self.ids)]
        except KeyError:
            return
        if common_prefix(item.input_ids[:item.n_tokens].tolist(), self.ids) > \
                common_prefix(llama._input_ids.tolist(), self.ids):
            with contextlib.suppress(StateMismatchError, FormatError, ContextFullError, InvalidArgumentError):
                llama.load_state(item)

    def _prompt_logprobs(self) -> dict:
        """The echoed prompt's tokens (a leading BOS left out); the first has no log-probability."""
        llama = self.llama
        out = {key: [] for key in LOGPROB_KEYS}
        start = 1 if self.ids[0] == llama.token_bos() else 0
        offset = 0
        for pos in range(start, len(self.ids)):
            token = self.ids[pos]
            text = token_text(llama._model, token)
            if pos == start:
                lp, top = None, None
            else:
                _t, lp, top = token_logprob(llama._model, llama.scores[pos - 1], token, self.logprobs)
            for key, value in zip(LOGPROB_KEYS, (text, offset, lp, top)):
                out[key].append(value)
            offset += len(text)
        return out

    def _chunk(self, text: str, finish_reason, logprobs=None) -> dict:
        return completions.completion(self.id, self.created, self.model, text, finish_reason, None, logprobs)

    def run(self, sampler: TokenSampler, stopping_criteria, stream: bool):
        llama = self.llama
        if llama.cache is not None:
            self._load_cached()
        head = self._head()
        out = TextStream(llama._model, self.stops, self.logprobs,
                         len(head) if self.echo else len(self.prompt_text or ""))
        finish = "length"
        run = Run(prompt_tokens=len(self.ids))  # for innerq run/chat's statistics
        llama.last_run = run
        t0 = time.perf_counter()
        tokens = llama._token_stream(list(self.ids), sampler, True, stopping_criteria)
        if stream and head:
            yield self._chunk(head, None)
        for token in tokens:
            if not run.tokens:
                run.prompt_seconds, t0 = time.perf_counter() - t0, time.perf_counter()
            run.tokens.append(token)
            piece, step = out.push(token, sampler.last_row)
            if stream and (piece or step):
                yield self._chunk(piece, None, step)
            if out.finish_reason is not None:
                finish = out.finish_reason
                break
            if len(out.tokens) >= self.max_tokens:
                break
        else:
            if stopping_criteria is not None:
                finish = "stop"  # the generator ended: a stopping criterion (or a full context)
        tokens.close()
        run.completion_tokens, run.finish_reason = len(out.tokens), finish
        run.generate_seconds = time.perf_counter() - t0
        tail = out.finish()
        if stream and tail:
            yield self._chunk(tail, None)
        if llama.cache is not None:
            llama.cache[(llama._cache_name, *self.ids, *out.tokens)] = llama.save_state()
        if stream:
            yield self._chunk("", finish)
            return
        lp = out.logprobs
        if lp is not None and self.echo:  # the prompt's rows, now evaluated, come first
            lp = {key: values + lp[key] for key, values in self._prompt_logprobs().items()}
        use = completions.usage(len(self.ids), len(out.tokens))
        yield completions.completion(self.id, self.created, self.model, head + out.text, finish, use, lp)
