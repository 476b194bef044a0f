"""innerq_state_save / innerq_state_load: a saved sequence continues exactly where it was, in
the same or another context of the same model and cache configuration; anything else is a
clear error that leaves the context as it was."""
from __future__ import annotations

import numpy as np
import pytest

import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq._native import ContextHandle, ModelHandle  # noqa: E402

CFG = TinyConfig(head_dim=32, n_head_kv=2, n_layer=2, seed=5)
KW = dict(n_ctx=300, n_batch=32, n_threads=1, kv_group=32, kv_sink=8, kv_recent=16)
CACHES = ["innerq", "innerq4", "kivi2", "f16", "q8_0", "q4_0", "f32"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    return {
        "a": tiny_model.write_tiny_model(root / "a.gguf", CFG),
        # the same shape, other weights: a fine-tune of the same architecture
        "b": tiny_model.write_tiny_model(root / "b.gguf", TinyConfig(head_dim=32, n_head_kv=2, n_layer=2, seed=6)),
    }


@pytest.fixture(scope="module")
def model(paths):
    return ModelHandle.load(paths["a"])


def ctx_of(model, kv, **kw):
    return ContextHandle.init(model, kv_k=kv, **{**KW, **kw})


def toks(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def run(ctx, tokens):
    """logits after each token decoded one at a time"""
    out = []
    for t in tokens:
        ctx.decode([t])
        out.append(ctx.logits())
    return np.stack(out)


@pytest.mark.parametrize("kv", CACHES)
def test_roundtrip_continues_exactly(model, kv):
    a = ctx_of(model, kv)
    a.decode(toks(150))  # past the first flush of the quantized caches
    for t in toks(5, 1):
        a.decode([t])
    state = a.save_state()
    assert len(state) == a.state_size()
    b = ctx_of(model, kv)
    b.decode(toks(20, 9))  # whatever b held is replaced
    b.load_state(state)
    assert b.n_past() == a.n_past() == 155
    np.testing.assert_array_equal(b.logits(), a.logits())  # the last logits travel with the state
    assert b.save_state() == state
    cont = toks(40, 2)  # through further flushes
    np.testing.assert_array_equal(run(b, cont), run(a, cont))
    # the record of batches travels too: both rewind alike
    assert b.truncate(140) == a.truncate(140)


def test_state_holds_the_cache_as_stored(model):
    """A state holds the used part of the cache in its stored form, so an InnerQ state is a
    fraction of an f16 one and grows with the tokens, not with n_ctx."""
    sizes = {}
    for kv in ("innerq", "f16"):
        for n_ctx in (300, 600):
            c = ctx_of(model, kv, n_ctx=n_ctx, kv_recent=16)
            c.decode(toks(280))
            sizes[kv, n_ctx] = len(c.save_state())
    assert sizes["innerq", 300] == sizes["innerq", 600]
    assert sizes["f16", 300] == sizes["f16", 600]
    n_vocab = innerq._ffi.lib.innerq_model_n_vocab(model.ptr)
    # the f16 rows: 2 layers x 2 heads x 32 dims x 2 (k, v) x 2 bytes per token; plus the logits
    assert sizes["f16", 300] >= 280 * 2 * 2 * 32 * 2 * 2 + 4 * n_vocab
    assert sizes["innerq", 300] < 0.6 * sizes["f16", 300]


def test_load_mismatch_is_a_clear_error(model, paths):
    a = ctx_of(model, "innerq")
    a.decode(toks(100))
    state = a.save_state()
    other = ModelHandle.load(paths["b"])
    for ctx, what in ((ContextHandle.init(other, kv_k="innerq", **KW), "another model"),
                      (ctx_of(model, "f16"), "another cache type"),
                      (ctx_of(model, "innerq", kv_group=32, kv_recent=32), "another window"),
                      (ctx_of(model, "innerq", kv_hybrid=False), "another quantizer mode"),
                      (ctx_of(model, "innerq", kv_value_scales=1), "value blocks with row scales"),
                      (ctx_of(model, "innerq", kv_params8=1), "blocks with 8-bit group parameters"),
                      (ctx_of(model, "innerq", kv_key_levels=1), "keys on the key levels")):
        ctx.decode(toks(10, 3))
        before = ctx.logits()
        with pytest.raises(innerq.StateMismatchError):
            ctx.load_state(state)
        assert ctx.n_past() == 10, what
        np.testing.assert_array_equal(ctx.logits(), before)
    with pytest.raises(innerq.ContextFullError):
        ctx_of(model, "innerq", n_ctx=64).load_state(state)


def test_damaged_states_are_errors_and_change_nothing(model):
    a = ctx_of(model, "innerq")
    a.decode(toks(100))
    state = a.save_state()
    b = ctx_of(model, "innerq")
    b.decode(toks(10, 4))
    before = b.logits()
    rng = np.random.default_rng(0)
    bad = [b"", state[:7], state[:100], state[:-1], state + b"\0", b"x" * len(state)]
    for i in rng.integers(0, len(state), 20):
        flipped = bytearray(state)
        flipped[i] ^= 0x10
        bad.append(bytes(flipped))
    for s in bad:
        with pytest.raises(innerq.InnerQError) as e:
            b.load_state(s)
        assert isinstance(e.value, (innerq.FormatError, innerq.StateMismatchError)), str(e.value)
        assert b.n_past() == 10
    np.testing.assert_array_equal(b.logits(), before)
    cont = toks(5, 5)
    fresh = ctx_of(model, "innerq")
    fresh.decode(toks(10, 4))
    np.testing.assert_array_equal(run(b, cont), run(fresh, cont))


def test_empty_state(model):
    a = ctx_of(model, "innerq")
    state = a.save_state()
    b = ctx_of(model, "innerq")
    b.decode(toks(50))
    b.load_state(state)
    assert b.n_past() == 0
    with pytest.raises(innerq.InvalidArgumentError):
        b.logits()
