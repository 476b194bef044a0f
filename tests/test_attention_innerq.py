"""The ATTENTION op over quantized caches (cpu/attention-qcache.c) against the reference
attention (iq_qcache_attention_ref).

The op splits a long cache into stretches over the threads and merges their states; the
glue reuses a thread's prepared query from one stretch to the next and lets the kernels
update a private copy of the states. Whatever the split and the thread count, the result
must be the reference's within the kernels' int8 query / u8 probability arithmetic
(test_innerq_attn.assert_within_q8_p8; KIVI blocks are computed in f32: float rounding), for
decode and prompt batches, and a prepared query must never be reused for another cache or
another group size.
"""
from __future__ import annotations

import cffi
import numpy as np
import pytest

from conftest import lib_path
from innerq_ffi import QCache, load
from test_innerq_attn import assert_within_q8_p8, attention_ref, dense_cache, filled_cache, innerq_cfg, kivi_cfg
from test_ops import CDEF, I32, IQ_KV_S_COUNT, Graph, read_f32

# the layer with its quantized fields (test_ops declares them), for the CUDA tests' FFI
QUANT_LAYER = CDEF


@pytest.fixture(scope="module")
def api():
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(lib_path())


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["t1", "t2", "t3"])
def backend(request, api):
    ffi, lib = api
    be = lib.iq_backend_cpu_init(request.param)
    assert be != ffi.NULL
    yield be
    lib.iq_backend_free(be)


def type_ids(cfg):
    qlib = load()[1]
    if cfg["axis_k"] == 1:  # KIVI
        return [None, None, qlib.IQ_TYPE_KIVI2, None, qlib.IQ_TYPE_KIVI4][cfg["bits_k"]], \
            [None, None, qlib.IQ_TYPE_KIVI2, None, qlib.IQ_TYPE_KIVI4][cfg["bits_v"]]
    names = {2: qlib.IQ_TYPE_INNERQ2, 3: qlib.IQ_TYPE_INNERQ3, 4: qlib.IQ_TYPE_INNERQ4, 5: qlib.IQ_TYPE_INNERQ5}
    return names[cfg["bits_k"]], names[cfg["bits_v"]]


def layer_of(api, graph, qc, cfg, device=None, bufs=None):
    """An iq_kv_layer over the QCache: its configuration, and a tensor of the graph's context
    over each region of the QCache's buffer (kept alive by the graph); with a device backend,
    over a copy of each region in a buffer of that device (appended to bufs, for the caller
    to free)."""
    ffi, lib = api
    qffi, qlib = load()
    layer = ffi.new("struct iq_kv_layer *")
    layer.type_k, layer.type_v = type_ids(cfg)
    layer.head_dim, layer.n_kv_head, layer.n_ctx = qc.D, qc.H, qc.c.n_ctx
    layer.page, layer.n_pages, layer.n_slots = qc.G, qc.c.cap_blocks, 1
    ffi.memmove(ffi.addressof(layer, "qcfg"), qffi.buffer(qc.cfg), qffi.sizeof("struct iq_qcache_config"))
    assert qlib.IQ_QREGION_COUNT == 7
    ty, ne = qffi.new("enum iq_type *"), qffi.new("int64_t[4]")
    for r in range(qlib.IQ_QREGION_COUNT):
        qlib.iq_qcache_region_shape(qc.c, r, ty, ne)
        t = lib.iq_new_tensor(graph.ctx, int(ty[0]), 4, ffi.new("int64_t[4]", list(ne)))
        if device is None:
            t.data = ffi.cast("void *", int(qffi.cast("uintptr_t", qc.c.region[r])))
        else:
            buf = lib.iq_backend_alloc_buffer(device, lib.iq_nbytes(t))
            assert buf != ffi.NULL
            bufs.append(buf)
            lib.iq_tensor_place(t, buf, 0)
            data = bytes(qffi.buffer(qc.c.region[r], int(qc.c.bytes[r])))
            lib.iq_tensor_set(t, data, 0, len(data))
        layer.region[r] = t
    graph.keep.append(layer)
    return layer


def batch_of(graph, qc, n):
    """The step's row of a batch of n tokens of the QCache's one sequence (QCache.plan: the
    runtime's counters and flush plan) and its page table (its pages in order), as the ops'
    inputs; and the row in the QCache's FFI, to commit after the graph ran."""
    qffi = qc.ffi
    qb = qc.plan(n)
    assert qb is not None
    qb.slot, qb.token0, qb.n_tokens = 0, 0, n
    row = np.frombuffer(bytes(qffi.buffer(qb)), dtype=np.int32)
    assert len(row) == IQ_KV_S_COUNT
    seqs = graph.input(row.copy(), I32, (IQ_KV_S_COUNT, 1))
    pages = graph.input(np.arange(max(qc.c.cap_blocks, 1), dtype=np.int32), I32, (max(qc.c.cap_blocks, 1), 1))
    return seqs, pages, qb


