"""innerq against llama.cpp (llama-cpp-python) on SmolLM2-135M; skipped where it isn't installed.

Both engines get llama.cpp's token ids and an f16 cache; both multiply the Q4_1 weights
against Q8-rounded activations, so their distributions should nearly coincide.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import lib_path

pytest.importorskip("llama_cpp")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import compare_llamacpp as cmp  # noqa: E402
from logit_stats import kl_divergence, top1_agreement  # noqa: E402

AUSTEN = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "austen.txt"


@pytest.fixture(scope="module")
def Session():
    os.environ["INNERQ_LIB"] = lib_path()
    from innerq_session import Session

    return Session


@pytest.fixture(scope="module")
def llm(smollm2):
    return cmp.llama_open(str(smollm2), n_ctx=512, n_threads=2, kv="f16")


def test_greedy_tokens_agree(Session, smollm2, llm):
    prompt = cmp.llama_tokens(llm, "The capital of France is")
    theirs = cmp.greedy_llama(llm, prompt, 8)
    with Session(smollm2, n_ctx=64, kv_k="f16", kv_v="f16") as s:
        ours = cmp.greedy_innerq(s, prompt, 8)
    assert ours == theirs


def test_kl_divergence_on_austen(Session, smollm2, llm):
    if not AUSTEN.is_file():
        pytest.skip(f"{AUSTEN} missing")
    tokens = cmp.passage(llm, str(AUSTEN), 512, offset=1000)
    llm.reset()
    llm.eval(tokens)
    base = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    with Session(smollm2, n_ctx=512, kv_k="f16", kv_v="f16") as s:
        ours = s.eval(tokens)
    kld = kl_divergence(base, ours)
    assert kld.mean() < 0.01, f"mean KLD {kld.mean():.4g}, max {kld.max():.4g}, top-1 {top1_agreement(base, ours):.3f}"
