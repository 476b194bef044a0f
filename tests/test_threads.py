"""Threads sharing one Llama (or one C context) get the outputs of sequential use; contexts on
one model run in parallel (innerq.h, "Threads"; tests/test-threads.c for the C side)."""
from __future__ import annotations

import subprocess
import threading

import pytest

import tiny_model
from conftest import tool_path
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
from innerq import InnerQError, Llama  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, a small fox"]
ROUNDS = 20


def run_threads(fn, n: int = 2) -> list:
    """fn(i) on n threads at once; their results (or the exception one raised)."""
    results: list = [None] * n
    start = threading.Barrier(n)

    def body(i):
        start.wait()
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            results[i] = e

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


@pytest.fixture(scope="module")
def llm(smollm2):
    with Llama(smollm2, n_ctx=128, n_threads=1) as m:
        yield m


def test_two_threads_share_one_llama(llm):
    expected = [llm.generate(p, max_tokens=8, temperature=0) for p in PROMPTS]
    assert expected[0] != expected[1]
    results = run_threads(lambda i: [llm.generate(PROMPTS[i], max_tokens=8, temperature=0) for _ in range(ROUNDS)])
    for i, outs in enumerate(results):
        assert outs == [expected[i]] * ROUNDS, outs


def test_streams_of_two_threads_do_not_interleave(llm):
    expected = [llm.generate(p, max_tokens=8, temperature=0) for p in PROMPTS]

    def stream(i):
        outs = []
        for _ in range(ROUNDS // 4):
            pieces = llm.create_completion(PROMPTS[i], max_tokens=8, temperature=0, stream=True)
            outs.append("".join(c["choices"][0]["text"] for c in pieces))
        return outs

    for i, outs in enumerate(run_threads(stream)):
        assert outs == [expected[i]] * (ROUNDS // 4), outs


def test_an_abandoned_stream_gives_the_llama_back(llm):
    expected = llm.generate(PROMPTS[1], max_tokens=8, temperature=0)
    unstarted = llm.generate(PROMPTS[0], max_tokens=8, temperature=0, stream=True)
    started = llm.generate(PROMPTS[0], max_tokens=8, temperature=0, stream=True)
    next(started)
    del unstarted, started  # collected: another thread must not wait for them forever
    assert run_threads(lambda i: llm.generate(PROMPTS[1], max_tokens=8, temperature=0), 1) == [expected]


def test_a_stream_superseded_by_its_own_thread(llm):
    first = llm.generate(PROMPTS[0], max_tokens=8, temperature=0, stream=True)
    next(first)
    second = llm.generate(PROMPTS[1], max_tokens=8, temperature=0)  # does not wait for itself
    with pytest.raises(InnerQError, match="superseded"):
        list(first)
    assert run_threads(lambda i: llm.generate(PROMPTS[1], max_tokens=8, temperature=0), 1) == [second]


def test_two_llamas_in_parallel(smollm2):
    with Llama(smollm2, n_ctx=128, n_threads=1) as a, Llama(smollm2, n_ctx=128, n_threads=1) as b:
        llms = [a, b]
        expected = [llms[i].generate(p, max_tokens=8, temperature=0) for i, p in enumerate(PROMPTS)]
        results = run_threads(lambda i: [llms[i].generate(PROMPTS[i], max_tokens=8, temperature=0)
                                         for _ in range(ROUNDS // 4)])
        for i, outs in enumerate(results):
            assert outs == [expected[i]] * (ROUNDS // 4), outs


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_c_threads(which, request, tmp_path):
    """tests/test-threads.c: one context shared (lock held per generation, and single calls)
    and a context per thread on one model."""
    exe = tool_path("test-threads")
    if which == "tiny":
        model = tiny_model.write_tiny_model(tmp_path / "tiny.gguf", TinyConfig(head_dim=64, n_head_kv=2))
    else:
        model = request.getfixturevalue("smollm2")
    r = subprocess.run([exe, str(model), str(ROUNDS)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("passed"), r.stdout + r.stderr
