"""Prompt caches and state files (python/innerq/llama_cache.py): files written whole or not at
all, read back checked; a disk cache that treats a damaged, missing or foreign entry as a
miss, is keyed by the model and its cache configuration, and serves several processes."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tiny_model
from conftest import ROOT
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
from innerq import FormatError, InnerQIOError, Llama, LlamaDiskCache, LlamaState  # noqa: E402

PROMPT = "The Dashwoods had long been settled in Sussex"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return {s: tiny_model.write_tiny_model(root / f"tiny{s}.gguf", TinyConfig(head_dim=64, n_head_kv=2, seed=s))
            for s in (1, 2)}


def same_state(a: LlamaState, b: LlamaState) -> bool:
    return (a.n_tokens == b.n_tokens and a.seed == b.seed and bytes(a.llama_state) == bytes(b.llama_state)
            and np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.scores, b.scores))


def greedy(llm, prompt=PROMPT) -> str:
    return llm(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]


# ---- state files ----

def test_state_file_round_trip_and_damage(tiny, tmp_path):
    with Llama(tiny[1], n_ctx=64, logits_all=True, seed=7) as llm:
        llm.eval(llm.tokenize(PROMPT.encode()))
        state = llm.save_state()
    path = tmp_path / "s.iqstate"
    state.save(path)
    assert same_state(LlamaState.load(path), state)
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)  # states hold prompts
    raw = path.read_bytes()
    for bad in (raw[:-1], raw[:40], b"", raw[:100] + bytes([raw[100] ^ 1]) + raw[101:], b"x" * 200):
        path.write_bytes(bad)
        with pytest.raises(FormatError):
            LlamaState.load(path)
    with pytest.raises(InnerQIOError):
        LlamaState.load(tmp_path / "missing.iqstate")


KILLED_WRITER = """
import sys, numpy as np
from innerq import LlamaDiskCache, LlamaState
rng = np.random.default_rng(0)
state = LlamaState(input_ids=np.arange(4096, dtype=np.intc), scores=rng.standard_normal((256, 49152), np.float32),
                   n_tokens=4096, llama_state=rng.bytes(1 << 20), llama_state_size=1 << 20, seed=1)
kind, path = sys.argv[1], sys.argv[2]
cache = LlamaDiskCache(path) if kind == "cache" else None
write = (lambda: cache.__setitem__((1, 2, 3), state)) if cache else (lambda: state.save(path))
write()
print("ready", flush=True)
while True:
    write()
"""


@pytest.mark.parametrize("kind", ["cache", "state"])
def test_kill_9_while_writing_leaves_the_previous_file(kind, tmp_path):
    """A writer killed at a random moment of rewriting a 50 MB state (a disk-cache entry, a
    state file) leaves a whole earlier one (9f85726 rewrote cache entries in place: a half
    pickle that failed every later lookup)."""
    path = tmp_path / ("cache" if kind == "cache" else "s.iqstate")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    rnd = random.Random(3)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, kind, str(path)], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = LlamaDiskCache(path)[(1, 2, 3)] if kind == "cache" else LlamaState.load(path)
        assert state.n_tokens == 4096 and state.scores.shape == (256, 49152) and len(state.llama_state) == 1 << 20


# ---- the disk cache ----

def test_damaged_and_missing_entries_are_misses(tiny, tmp_path):
    cache = LlamaDiskCache(tmp_path / "cache")
    with Llama(tiny[1], n_ctx=128) as llm:
        want = greedy(llm)
        llm.set_cache(cache)
        assert greedy(llm) == want
        for f in (tmp_path / "cache").iterdir():  # cut short, as by a crash of an in-place write
            f.write_bytes(f.read_bytes()[:-10])
        llm.reset()
        assert greedy(llm) == want  # a miss: evaluated again, and stored again whole
        (entry,) = (tmp_path / "cache").glob("*.iqstate")
        LlamaState.load(entry)
        entry.unlink()  # removed behind the cache's back
        llm.reset()
        assert greedy(llm) == want


def test_models_and_configurations_sharing_a_folder_do_not_meet(tiny, tmp_path):
    """9f85726: the second model's chat calls failed with StateMismatchError."""
    folder = tmp_path / "shared"
    wants = {}
    for model, kv in ((tiny[1], "innerq"), (tiny[2], "innerq"), (tiny[1], "f16")):
        with Llama(model, n_ctx=128, kv_type=kv) as llm:
            wants[model, kv] = greedy(llm)
            llm.reset()
            llm.set_cache(LlamaDiskCache(folder))
            loads = []
            load = llm.load_state
            llm.load_state = lambda s: (loads.append(s), load(s))
            assert greedy(llm) == wants[model, kv]
            assert not loads  # the others' states, the same tokens, are not theirs
    assert len(list(folder.glob("*.iqstate"))) == 3


def test_the_default_folder_is_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert LlamaDiskCache().cache_dir == tmp_path / ".cache" / "innerq" / "prompt-cache"


TWO_PROCESSES = """
import sys
from innerq import Llama, LlamaDiskCache
with Llama(sys.argv[1], n_ctx=128) as llm:
    llm.set_cache(LlamaDiskCache(sys.argv[2], capacity_bytes=int(sys.argv[4])))
    for i in range(12):
        llm.reset()
        llm(f"{sys.argv[3]} {i % 5} and so on", max_tokens=2, temperature=0)
print("done")
"""


def test_two_processes_share_one_folder(tiny, tmp_path):
    """9f85726: FileNotFoundError on index.tmp once two processes wrote its index at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    folder = tmp_path / "cache"
    size = len(open(tiny[1], "rb").read()) // 40  # room for a few entries: evictions race too
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(tiny[1]), str(folder), who, str(size)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for who in ("Elinor", "Marianne")]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "done", err
    with Llama(tiny[1], n_ctx=128) as llm:
        want = greedy(llm, "Elinor 3 and so on")
        llm.set_cache(LlamaDiskCache(folder))
        assert greedy(llm, "Elinor 3 and so on") == want


def test_a_state_file_through_a_link_or_on_a_device(tmp_path):
    """A link is followed (its target replaced, the link kept); a device is written as it is,
    never replaced by a regular file."""
    import stat

    state = LlamaState(input_ids=np.arange(8, dtype=np.intc), scores=np.ones((1, 5), np.float32), n_tokens=8,
                       llama_state=b"\1\2\3", llama_state_size=3, seed=None)
    target, link = tmp_path / "real.iqstate", tmp_path / "link.iqstate"
    link.symlink_to(target)
    state.save(link)
    assert link.is_symlink() and same_state(LlamaState.load(target), state)
    state.save("/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
