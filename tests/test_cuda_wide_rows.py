"""The CUDA decode kernels on rows as wide as a 7B-class model's (test_cuda_ops.py takes
k = 512): the matvec's whole 128-block segments and a partial one, the norm chain's float4
rows of 1024 threads and more, and SWIGLU writing the q8_1 x of the product after it.
Skipped without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_ops import NAMES, Q4_1, Q5_0, Q5_1, api, cpu, gpu, on_both, table, weight_bytes  # noqa: F401
from test_ops import Q4_0, Q8_0

Q32 = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0]


def check_q8_product(g, c, x, wd):
    """The matvec's agreement (test_mul_mat_every_weight_type's bounds for the q8 types)."""
    ref = x.astype(np.float64) @ wd.astype(np.float64).T
    scale = np.abs(x) @ np.abs(wd).T
    assert np.all(np.abs(g - ref) <= 2e-3 * scale + 1e-5), np.max(np.abs(g - ref) / scale)
    assert np.all(np.abs(g - c) <= 2e-6 * scale + 1e-5), np.max(np.abs(g - c) / scale)


def dequant(api, cpu, gpu, type_, raw, k):
    n = raw.shape[0]
    wd, _ = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_get_rows(gr.ctx, table(gr, type_, raw, k),
                                                                 gr.input(np.arange(n, dtype=np.int32))))
    return wd


@pytest.mark.parametrize("k", [4096, 4608])
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("type_", Q32, ids=NAMES.get)
def test_matvec_wide_rows(api, cpu, gpu, type_, m, k):
    rng = np.random.default_rng(11 + m)
    n = 37
    raw = weight_bytes(type_, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wd = dequant(api, cpu, gpu, type_, raw, k)
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_mul_mat(gr.ctx, table(gr, type_, raw, k), gr.input(x)))
    check_q8_product(g.reshape(m, n), c.reshape(m, n), x, wd)


@pytest.mark.parametrize("n,rows", [(4096, 1), (4096, 3), (5120, 2), (8192, 1)])
def test_norm_chain_wide_rows(api, cpu, gpu, n, rows):
    rng = np.random.default_rng(n + rows)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    y = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal((1, n)).astype(np.float32)
    k_out = 24
    raw = weight_bytes(Q4_0, k_out, n, rng)

    def chain(gr):
        lib = gr.lib
        return lib.iq_mul(gr.ctx, lib.iq_rms_norm(gr.ctx, lib.iq_add(gr.ctx, gr.input(x), gr.input(y)), 1e-5),
                          gr.input(w))

    c, g = on_both(api, cpu, gpu, chain)
    np.testing.assert_allclose(g, c, rtol=2e-5, atol=1e-5)
    # the chain's q8_1 copy, read by the product after it
    wd = dequant(api, cpu, gpu, Q4_0, raw, n)
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_mul_mat(gr.ctx, table(gr, Q4_0, raw, n), chain(gr)))
    h, _ = on_both(api, cpu, gpu, chain)  # the chain's result (the CPU's)
    check_q8_product(g.reshape(rows, k_out), c.reshape(rows, k_out), h.reshape(rows, n), wd)


@pytest.mark.parametrize("m", [1, 3])
def test_swiglu_then_product(api, cpu, gpu, m):
    rng = np.random.default_rng(5 + m)
    k, n = 4608, 40
    a = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    b = rng.standard_normal((m, k)).astype(np.float32)
    raw = weight_bytes(Q4_0, n, k, rng)
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_swiglu(gr.ctx, gr.input(a), gr.input(b)))
    np.testing.assert_allclose(g, c, rtol=2e-5, atol=1e-6)
    s = c.reshape(m, k)
    wd = dequant(api, cpu, gpu, Q4_0, raw, k)
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_mul_mat(
        gr.ctx, table(gr, Q4_0, raw, k), gr.lib.iq_swiglu(gr.ctx, gr.input(a), gr.input(b))))
    check_q8_product(g.reshape(m, n), c.reshape(m, n), s, wd)
