"""llama-cpp-python's `llama_cache`: prompt caches for Llama.set_cache.

A cache maps the token sequence a state was saved after to the LlamaState. A lookup with a new
prompt returns the state whose tokens share the longest prefix with it; Llama then loads it
when that prefix is longer than what its context already shares with the prompt, and
evaluates only the rest. innerq's states hold the KV cache in its packed form (the InnerQ
regions quantized, not expanded), so a cache holds several times more of them per byte."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence, Tuple

from ._files import remove_stale_temporaries
from .errors import FormatError, InnerQIOError


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


# ---- states in files ----

STATE_MAGIC = b"IQSTATE\0"
STATE_VERSION = 1
_DIGEST = 16  # bytes of the BLAKE2b digest that ends a state file


def _state_key(key) -> tuple:
    """A cache key as stored: a tuple of ints, led by Llama's name of the model and cache
    configuration (a str)."""
    return tuple(k if isinstance(k, str) else int(k) for k in key)


def write_state_file(path, state, key=None) -> None:
    """Writes a LlamaState (and the cache key it is stored under, if any) to path, whole or not
    at all (innerq._files). Layout: STATE_MAGIC; uint32 version, header length; a JSON header
    (key, n_tokens, seed, the arrays' shapes, the C state's length); input_ids as int32, scores
    as float32, the C state; a BLAKE2b digest (16 bytes) of all before it. InnerQIOError if it
    cannot be written."""
    import numpy as np

    from ._files import write_whole

    ids = np.ascontiguousarray(state.input_ids, dtype="<i4")
    scores = np.ascontiguousarray(state.scores, dtype="<f4")
    blob = bytes(state.llama_state)
    header = json.dumps({"key": None if key is None else list(_state_key(key)), "n_tokens": int(state.n_tokens),
                         "seed": state.seed, "input_ids": list(ids.shape), "scores": list(scores.shape),
                         "llama_state": len(blob)}).encode()
    chunks = [STATE_MAGIC, struct.pack("<II", STATE_VERSION, len(header)), header, memoryview(ids).cast("B"),
              memoryview(scores).cast("B"), blob]
    digest = hashlib.blake2b(digest_size=_DIGEST)
    for c in chunks:
        digest.update(c)
    try:
        write_whole(path, chunks + [digest.digest()])
    except OSError as e:
        raise InnerQIOError(f"cannot write the state file {path}: {e}") from None


def _read_header(f, path) -> tuple[dict, int]:
    """The JSON header of a state file open at its start, and where the data begins."""
    head = f.read(len(STATE_MAGIC) + 8)
    if len(head) < len(STATE_MAGIC) + 8 or head[:len(STATE_MAGIC)] != STATE_MAGIC:
        raise FormatError(f"{path} is not an innerq state file")
    version, n = struct.unpack("<II", head[len(STATE_MAGIC):])
    if version != STATE_VERSION:
        raise FormatError(f"{path}: state file version {version} (this innerq reads {STATE_VERSION})")
    raw = f.read(n)
    try:
        header = json.loads(raw) if len(raw) == n else None
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or not isinstance(header.get("key"), (list, type(None))):
        raise FormatError(f"{path}: the state file's header is damaged")
    return header, len(head) + n


def read_state_key(path) -> tuple | None:
    """The cache key a state file was stored under (None: none), from its header alone."""
    with open(path, "rb") as f:
        key = _read_header(f, path)[0]["key"]
    if key is not None and not all(isinstance(k, (int, str)) for k in key):
        raise FormatError(f"{path}: the state file's header is damaged")
    return None if key is None else tuple(key)


def read_state_file(path):
    """(key, LlamaState) of a file write_state_file wrote; FormatError if it is damaged, cut
    short or not one; OSError (FileNotFoundError, ...) if it cannot be read."""
    import numpy as np

    from .llama import LlamaState

    with open(path, "rb") as f:
        header, start = _read_header(f, path)
        f.seek(0)
        data = f.read()
    body = memoryview(data)[:-_DIGEST]
    if len(data) < start + _DIGEST or hashlib.blake2b(body, digest_size=_DIGEST).digest() != data[-_DIGEST:]:
        raise FormatError(f"{path}: the state file is damaged or cut short (its digest does not match)")
    try:
        ids_shape, scores_shape = tuple(header["input_ids"]), tuple(header["scores"])
        n_blob = int(header["llama_state"])
        n_ids, n_scores = 4 * int(np.prod(ids_shape)), 4 * int(np.prod(scores_shape))
        if start + n_ids + n_scores + n_blob != len(body):
            raise ValueError("sizes")
        ids = np.frombuffer(body, "<i4", n_ids // 4, start).reshape(ids_shape).astype(np.intc)
        scores = np.frombuffer(body, "<f4", n_scores // 4, start + n_ids).reshape(scores_shape).astype(np.float32)
        blob = bytes(body[start + n_ids + n_scores:])
        state = LlamaState(input_ids=ids, scores=scores, n_tokens=int(header["n_tokens"]), llama_state=blob,
                           llama_state_size=len(blob), seed=header["seed"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{path}: the state file's header does not match its data ({e})") from None
    key = header["key"]
    return (None if key is None else tuple(key)), state


def default_cache_dir() -> Path:
    """Where LlamaDiskCache keeps states unless told: ~/.cache/innerq/prompt-cache."""
    return Path.home() / ".cache" / "innerq" / "prompt-cache"


class LlamaDiskCache(BaseLlamaCache):
    """States in files under cache_dir (default_cache_dir() by default), one file per state
    named after its key, least recently used removed first beyond capacity_bytes.

    * A file is written whole or not at all (write_state_file): a crash or kill -9 while one
      is written leaves the folder as it was.
    * An entry that is missing, damaged or cut short when it is read is a miss (a damaged one is
      removed); Llama's keys begin with the model's fingerprint and its cache configuration,
      so the states of other models or configurations in the same folder are never found.
    * Several processes may share one folder: there is no index to keep in step; each lists the
      folder when it looks for a key (reading the key of a file it has not seen before), and
      recency is a file's modification time, renewed on each hit. A writer removes what killed
      writers left (temporary files an hour old).
    llama-cpp-python uses the diskcache package for this; plain files need no dependency."""

    SUFFIX = ".iqstate"

    def __init__(self, cache_dir: str | os.PathLike | None = None, capacity_bytes: int = (2 << 30)):
        super().__init__(capacity_bytes)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InnerQIOError(f"cache directory {self.cache_dir}: {e}") from None
        self._seen: dict[str, tuple] = {}  # file name -> key, of the entries read so far

    def _name(self, key: tuple) -> str:
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest() + self.SUFFIX

    def _remove(self, name: str) -> None:
        self._seen.pop(name, None)
        with contextlib.suppress(OSError):
            (self.cache_dir / name).unlink()

    def _entries(self) -> list:
        """The entries in the folder now (DirEntry)."""
        try:
            return [e for e in os.scandir(self.cache_dir) if e.name.endswith(self.SUFFIX)]
        except OSError:
            return []

    def _keys(self):
        names = {e.name for e in self._entries()}
        for gone in self._seen.keys() - names:
            del self._seen[gone]
        for name in names - self._seen.keys():
            try:
                key = read_state_key(self.cache_dir / name)
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            except (FormatError, OSError):
                self._remove(name)
                continue
            if key is not None:
                self._seen[name] = key
        return list(self._seen.values())

    @property
    def cache_size(self) -> int:
        total = 0
        for e in self._entries():
            with contextlib.suppress(OSError):
                total += e.stat().st_size
        return total

    def __getitem__(self, key: Sequence[int]):
        found = self._lookup(_state_key(key))
        name = self._name(found)
        path = self.cache_dir / name
        try:
            stored, value = read_state_file(path)
        except FileNotFoundError:
            self._seen.pop(name, None)
            raise KeyError("Key not found") from None
        except (FormatError, OSError):
            self._remove(name)
            raise KeyError("Key not found") from None
        if stored != found:
            raise KeyError("Key not found")
        with contextlib.suppress(OSError):
            os.utime(path)
        return value

    def __setitem__(self, key: Sequence[int], value) -> None:
        key = _state_key(key)
        name = self._name(key)
        write_state_file(self.cache_dir / name, value, key)
        self._seen[name] = key
        remove_stale_temporaries(self.cache_dir)
        sizes = []
        for e in self._entries():
            with contextlib.suppress(OSError):
                st = e.stat()
                sizes.append((st.st_mtime, e.name, st.st_size))
        total = sum(size for _, _, size in sizes)
        for _mtime, old, size in sorted(sizes):
            if total <= self.capacity_bytes:
                break
            if old != name:  # the newest entry stays, as large as it may be
                self._remove(old)
                total -= size
