"""The tensor-core attention of prompt batches (cuda/attention-fa.cuh) against the CPU backend
and float64 numpy oracles.

Every step over an f16 cache takes it (decode steps too: a GQA group's rows in one warp, more
K / V tiles in flight; a launch of more CTAs than the four-warp kernel holds at once on CTAs of
one warp), a batch of 64 query vectors and more (tokens x query heads per KV head)
over a quantized cache without the score correction, head_dim 64 / 128; the cases sit at tile edges (n_tokens not a multiple of 64 / r), with the batch alone
(n_past 0) and after a long stored cache (split positions, merged), with and without decode
semantics. A subprocess runs some of the same cases with the f32 kernel forced (the test
library's kernel variant fa_f32, tests/cuda_lib.py), and the two must agree. Skipped without a
GPU (tests/cuda_lib.py).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_lib import FA_ATOL, assert_attention_close, cuda_api, gpu_backend, variants_env
from test_cuda_ops import api, cpu, gpu  # noqa: F401 (the module fixtures of the plain caches)
from test_ops import CDEF, F16, Cache, Graph, seqs_input


def oracle(q, k, v, ck, cv, n_past, scale, decode):
    """float64 causal attention; q [nt, nh, D], k/v [nt, nkv, D], cache ck/cv [nkv, n_ctx, D].
    decode: a query's earlier batch rows rounded to f16 (as the cache will hold them), its own
    row as it is. Returns [nt, nh * D]."""
    nt, nh, D = q.shape
    nkv = k.shape[1]
    r = nh // nkv
    out = np.zeros((nt, nh, D))
    for g in range(nkv):
        for i in range(nt):
            kb, vb = k[: i + 1, g].astype(np.float64), v[: i + 1, g].astype(np.float64)
            if decode:
                kb[:i] = k[:i, g].astype(np.float16).astype(np.float64)
                vb[:i] = v[:i, g].astype(np.float16).astype(np.float64)
            keys = np.concatenate([ck[g, :n_past].astype(np.float64), kb])
            vals = np.concatenate([cv[g, :n_past].astype(np.float64), vb])
            s = q[i, g * r:(g + 1) * r].astype(np.float64) @ keys.T * scale  # [r, positions]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[i, g * r:(g + 1) * r] = p @ vals / p.sum(axis=1, keepdims=True)
    return out.reshape(nt, nh * D)


def inputs(case):
    D, n_kv, r, nt, n_past = case
    rng = np.random.default_rng(hash(case) % 2**32)
    q = rng.standard_normal((nt, n_kv * r, D)).astype(np.float32)
    k = rng.standard_normal((nt, n_kv, D)).astype(np.float32)
    v = rng.standard_normal((nt, n_kv, D)).astype(np.float32)
    q[:, :, 1] *= 6.0  # a few large scores: a peaked softmax
    k[:, :, 1] += 1.5
    return q, k, v, 1.0 / np.sqrt(D)


def run_f16(api, be, case, decode):
    """ATTENTION of a batch over an f16 cache of n_past random rows on `be`: (output [nt, nh * D],
    the cache's rows as stored, float32 [n_kv, n_ctx, D] for K and V)."""
    D, n_kv, r, nt, n_past = case
    q, k, v, scale = inputs(case)
    g = Graph(api, mem=8 << 20)
    cache = Cache(g, be, F16, D, n_kv, n_past + nt + 3, np.random.default_rng(n_past + D), shuffle=False)
    try:
        a = g.lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), cache.layer, seqs_input(g, [(0, n_past, nt)]),
                               cache.pages, scale)
        g.lib.iq_attention_set_decode_semantics(a, decode)
        return g.compute(be, a).reshape(nt, -1), cache.k, cache.v
    finally:
        cache.free()
        g.close()


