"""innerq against llama.cpp (llama-cpp-python); skipped where it isn't installed.

On SmolLM2-135M both engines get llama.cpp's token ids and an f16 cache; both multiply the Q4_1
weights against Q8-rounded activations, so their distributions should nearly coincide.
compare_llamacpp.py ppl-kld is checked on a tiny F32 model against an innerq-perplexity base
and against llama.cpp driven through llama-cpp-python's high-level API.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TEXT, lib_path, tool_path

pytest.importorskip("llama_cpp")
TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import compare_llamacpp as cmp  # noqa: E402
import tiny_model  # noqa: E402
from logit_stats import kl_divergence, top1_agreement  # noqa: E402
from test_perplexity import (FIRST, N_CTX, STEP, expected_statistics, final_estimate, log_softmax,  # noqa: E402
                             read_base, statistics)



@pytest.fixture(scope="module")
def llm(smollm2):
    return cmp.llama_open(str(smollm2), n_ctx=512, n_threads=2, kv="f16")


# A step where either engine's top two logits are closer than this is a near tie: the engines'
# activation rounding (KLD ~1e-3 between them) can order it either way, and so can two builds
# of llama.cpp (on "The capital of France is" innerq's 6th token's top two are 0.10 apart).
NEAR_TIE = 0.25


def top_two(scores) -> tuple[list[int], float]:
    scores = np.asarray(scores, dtype=np.float64)
    top = np.argsort(scores)[::-1][:2]
    return [int(t) for t in top], float(scores[top[0]] - scores[top[1]])


@pytest.mark.parametrize("text", ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"])
def test_greedy_tokens_agree(Session, smollm2, llm, text):
    """Greedy text equal to llama.cpp's up to the first near tie, where each engine's token is
    one of the other's top two; at least 4 tokens before it."""
    prompt = cmp.llama_tokens(llm, text)
    theirs = cmp.greedy_llama(llm, prompt, 16)
    llm.reset()
    llm.eval(prompt + theirs)
    with Session(smollm2, n_ctx=64, kv_k="f16", kv_v="f16") as s:
        ours = cmp.greedy_innerq(s, prompt, 16)
        s.clear()
        mine = s.eval(prompt + ours)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        top_l, gap_l = top_two(llm.scores[len(prompt) + i - 1])
        top_i, gap_i = top_two(mine[len(prompt) + i - 1])
        if min(gap_l, gap_i) < NEAR_TIE:
            assert i >= 4 and a in top_l and b in top_i, (i, a, b, top_l, top_i, gap_l, gap_i)
            return
        assert a == b, (i, ours, theirs)


def test_kl_divergence_on_austen(Session, smollm2, llm):
    tokens = cmp.passage(llm, str(TEXT), 512, offset=1000)
    llm.reset()
    llm.eval(tokens)
    base = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    with Session(smollm2, n_ctx=512, kv_k="f16", kv_v="f16") as s:
        ours = s.eval(tokens)
    kld = kl_divergence(base, ours)
    assert kld.mean() < 0.01, f"mean KLD {kld.mean():.4g}, max {kld.max():.4g}, top-1 {top1_agreement(base, ours):.3f}"


# ---- ppl-kld: innerq-perplexity --kl-divergence run by llama.cpp ----

CHUNK_ROW = re.compile(r"^ {0,3}\d+(?: +-?\d+\.\d+ ± +-?\d+\.\d+){3}(?: +-?\d+\.\d+ ± +-?\d+\.\d+ %){2}$")


def _stdout(cmd: list) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _llama_scored(model: Path, chunk_tokens: np.ndarray) -> np.ndarray:
    """llama.cpp's log-probs of the scored positions, through the high-level Llama class:
    first half in one eval, then one token per eval."""
    llm = cmp.llama_open(str(model), n_ctx=N_CTX, n_threads=1, kv="f16")
    rows = []
    for c in chunk_tokens:
        llm.reset()
        llm.eval([int(t) for t in c[:FIRST]])
        for t in c[FIRST:N_CTX - 1]:
            llm.eval([int(t)])
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64))
    return np.stack(rows)


