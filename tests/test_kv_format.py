"""The table of cache formats (src/kv-format.h), through its test-only row: src/kv-fmt-test.c
stores bf16 keys and values in pages of 64 tokens, and it is all a format needs (its file and
its row; the test builds compile it, the wheel does not).

* The format's name is a cache type of the test build, its pool has 64-token pages.
* Its logits under decode semantics are the numpy reference's with every key and value a query
  reads before its own rounded to bf16 (and not the reference's without that rounding).
* Sequences batched together get their logits alone, bit for bit, with their pages scattered
  through the pool; removing a sequence's last tokens and evaluating them again gives the same
  logits as the first time (decode semantics, float tolerance); a sequence's state moves to another context.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import reference
import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq._native import ContextHandle, ModelHandle, kv_types  # noqa: E402
from test_sequences import run  # noqa: E402

if "bf16" not in kv_types():
    if os.environ.get("INNERQ_LIB"):
        pytest.skip("INNERQ_LIB is a build without the test-only formats", allow_module_level=True)
    raise AssertionError("the test build has no test-only cache format (INNERQ_TEST_FORMATS)")

CFG = TinyConfig(head_dim=32, n_head=4, n_head_kv=2, n_layer=2, seed=21)
PAGE = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("fmt") / "m.gguf", CFG)


@pytest.fixture(scope="module")
def model(model_path):
    return ModelHandle.load(model_path)


def make(model, n_seq=4, n_ctx=1024, kv="bf16"):
    ctx = ContextHandle.init(model, n_ctx=n_ctx, n_seq_max=n_seq, n_batch=32, n_threads=2, kv_k=kv, kv_v=kv)
    ctx.set_batch_mode(False, False)
    return ctx


def toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest, ties to even), as float64."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def test_the_test_format_is_a_cache_type_with_its_pages(model):
    ctx = make(model)
    pool = ctx.pool()
    assert pool["page_tokens"] == PAGE
    assert pool["n_pages"] == 1024 // PAGE + 4 - 1
    ctx.decode_batch(toks(200, 1), [2] * 200)
    assert ctx.pool()["n_pages_used"] == -(-200 // PAGE)
    assert ctx.pool()["bytes"] == pool["bytes"]


def stored_attention(q, k, v):
    """Causal attention as a cache of bf16 rows under decode semantics gives it: each query reads
    the rows before its own rounded to bf16, its own row as computed (docs/DESIGN.md 3.4)."""
    n, n_head, d = q.shape
    group = n_head // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    kr, vr = bf16(k), bf16(v)
    scores = np.einsum("ihd,jhd->hij", q, kr)
    own = np.arange(n)
    scores[:, own, own] = np.einsum("ihd,ihd->hi", q, k)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores / np.sqrt(d), -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("hij,jhd->ihd", p, vr) + p[:, own, own].T[:, :, None] * (v - vr)
    return out.reshape(n, n_head * d)


def test_logits_are_the_reference_with_bf16_keys_and_values(model, model_path, monkeypatch):
    tokens = toks(150, 2)
    ctx = make(model, n_seq=1)
    ctx.set_batch_mode(False, True)
    got = []
    for i in range(0, len(tokens), 50):
        part = tokens[i:i + 50]
        ctx.decode_batch(part, [0] * len(part), logits=[True] * len(part))
        got += [ctx.logits(j) for j in range(len(part))]
    got = np.stack(got)
    w = reference.load(model_path)
    exact = reference.forward(w, tokens)
    monkeypatch.setattr(reference, "attention", stored_attention)
    want = reference.forward(w, tokens)

    def err(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    # the f32 sums' rounding: 1.0e-5 of the logits' scale with numpy 2.4.6's reference (an
    # earlier numpy stayed under 1e-5); rounding the cache to bf16 moves them 1.2e-3, which
    # the second bound keeps apart from it
    assert err(got, want) < 2e-5, err(got, want)
    assert err(exact, want) > 20 * err(got, want), (err(exact, want), err(got, want))


def test_batched_sequences_equal_each_alone_across_scattered_pages(model):
    # sequences growing in turns take pages in turns: each one's pages are scattered
    calls = [[(s, toks(40 + 7 * s, 10 + s)) for s in range(4)]]
    calls += [[(s, toks(1 + 30 * (k % 2), 100 * k + s)) for s in range(4)] for k in range(8)]
    together = run(make(model), calls)
    for s in range(4):
        alone = run(make(model), calls, only=s)[s]
        np.testing.assert_array_equal(together[s], alone, err_msg=f"sequence {s}")


def test_removing_and_evaluating_again_gives_the_same_logits(model):
    ctx = make(model, n_seq=2)
    ctx.set_batch_mode(False, True)  # decode semantics: a token's logits whatever the batches
    first = toks(300, 5)
    ctx.decode_batch(toks(90, 6), [0] * 90)  # the other sequence holds pages in between
    ctx.decode_batch(first, [1] * 300, logits=[True] * 300)
    want = np.stack([ctx.logits(i) for i in range(300)])
    for n in (299, 200, 128, 64, 63, 1):
        ctx.seq_rm(1, n, -1)
        assert ctx.seq_pos_max(1) == n - 1
        rest = first[n:]
        ctx.decode_batch(rest, [1] * len(rest), pos=list(range(n, 300)), logits=[True] * len(rest))
        got = np.stack([ctx.logits(i) for i in range(len(rest))])
        # float tolerance (docs/DESIGN.md 3.4): other batches sum the products in other orders;
        # a row read from the wrong page or lost would move logits by far more
        np.testing.assert_allclose(got, want[n:], rtol=0, atol=1e-4, err_msg=f"removed from {n}")


def test_a_sequence_state_moves_to_another_context(model):
    a, b = make(model, n_seq=2), make(model, n_seq=3)
    a.decode_batch(toks(150, 7), [1] * 150)
    b.decode_batch(toks(70, 8), [0] * 70)
    b.load_seq_state(2, a.save_seq_state(1))
    nxt = toks(3, 9)
    a.decode_batch(nxt, [1] * 3, pos=[150, 151, 152], logits=[True] * 3)
    b.decode_batch(nxt, [2] * 3, pos=[150, 151, 152], logits=[True] * 3)
    for i in range(3):
        np.testing.assert_array_equal(a.logits(i), b.logits(i))
