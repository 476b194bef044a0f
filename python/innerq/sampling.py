"""Sampler settings, one generation's sampler, and stop strings."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._ffi import ffi, lib
from ._native import DEFAULT_SEED, SamplerHandle, as_float, as_int, check
from .errors import InnerQError, InvalidArgumentError


@dataclass(frozen=True)
class Sampling:
    """What innerq_sampler_params holds; temperature <= 0 is greedy (argmax). The defaults are
    the C library's, applied by the callers (Llama's methods)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int | None  # None: the C default
    seed: int | None           # None or -1: from the clock

    def params(self, n_ctx: int):
        """The innerq_sampler_params; repeat_last_n = -1 means the whole context (n_ctx)."""
        p = ffi.new("innerq_sampler_params *", lib.innerq_sampler_default_params())
        p.temperature = as_float("temperature", self.temperature)
        p.top_k = as_int("top_k", self.top_k)
        p.top_p = as_float("top_p", self.top_p)
        p.min_p = as_float("min_p", self.min_p)
        p.repeat_penalty = as_float("repeat_penalty", self.repeat_penalty)
        if self.repeat_last_n is not None:
            n = as_int("repeat_last_n", self.repeat_last_n, -1)
            p.repeat_last_n = n_ctx if n == -1 else n
        p.seed = DEFAULT_SEED if self.seed is None or self.seed == -1 else as_int("seed", self.seed, 0, 2**64 - 1)
        return p

    def check(self) -> None:
        """InvalidArgumentError for a value out of range, as innerq-cli says it
        (innerq_sampler_params_check): before a model is loaded for them."""
        check(lib.innerq_sampler_params_check(self.params(0)))

    def sampler(self, n_ctx: int) -> SamplerHandle:
        """A C sampler (its params() checked by innerq_sampler_init)."""
        out = ffi.new("innerq_sampler **")
        check(lib.innerq_sampler_init(self.params(n_ctx), out))
        return SamplerHandle(out[0])


class TokenSampler:
    """One generation's sampling: the C sampler (penalty history, top-k/top-p/min-p, temperature,
    the seeded draw) with the steps it does not have done on a copy of the logits first
    (logits processors, frequency and presence penalties over the last `last_n` tokens), and a
    grammar matcher checked lazily as llama.cpp does: the drawn token is kept when the grammar
    accepts it, and only otherwise are the logits masked to the tokens it allows and the draw
    repeated. history: the tokens before the first draw (the last `last_n` go into the
    penalty history). keep_rows: keep last_row, the logits of the last draw (for logprobs)."""

    def __init__(self, sampling: Sampling, n_ctx: int, *, last_n: int, frequency_penalty=0.0, presence_penalty=0.0,
                 logits_processor=None, matcher=None, history=(), keep_rows: bool = False):
        self.c = sampling.sampler(n_ctx)
        self.last_n = last_n
        self.freq, self.pres = float(frequency_penalty or 0.0), float(presence_penalty or 0.0)
        self.processors = logits_processor
        self.matcher = matcher
        self.tok = ffi.new("innerq_token *")
        self.keep_rows = keep_rows
        self.last_row = None
        for t in history[max(0, len(history) - last_n):] if last_n > 0 else ():
            lib.innerq_sampler_accept(self.c.ptr, int(t))

    def _draw(self, logits: np.ndarray) -> int:
        check(lib.innerq_sampler_sample(self.c.ptr, ffi.cast("float *", ffi.from_buffer(logits)), logits.shape[0],
                                        self.tok))
        return int(self.tok[0])

    def sample(self, logits: np.ndarray, history: np.ndarray) -> int:
        """The next token after history (the tokens so far) from its logits (not modified)."""
        x = np.array(logits, dtype=np.float32)
        if self.keep_rows:
            self.last_row = x.copy()
        if self.processors:
            x = np.ascontiguousarray(self.processors(history, x), dtype=np.float32)
        if self.freq or self.pres:
            window = history[-self.last_n:] if self.last_n > 0 else history
            counts = np.bincount(window, minlength=x.shape[0])[:x.shape[0]].astype(np.float32)
            x -= counts * self.freq + (counts > 0) * self.pres
        token = self._draw(x)
        if self.matcher is not None and not self.matcher.accepts(token):
            allowed = self.matcher.allowed()
            if not allowed:
                raise InnerQError("the grammar allows no token here: the text cannot be continued")
            masked = np.full_like(x, -np.inf)
            masked[allowed] = x[allowed]
            token = self._draw(masked)
        return token

    def accept(self, token: int) -> None:
        lib.innerq_sampler_accept(self.c.ptr, token)
        if self.matcher is not None:
            self.matcher.accept(token)


def logit_bias_processor(logit_bias: dict, n_vocab: int):
    """A logits processor that adds logit_bias, {token id (or its decimal text): bias}, to the
    logits (OpenAI's and llama-cpp-python's logit_bias)."""
    if not isinstance(logit_bias, dict):
        raise InvalidArgumentError(f"logit_bias must be a map of token ids to biases, got {logit_bias!r}")
    bias = {}
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"logit_bias keys must be token ids, got {key!r}") from None
        bias[as_int("logit_bias token", token, 0, n_vocab - 1)] = as_float(f"logit_bias[{key!r}]", value)
    tokens = np.array(list(bias), dtype=np.int64)
    values = np.array(list(bias.values()), dtype=np.float32)

    def add_bias(_ids, scores):
        scores[tokens] += values
        return scores

    return add_bias


def stop_list(stop) -> list[str]:
    """stop as given by a caller (None, a string, or a list of strings) as a list."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (bytes, bytearray, memoryview)):  # iterating would give ints
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got bytes {bytes(stop)!r} "
                                   "(decode it)")
    try:
        items = list(stop)
    except TypeError:
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}") from None
    for s in items:
        if not isinstance(s, str):
            raise InvalidArgumentError(f"stop strings must be str, got {s!r}")
    return [s for s in items if s]


class StopMatcher:
    """Cuts a stream of text at the first occurrence of any stop string.

    Text that could be the beginning of a stop string is held back until the next piece
    shows whether it is, so a stop string split across tokens is still caught and never
    partly emitted."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self) -> str:
        """The text held back at the end of the stream (it did not become a stop string)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
