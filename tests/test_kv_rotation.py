"""The Hadamard rotation of InnerQ caches (docs/INNERQ.md, "Rotation along head_dim").

Keys and queries are rotated after RoPE by one orthonormal matrix, so q.k is unchanged; values
are rotated before the store and the attention output is rotated back, so p.V is unchanged.
Before anything is quantized (a sink larger than the prompt) the cache holds f16 rows either
way, so a rotated and an unrotated cache give the same logits up to the f16 rounding of
different rows; with quantized tokens the rotation must change them (it is on).
"""
from __future__ import annotations


import numpy as np
import pytest

from tiny_model import TinyConfig
import tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("rot") / "m.gguf",
                                       TinyConfig(head_dim=64, n_head=4, n_head_kv=2, n_layer=2, seed=5))


def tokens(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 200, n)]


def relative_error(a, b):
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


@pytest.mark.parametrize("rot", [1, 2, 3])
def test_rotation_preserves_attention(Session, model, rot):
    toks = tokens(40)
    out = {}
    for r in (0, rot):
        with Session(model, n_ctx=128, kv_k="innerq4", kv_v="innerq4", kv_sink=64, kv_rot=r) as s:
            out[r] = s.eval_one_by_one(toks)
    with Session(model, n_ctx=128, kv_k="f32", kv_v="f32") as s:
        ref = s.eval_one_by_one(toks)
    # both within f16 rounding of the f32 cache, and of each other
    assert relative_error(out[0], ref).max() < 2e-3
    assert relative_error(out[rot], ref).max() < 2e-3
    assert relative_error(out[rot], out[0]).max() < 2e-3


def test_rotation_changes_quantized_tokens(Session, model):
    toks = tokens(300, seed=1)
    out = {}
    for r in (0, 3):
        with Session(model, n_ctx=512, kv_k="innerq2", kv_v="innerq2", kv_rot=r) as s:
            out[r] = s.eval_one_by_one(toks)[-20:]
    with Session(model, n_ctx=512, kv_k="f32", kv_v="f32") as s:
        ref = s.eval_one_by_one(toks)[-20:]
    assert not np.array_equal(out[0], out[3])
    # both are approximations of the same attention
    assert relative_error(out[3], ref).max() < 0.5 and relative_error(out[0], ref).max() < 0.5


def test_rotation_default_and_state(Session, model):
    """The default rotates (kv_rot -1); a state saved with one rotation does not load into a
    context with another (the cache holds rotated rows)."""
    from innerq import _native

    assert _native.defaults()["kv_rot"] == -1
    toks = tokens(200, seed=2)
    with Session(model, n_ctx=256, kv_k="innerq3", kv_v="innerq2", kv_rot=3) as a, \
         Session(model, n_ctx=256, kv_k="innerq3", kv_v="innerq2", kv_rot=0) as b:
        a.decode(toks)
        ffi, lib = a.ffi, a.lib
        n = lib.innerq_state_size(a.ctx)
        size = ffi.new("size_t *")
        buf = ffi.new("uint8_t[]", n)
        assert lib.innerq_state_save(a.ctx, buf, n, size) == 0
        assert lib.innerq_state_load(b.ctx, buf, size[0]) == lib.INNERQ_ERR_STATE_MISMATCH