# head_dim, n_kv_head, r, n_tokens, n_past; vectors = n_tokens * r (64 and up: the new kernel)
F16_CASES = [
    (128, 2, 4, 16, 0),      # exactly one Q tile per KV head, the batch alone
    (128, 2, 4, 300, 0),     # 19 tiles, the last partial (300 = 18 * 16 + 12)
    (128, 2, 4, 77, 1000),   # split positions, partial tiles of positions and queries
    (128, 1, 8, 33, 5000),   # r 8: 8 tokens per tile, a long cache
    (128, 2, 1, 64, 37),     # r 1: 64 tokens per tile
    (128, 2, 1, 129, 300),   # one query vector in the last tile
    (64, 2, 4, 100, 0),
    (64, 3, 8, 9, 1000),     # 72 vectors: two tiles, the second nearly empty
    (64, 1, 1, 300, 5000),
    (64, 2, 4, 65, 31),      # n_past not a multiple of the position tile
    (64, 2, 3, 22, 64),      # r 3: 21 tokens per tile (63 vectors)
    (128, 2, 4, 15, 200),    # 60 vectors: the last warp idle
    (64, 2, 8, 1, 700),      # one token: decode keeps its kernel
    (128, 2, 4, 1, 5000),    # a decode step at depth: one warp's rows, four stages of tiles, splits
    (64, 3, 4, 3, 2500),     # three tokens of a sequence (12 vectors): the decode stages too
    (128, 1, 8, 2, 64),      # 16 vectors, a cache of one tile
    (128, 8, 4, 300, 0),     # 8 KV heads x 19 tiles fill the device: the prompt's tiles unsplit
    (64, 8, 4, 280, 700),    # the same after a stored cache (kv-seqs.cuh iq_cu_sched_splits)
    # decode steps of more splits x KV heads than 2 CTAs a multiprocessor (H100 / H200: 264): CTAs
    # of one warp (attention.cu few_vecs)
    (128, 8, 4, 1, 5000),    # the 8B shape's GQA group, 40 splits
    (64, 8, 2, 3, 5000),     # three tokens (6 vectors), D 64
    (128, 8, 16, 1, 9000),   # 16 vectors: the warp's every row, 64 splits
]


def case_id(c):
    return "D{}-H{}-r{}-n{}-past{}".format(*c)


@pytest.mark.parametrize("decode", [False, True], ids=["batch", "decode"])
@pytest.mark.parametrize("case", F16_CASES, ids=case_id)
def test_f16_cache_matches_cpu_and_oracle(api, cpu, gpu, case, decode):
    D, n_kv, r, nt, n_past = case
    q, k, v, scale = inputs(case)
    got, ck, cv = run_f16(api, gpu, case, decode)
    on_cpu, _, _ = run_f16(api, cpu, case, decode)
    vmax = max(np.abs(cv[:, :n_past]).max(initial=0.0), np.abs(v).max())
    assert_attention_close(got, on_cpu, True, vmax)
    want = oracle(q, k, v, ck, cv, n_past, scale, decode)
    assert_attention_close(got, want, True, vmax)


def test_f16_cache_large_values(api, cpu, gpu):
    """Keys and queries of a few hundred (scores in the thousands before the scale, values far
    from 1): f16 operands, f32 scores and sums keep the bound relative to the values' scale."""
    D, n_kv, r, nt, n_past = 128, 1, 4, 40, 100
    rng = np.random.default_rng(5)
    q = (rng.standard_normal((nt, n_kv * r, D)) * 30).astype(np.float32)
    k = (rng.standard_normal((nt, n_kv, D)) * 0.3).astype(np.float32)
    v = (rng.standard_normal((nt, n_kv, D)) * 200).astype(np.float32)
    outs = []
    for be in (cpu, gpu):
        g = Graph(api, mem=8 << 20)
        cache = Cache(g, be, F16, D, n_kv, n_past + nt, np.random.default_rng(6), shuffle=False)
        try:
            a = g.lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), cache.layer,
                                   seqs_input(g, [(0, n_past, nt)]), cache.pages, 0.088)
            outs.append(g.compute(be, a).reshape(nt, -1))
            ck, cv = cache.k, cache.v
        finally:
            cache.free()
            g.close()
    want = oracle(q, k, v, ck, cv, n_past, 0.088, False)
    vmax = max(np.abs(cv[:, :n_past]).max(), np.abs(v).max())
    assert_attention_close(outs[1], outs[0], True, vmax)
    assert_attention_close(outs[1], want, True, vmax)


# ---- the quantized caches' prompt path: dequantized into f16 rows ----

def qcache_cfgs():
    from test_innerq_attn import innerq_cfg, kivi_cfg
    return [
        (innerq_cfg(3, 2, 32, S=8, R=16, correction=False), "innerq3/2-nocorr"),
        (innerq_cfg(4, 2, 32, S=4, R=24, norm=False, correction=False), "innerq4/2-plain"),
        (innerq_cfg(3, 2, 64, S=32, R=96, correction=False), "innerq-g64-nocorr"),
        (kivi_cfg(2, 32, R=16), "kivi2"),
        (innerq_cfg(3, 2, 32, S=8, R=16), "innerq3/2-corr"),  # the score correction: the old kernel
    ]


