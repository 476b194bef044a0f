"""Embeddings (context param `embeddings`): the final hidden state after the output norm, per
token and pooled, against the numpy reference forward pass (reference.hidden)."""
from __future__ import annotations

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

from innerq._ffi import lib  # noqa: E402
from innerq._native import ContextHandle, ModelHandle  # noqa: E402

CFG = TinyConfig(head_dim=32, n_head_kv=2, n_layer=2, seed=7)
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, 250, 37)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("embd") / "m.gguf", CFG)


@pytest.fixture(scope="module")
def ref(path):
    return reference.hidden(reference.load(path), TOKENS)


def rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("n_batch", [8, 64])
def test_per_token_embeddings_match_reference(path, ref, n_batch):
    """Pooling NONE (what a Llama GGUF gets by default, as in llama.cpp): every token's vector,
    across batches of one call."""
    m = ModelHandle.load(path)
    c = ContextHandle.init(m, n_ctx=64, n_batch=n_batch, kv_k="f32", embeddings=True)
    assert lib.innerq_pooling_type(c.ptr) == lib.INNERQ_POOLING_NONE
    c.decode(TOKENS)
    rows = c.embeddings()
    assert rows.shape == (len(TOKENS), CFG.n_embd)
    assert rel(rows, ref) < 1e-4
    assert rel(c.embeddings(5), ref[5]) < 1e-4
    assert rel(c.embeddings(-1), ref[-1]) < 1e-4
    # the logits are still the last token's
    logits = reference.forward(reference.load(path), TOKENS)[-1]
    assert rel(c.logits(), logits) < 1e-4


@pytest.mark.parametrize("pooling,pool", [(1, lambda h: h.mean(0)), (2, lambda h: h[0]), (3, lambda h: h[-1])])
def test_pooled_embeddings_match_reference(path, ref, pooling, pool):
    m = ModelHandle.load(path)
    c = ContextHandle.init(m, n_ctx=64, n_batch=16, kv_k="f32", embeddings=True, pooling=pooling)
    c.decode(TOKENS)
    got = c.embeddings()
    assert got.shape == (CFG.n_embd,)
    assert rel(got, pool(ref)) < 1e-4


def test_pooling_from_the_gguf(tmp_path, ref):
    """pooling UNSPECIFIED takes the file's llama.pooling_type (an embedding model's)."""
    p = tiny_model.write_tiny_model(tmp_path / "mean.gguf", TinyConfig(head_dim=32, n_head_kv=2, n_layer=2, seed=7,
                                                                       pooling_type=1))
    c = ContextHandle.init(ModelHandle.load(p), n_ctx=64, kv_k="f32", embeddings=True)
    assert lib.innerq_pooling_type(c.ptr) == lib.INNERQ_POOLING_MEAN
    c.decode(TOKENS)
    assert rel(c.embeddings(), ref.mean(0)) < 1e-4


def test_embeddings_of_the_last_call_only(path):
    m = ModelHandle.load(path)
    c = ContextHandle.init(m, n_ctx=64, kv_k="f32", embeddings=True, pooling=1)
    c.decode(TOKENS[:20])
    c.decode(TOKENS[20:])
    want = reference.hidden(reference.load(path), TOKENS)[20:]
    assert rel(c.embeddings(), want.mean(0)) < 1e-4
    assert lib.innerq_embeddings_rows(c.ptr) == len(TOKENS) - 20


def test_embedding_errors(path):
    m = ModelHandle.load(path)
    plain = ContextHandle.init(m, n_ctx=64)
    plain.decode(TOKENS[:3])
    with pytest.raises(innerq.InvalidArgumentError, match="without embeddings"):
        plain.embeddings()
    c = ContextHandle.init(m, n_ctx=64, embeddings=True)
    with pytest.raises(innerq.InvalidArgumentError, match="nothing has been evaluated"):
        c.embeddings()
    c.decode(TOKENS[:3])
    with pytest.raises(innerq.InvalidArgumentError, match="out of range"):
        c.embeddings(3)
    with pytest.raises(innerq.InvalidArgumentError, match="pooling"):
        ContextHandle.init(m, n_ctx=64, embeddings=True, pooling=4)
