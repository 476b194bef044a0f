"""tests/llama_cpp_compat_script.py, written for llama-cpp-python, runs unchanged on innerq;
where llama-cpp-python is installed, both give the same shapes (and the same greedy text)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "llama_cpp_compat_script.py"

try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)


def run_script(model, impl: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run([sys.executable, str(SCRIPT), str(model), impl], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_script_runs_unchanged_on_innerq(smollm2):
    import gguf

    got = run_script(smollm2, "innerq")
    fields = gguf.GGUFReader(str(smollm2)).fields
    assert got["chat_object"] == "chat.completion"
    assert got["n_ctx"] == 512 and got["n_vocab"] == len(fields["tokenizer.ggml.tokens"].contents())
    assert got["eos"] == fields["tokenizer.ggml.eos_token_id"].contents()
    for usage in (got["completion_usage"], got["chat_usage"]):
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert got["chat"] and got["chat_streamed"] == got["chat"]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_same_results_as_llama_cpp(smollm2):
    ours, theirs = run_script(smollm2, "innerq"), run_script(smollm2, "llama_cpp")
    assert ours["completion_usage"]["prompt_tokens"] == theirs["completion_usage"]["prompt_tokens"]
    assert ours["chat_usage"]["prompt_tokens"] == theirs["chat_usage"]["prompt_tokens"]
    assert (ours["n_ctx"], ours["n_vocab"], ours["eos"]) == (theirs["n_ctx"], theirs["n_vocab"], theirs["eos"])