QCACHE_CFGS = qcache_cfgs()


@pytest.fixture(scope="module")
def qapi():
    from test_attention_innerq import QUANT_LAYER
    return cuda_api(QUANT_LAYER)


@pytest.fixture(scope="module")
def qgpu(qapi):
    yield from gpu_backend(qapi)
# head_dim, n_kv_head, r, stored tokens, batch tokens
QCACHE_SHAPES = [(128, 2, 4, 700, 40), (64, 2, 8, 300, 9), (128, 1, 1, 1000, 100), (64, 3, 4, 0, 64),
                 (128, 2, 4, 5000, 17)]


@pytest.mark.parametrize("decode", [False, True], ids=["batch", "decode"])
@pytest.mark.parametrize("shape", QCACHE_SHAPES, ids=lambda s: "D{}-H{}-r{}-n{}-q{}".format(*s))
@pytest.mark.parametrize("cfg", [c for c, _ in QCACHE_CFGS], ids=[n for _, n in QCACHE_CFGS])
def test_qcache_prompt_matches_oracle(qapi, qgpu, cfg, shape, decode):
    import test_cuda_qcache as tq  # its device cache, steps and oracle

    api, be = qapi, qgpu
    D, H, r, n_past, nt = shape
    if D % cfg["group"] and cfg["axis_k"] == 0:
        pytest.skip("group does not divide head_dim")
    rng = np.random.default_rng(n_past + 7 * nt + D)
    dev = tq.DeviceCache(api, be, cfg, D, H, n_past + nt + 4)
    try:
        t = 0
        while t < n_past:  # the reference stores the cache, the device gets its bytes
            n = min(500, n_past - t)
            k = rng.standard_normal((n, H, D)).astype(np.float32)
            k[:, :, 3] *= 12.0
            assert dev.ref.store(k, rng.standard_normal((n, H, D)).astype(np.float32))
            t += n
        dev.upload()
        q = rng.standard_normal((nt, H * r, D)).astype(np.float32)
        k = rng.standard_normal((nt, H, D)).astype(np.float32)
        v = rng.standard_normal((nt, H, D)).astype(np.float32)
        scale = 1.0 / np.sqrt(D)
        got, _ = tq.run_step(api, be, dev, q, k, v, scale, decode, store=False)
        want = tq.oracle(dev.ref, q, k, v, scale, decode)
        _, V = tq.dense_cache(dev.ref)
        vmax = max(np.abs(V).max() if V.size else 0.0, np.abs(v).max())
        if cfg.get("score_correction", False):  # the f32 kernel: within ~1e-6 of the oracle
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * vmax)
        else:  # the tensor-core kernel (64 query vectors and more in every shape)
            np.testing.assert_allclose(got, want, rtol=0, atol=FA_ATOL * vmax)
    finally:
        dev.close()


# ---- the f32 kernel forced (variant fa_f32): the same results ----

OLD_NEW_CASES = [F16_CASES[2], F16_CASES[3], F16_CASES[8]]


def dump(path, cases="OLD_NEW_CASES"):
    """The outputs of the cases on the GPU of this process (run with a variant set)."""
    api_ = cuda_api(CDEF)
    be = next(gpu_backend(api_))
    try:
        out = {f"{case_id(c)}-{d}": run_f16(api_, be, c, d)[0] for c in globals()[cases] for d in (False, True)}
    finally:
        api_[1].iq_backend_free(be)
    np.savez(path, **out)


def dump_with(path, cases, **variants):
    tests = Path(__file__).resolve().parent
    env = dict(variants_env(**variants), INNERQ_NO_BUILD="1")
    code = f"import sys; sys.path.insert(0, {str(tests)!r}); import test_cuda_fa as t; t.dump({str(path)!r}, {cases!r})"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tests, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return np.load(path)


def test_f32_kernel_gives_the_same_results(api, gpu, tmp_path):
    old = dump_with(tmp_path / "old.npz", "OLD_NEW_CASES", fa_f32=1)
    for c in OLD_NEW_CASES:
        for d in (False, True):
            new, _, cv = run_f16(api, gpu, c, d)
            ref = old[f"{case_id(c)}-{d}"]
            assert_attention_close(new, ref, True, max(np.abs(cv).max(), np.abs(inputs(c)[2]).max()))
            assert not np.array_equal(new, ref), "the fa_f32 variant ran the same kernel"
