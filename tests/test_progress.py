"""Progress of long work goes to stderr on a terminal and nowhere else: innerq-cli and
`innerq run` while a prompt longer than n_batch is evaluated, innerq-bench per test and
repetition. Each command runs twice, with stderr on a pseudo-terminal and on a pipe."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tiny_model
from conftest import ROOT, TEXT, lib_path, tool_path
from tiny_model import TinyConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(head_dim=64, seed=3))


@pytest.fixture(scope="module")
def long_prompt(tmp_path_factory):
    """About 400 tokens of the tiny models' byte-level vocabulary."""
    p = tmp_path_factory.mktemp("prompt") / "prompt.txt"
    p.write_bytes(TEXT.read_bytes()[2000:2400])
    return p


def on_terminal(cmd, env=None) -> tuple[int, str]:
    """Runs cmd with stderr on a pseudo-terminal; returns the exit status and what the terminal got."""
    master, slave = os.openpty()
    with open(os.devnull, "wb") as devnull:
        p = subprocess.Popen([str(c) for c in cmd], stdout=devnull, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    got = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        got += data
    os.close(master)
    return p.wait(timeout=300), got.decode("utf-8", "replace")


def piped(cmd, env=None) -> tuple[int, str]:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=300)
    return r.returncode, r.stderr


def test_cli_prompt_progress(tiny, long_prompt):
    cmd = [tool_path("innerq-cli"), "-m", tiny, "-f", long_prompt, "-b", 32, "-n", 2, "--temp", 0, "-t", 1]
    rc, term = on_terminal(cmd)
    assert rc == 0, term
    assert "innerq-cli: prompt 0/" in term and "innerq-cli: prompt 32/" in term and "\r" in term, term
    rc, err = piped(cmd)
    assert rc == 0 and "prompt 0/" not in err and "\r" not in err, err
    rc, term = on_terminal(cmd + ["-q"])
    assert rc == 0 and "prompt 0/" not in term, term
    # one piece (the prompt fits in a batch): nothing to show
    rc, term = on_terminal(cmd[:6] + [512] + cmd[7:])
    assert rc == 0 and "prompt 0/" not in term, term


def test_bench_progress(tiny):
    cmd = [tool_path("innerq-bench"), "-m", tiny, "-p", 16, "-n", 4, "-r", 2, "-t", 1]
    rc, term = on_terminal(cmd)
    assert rc == 0, term
    for line in ("test 1/2 (pp16, innerq/innerq): warmup", "test 1/2 (pp16, innerq/innerq): run 2/2",
                 "test 2/2 (tg4, innerq/innerq): run 1/2"):
        assert f"innerq-bench: {line}" in term, (line, term)
    rc, err = piped(cmd)
    assert rc == 0 and err == "", err
    rc, term = on_terminal(cmd + ["-q"])
    assert rc == 0 and "run 1/2" not in term, term


def test_innerq_run_prompt_progress(tiny, long_prompt):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "INNERQ_LIB": lib_path()}
    cmd = [sys.executable, "-m", "innerq", "run", tiny, "-p", long_prompt.read_text(), "-b", 32, "-n", 2,
           "--temp", 0, "-t", 1]
    rc, term = on_terminal(cmd, env)
    assert rc == 0, term
    assert "innerq: prompt of " in term and "] 100%" in term, term
    rc, err = piped(cmd, env)
    assert rc == 0 and "innerq: prompt of" not in err, err
    rc, term = on_terminal(cmd + ["-q"], env)
    assert rc == 0 and "innerq: prompt of" not in term, term