def check(qc, cfg, got, ref):
    _, V = dense_cache(qc)
    if cfg["axis_k"] == 1:
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5 * np.abs(V).max())
    else:
        assert_within_q8_p8(got, ref, V)


CASES = [  # cfg, head_dim, n_kv_head, r, n_past, batch tokens
    (innerq_cfg(3, 2, 64), 64, 3, 3, 700, 1),             # decode: the cache is split into stretches
    (innerq_cfg(3, 2, 64), 128, 2, 4, 1500, 1),
    (innerq_cfg(4, 4, 32, S=4, R=40), 64, 2, 1, 300, 5),  # a prompt batch over the cache
    (innerq_cfg(2, 2, 128, S=16, R=64), 128, 1, 12, 900, 1),  # r > 8: heads in two passes
    (innerq_cfg(5, 3, 64), 64, 3, 3, 700, 3),             # 5-bit keys, a batch
    (kivi_cfg(2, 64), 64, 3, 3, 500, 2),
    (kivi_cfg(4, 64), 128, 2, 4, 900, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]['bits_k']}{c[0]['bits_v']}g{c[0]['group']}-D{c[1]}"
                         f"-H{c[2]}-r{c[3]}-n{c[4]}-nt{c[5]}")
def test_op_matches_reference(api, backend, case):
    cfg, D, H, r, n_past, nt = case
    qc, _, _ = filled_cache(cfg, D, H, n_past, [400, 1, 63, 1, 100, 7], seed=n_past, n_ctx=n_past + nt)
    rng = np.random.default_rng(n_past + 1)
    q = rng.standard_normal((nt, H * r, D)).astype(np.float32)
    k = rng.standard_normal((nt, H, D)).astype(np.float32)
    v = rng.standard_normal((nt, H, D)).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    g = Graph(api)
    try:
        lib = g.lib
        seqs, pages, _ = batch_of(g, qc, nt)
        out = lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), layer_of(api, g, qc, cfg), seqs, pages,
                               scale)
        got = g.compute(backend, out).reshape(nt, H * r, D)
    finally:
        g.close()
    check(qc, cfg, got, attention_ref(qc, q, scale, k, v))


def outlier_cache(cfg, D, n, channel, seed):
    """One KV head whose keys have a 12x outlier channel, stored at once (so the first flush,
    which fixes the key norms, sees every key)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, 1, D)).astype(np.float32)
    k[:, :, channel] *= 12.0
    qc = QCache(cfg, D, 1, n + 1)
    assert qc.store(k, rng.standard_normal((n, 1, D)).astype(np.float32))
    return qc


@pytest.mark.parametrize("second", ["other norms", "other group"])
def test_prepared_query_is_not_reused_across_caches(api, backend, second):
    """One graph, two attention ops with the same query over one KV head each: the second
    cache has its outlier on another channel (other key norms), or holds the same keys grouped
    by 32 instead of 64 (the same norms, other int8 query groups). Each op must give its own
    cache's attention, though a thread meets the same query and head in both."""
    D, r, n = 64, 4, 600
    cfgs = [innerq_cfg(3, 2, 64), innerq_cfg(3, 2, 64 if second == "other norms" else 32)]
    caches = [outlier_cache(cfgs[0], D, n, 3, seed=5),
              outlier_cache(cfgs[1], D, n, 40 if second == "other norms" else 3, seed=5)]
    same = np.array_equal(caches[0].norms(), caches[1].norms())
    assert same == (second == "other group")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, r, D)).astype(np.float32)
    k = rng.standard_normal((1, 1, D)).astype(np.float32)
    v = rng.standard_normal((1, 1, D)).astype(np.float32)
    g = Graph(api)
    lib = g.lib
    ga = lib.iq_gallocr_new(backend)  # ours: the outputs are read after the run
    try:
        qt, kt, vt = g.input(q), g.input(k), g.input(v)
        outs = [lib.iq_attention(g.ctx, qt, kt, vt, layer_of(api, g, qc, c), *batch_of(g, qc, 1)[:2], 0.125)
                for qc, c in zip(caches, cfgs)]
        for o in outs:
            lib.iq_set_output(o)
        g.compute(backend, lib.iq_add(g.ctx, outs[0], outs[1]), ga)
        got = [read_f32(g.ffi, lib, o).reshape(1, r, D) for o in outs]
    finally:
        lib.iq_gallocr_free(ga)
        g.close()
    for qc, c, x in zip(caches, cfgs, got):
        check(qc, c, x, attention_ref(qc, q, 0.125, k, v))
