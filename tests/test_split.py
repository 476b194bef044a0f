"""A model split between the CPU and a GPU (n_gpu_layers 1 .. n_layer, llama.cpp's -ngl N: the
last N layers on the GPU, the input and output layers and the rest on the CPU), one graph over
two backends (ggml_innerq/iq-sched.h).

On a machine without a GPU the split runs with a second CPU device in the GPU's place (the
library's test switch, tests/split_worker.py): the same graph cut, copies at the boundaries,
weights and KV cache per device. Every logit equals the CPU-only run's bit for bit, for each
cache format, many sequences, sequence copies, cuts and states, NEOX (reordered) weights and a
tied output. tests/test_cuda_model.py runs the split on a GPU against the CPU within the
GPU-vs-CPU floor.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tiny_model
from conftest import BUILD, ROOT
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

TEST_LIB = BUILD / "libinnerq_test.so"
pytestmark = pytest.mark.skipif(not TEST_LIB.exists(), reason="libinnerq_test.so is not built")

G = {"kv_group": 32, "kv_sink": 8, "kv_recent": 16}
CACHES = [{"kv_k": "f16"}, {"kv_k": "q4_0"}, {"kv_k": "innerq", **G}, {"kv_k": "innerq4", "kv_v": "innerq2", **G},
          {"kv_k": "kivi2", "kv_group": 32}]


def check_split(tmp_path, model, cases):
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, INNERQ_LIB=str(TEST_LIB))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "split_worker.py"), str(model), str(spec)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == sum(len(c["ngl"]) for c in cases) and all(ln.startswith("equal") for ln in lines), r.stdout


@pytest.mark.parametrize("n_batch", [24, 64], ids=["batches", "offloaded-prompt"])
@pytest.mark.parametrize("cache", CACHES, ids=lambda c: "/".join(str(v) for v in c.values()))
def test_split_equals_the_cpu(tmp_path, cache, n_batch):
    """n_batch 64: the prompt's first batch (64 tokens) runs the CPU layers' products on the
    other device (iq_sched_set_offload's rule, 32 columns and more), a weight copied over per
    product; batches of 24 and decoding steps stay on the CPU."""
    model = tiny_model.write_tiny_model(tmp_path / "m.gguf", TinyConfig(head_dim=64, n_head=4, n_head_kv=2,
                                                                        n_layer=4, seed=3))
    check_split(tmp_path, model, [{"ngl": [1, 2, 4], "cache": cache, "seqs": True, "n_batch": n_batch}])


@pytest.mark.parametrize("cfg", [TinyConfig(arch="qwen2", head_dim=64, n_head=4, n_head_kv=2, n_layer=3, seed=5),
                                 TinyConfig(wtype="Q8_0", tied=True, rope_freqs=True, head_dim=64, n_head=4,
                                            n_head_kv=2, n_layer=3, seed=6),
                                 TinyConfig(arch="gemma3", head_dim=64, n_head=4, n_head_kv=2, n_layer=3, seed=7,
                                            sliding_window=32, swa_pattern=2)],
                         ids=["qwen2", "q8_0-tied-rope_freqs", "gemma3"])
def test_split_equals_the_cpu_for_other_weights(tmp_path, cfg):
    model = tiny_model.write_tiny_model(tmp_path / "m.gguf", cfg)
    check_split(tmp_path, model, [{"ngl": [1, 3], "cache": {"kv_k": "innerq", **G}, "seqs": True},
                                  {"ngl": [2], "cache": {"kv_k": "f16"}, "seqs": False}])


def test_split_equals_the_cpu_on_smollm2(tmp_path, smollm2):
    check_split(tmp_path, smollm2, [{"ngl": [15, 30], "cache": {}, "seqs": False, "n_batch": 64}])


def test_kv_bits_with_a_split_is_a_clear_error(tmp_path):
    model = tiny_model.write_tiny_model(tmp_path / "m.gguf", TinyConfig(head_dim=64, n_layer=2))
    code = f"""
import cffi, os, sys
sys.path.insert(0, {str(ROOT / 'python')!r})
from innerq._native import ContextHandle, ModelHandle
from innerq.errors import UnsupportedError
f = cffi.FFI(); f.cdef("void device_test_split_on_cpu(_Bool on);")
f.dlopen(os.environ["INNERQ_LIB"]).device_test_split_on_cpu(True)
m = ModelHandle.load({str(model)!r}, n_gpu_layers=1)
try:
    ContextHandle.init(m, n_ctx=256, kv_bits=3.5)
except UnsupportedError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, INNERQ_LIB=str(TEST_LIB)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "kv_bits (the automatic layout) with the model's layers split" in r.stdout, r.stdout
