"""Decode semantics of a batch (docs/DESIGN.md 3.4, iq_attention_set_decode_semantics).

The oracle is decoding itself: the same queries, keys and values fed one token at a time
through ATTENTION + KV_STORE. A batch with decode semantics, split where a quantized cache
flushes (kv_quntil_flush), must give every query the same output up to float rounding,
for every cache type, thread count and instruction set. The same batch without decode
semantics reads its own keys unrounded and must differ where the cache type rounds (the
check that the comparison can fail).
"""
from __future__ import annotations

import cffi
import numpy as np
import pytest

from conftest import lib_path
from innerq_ffi import QCache
from test_attention_innerq import QUANT_LAYER, batch_of, layer_of
from test_innerq_attn import filled_cache, innerq_cfg, kivi_cfg
from test_ops import F16, F32, Q4_0, Q8_0, Cache, Graph, seqs_input
from test_ops import backend, isa  # noqa: F401  (fixtures, over this module's api)


@pytest.fixture(scope="module")
def api():
    ffi = cffi.FFI()
    ffi.cdef(QUANT_LAYER + "void iq_attention_set_decode_semantics(struct iq_tensor * attention, bool on);")
    return ffi, ffi.dlopen(lib_path())


class PlainLayer:
    """A plain cache (test_ops.Cache) with random contents up to n_past; its own graph owns
    the tensors."""

    def __init__(self, api, be, type_, hd, n_kv, n_ctx, n_past, seed):
        self.graph = Graph(api)
        self.cache = Cache(self.graph, be, type_, hd, n_kv, n_ctx, np.random.default_rng(seed))
        self.layer = self.cache.layer

    def until_flush(self) -> int:
        return 1 << 30

    def batch(self, g, n_past, n):
        return seqs_input(g, [(0, n_past, n)]), self.cache.pages, None

    def commit(self, plan, n):
        pass

    def close(self):
        self.cache.free()
        self.graph.close()


class QuantLayer:
    """A quantized cache (InnerQ or KIVI) filled to n_past with keys that have outlier channels."""

    def __init__(self, api, cfg, hd, n_kv, n_ctx, n_past, seed):
        self.qc, _, _ = filled_cache(cfg, hd, n_kv, n_past, [300, 1, 40, 7], seed=seed, n_ctx=n_ctx)
        self.api, self.cfg = api, cfg
        self.graph = Graph(api)
        self.layer = layer_of(api, self.graph, self.qc, cfg)

    def until_flush(self) -> int:
        return self.qc.until_flush()

    def batch(self, g, n_past, n):
        assert self.qc.c.n_tokens == n_past
        return batch_of(g, self.qc, n)

    def commit(self, plan, n):
        self.qc.commit(plan, n)

    def close(self):
        self.graph.close()


def step(api, be, layer, q, k, v, n_past, scale, decode) -> np.ndarray:
    """ATTENTION (decode semantics or not) then KV_STORE of one batch; the attention output."""
    g = Graph(api)
    try:
        lib = g.lib
        kt, vt = g.input(k), g.input(v)
        seqs, pages, plan = layer.batch(g, n_past, len(q))
        a = lib.iq_attention(g.ctx, g.input(q), kt, vt, layer.layer, seqs, pages, scale)
        assert a != g.ffi.NULL
        lib.iq_attention_set_decode_semantics(a, decode)
        out = g.compute(be, lib.iq_kv_store(g.ctx, a, kt, vt, layer.layer, seqs, pages)).reshape(len(q), -1)
        layer.commit(plan, len(q))  # the runtime's bookkeeping, after the graph ran
        return out
    finally:
        g.close()


def run(api, be, make, q, k, v, n_past, mode) -> np.ndarray:
    """Outputs of every query: one token at a time ("decode"), or in batches with decode
    semantics split at flushes ("batched"), or in the same batches without ("plain")."""
    layer = make()
    scale = 1.0 / np.sqrt(q.shape[-1])
    rows, i = [], 0
    try:
        while i < len(q):
            n = 1 if mode == "decode" else min(len(q) - i, layer.until_flush(), 40)
            rows.append(step(api, be, layer, q[i:i + n], k[i:i + n], v[i:i + n], n_past + i, scale,
                             mode == "batched"))
            i += n
    finally:
        layer.close()
    return np.concatenate(rows)


