"""The text of a generation as a completion returns it, token by token: complete UTF-8
characters, cut before the first stop string, and each token's log-probabilities in the shape
of an OpenAI completion's `logprobs` (tokens, text_offset, token_logprobs, top_logprobs).
Llama's completions and the server's requests both read their tokens through it."""
from __future__ import annotations

import codecs

import numpy as np

from .sampling import StopMatcher

LOGPROB_KEYS = ("tokens", "text_offset", "token_logprobs", "top_logprobs")


def logits_to_logprobs(logits, axis: int = -1) -> np.ndarray:
    """log_softmax along axis, in float32; rows of -inf stay -inf rather than NaN."""
    x = np.asarray(logits, dtype=np.float32)
    top = np.amax(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0).astype(np.float32)
    shifted = x - top
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def token_text(model, token: int) -> str:
    """One token's text (the bytes of a partial UTF-8 character left out)."""
    return model.token_to_piece(token).decode("utf-8", errors="ignore")


def token_logprob(model, row: np.ndarray, token: int, n_top: int) -> tuple[str, float, dict]:
    """token's text and log-probability under the logits row, and the n_top likeliest tokens'
    (with token itself) as {text: log-probability}."""
    lp = logits_to_logprobs(row)
    text = token_text(model, token)
    top = {}
    for t in np.argsort(-lp, kind="stable")[:n_top]:
        top[token_text(model, int(t))] = float(lp[t])
    top[text] = float(lp[token])
    return text, float(lp[token]), top


class TextStream:
    """The generated text of one completion. push() each sampled token; finish() at the end.

    n_logprobs: how many likeliest tokens each token's logprobs entry lists (None: no
    logprobs); offset: where the generated text starts in the text the caller returns (after an
    echoed prompt), for text_offset. Text that may be the beginning of a stop string is held
    back until the next token shows whether it is."""

    def __init__(self, model, stops: list[str], n_logprobs: int | None = None, offset: int = 0):
        self.model = model
        self.stops = StopMatcher(stops)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self.n_logprobs = n_logprobs
        self.offset = offset
        self.text = ""
        self.tokens: list[int] = []  # the completion's tokens (an end-of-generation token is not one)
        self.logprobs = {key: [] for key in LOGPROB_KEYS} if n_logprobs is not None else None
        self.finish_reason: str | None = None  # "stop" at an end-of-generation token or a stop string

    def push(self, token: int, row: np.ndarray | None = None) -> tuple[str, dict | None]:
        """Adds a sampled token (row: the logits it was drawn from, for its logprobs); returns
        the text it completes and its logprobs entry (None without logprobs)."""
        if self.model.is_eog(token):
            self.finish_reason = "stop"
            return "", None
        self.tokens.append(token)
        piece = self.stops.feed(self.decoder.decode(self.model.token_to_piece(token)))
        step = None
        if self.logprobs is not None:
            text, lp, top = token_logprob(self.model, row, token, self.n_logprobs)
            step = {"tokens": [text], "text_offset": [self.offset + len(self.text)], "token_logprobs": [lp],
                    "top_logprobs": [top]}
            for key in LOGPROB_KEYS:
                self.logprobs[key] += step[key]
        self.text += piece
        if self.stops.stopped:
            self.finish_reason = "stop"
        return piece, step

    def finish(self) -> str:
        """The text held back at the end (nothing after a stop string)."""
        if self.stops.stopped:
            return ""
        tail = self.stops.feed(self.decoder.decode(b"", final=True)) + self.stops.finish()
        self.text += tail
        return tail
