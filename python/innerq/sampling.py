"""Sampler settings and stop strings."""
from __future__ import annotations

from dataclasses import dataclass

from ._ffi import ffi, lib
from ._native import DEFAULT_SEED, SamplerHandle, as_float, as_int, check
from .errors import InvalidArgumentError


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
