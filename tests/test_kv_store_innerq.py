"""The KV_STORE op over quantized caches, and who owns the bookkeeping (docs/DESIGN.md 3.6, 6).

The ops read the runtime's counters and flush plan from the step's input (each sequence's row,
set after the graph is built) and write only the cache's region tensors; the runtime commits
its counters after the graph ran (src/kv-plan.c). So: op_params hold the static configuration
alone (two steps' ops are the same op); a graph built but not run leaves storage and counters
as they were; a run writes the same bytes as the reference store (iq_qcache_store_head over
the same plan) and still leaves the counters to the runtime; a row that does not fit the cache
fails the run with a message, before anything is written.
"""
from __future__ import annotations

import numpy as np
import pytest

from innerq_ffi import QCache
from test_attention_innerq import api, batch_of, layer_of  # noqa: F401  (api: fixture)
from test_innerq_attn import innerq_cfg, kivi_cfg
from test_ops import I32, IQ_KV_S_COUNT, Graph

CFGS = [(innerq_cfg(3, 2, 32, S=8, R=16), "innerq"), (kivi_cfg(2, 32, R=16), "kivi2")]


@pytest.fixture(scope="module")
def backend(api):  # noqa: F811
    ffi, lib = api
    be = lib.iq_backend_cpu_init(2)
    assert be != ffi.NULL
    yield be
    lib.iq_backend_free(be)


def filled(cfg, n_past, seed, H=2, D=64, n_ctx=400):
    """A cache with n_past tokens stored by the reference path, in uneven stores."""
    qc = QCache(cfg, D, H, n_ctx)
    rng = np.random.default_rng(seed)
    t = 0
    for n in [5, 1, 30, 2, 60, 9] * 20:
        n = min(n, n_past - t)
        if n == 0:
            break
        assert qc.store(rng.standard_normal((n, H, D)), rng.standard_normal((n, H, D)))
        t += n
    return qc


def store_graph(api, qc, cfg, k, v):  # noqa: F811
    """A graph attention -> kv_store of the batch k, v over qc; (graph, attention, output, step's row input, plan)."""
    g = Graph(api)
    lib = g.lib
    n, H, D = k.shape
    q = np.zeros((n, H, D), np.float32)
    seqs, pages, plan = batch_of(g, qc, n)
    layer = layer_of(api, g, qc, cfg)
    kt, vt = g.input(k), g.input(v)
    a = lib.iq_attention(g.ctx, g.input(q), kt, vt, layer, seqs, pages, 0.125)
    out = lib.iq_kv_store(g.ctx, a, kt, vt, layer, seqs, pages)
    assert out != g.ffi.NULL
    return g, a, out, seqs, plan


@pytest.mark.parametrize("cfg", [c for c, _ in CFGS], ids=[n for _, n in CFGS])
def test_ops_take_the_step_as_inputs(api, cfg):  # noqa: F811
    """The ops of two steps with other counters and flush plans have the same op_params (the
    configuration); the step's rows, the page table and the regions are their sources."""
    params = []
    for n_past, n in [(30, 40), (97, 50)]:
        qc = filled(cfg, n_past, seed=n)
        k = np.zeros((n, 2, 64), np.float32)
        g, a, out, seqs, plan = store_graph(api, qc, cfg, k, k)
        try:
            lib = qc.lib
            assert plan.n_past == n_past and plan.flush.n_flush > 0
            for t in (a, out):
                p = t.op_params
                assert (p[lib.IQ_KV_P_GROUP], p[lib.IQ_KV_P_SINK_CAP], p[lib.IQ_KV_P_RECENT_CAP]) == \
                    (cfg["group"], cfg["n_sink"], cfg["n_recent"])
                assert t.src[lib.IQ_KV_SRC_SEQS] == seqs and t.src[lib.IQ_KV_SRC_PAGES] != g.ffi.NULL
                for r in range(lib.IQ_QREGION_COUNT):
                    assert t.src[lib.IQ_KV_SRC_STORAGE + r] != g.ffi.NULL
            params.append([list(t.op_params) for t in (a, out)])
        finally:
            g.close()
    assert params[0] == params[1]


