"""llama-cpp-python's `llama_speculative`: draft models for Llama(draft_model=...).

A draft model proposes the tokens that may follow; Llama.generate evaluates them together with
the sampled token in one batch (logits for every position), keeps the longest run the
sampler agrees with, and rewinds the cache past the first disagreement. Prompt lookup needs
no second model: it proposes what followed the latest occurrence of the text's last n-gram."""
from __future__ import annotations

import abc
from typing import Any

import numpy as np
from numpy.lib import stride_tricks


class LlamaDraftModel(abc.ABC):
    @abc.abstractmethod
    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        raise NotImplementedError


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Proposes up to num_pred_tokens tokens that followed the first earlier occurrence of the
    last max_ngram_size (then shorter) tokens."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens

    @staticmethod
    def find_candidate_pred_tokens(input_ids: np.ndarray, max_ngram_size: int, num_pred_tokens: int) -> np.ndarray:
        ids = np.asarray(input_ids)
        n = ids.shape[0]
        for size in range(min(max_ngram_size, n - 1), 0, -1):
            tail = ids[n - size:]
            starts = np.flatnonzero(np.all(stride_tricks.sliding_window_view(ids, size) == tail, axis=1))
            for start in starts:
                begin = start + size
                end = min(begin + num_pred_tokens, n)
                if begin < end:  # the final occurrence (the tail itself) has nothing after it
                    return ids[begin:end]
        return np.array([], dtype=np.intc)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        return self.find_candidate_pred_tokens(input_ids, self.max_ngram_size, self.num_pred_tokens)
