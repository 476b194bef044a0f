"""Loading and freeing a model 50 times in one process does not grow its memory: the RSS
after the last round is within a few MiB of the RSS after the warm-up rounds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

GROWTH_LIMIT_MIB = 4.0


def test_load_free_50_times_does_not_grow_rss(smollm2):
    # Under a sanitizer build (tests/README.md) freed memory waits in ASan's quarantine, which
    # would read as growth: it is turned off (the option means nothing to other builds).
    asan = os.environ.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=0:thread_local_quarantine_size_kb=0"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "rss_loop.py"), str(smollm2), "-n", "50", "--json"],
                       env={**os.environ, "PYTHONPATH": str(ROOT / "python"), "ASAN_OPTIONS": asan.lstrip(":")},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["rounds"] == 50
    assert result["growth_mib"] < GROWTH_LIMIT_MIB, result


LAZY_PROBE = """
import json, sys
from innerq import Llama
from innerq._ffi import lib

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

base = rss_mib()
llm = Llama(sys.argv[1], n_ctx=int(sys.argv[2]), kv_type="f16", n_threads=1)
created = rss_mib() - base
llm.generate("The capital of France is", max_tokens=8, temperature=0)
print(json.dumps({"cache_mib": lib.innerq_cache_size(llm._ctx.ptr) / 2**20,
                  "created_mib": created, "used_mib": rss_mib() - base}))
"""


def test_plain_cache_is_committed_as_it_fills(smollm2):
    """A plain cache commits memory as tokens are written, not all of it when it is created
    (docs/MEMORY.md): a cache larger than the free memory is no OOM kill waiting to happen."""
    r = subprocess.run([sys.executable, "-c", LAZY_PROBE, str(smollm2), "32768"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "python")}, timeout=600)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["cache_mib"] > 700, m  # 30 layers x 3 KV heads x 64 x 2 bytes x 2 per token
    assert m["created_mib"] < 64 and m["used_mib"] < 200, m
