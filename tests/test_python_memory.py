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
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "rss_loop.py"), str(smollm2), "-n", "50", "--json"],
                       env={**os.environ, "PYTHONPATH": str(ROOT / "python")}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["rounds"] == 50
    assert result["growth_mib"] < GROWTH_LIMIT_MIB, result
