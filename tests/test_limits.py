"""Inputs without end or that grow without bound, under a 2 GB address-space cap (issue 33):
every face that reads a text or compiles a grammar stops with a clear error in bounded time,
instead of growing until the kernel kills it (9f85726: innerq-cli -f /dev/zero reached 23 GB).

The cap is RLIMIT_AS (as `prlimit --as=2147483648`); an allocation past it fails, so a face
that reads without a limit fails too, but with "out of memory" (or a traceback) after reading
2 GB, not with the limit's message."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest

from conftest import ROOT, tool_path

CAP = 2 << 30
LIMIT_MSG = "larger than 64 MiB, the most innerq reads as one text"


def capped(cmd, stdin=None, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """cmd run under the cap; (result, seconds)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    t0 = time.monotonic()
    with open(stdin, "rb") if stdin else open(os.devnull, "rb") as f:
        r = subprocess.run([str(c) for c in cmd], stdin=f, capture_output=True, text=True, errors="replace",
                           env=env, preexec_fn=cap, timeout=timeout)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("tool", ["innerq-cli", "innerq-perplexity"])
def test_c_tools_read_at_most_the_limit(tool, smollm2):
    r, seconds = capped([tool_path(tool), "-m", smollm2, "-f", "/dev/zero"])
    assert r.returncode == 1 and r.stderr.strip() == f"{tool}: error: cannot read '/dev/zero': it is {LIMIT_MSG}", \
        r.stderr
    assert seconds < 20


@pytest.mark.parametrize("command", ["run", "chat"])
def test_innerq_command_reads_at_most_the_limit(command, smollm2):
    """innerq run's prompt on stdin, and a line of innerq chat from a pipe."""
    r, seconds = capped([sys.executable, "-m", "innerq", command, smollm2, "-q"], stdin="/dev/zero")
    assert r.returncode == 1 and r.stderr.strip().endswith(LIMIT_MSG), r.stderr
    assert "Traceback" not in r.stderr
    assert seconds < 30
