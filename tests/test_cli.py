"""innerq-cli and innerq-bench as a user runs them: exit codes, messages and output.

Usage errors exit with 2, every other failure with 1, each with one line
"PROG: error: ..." on stderr. Generation is checked against llama.cpp (through
llama-cpp-python, where installed) and against the English of the Austen corpus.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, TEXT, tool_path

PROMPT = "The capital of France is"
SPEED = r"^{what}: (\d+) tokens, (\d+\.\d+) ms, (\d+\.\d+) t/s$"


def run(tool: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool_path(tool), *map(str, args)],
        capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=timeout,
    )


def assert_error(res: subprocess.CompletedProcess, tool: str, rc: int, *needles: str):
    assert res.returncode == rc, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def speed(stderr: str, what: str) -> int:
    m = re.search(SPEED.format(what=what), stderr, flags=re.M)
    assert m, stderr
    return int(m.group(1))


# ---- no model needed ----

@pytest.mark.parametrize("tool", ["innerq-cli", "innerq-bench"])
def test_help(tool):
    res = run(tool, "--help")
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.startswith("usage:")
    for flag in ["-m", "--kv-k", "--kv-v", "--kv-group", "--no-kv-norm", "--no-kv-debias", "--no-kv-norm-pairs"]:
        assert flag in res.stdout


def test_version():
    res = run("innerq-cli", "--version")
    assert res.returncode == 0
    assert re.match(r"innerq-cli \S+ \((scalar|avx2|avx512|neon|dotprod|i8mm)\)$", res.stdout.strip()), res.stdout


CLI_USAGE_ERRORS = [
    (["--bogus"], "--bogus"),
    (["-m"], "-m"),
    (["-m", "x.gguf", "-n"], "-n"),
    (["-m", "x.gguf", "-n", "abc"], "abc"),
    (["-m", "x.gguf", "-n", "12x"], "12x"),
    (["-m", "x.gguf", "-n", "-2"], "-n"),
    (["-m", "x.gguf", "-n", "99999999999"], "99999999999"),
    (["-m", "x.gguf", "--temp", "nan"], "nan"),
    (["-m", "x.gguf", "--temp", ""], "--temp"),
    (["-m", "x.gguf", "--top-p", "1.5"], "top_p = 1.5 is out of range"),
    (["-m", "x.gguf", "--min-p", "5"], "min_p = 5 is out of range"),
    (["-m", "x.gguf", "--repeat-penalty", "0"], "repeat_penalty = 0 must be > 0"),
    (["-m", "x.gguf", "--kv-rot", "7"], "kv_rot = 7 is out of range"),
    (["-m", "x.gguf", "--seed", "-5"], "-5"),
    (["-m", "x.gguf", "-t", "-3"], "-t"),
    (["-m", "x.gguf", "--kv-group", "x"], "--kv-group"),
    (["-m", "x.gguf", "stray"], "stray"),
    (["-m", "x.gguf", "-p", "a", "-f", "b.txt"], "-f"),
    (["-p", "hello"], "-m"),
]


@pytest.mark.parametrize("args,needle", CLI_USAGE_ERRORS)
def test_cli_usage_errors(args, needle):
    assert_error(run("innerq-cli", *args), "innerq-cli", 2, needle)


BENCH_USAGE_ERRORS = [
    (["-m", "x.gguf", "-p", "16,,32"], "-p"),
    (["-m", "x.gguf", "-p", "16,abc"], "abc"),
    (["-m", "x.gguf", "-d", "-1"], "-d"),
    (["-m", "x.gguf", "-r", "0"], "-r"),
    (["-m", "x.gguf", "-o", "xml"], "xml"),
    (["-m", "x.gguf", "-p", "0", "-n", "0"], "nothing to run"),
    (["-m", "x.gguf", "--kv", "innerq", "--kv-k", "f16"], "--kv"),
    (["-m", "x.gguf", "--frobnicate"], "--frobnicate"),
    (["-p", "16"], "-m"),
    # refused before the model is loaded, not by the library once the table has begun
    (["-m", "x.gguf", "--kv-k", "f16,bogus"], "unknown KV cache type 'bogus'"),
    (["-m", "x.gguf", "--kv-v", "q9"], "unknown KV cache type 'q9'"),
    (["-m", "x.gguf", "--kv", "innerq,nope"], "unknown KV cache type 'nope'"),
    (["-m", "x.gguf", "-b", "100000"], "-b must be in [1, 8192]"),
    (["-m", "x.gguf", "-d", "4194300", "-p", "512"], "the largest is 4194304"),
]


@pytest.mark.parametrize("args,needle", BENCH_USAGE_ERRORS)
def test_bench_usage_errors(args, needle):
    assert_error(run("innerq-bench", *args), "innerq-bench", 2, needle)


@pytest.mark.parametrize("tool", ["innerq-cli", "innerq-bench"])
def test_missing_model(tool, tmp_path):
    path = tmp_path / "no-such-model.gguf"
    args = ["-m", path, "-p", "hi"] if tool == "innerq-cli" else ["-m", path, "-p", "8", "-n", "0", "-r", "1"]
    assert_error(run(tool, *args), tool, 1, str(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("These are notes, not a model.\n" * 20)
    assert_error(run("innerq-cli", "-m", path, "-p", "hi"), "innerq-cli", 1)


def test_missing_prompt_file(smollm2, tmp_path):
    path = tmp_path / "no-such-prompt.txt"
    assert_error(run("innerq-cli", "-m", smollm2, "-f", path), "innerq-cli", 1, str(path))


# ---- with the real model ----

def english_words(model) -> set[str]:
    """The words of the test text (one novel, 5,000 words) and the commonest English words: the
    whole-word tokens ("Ġword") among the first 4000 of the model's BPE vocabulary, whose order
    is that of the merges, most frequent first. Random tokens joined into letter runs pass the
    0.6 share below in none of 300 draws of 16."""
    import gguf

    tokens = gguf.GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].contents()[:4000]
    common = {t[1:].lower() for t in tokens if t.startswith("\u0120") and t[1:].isascii() and t[1:].isalpha()}
    return common | set(re.findall(r"[a-z]+", TEXT.read_text(encoding="utf-8", errors="replace").lower()))


def test_prompt_longer_than_context(smollm2):
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)
    res = run("innerq-cli", "-m", smollm2, "-c", "32", "-p", long_prompt, "-n", "4")
    assert_error(res, "innerq-cli", 1)
    assert "context" in res.stderr.lower()


def test_greedy_generation(smollm2):
    res = run("innerq-cli", "-m", smollm2, "-p", PROMPT, "-n", "16", "--temp", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(PROMPT)
    words = re.findall(r"[A-Za-z]+", res.stdout[len(PROMPT):])
    assert len(words) >= 4, res.stdout
    known = english_words(smollm2)
    assert sum(w.lower() in known for w in words) >= 0.6 * len(words), words
    n_prompt, n_eval = speed(res.stderr, "prompt eval"), speed(res.stderr, "eval")
    assert n_prompt >= 5  # five words, no fewer tokens
    assert 1 <= n_eval <= 15  # the 16th token is printed, not evaluated


def test_no_display_prompt_and_determinism(smollm2):
    common = ["-m", smollm2, "-p", PROMPT, "-n", "12", "-t", "1"]
    shown = run("innerq-cli", *common, "--temp", "0")
    hidden = run("innerq-cli", *common, "--temp", "0", "--no-display-prompt")
    assert shown.returncode == 0 and hidden.returncode == 0, (shown.stderr, hidden.stderr)
    assert shown.stdout == PROMPT + hidden.stdout
    # A fixed seed gives the same sampled text every time.
    sampled = [run("innerq-cli", *common, "--temp", "0.9", "--seed", "7", "--no-display-prompt") for _ in range(2)]
    assert sampled[0].returncode == 0, sampled[0].stderr
    assert sampled[0].stdout == sampled[1].stdout


def test_generate_until_context_end(smollm2):
    res = run("innerq-cli", "-m", smollm2, "-p", PROMPT, "-n", "-1", "-c", "24", "--temp", "0")
    assert res.returncode == 0, res.stderr
    assert speed(res.stderr, "prompt eval") + speed(res.stderr, "eval") <= 24


def test_prompt_from_file(smollm2, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    by_file = run("innerq-cli", "-m", smollm2, "-f", path, "-n", "6", "--temp", "0", "-t", "1")
    by_flag = run("innerq-cli", "-m", smollm2, "-p", PROMPT, "-n", "6", "--temp", "0", "-t", "1")
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == by_flag.stdout


def test_matches_llama_cpp(smollm2):
    """Greedy: the first generated word and the prompt's token count agree with llama.cpp."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(str(smollm2), n_ctx=128, n_threads=1, verbose=False)
    for prompt in [PROMPT, "Once upon a time, there was a little"]:
        want = ref.create_completion(prompt, max_tokens=8, temperature=0.0)["choices"][0]["text"]
        n_want = len(ref.tokenize(prompt.encode(), add_bos=True, special=True))  # BOS if the model wants it
        res = run("innerq-cli", "-m", smollm2, "-p", prompt, "-n", "8", "--temp", "0", "--no-display-prompt")
        assert res.returncode == 0, res.stderr
        assert re.findall(r"\w+", res.stdout)[:1] == re.findall(r"\w+", want)[:1], (res.stdout, want)
        assert speed(res.stderr, "prompt eval") == n_want


