"""Sliding-window layers of a quantized cache keep no blocks (docs/DESIGN.md 3.6).

Gemma 3's local layers attend to the last n_swa positions only. With the default windows the
recent window holds the sliding window and one block more (R >= n_swa + G), so every position a
local layer reads is in its f16 sink or window: such a layer stores no quantized blocks, its
cache is the windows alone, and the quantized cache goes to the global layers, where the context
is long. Checked here:
* every logit of a multi-sequence schedule (prompts read together, decoding steps, a copy, a
  cut, a sequence's state loaded into another slot) is the same bits as with the local layers
  keeping their blocks (tests/window_worker.py, the library's test switch), for the InnerQ and
  KIVI formats;
* the memory: the local layers' blocks are gone, no more and no less;
* a rewind keeps what a local layer can still read: back to n when its window keeps the n_swa - 1
  positions before n, else back to the sink, and the re-read continues as a fresh context does;
* the real Gemma 3 270M's cache at 32K tokens (when INNERQ_GEMMA3_GGUF names the file).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tiny_model
from conftest import BUILD, ROOT
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from innerq._native import ContextHandle, ModelHandle  # noqa: E402

TEST_LIB = BUILD / "libinnerq_test.so"
N_SWA = 24


def gemma(tmp_path, swa_pattern: int = 2, name: str = "g.gguf"):
    """4 layers; swa_pattern 2: layers 0 and 2 local, 4: layers 0, 1, 2 local."""
    cfg = TinyConfig(arch="gemma3", head_dim=64, n_head=2, n_head_kv=1, embd=96, n_layer=4, sliding_window=N_SWA,
                     swa_pattern=swa_pattern, rope_base_swa=1000.0, seed=7)
    return tiny_model.write_tiny_model(tmp_path / name, cfg)


def worker(path, cache: dict) -> dict:
    env = dict(os.environ, INNERQ_LIB=str(TEST_LIB))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "window_worker.py"), str(path), json.dumps(cache)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


CACHES = {
    "innerq": {"kv_k": "innerq"},
    "innerq G32": {"kv_k": "innerq", "kv_group": 32, "kv_sink": 8, "kv_recent": 32},
    "innerq4/innerq2": {"kv_k": "innerq4", "kv_v": "innerq2"},
    "kivi2": {"kv_k": "kivi2", "kv_group": 32},
}


@pytest.mark.skipif(not TEST_LIB.exists(), reason="libinnerq_test.so is not built")
@pytest.mark.parametrize("name", CACHES)
def test_local_layers_keep_no_blocks_and_the_logits_do_not_change(tmp_path, name):
    got = worker(gemma(tmp_path), CACHES[name])
    assert got["equal"], got["max_diff"]
    kept, only = got["n_quant"]
    assert all(n > 0 for n in kept), kept          # blocks were flushed on every layer
    assert only[0] == only[2] == 0 and only[1] == kept[1] and only[3] == kept[3], only
    assert got["kept"][0] == got["kept"][1]         # a cut of three tokens keeps them on every layer
    assert got["memory"][1]["bytes"] < got["memory"][0]["bytes"]
    assert got["memory"][1]["bits"] < got["memory"][0]["bits"]
    assert got["seq_state"][1] < got["seq_state"][0] and got["state"][1] < got["state"][0]
    assert got["cross_load"] != "loaded" and "state" in got["cross_load"].lower(), got["cross_load"]


@pytest.mark.skipif(not TEST_LIB.exists(), reason="libinnerq_test.so is not built")
def test_the_memory_saved_is_the_local_layers_blocks(tmp_path):
    """Two local layers of four save 2 B, three save 3 B: B, one layer's blocks, is the same."""
    two = worker(gemma(tmp_path, 2, "two.gguf"), CACHES["innerq"])["memory"]
    three = worker(gemma(tmp_path, 4, "three.gguf"), CACHES["innerq"])["memory"]
    assert two[0]["bytes"] == three[0]["bytes"]
    saved2, saved3 = two[0]["bytes"] - two[1]["bytes"], three[0]["bytes"] - three[1]["bytes"]
    assert saved2 > 0 and saved2 % 2 == 0 and saved2 // 2 * 3 == saved3, (saved2, saved3)


def tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def test_a_rewind_keeps_what_the_local_layers_can_read(tmp_path):
    """300 tokens in batches of 32: sink S 32, R 96 (the floor; >= n_swa + G = 88), 128 tokens
    in blocks, 140 in the window. A cut at n keeps n while the window keeps the n_swa - 1
    positions before n; a deeper one goes back to the sink (a block cut keeps it too)."""
    m = ModelHandle.load(gemma(tmp_path))
    hist = tokens(300, 1)
    ctx = ContextHandle.init(m, n_ctx=512, n_batch=32, n_threads=2, kv_k="innerq")
    ctx.decode(hist)
    mem = ctx.kv_memory()
    S, Q = mem["n_sink"], ctx.layer_info(1)["n_quant"]
    assert (S, mem["n_recent"], Q, ctx.layer_info(0)["n_quant"]) == (32, 96, 128, 0)
    state = ctx.save_state()

    def expected(n):
        if n <= S or n >= S + Q + N_SWA - 1:
            return n
        return S

    for n in [299, 250, S + Q + N_SWA - 1, S + Q + N_SWA - 2, S + Q, 170, 100, 33, 32, 20, 0]:
        ctx.load_state(state)
        assert ctx.truncate(n) == expected(n), n
    # the re-read after going back to the sink continues as a fresh context fed the same calls
    ctx.load_state(state)
    assert ctx.truncate(S + Q + 5) == S
    more = tokens(40, 2)
    ctx.decode(hist[S:S + Q + 5] + more)
    fresh = ContextHandle.init(m, n_ctx=512, n_batch=32, n_threads=2, kv_k="innerq")
    fresh.decode(hist[:S])
    fresh.decode(hist[S:S + Q + 5] + more)
    assert np.array_equal(ctx.logits(), fresh.logits())
    for t in tokens(8, 3):
        ctx.decode([t])
        fresh.decode([t])
        assert np.array_equal(ctx.logits(), fresh.logits())


def test_a_short_recent_window_keeps_the_blocks(tmp_path):
    """kv_recent below the sliding window: a local layer reads blocks, so it keeps them."""
    m = ModelHandle.load(gemma(tmp_path))
    ctx = ContextHandle.init(m, n_ctx=512, n_batch=32, n_threads=2, kv_k="innerq", kv_recent=16)
    ctx.decode(tokens(300, 1))
    assert ctx.layer_info(0)["n_quant"] == ctx.layer_info(1)["n_quant"] > 0


GEMMA = os.environ.get("INNERQ_GEMMA3_GGUF")


@pytest.mark.skipif(not GEMMA or not os.path.isfile(GEMMA or ""), reason="INNERQ_GEMMA3_GGUF is not set")
def test_gemma3_270m_cache_at_32k():
    """18 layers, 15 local with a window of 512: at 32K tokens the cache is the 3 global layers'
    blocks and every layer's windows; the CPU's default cache under 1/4 of the same cache with
    its local layers' blocks kept would be."""
    m = innerq.Llama(GEMMA, n_ctx=32768, verbose=False)
    mem = m.kv_memory
    assert mem["n_recent"] == 512 + 64
    hd, n_kv, n_layer = 256, 1, 18
    f16 = 2 * 32768 * hd * n_kv * n_layer * 2
    assert mem["bytes"] < f16 / 12, (mem["bytes"], f16)
