"""llama-cpp-python's `llama_cache`: prompt caches for Llama.set_cache.

A cache maps the token sequence a state was saved after to the LlamaState. A lookup with a new
prompt returns the state whose tokens share the longest prefix with it; Llama then loads it
when that prefix is longer than what its context already shares with the prompt, and
evaluates only the rest. innerq's states hold the KV cache in its packed form (the InnerQ
regions quantized, not expanded), so a cache holds several times more of them per byte."""
from __future__ import annotations

import os
import pickle
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence, Tuple

from .errors import InnerQIOError


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BaseLlamaCache(ABC):
    """A cache of LlamaStates keyed by token sequences, bounded by capacity_bytes."""

    def __init__(self, capacity_bytes: int = (2 << 30)):
        self.capacity_bytes = capacity_bytes

    @property
    @abstractmethod
    def cache_size(self) -> int:
        raise NotImplementedError

    def _find_longest_prefix_key(self, key: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
        best, best_len = None, 0
        for k in self._keys():
            n = common_prefix(k, key)
            if n > best_len:
                best, best_len = k, n
        return best

    @abstractmethod
    def _keys(self):
        raise NotImplementedError

    def _lookup(self, key: Sequence[int]) -> Tuple[int, ...]:
        """The stored key sharing the longest prefix with key; KeyError where none shares one."""
        found = self._find_longest_prefix_key(tuple(key))
        if found is None:
            raise KeyError("Key not found")
        return found

    @abstractmethod
    def __getitem__(self, key: Sequence[int]):
        raise NotImplementedError

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(tuple(key)) is not None

    @abstractmethod
    def __setitem__(self, key: Sequence[int], value) -> None:
        raise NotImplementedError


class LlamaRAMCache(BaseLlamaCache):
    """States in memory, least recently used dropped first beyond capacity_bytes."""

    def __init__(self, capacity_bytes: int = (2 << 30)):
        super().__init__(capacity_bytes)
        self.cache_state: "OrderedDict[Tuple[int, ...], object]" = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(state.llama_state_size for state in self.cache_state.values())

    def _keys(self):
        return self.cache_state.keys()

    def __getitem__(self, key: Sequence[int]):
        found = self._lookup(key)
        self.cache_state.move_to_end(found)
        return self.cache_state[found]

    def __setitem__(self, key: Sequence[int], value) -> None:
        key = tuple(key)
        self.cache_state.pop(key, None)
        self.cache_state[key] = value
        while self.cache_size > self.capacity_bytes and len(self.cache_state) > 0:
            self.cache_state.popitem(last=False)


# llama-cpp-python's name for the RAM cache of its first releases.
LlamaCache = LlamaRAMCache


class LlamaDiskCache(BaseLlamaCache):
    """States in files under cache_dir (one pickle per state and an index of the keys), least
    recently used removed first beyond capacity_bytes. llama-cpp-python uses the diskcache
    package for this; plain files need no extra dependency."""

    def __init__(self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = (2 << 30)):
        super().__init__(capacity_bytes)
        self.cache_dir = Path(cache_dir)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InnerQIOError(f"cache directory {cache_dir}: {e}") from None
        self._index_path = self.cache_dir / "index.pickle"
        self._index: "OrderedDict[Tuple[int, ...], str]" = OrderedDict()
        if self._index_path.exists():
            with open(self._index_path, "rb") as f:
                self._index = pickle.load(f)

    def _save_index(self) -> None:
        tmp = self._index_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(self._index, f)
        os.replace(tmp, self._index_path)

    @property
    def cache_size(self) -> int:
        return sum((self.cache_dir / name).stat().st_size for name in self._index.values()
                   if (self.cache_dir / name).exists())

    def _keys(self):
        return self._index.keys()

    def __getitem__(self, key: Sequence[int]):
        found = self._lookup(key)
        with open(self.cache_dir / self._index[found], "rb") as f:
            value = pickle.load(f)
        self._index.move_to_end(found)
        self._save_index()
        return value

    def __setitem__(self, key: Sequence[int], value) -> None:
        key = tuple(key)
        name = self._index.pop(key, None) or f"state-{uuid.uuid4().hex}.pickle"
        with open(self.cache_dir / name, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        self._index[key] = name
        while self.cache_size > self.capacity_bytes and len(self._index) > 1:
            _k, old = self._index.popitem(last=False)
            (self.cache_dir / old).unlink(missing_ok=True)
        self._save_index()