BENCH_FIELDS = {
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch", "n_threads", "type_k", "type_v",
    "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns", "samples_ts",
    "backend", "cpu_isa", "kv_n_ctx", "kv_bytes", "kv_effective_bits", "n_gpu_layers",
}


def test_bench_json(smollm2):
    res = run("innerq-bench", "-m", smollm2, "-p", "16", "-n", "4", "-r", "2", "-o", "json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows] == [(16, 0, 0), (0, 4, 0)]
    for r in rows:
        assert BENCH_FIELDS <= set(r), BENCH_FIELDS - set(r)
        assert r["model_filename"] == str(smollm2)
        assert r["model_size"] > 0 and r["model_n_params"] > 0
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 2
        n_tokens = r["n_prompt"] + r["n_gen"]
        for ns, ts in zip(r["samples_ns"], r["samples_ts"]):
            assert ns > 0 and ts == pytest.approx(n_tokens * 1e9 / ns, rel=1e-4)
        assert r["avg_ns"] == pytest.approx(sum(r["samples_ns"]) / 2, rel=1e-6, abs=1)
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2, rel=1e-4)
        # the context holds the test's tokens: its cache's bytes over their keys and values
        assert r["kv_n_ctx"] == n_tokens
        assert r["kv_effective_bits"] == pytest.approx(8 * r["kv_bytes"] / (2 * n_tokens * 30 * 3 * 64), rel=1e-5)


