"""The fused CUDA decode attention over the InnerQ cache (cuda/qattention.cu, G = 32) against
the reference attention (iq_qcache_attention_ref) and a numpy dequantize-then-softmax oracle.

Caches are built on the CPU (the reference store: sink, quantized blocks and recent window all
filled), their region bytes copied into GPU buffers (the block format is the same on both), and
the ATTENTION op runs on the CUDA backend. Two kernels take it: the CTA kernel with dp4a
(cuda/qattention.cu) and the warp kernel on tensor cores (cuda/qattention-mma.cu, up to 8 query
vectors per KV head); a rule of shapes picks one, the test library's kernel variant qattn forces
one (tests/cuda_lib.py), and test_every_case_on_each_kernel runs the cases again under each. Both compute with packed 8-bit
codes and two 8-bit parts of the query and of the probabilities, so they are held to float
tolerance (about 2e-5 relative error per dot product), not to the CPU kernels' q8 / p8 tolerance.

Needs the backend to route ATTENTION over a quantized cache to
iq_cuda_qcache_attention_decode (the quantized-cache storage branch); skips without a GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from cuda_lib import VARIANTS_ENV, cuda_api, gpu_backend, variants_env
from test_attention_innerq import QUANT_LAYER, batch_of, layer_of
from test_innerq_attn import attention_ref, dense_cache, filled_cache, innerq_cfg
from test_ops import Graph


@pytest.fixture(scope="module")
def api():
    return cuda_api(QUANT_LAYER)


gpu = pytest.fixture(scope="module", name="gpu")(gpu_backend)


def run_gpu(api, gpu, qc, cfg, q, k, v, scale, decode):
    ffi, lib = api
    nt = q.shape[0]
    g = Graph(api, mem=4 << 20)
    bufs = []
    try:
        layer = layer_of(api, g, qc, cfg, device=gpu, bufs=bufs)
        seqs, pages, _ = batch_of(g, qc, nt)
        out = lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), layer, seqs, pages, scale)
        lib.iq_attention_set_decode_semantics(out, decode)
        return g.compute(gpu, out).reshape(q.shape)
    finally:
        g.close()
        for b in bufs:
            lib.iq_buffer_free(b)


def ref_decode(qc, q, scale, k, v, decode):
    """The reference with the batch rows as the op reads them: with decode semantics query i
    sees rows before its own rounded to f16 and its own as it is (one query at a time)."""
    if not decode:
        return attention_ref(qc, q, scale, k, v)
    out = np.zeros_like(q)
    for i in range(q.shape[0]):
        kr = np.concatenate([k[:i].astype(np.float16).astype(np.float32), k[i:i + 1]])
        vr = np.concatenate([v[:i].astype(np.float16).astype(np.float32), v[i:i + 1]])
        # rows 0..i, all seen by the last query of this sub-batch: take that query's output
        qq = np.zeros((i + 1,) + q.shape[1:], np.float32)
        qq[i] = q[i]
        out[i] = attention_ref(qc, qq, scale, kr, vr)[i]
    return out


def assert_matches_reference(api, gpu, qc, cfg, r, nt, seed, decode):
    """A batch of nt random queries (r per KV head) and rows over the cache qc: the GPU's attention
    equals the reference's to float tolerance (2e-4 of the largest value)."""
    D, H = qc.D, qc.H
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nt, H * r, D)).astype(np.float32)
    k = rng.standard_normal((nt, H, D)).astype(np.float32)
    v = rng.standard_normal((nt, H, D)).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    got = run_gpu(api, gpu, qc, cfg, q, k, v, scale, decode)
    ref = ref_decode(qc, q, scale, k, v, decode)
    _, V = dense_cache(qc)
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-4 * np.abs(V).max())


CASES = [  # bits_k, bits_v, D, H (KV heads), r, n_past, n_q, norm, correction[, S, R]
    (3, 2, 128, 2, 4, 1500, 1, True, True),
    (3, 2, 128, 1, 8, 900, 4, True, True),
    (2, 2, 64, 3, 1, 700, 2, True, False),
    (4, 4, 128, 2, 1, 1300, 3, False, True),
    (4, 2, 64, 2, 8, 600, 1, False, False),
    (2, 3, 128, 1, 4, 2100, 4, True, True),
    (3, 4, 64, 1, 4, 200, 1, True, True),   # first flush only: one quantized block
    (3, 2, 128, 2, 4, 100, 2, True, True),  # no quantized block yet
    # for the warp kernel on tensor cores (qattention-mma.cu): 8 vectors (two B tiles), D 64
    (3, 2, 128, 2, 4, 1600, 2, False, False),
    (4, 3, 64, 2, 2, 900, 3, True, True),
    # windows of the new default's size (S 64, R 256 at 4K; 600 / 2400 rows): many window CTAs
    (3, 2, 128, 1, 4, 3500, 1, False, False, 64, 256),
    (2, 4, 128, 2, 1, 5000, 1, True, False, 600, 2400),
    # more blocks than warp splits: several blocks per warp
    (3, 2, 128, 1, 4, 26000, 1, False, False),
    # 5-bit codes (4-bit plane + 1-bit plane): keys, values, both; both kernels (the warp kernel from
    # 1600 stored tokens on)
    (5, 3, 128, 2, 4, 1600, 1, True, True),
    (5, 3, 64, 2, 4, 700, 2, False, False),
    (3, 5, 128, 2, 4, 1600, 3, True, True),
    (5, 5, 64, 1, 8, 1800, 1, True, False),
    # head_dim 256 (Gemma 3): the CTA kernel whichever kernel is asked for (qa_mma_ok)
    (3, 2, 256, 1, 4, 1500, 1, True, True),
    (4, 3, 256, 1, 4, 700, 4, False, False),
    (2, 5, 256, 2, 2, 900, 2, True, False),
]