def test_ppl_kld_on_an_innerq_base(tmp_path):
    model = tiny_model.write_tiny_model(tmp_path / "tiny.gguf",
                                        tiny_model.TinyConfig(head_dim=32, n_head_kv=2, seed=4))
    text = tmp_path / "austen.txt"
    text.write_bytes(TEXT.read_bytes()[:360])
    base = tmp_path / "base.kld"
    perplexity = tool_path("innerq-perplexity")
    base_out = _stdout([perplexity, "-m", model, "-f", text, "-c", N_CTX, "-t", 1, "--kv", "f16",
                        "--kl-divergence-base", base])
    ours = _stdout([perplexity, "-m", model, "-t", 1, "--kv", "f16", "--kl-divergence-base", base, "--kl-divergence"])
    theirs = _stdout([sys.executable, TOOLS / "compare_llamacpp.py", "ppl-kld", "-m", model, "--base", base,
                      "--kv", "f16", "-t", 1])

    # the lines innerq-perplexity prints, parsed by the same expressions
    printed = statistics(theirs)
    assert {k: len(v) for k, v in printed.items()} == {k: len(v) for k, v in statistics(ours).items()}
    (_, _, _, n_chunks, _), tokens, records = read_base(base)
    for out in (ours, theirs):
        lines = out.splitlines()
        rows = [ln for ln in lines if CHUNK_ROW.match(ln)]
        assert len(rows) == n_chunks and lines[0].startswith("chunk ") and lines[1] == rows[0], out
    assert theirs.splitlines()[0] == ours.splitlines()[0]

    # PPL(base) is the base run's
    nll_b = records["nll"].ravel()
    np.testing.assert_allclose(printed["Mean PPL(base)"][0], math.exp(nll_b.mean()), rtol=1e-6)
    np.testing.assert_allclose(printed["Mean PPL(base)"][0], final_estimate(base_out)[0], atol=0.6e-4)

    # every statistic from llama.cpp's log-probs taken another way and the base as the file holds it
    lp_q = log_softmax(_llama_scored(model, tokens))
    lp_b = records["lo"].reshape(-1, 1) + STEP * records["code"].reshape(len(nll_b), -1)
    lp_b -= np.log(np.exp(lp_b).sum(axis=-1, keepdims=True))
    nll_q = -lp_q[np.arange(len(nll_b)), tokens[:, FIRST + 1:].ravel()]
    kld = (np.exp(lp_b) * (lp_b - lp_q)).sum(axis=-1)
    # F32 weights and f16 caches in both engines: they differ only in rounding inside attention
    # (llama.cpp's CPU flash attention works partly in f16; about 1e-7 here) and in the order of operations
    assert kld.mean() < 1e-6 and printed["Mean    KLD"][0] < 1e-6, kld.mean()
    expected = expected_statistics(nll_q, nll_b, kld, np.exp(-nll_q) - np.exp(-nll_b),
                                   lp_q.argmax(axis=-1) == records["top"].ravel())
    for label, values in expected.items():
        decimals = 2 if label.startswith("Cor") else 3 if "Δp" in label or "top" in label else 6
        # ppl-kld scores in batches, _llama_scored one token at a time: float rounding, about 1e-5
        # nats per token, which is 1e-5 * PPL in the differences of PPLs
        noise = 1e-5 * (math.exp(nll_b.mean()) if "PPL(Q)-" in label else 1.0)
        np.testing.assert_allclose(printed[label], values, rtol=1e-4, atol=max(0.6 * 10 ** -decimals, noise),
                                   err_msg=label)


def test_single_bytes_round_trip_at_least_as_llama_cpp(smollm2):
    """Every byte value alone, tokenized and detokenized: innerq loses only the bytes the
    vocabulary has no token for (innerq.h says which), and so never more than llama.cpp, which
    also turns every byte that is not valid UTF-8 on its own into U+FFFD before tokenizing."""
    import llama_cpp

    os.environ["INNERQ_LIB"] = lib_path()
    from innerq import Llama

    ref = llama_cpp.Llama(str(smollm2), vocab_only=True, verbose=False)
    with Llama(str(smollm2), n_ctx=64) as llm:
        lost_iq = {b for b in range(256) if llm.detokenize(llm.tokenize(bytes([b]), add_bos=False)) != bytes([b])}
    lost_ref = {b for b in range(256)
                if ref.detokenize(ref.tokenize(bytes([b]), add_bos=False, special=False)) != bytes([b])}
    assert lost_iq <= lost_ref
    # SmolLM2's vocabulary has no token for these 21 bytes, alone or in a merge
    assert lost_iq == {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}


# ---- the other architectures: tiny random models, the same file in both engines ----

# F32 weights and f16 caches: the engines differ by float rounding only (llama.cpp's CPU flash
# attention works partly in f16, its GELU reads a table of f16 inputs). Measured over 300
# tokens: max |logit difference| 7.5e-4 (qwen2, qwen3), 1.2e-3 (llama, phi3, phi3 with LongRoPE),
# 1.3e-3 (qwen3 with YaRN), 1.8e-3 (gemma3 with linear scaling), 2.8e-3 (gemma3), 7.4e-4 and
# 8.2e-4 (phi3 with 3/4 or 1/2 of each head rotated, LongRoPE's attn_factor or YaRN's mscale:
# scaling every channel instead would be 0.59 away), mean KLD 1e-9 to 5e-8. (llama.cpp's llama
# and qwen3 graphs assert that every channel is rotated: the partly rotated ones are phi3.)
ARCH_BOUNDS = {"llama": 3e-3, "qwen2": 2e-3, "qwen3": 2e-3, "phi3": 3e-3, "gemma3": 6e-3, "qwen3-yarn": 3e-3,
               "gemma3-linear": 6e-3, "phi3-longrope": 3e-3, "phi3-partial-longrope": 3e-3, "phi3-yarn-partial": 3e-3}


@pytest.mark.parametrize("arch", ARCH_BOUNDS)
def test_architectures_logits_match_llama_cpp(Session, tmp_path, arch):
    from test_archs import KLD_MODELS, prompt

    model = str(tiny_model.write_tiny_model(tmp_path / f"{arch}.gguf", KLD_MODELS[arch]))
    llm = cmp.llama_open(model, n_ctx=512, n_threads=2, kv="f16")
    tokens = prompt(llm.n_vocab(), 300, seed=1)
    llm.reset()
    llm.eval(tokens)
    theirs = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    with Session(model, n_ctx=512, kv_k="f16", kv_v="f16") as s:
        ours = s.eval_one_by_one(tokens)
    diff = np.abs(ours - theirs).max()
    kld = kl_divergence(theirs, ours).mean()
    assert diff < ARCH_BOUNDS[arch] and kld < 1e-6, (diff, kld)