def test_bench_takes_a_list_of_gpu_layers(smollm2):
    """-ngl 0,15 as llama-bench: the model loaded once per value, an ngl column (JSON:
    n_gpu_layers) in every row; without a GPU the value is reported and the CPU runs it."""
    res = run("innerq-bench", "-m", smollm2, "-p", "8", "-n", "2", "-r", "1", "-ngl", "0,15")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:6] == ["model", "size", "params", "backend", "threads", "ngl"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [(r[5], r[9]) for r in rows] == [("0", "pp8"), ("0", "tg2"), ("15", "pp8"), ("15", "tg2")]
    res = run("innerq-bench", "-m", smollm2, "-p", "8", "-n", "0", "-r", "1", "-ngl", "0,15", "-o", "json")
    assert res.returncode == 0, res.stderr
    assert [r["n_gpu_layers"] for r in json.loads(res.stdout)] == [0, 15]


def test_bench_markdown_with_depth(smollm2):
    res = run("innerq-bench", "-m", smollm2, "-p", "8", "-n", "2", "-d", "0,16", "-r", "1", "--kv-k", "f16,q8_0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["model", "size", "params", "backend", "threads", "type_k", "type_v", "kv bits", "test", "t/s"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [(r[5], r[8]) for r in rows] == [
        (k, t) for k in ("f16", "q8_0") for t in ("pp8", "tg2", "pp8 @ d16", "tg2 @ d16")
    ]
    # the cache of a context of the test's tokens (2 to 24): f16's 16 bits and q8_0's 8.5 per
    # element, in a whole page of 64 tokens
    for r in rows:
        bits = 16.0 if r[5] == "f16" else 8.5
        ctx = sum(int(n) for n in re.findall(r"\d+", r[8]))
        assert float(r[7]) == pytest.approx(bits * 64 / ctx, rel=0.01), r
    assert all(re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", r[9]) for r in rows), rows
