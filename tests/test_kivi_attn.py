"""The CPU kernels over KIVI caches (keys grouped per channel over G tokens, values per token
over G channels) on every ISA, against numpy.

Oracle: numpy's softmax(q K^T scale) V over the cache decoded from its raw bytes
(test_innerq_attn.dense_cache). The KIVI kernels work in f32 with no quantized query or
probabilities, so every ISA must match the oracle to float rounding, over whole caches and over
token ranges that start and end inside blocks (thread splits merged with iq_attn_state_merge).
Besides kivi2 / kivi4 as the cache types define them, the cases reach what the layout allows:
3-bit codes, G = 128, head dims 96 and 256, a sink window and key normalization (configurations
built by hand), and query groups of 1 to 8 heads (passes of at most 4 heads in the SIMD code).
"""
from __future__ import annotations

import numpy as np
import pytest

from innerq_ffi import QCache, fptr
from test_innerq_attn import attend_kernel, attention_np, dense_cache, filled_cache, kernels, kivi_cfg

CASES = [  # cfg, head_dim, n_kv_head, r
    (kivi_cfg(2, 32), 64, 3, 3),
    (kivi_cfg(2, 64), 64, 2, 1),
    (kivi_cfg(2, 64), 128, 2, 4),
    (kivi_cfg(4, 64), 64, 3, 3),
    (kivi_cfg(4, 64), 128, 1, 4),
    (kivi_cfg(4, 32), 128, 1, 8),
    (kivi_cfg(2, 128), 128, 1, 5),
    (kivi_cfg(4, 32), 96, 2, 2),
    (kivi_cfg(2, 128), 256, 1, 3),
    (dict(kivi_cfg(3, 64), n_sink=8, key_norm=True), 64, 2, 3),
    (dict(kivi_cfg(3, 32, R=40), n_sink=5), 128, 1, 4),
]


def case_id(case):
    cfg, D, H, r = case
    extra = ("-S%d" % cfg["n_sink"] if cfg["n_sink"] else "") + ("-norm" if cfg["key_norm"] else "")
    return f"b{cfg['bits_k']}-G{cfg['group']}-D{D}-H{H}-r{r}{extra}"


def make(case, n=600, seed=11):
    cfg, D, H, r = case
    qc, _, _ = filled_cache(cfg, D, H, n, [300, 1, 45, 1, 97, 3], seed=seed)
    c = qc.c
    assert c.n_sink == cfg["n_sink"] and c.n_quant >= 2 * cfg["group"] and c.n_recent > 0
    if cfg["key_norm"]:
        assert not np.all(qc.norms() == 1.0)
    rng = np.random.default_rng(seed + 1)
    q = (2.0 * rng.standard_normal((2, H * r, D))).astype(np.float32)  # peaked softmax
    return qc, q, 1.0 / np.sqrt(D)


def assert_exact(got, expect, V, name):
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=2e-5 * np.abs(V).max(), err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_isa_matches_numpy(case):
    qc, q, scale = make(case)
    K, V = dense_cache(qc)
    expect = attention_np(q, K, V, scale)
    for name, kt in kernels():
        assert_exact(attend_kernel(qc, kt, q, scale), expect, V, name)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6], CASES[10]], ids=case_id)
def test_ranges_inside_blocks_match_numpy(case):
    """Token ranges cut anywhere (inside blocks, one token long, at the region edges), each
    attended on its own and merged: the KIVI kernels have no per-block quantization, so any
    split gives the whole attention to float rounding."""
    qc, q, scale = make(case)
    K, V = dense_cache(qc)
    expect = attention_np(q[:1], K, V, scale)
    c, G = qc.c, case[0]["group"]
    q0, q1, n = c.n_sink, c.n_sink + c.n_quant, c.n_tokens
    cuts = sorted({0, 1, q0, q0 + 3, q0 + G - 1, q0 + G, q0 + G + 1, q0 + 2 * G + 17, q1 - 5, q1 - 4, q1, q1 + 2, n})
    for name, kt in kernels():
        assert_exact(attend_kernel(qc, kt, q[:1], scale, splits=cuts), expect, V, name)


def test_single_block_pieces_match_numpy():
    """iq_innerq_attend over pieces [a, b) of one block, a and b off the 4- and 16-token tiles."""
    case = CASES[3]
    qc, q, scale = make(case)
    ffi, lib = qc.ffi, qc.lib
    K, V = dense_cache(qc)
    cfg, D, H, r = case
    G = cfg["group"]
    qh = np.ascontiguousarray(q[0, :r])
    qp = ffi.new("struct iq_innerq_query *")
    assert lib.iq_innerq_query_prep(qc.c, 0, fptr(ffi, qh), r, scale, qp)
    for a, b in [(0, G), (5, 6), (3, 29), (17, 64), (31, 33), (G + 1, G + 47)]:
        s = (K[0, a:b] @ qh.astype(np.float64).T) * scale  # [n][r]
        p = np.exp(s - s.max(axis=0))
        expect = (p.T @ V[0, a:b]) / p.sum(axis=0)[:, None]
        for name, kt in kernels():
            st = np.zeros(r * (D + 2), np.float32)
            lib.iq_attn_state_init(fptr(ffi, st), r, D)
            lib.iq_innerq_attend(kt, qc.c, 0, qp, a, b, fptr(ffi, st))
            out = np.zeros((r, D), np.float32)
            lib.iq_attn_state_finish(fptr(ffi, st), r, D, fptr(ffi, out))
            assert_exact(out, expect, V, f"{name} [{a}, {b})")


def test_query_prep_refuses_caches_of_one_axis():
    for axis in (0, 1):
        qc = QCache(dict(kivi_cfg(2, 32), axis_k=axis, axis_v=axis), 64, 1, 256)
        qp = qc.ffi.new("struct iq_innerq_query *")
        q = np.zeros((1, 64), np.float32)
        assert not qc.lib.iq_innerq_query_prep(qc.c, 0, fptr(qc.ffi, q), 1, 1.0, qp)
        assert b"axis" in qc.ffi.string(qc.lib.iq_error_get())
