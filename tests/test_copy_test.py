"""tools/copy_test.py, a small version: random token sequences shown early in a context of
768 tokens and again at its end; the copies the greedy next token gets right, a cache against
f16 (the full run at SmolLM2's 8192 tokens: docs/ACCURACY.md, issue 29)."""
from __future__ import annotations

import os
import sys

import pytest

from conftest import ROOT, lib_path


@pytest.fixture(scope="module")
def run(smollm2):
    os.environ["INNERQ_LIB"] = lib_path()
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from copy_test import copy_accuracy, filler_tokens
    from innerq.gguf_model import Model

    with Model(smollm2) as model:
        filler = filler_tokens(model, ROOT / "tests/data/sense-and-sensibility.txt", 768)

        def accuracy(kv: str) -> float:
            correct, total, _ = copy_accuracy(model, {"kv_k": kv, "kv_v": kv, "n_threads": 2}, filler, 768, 4, 16, 0)
            assert total == 4 * 15
            return correct / total

        yield accuracy


def test_f16_copies_and_4_bits_keep_most_copies(run):
    f16 = run("f16")
    assert f16 >= 0.6  # induction: chance is 1 / 48,000
    assert run("innerq4") >= f16 - 0.1  # 60 predictions: 1.7 points each


@pytest.mark.xfail(strict=True, reason="at 768 tokens the preset is K3/V2 (its windows are at their floors, no "
                   "bytes left to spend on code bits), and 3-bit keys with 2-bit values lose copies of random tokens; "
                   "at SmolLM2's 8192, where it has 4-bit keys, it copies within 2 points of f16 (docs/ACCURACY.md)")
def test_the_preset_copies_within_2_points_of_f16(run):
    assert run("innerq") >= run("f16") - 0.02


def test_cache_specs_keep_parameters_with_their_cache():
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from copy_test import cache_params, cache_specs

    specs = cache_specs("f16,innerq@kv_bits=4.5,kv_sink=32,innerq4,innerq@kv_value_scales=0")
    assert specs == ["f16", "innerq@kv_bits=4.5,kv_sink=32", "innerq4", "innerq@kv_value_scales=0"]
    assert cache_params(specs[1]) == {"kv_k": "innerq", "kv_v": "innerq", "kv_bits": 4.5, "kv_sink": 32}
    layered = cache_specs("f16,innerq@kv_layer_bits=0:4:3;1:4:2,kv_sink=32")
    assert layered == ["f16", "innerq@kv_layer_bits=0:4:3;1:4:2,kv_sink=32"]
    assert cache_params(layered[1]) == {"kv_k": "innerq", "kv_v": "innerq", "kv_layer_bits": "0:4:3,1:4:2", "kv_sink": 32}