PLAIN = [(F32, "f32"), (F16, "f16"), (Q8_0, "q8_0"), (Q4_0, "q4_0")]
QUANT = [
    (innerq_cfg(3, 2, 64), "innerq"),                 # S 32, R 96, G 64
    (innerq_cfg(2, 2, 32, S=8, R=16), "innerq2-small"),   # flushes every 32 tokens of the batches
    (innerq_cfg(4, 3, 32, S=4, R=24, norm=False), "innerq4-innerq3"),
    (kivi_cfg(2, 32, R=16), "kivi2"),
]
CASES = [(t, name, 64, 3, 3) for t, name in PLAIN] + [(c, name, 64, 3, 3) for c, name in QUANT] + \
    [(innerq_cfg(3, 2, 64), "innerq-D128-r4", 128, 2, 4), (Q4_0, "q4_0-D128-r1", 128, 2, 1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[1])
def test_batch_with_decode_semantics_is_decoding(api, backend, isa, case):
    what, name, hd, n_kv, r = case
    n_past, nt = 700, 90  # a long cache (split over threads) and batches crossing flushes
    rng = np.random.default_rng(len(name))
    q = rng.standard_normal((nt, n_kv * r, hd)).astype(np.float32)
    k = rng.standard_normal((nt, n_kv, hd)).astype(np.float32)
    k[:, :, 3] *= 8.0  # an outlier channel, as real keys have
    v = rng.standard_normal((nt, n_kv, hd)).astype(np.float32)
    if isinstance(what, dict):
        def make():
            return QuantLayer(api, what, hd, n_kv, n_past + nt, n_past, seed=3)
    else:
        def make():
            return PlainLayer(api, backend, what, hd, n_kv, n_past + nt, n_past, seed=3)

    decoded = run(api, backend, make, q, k, v, n_past, "decode")
    batched = run(api, backend, make, q, k, v, n_past, "batched")
    # float rounding: about 1e-6 here; reading the batch's own keys and values unrounded (f16
    # windows) is 6e-5 .. 1e-4, through q8_0 / q4_0 4e-2 .. 3e-1
    tol = 4e-6 * np.abs(v).max()
    np.testing.assert_allclose(batched, decoded, rtol=0, atol=tol)
    if isinstance(what, dict):
        # a quantized cache on the CPU: the same stretches, tiles and merges for a position
        # in a batch and in a decode step, so the same bits (ops-attention.c, attn_qcut)
        np.testing.assert_array_equal(batched, decoded)
    if what != F32:
        plain = run(api, backend, make, q, k, v, n_past, "plain")
        assert np.abs(plain - decoded).max() > 2.5 * tol


def test_until_flush_follows_the_schedule():
    """kv_quntil_flush tokens stored one at a time end with exactly one flush, and no
    token before the last one flushes (docs/DESIGN.md 3.2)."""
    rng = np.random.default_rng(0)
    for cfg in (innerq_cfg(3, 2, 32, S=8, R=16), kivi_cfg(2, 32, R=16)):
        qc = QCache(cfg, 64, 1, 400)
        while qc.state()[0] < 300:
            n = qc.until_flush()
            assert n >= 1
            for i in range(n):
                quant = qc.state()[2]
                assert qc.store(rng.standard_normal((1, 1, 64)), rng.standard_normal((1, 1, 64)))
                flushed = qc.state()[2] - quant
                assert flushed == (cfg["group"] if i == n - 1 else 0), (qc.state(), i, n)


def test_flushes_per_batch_stay_within_the_device_grid():
    """The CUDA KV_STORE launches (G - 1 + n) / G flush blocks for a batch of n tokens
    (cuda/qcache-store.cu): the policy never plans more, whatever the batch sizes, the windows
    and the group, from an empty cache or from the counters a loaded state restores."""
    rng = np.random.default_rng(1)
    for group, S, R in ((32, 8, 16), (32, 0, 0), (64, 32, 96), (128, 4, 200), (32, 128, 512)):
        cfg = innerq_cfg(3, 2, group, S=S, R=R)
        qc = QCache(cfg, 128, 1, 6000)
        planned = 0
        for restart in range(3):
            qc.clear()
            if restart > 0:  # the counters of a state saved at n_past (kv_qcounters)
                n_past = int(rng.integers(1, 3000))
                st = qc.lib.kv_qcounters(qc.cfg, n_past)
                qc.qstate.n_sink, qc.qstate.n_quant, qc.qstate.norms_ready = st.n_sink, st.n_quant, st.norms_ready
                qc.c.n_tokens, qc.c.n_sink, qc.c.n_quant = n_past, st.n_sink, st.n_quant
                qc.c.n_recent = n_past - st.n_sink - st.n_quant
            while True:
                n = int(rng.choice([1, 1, 1, 2, 7, 31, 32, 33, 64, 100, 512, 700]))
                b = qc.plan(n)
                if b is None:
                    break
                assert b.flush.n_flush <= (group - 1 + n) // group, (group, S, R, n, qc.state(), b.flush.n_flush)
                planned += b.flush.n_flush
                qc.commit(b, n)
        assert planned > 0