@pytest.mark.parametrize("cfg", [c for c, _ in CFGS], ids=[n for _, n in CFGS])
def test_graph_built_not_run_leaves_the_cache_alone(api, backend, cfg):  # noqa: F811
    qc = filled(cfg, 90, seed=2)
    before, state = qc.buf.copy(), qc.state()
    rng = np.random.default_rng(3)
    k = rng.standard_normal((40, 2, 64)).astype(np.float32)
    g, _, out, _, plan = store_graph(api, qc, cfg, k, k)
    try:
        assert plan.flush.n_flush > 0  # the batch flushes: there would be something to change
        lib = g.lib
        graph = lib.iq_new_graph(g.ctx, 64)
        assert lib.iq_graph_expand(graph, out)
        ga = lib.iq_gallocr_new(backend)
        assert lib.iq_gallocr_alloc_graph(ga, graph)
        lib.iq_gallocr_free(ga)
    finally:
        g.close()
    np.testing.assert_array_equal(qc.buf, before)
    assert qc.state() == state and qc.qstate.n_quant == state[2]


@pytest.mark.parametrize("cfg", [c for c, _ in CFGS], ids=[n for _, n in CFGS])
@pytest.mark.parametrize("n_past,n", [(0, 7), (3, 100), (90, 40), (200, 1)])
def test_kv_store_op_writes_what_the_reference_store_writes(api, backend, cfg, n_past, n):  # noqa: F811
    """The op over one cache and the reference store over a copy of it leave the same bytes;
    the op leaves the counters to the runtime, whose commit gives the reference's."""
    op_qc, ref_qc = filled(cfg, n_past, seed=4), filled(cfg, n_past, seed=4)
    np.testing.assert_array_equal(op_qc.buf, ref_qc.buf)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((n, 2, 64)).astype(np.float32)
    k[:, :, 5] *= 9.0  # an outlier channel: the norms matter
    v = rng.standard_normal((n, 2, 64)).astype(np.float32)
    state = op_qc.state()
    g, _, out, _, plan = store_graph(api, op_qc, cfg, k, v)
    try:
        g.compute(backend, out)
    finally:
        g.close()
    assert op_qc.state() == state  # ops do not touch the bookkeeping
    op_qc.commit(plan, n)
    assert ref_qc.store(k, v)
    assert op_qc.state() == ref_qc.state() and op_qc.norms_ready == ref_qc.norms_ready
    np.testing.assert_array_equal(op_qc.buf, ref_qc.buf)


def test_plan_that_does_not_fit_is_refused(api, backend):  # noqa: F811
    """A step's row that would make the op write outside the regions fails the run with a
    message, and the cache is as it was."""
    cfg = innerq_cfg(3, 2, 32, S=8, R=16)
    qc = filled(cfg, 60, seed=6)
    before = qc.buf.copy()
    ffi, lib = api
    k = np.zeros((4, 2, 64), np.float32)
    # a full window with one flush planned: the first new token would land past the window
    full_window = {"n_past": qc.c.n_sink + qc.c.n_quant + qc.c.cap_recent, "n_flush": 1}
    for bad in ({"n_flush": 5}, {"n_sink_new": 3}, {"n_quant": 7}, {"n_past": 500}, {"slot": 1}, {"token0": 1},
                full_window):
        g = Graph(api)
        try:
            row = qc.plan(4)
            row.slot, row.token0, row.n_tokens = 0, 0, 4
            for field, value in bad.items():
                setattr(row.flush if field in ("n_flush", "n_sink_new") else row, field, value)
            seqs = g.input(np.frombuffer(bytes(qc.ffi.buffer(row)), np.int32).copy(), I32, (IQ_KV_S_COUNT, 1))
            pages = g.input(np.arange(qc.c.cap_blocks, dtype=np.int32), I32, (qc.c.cap_blocks, 1))
            layer = layer_of(api, g, qc, cfg)
            out = lib.iq_kv_store(g.ctx, g.input(k), g.input(k), g.input(k), layer, seqs, pages)
            assert out != ffi.NULL
            graph = lib.iq_new_graph(g.ctx, 32)
            assert lib.iq_graph_expand(graph, out)
            ga = lib.iq_gallocr_new(backend)
            try:
                assert lib.iq_gallocr_alloc_graph(ga, graph)
                for t, data in g.inputs:
                    lib.iq_tensor_set(t, data, 0, len(data))
                assert lib.iq_backend_graph_compute(backend, graph) != 0, bad
            finally:
                lib.iq_gallocr_free(ga)
            msg = ffi.string(lib.iq_error_get()).decode()
            assert "kv_store" in msg or "quantized KV cache" in msg, msg
        finally:
            g.close()
    np.testing.assert_array_equal(qc.buf, before)
