"""Threads sharing one Llama (or one C context) get the outputs of sequential use; contexts on
one model run in parallel (innerq.h, "Threads"; tests/test-threads.c for the C side)."""
from __future__ import annotations

import os
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


# ---- fork, the default thread count, and more threads than CPUs ----

def in_child(fn, timeout: float = 60.0) -> str:
    """fn() in a child made by fork(), its text back through a pipe; an error if the child
    fails, is killed or is still running after timeout seconds (the pool's workers did not
    follow it into the child)."""
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(w, fn().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child hung (> {timeout} s)")
        time.sleep(0.05)
    out = os.read(r, 1 << 16).decode()
    os.close(r)
    assert out, "the child failed"
    return out


@pytest.mark.parametrize("parent_generates", [False, True], ids=["loaded", "used"])
def test_a_forked_child_generates(smollm2, parent_generates):
    """innerq.h, "Threads": a child made by fork() after the parent loaded (and used) a Llama
    with the default threads generates as the parent does, and closes it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the pool has no workers to lose")
    llm = Llama(smollm2, n_ctx=128)
    try:
        want = llm.generate(PROMPTS[0], max_tokens=8, temperature=0) if parent_generates else None

        def child():
            text = llm.generate(PROMPTS[0], max_tokens=8, temperature=0)
            llm.close()
            return text

        got = in_child(child)
        assert got == (want or llm.generate(PROMPTS[0], max_tokens=8, temperature=0))
    finally:
        llm.close()


def pool_threads(code: str, env: dict | None = None) -> dict:
    """Runs code in a fresh interpreter where `Llama` and `lib` (the C library) are imported
    (numpy's threads started) and `threads()` counts the process's threads; returns the dict
    the code leaves in `out`."""
    import json
    import sys

    from conftest import ROOT

    prog = ("import json, os; from innerq import Llama; from innerq._ffi import lib\n"
            "threads = lambda: len(os.listdir('/proc/self/task'))\nout = {}\n" + code +
            "\nprint(json.dumps(out))")
    full = {**os.environ, "PYTHONPATH": str(ROOT / "python"), **(env or {})}
    r = subprocess.run([sys.executable, "-c", prog], env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def fake_cgroup(root, quota_us: int, period_us: int = 100000):
    """A cgroup tree under root whose CPU quota is quota_us per period_us, in the v2 and the v1
    layout, at every level of this process's cgroup path (cpu-count.c walks up to the root)."""
    root.mkdir()
    (root / "cpu.max").write_text(f"{quota_us} {period_us}\n")
    for line in open("/proc/self/cgroup").read().splitlines():
        _id, controllers, _path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            d = root / controllers
            d.mkdir(parents=True, exist_ok=True)
            (d / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
            (d / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return root


def default_workers(model, env=None, setup: str = "") -> int:
    """The worker threads a context with the default thread count starts."""
    code = f"{setup}\nn = threads()\nllm = Llama({str(model)!r}, n_ctx=64)\nout['workers'] = threads() - n"
    return pool_threads(code, env)["workers"]


def default_n_threads(env=None, setup: str = "") -> int:
    return pool_threads(f"{setup}\nout['n'] = lib.innerq_default_n_threads()", env)["n"]


def test_default_threads_follow_the_cgroup_quota(tmp_path, smollm2):
    """A CPU quota of one CPU makes the default one thread: the context starts no worker
    (9f85726 counted the online CPUs)."""
    one = {"INNERQ_CGROUP_ROOT": str(fake_cgroup(tmp_path / "one", 100000))}
    assert default_workers(smollm2, one) == 0
    assert default_n_threads(one) == 1
    # 1.5 CPUs of time round up to 2 (where the affinity mask has 2); no quota: the mask
    cpus = len(os.sched_getaffinity(0))
    assert default_n_threads({"INNERQ_CGROUP_ROOT": str(fake_cgroup(tmp_path / "1.5", 150000))}) == min(2, cpus)
    assert default_n_threads({"INNERQ_CGROUP_ROOT": str(tmp_path)}) == min(8, cpus)


def test_default_threads_follow_the_affinity_mask(smollm2):
    """Restricted to one CPU (taskset -c N), the default is one thread (9f85726: the online CPUs)."""
    one_cpu = f"os.sched_setaffinity(0, {{{min(os.sched_getaffinity(0))}}})"
    assert default_workers(smollm2, setup=one_cpu) == 0
    assert default_n_threads(setup=one_cpu) == 1


def test_no_more_pool_threads_than_cpus(smollm2):
    """n_threads=64 on a machine of fewer CPUs starts one thread per CPU: more would only
    take turns, and each barrier would wait for all of them (9f85726: 64 threads on 2 CPUs
    decoded 8 tokens in 107 s, 1 thread in 0.3 s)."""
    cpus = len(os.sched_getaffinity(0))
    if cpus >= 64:
        pytest.skip("64 CPUs or more")
    code = (f"n = threads()\nllm = Llama({str(smollm2)!r}, n_ctx=64, n_threads=64)\n"
            "out = {'workers': threads() - n, 'text': llm.generate('Hello', max_tokens=8, temperature=0)}")
    out = pool_threads(code)
    assert out["workers"] == cpus - 1
    assert out["text"]