@pytest.mark.parametrize("decode", [False, True], ids=["prompt", "decode"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}v{c[1]}-D{c[2]}-H{c[3]}-r{c[4]}-n{c[5]}-q{c[6]}"
                         f"{'-norm' if c[7] else ''}{'-corr' if c[8] else ''}{f'-S{c[9]}R{c[10]}' if len(c) > 9 else ''}")
def test_fused_attention_matches_reference(api, gpu, case, decode):
    bk, bv, D, H, r, n_past, nt, norm, corr = case[:9]
    S, R = case[9:] if len(case) > 9 else (32, 96)
    cfg = innerq_cfg(bk, bv, 32, S=S, R=R, norm=norm, correction=corr)
    qc, _, _ = filled_cache(cfg, D, H, n_past, [400, 1, 63, 1, 100, 7], seed=n_past, n_ctx=n_past + nt)
    assert qc.c.n_sink > 0 and qc.c.n_recent > 0 and (n_past < 200 or qc.c.n_quant > 0)
    assert_matches_reference(api, gpu, qc, cfg, r, nt, n_past + 1, decode)


FMT_CASES = [  # bits_k, bits_v, D, H (KV heads), r, n_past, n_q, correction, value row scales, 8-bit parameters
    (3, 2, 128, 2, 4, 1500, 1, True, True, True),
    (3, 2, 64, 3, 3, 900, 2, True, True, True),    # SmolLM2's heads
    (4, 3, 128, 1, 8, 700, 4, False, True, False),  # row scales alone: 16-byte copies
    (2, 4, 64, 2, 1, 1300, 3, True, False, True),   # 8-bit parameters alone: 8-byte copies
    (5, 5, 256, 1, 4, 900, 1, True, True, True),
    (3, 2, 128, 2, 4, 100, 2, True, True, True),    # no quantized block yet
]


@pytest.mark.parametrize("decode", [False, True], ids=["prompt", "decode"])
@pytest.mark.parametrize("case", FMT_CASES, ids=lambda c: f"k{c[0]}v{c[1]}-D{c[2]}-H{c[3]}-r{c[4]}-n{c[5]}-q{c[6]}"
                         f"{'-corr' if c[7] else ''}{'-rows' if c[8] else ''}{'-p8' if c[9] else ''}")
def test_fused_attention_reads_row_scales_and_8_bit_parameters(api, gpu, case, decode):
    """Blocks with value row scales and / or 8-bit group parameters: the CTA kernel decodes each
    group's (d, m) as iq_p8_decode_group and weighs a token's probability by its row scale (in 16
    bits of the block's largest weight), to the same tolerance as the fp16 blocks."""
    bk, bv, D, H, r, n_past, nt, corr, rows, p8 = case
    cfg = innerq_cfg(bk, bv, 32, correction=corr, vscale=rows, p8=p8)
    qc, _, _ = filled_cache(cfg, D, H, n_past, [400, 1, 63, 1, 100, 7], seed=n_past + 3, n_ctx=n_past + nt)
    assert_matches_reference(api, gpu, qc, cfg, r, nt, n_past + 2, decode)


def test_fused_attention_matches_numpy_oracle(api, gpu):
    """Dequantize (dense_cache), then f64 softmax attention: no correction, one query."""
    D, H, r, n_past = 128, 2, 4, 1700
    cfg = innerq_cfg(3, 2, 32, correction=False)
    qc, _, _ = filled_cache(cfg, D, H, n_past, [400, 1, 63, 1, 100, 7], seed=3, n_ctx=n_past + 1)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, H * r, D)).astype(np.float32)
    k = rng.standard_normal((1, H, D)).astype(np.float32)
    v = rng.standard_normal((1, H, D)).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    got = run_gpu(api, gpu, qc, cfg, q, k, v, scale, False)
    K, V = dense_cache(qc)
    want = np.zeros((1, H * r, D))
    for h in range(H):
        Kh = np.concatenate([K[h], k[0, h][None].astype(np.float64)])
        Vh = np.concatenate([V[h], v[0, h][None].astype(np.float64)])
        for j in range(r):
            s = scale * Kh @ q[0, h * r + j].astype(np.float64)
            p = np.exp(s - s.max())
            want[0, h * r + j] = p @ Vh / p.sum()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4 * np.abs(V).max())


@pytest.mark.skipif(VARIANTS_ENV in os.environ, reason="run from the default run")
def test_every_case_on_each_kernel(gpu):
    """The cases above again with the kernel forced (the default picks by shape, so most of them
    take the CTA kernel): the warp kernel wherever it applies, then the CTA kernel everywhere."""
    for mode in ("mma", "dp4a"):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                            "matches"], env=variants_env(qattn=mode), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0 and " passed" in r.stdout, (mode, r.stdout[-4000:])


@pytest.mark.skipif(VARIANTS_ENV in os.environ, reason="run from the default run")
@pytest.mark.parametrize("variants", [{"win_rows": 1}, {"qattn": "mma", "qw_win": 1}],
                         ids=["element-by-element", "one-window-cta"])
def test_window_rows_other_schedules(gpu, variants):
    """The cases above again with the window chunks read element by element (variant win_rows)
    rather than through the shared-memory tiles, and on the warp kernel with one window CTA per
    head (every window chunk through its two tile buffers in turn): against the reference."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "matches"],
                       env=variants_env(**variants), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, (variants, r.stdout[-4000:])
