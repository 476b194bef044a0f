"""The CUDA backend op by op against the CPU backend (and numpy), on random tensors.

Every op runs on both backends of the same (CUDA) library: the CPU backend is the
specification, already tested against numpy oracles in test_ops.py. Weight types gguf.quants
can't write (the K-quants, the iq4 types) are random blocks with sane scales, dequantized by
the CPU's get_rows for the reference. Skipped without a GPU.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from cuda_lib import assert_attention_close, cpu_backend, cuda_api, gpu_backend
from test_ops import (CDEF, F16, F32, I32, Q4_0, Q8_0, Cache, Graph, attention_ref, kv_rows, quant, read_f32,
                      seqs_input)

Q = gguf.GGMLQuantizationType
BF16, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 30, 3, 6, 7, 12, 13, 14
Q2_K, Q3_K, IQ4_NL, IQ4_XS = 10, 11, 20, 23
WEIGHT_TYPES = [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS]
NAMES = {F32: "f32", F16: "f16", BF16: "bf16", Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q5_1: "q5_1",
         Q8_0: "q8_0", Q2_K: "q2_K", Q3_K: "q3_K", Q4_K: "q4_K", Q5_K: "q5_K", Q6_K: "q6_K", IQ4_NL: "iq4_nl",
         IQ4_XS: "iq4_xs"}
# Types gguf.quants can't quantize: random blocks, with sane fp16 scales at these byte offsets.
RANDOM_BLOCKS = {Q2_K: [80, 82], Q3_K: [108], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208], IQ4_NL: [0], IQ4_XS: [0]}


@pytest.fixture(scope="module")
def api():
    return cuda_api(CDEF)


gpu = pytest.fixture(scope="module", name="gpu")(gpu_backend)


cpu = pytest.fixture(scope="module", name="cpu")(cpu_backend)


def on_both(api, cpu, gpu, build):
    """build(graph) -> output tensor, run on the CPU and the GPU: (cpu result, gpu result)."""
    out = []
    for be in (cpu, gpu):
        g = Graph(api, mem=4 << 20)
        try:
            out.append(g.compute(be, build(g)))
        finally:
            g.close()
    return out


def weight_bytes(type_, rows, k, rng):
    """Random rows of k elements in type_: raw bytes (uint8 [rows, row_bytes]) or f32."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if type_ == F32:
        return x
    if type_ == F16:
        return x.astype(np.float16).view(np.uint8)
    if type_ == BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if type_ in RANDOM_BLOCKS:
        elems, bs = gguf.GGML_QUANT_SIZES[Q(type_)]
        raw = rng.integers(0, 256, size=(rows, k // elems, bs), dtype=np.uint8)
        for off in RANDOM_BLOCKS[type_]:
            scale = (rng.random((rows, k // elems, 1)) * 0.02 + 0.001).astype(np.float16)
            raw[..., off:off + 2] = scale.view(np.uint8)
        return raw.reshape(rows, -1)
    return gguf.quants.quantize(x, Q(type_)).view(np.uint8)


def table(g, type_, raw, k):
    return g.input(raw, type_, shape=[k, raw.shape[0]])


# ---- small ops ----


@pytest.mark.parametrize("type_", WEIGHT_TYPES, ids=NAMES.get)
def test_get_rows_every_weight_type(api, cpu, gpu, type_):
    rng = np.random.default_rng(1)
    k = 512
    raw = weight_bytes(type_, 12, k, rng)
    ids = np.array([3, 0, 11, 3, 7], dtype=np.int32)
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_get_rows(gr.ctx, table(gr, type_, raw, k), gr.input(ids)))
    np.testing.assert_array_equal(g, c)  # both are the reference dequantization
    if type_ not in (F32, F16, BF16):
        np.testing.assert_array_equal(g, gguf.quants.dequantize(raw, Q(type_))[ids])


def test_get_rows_bad_id_fails(api, gpu):
    g = Graph(api)
    try:
        t = g.input(np.zeros((4, 32), np.float32))
        out = g.lib.iq_get_rows(g.ctx, t, g.input(np.array([1, 7], np.int32)))
        with pytest.raises(AssertionError, match="outside"):
            g.compute(gpu, out)
    finally:
        g.close()


def test_small_ops(api, cpu, gpu):
    """rms_norm, mul, add, swiglu; then an ADD of one row over all (a bias) and GEGLU."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 576)) * 3).astype(np.float32)
    w = rng.standard_normal((1, 576)).astype(np.float32)
    y = rng.standard_normal((5, 576)).astype(np.float32)

    def build(gr):
        lib = gr.lib
        n = lib.iq_mul(gr.ctx, lib.iq_rms_norm(gr.ctx, gr.input(x), 1e-5), gr.input(w))
        s = lib.iq_swiglu(gr.ctx, lib.iq_add(gr.ctx, n, gr.input(y)), gr.input(x))
        return lib.iq_geglu(gr.ctx, lib.iq_add(gr.ctx, s, gr.input(w)), gr.input(y))

    c, g = on_both(api, cpu, gpu, build)
    np.testing.assert_allclose(g, c, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("n_rot,ff,mscale", [(64, False, 1.0), (32, False, 1.0), (128, True, 1.0), (96, False, 1.19),
                                             (128, True, 0.9)])
def test_rope(api, cpu, gpu, n_rot, ff, mscale):
    """RoPE on the GPU as on the CPU, with a magnitude factor on cos and sin too (YaRN's mscale,
    LongRoPE's attn_factor: Phi-4-mini rotates 96 of 128 channels, the rest unscaled)."""
    rng = np.random.default_rng(6)
    hd, nh, nt = 128, 3, 5
    x = rng.standard_normal((nt, nh, hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 1000, 32000], dtype=np.int32)
    factors = (1.0 + rng.random(n_rot // 2) * 8).astype(np.float32)

    def build(gr):
        ft = gr.input(factors) if ff else gr.ffi.NULL
        return gr.lib.iq_rope(gr.ctx, gr.input(x), gr.input(pos), ft, n_rot, 500000.0, mscale)

    c, g = on_both(api, cpu, gpu, build)
    np.testing.assert_allclose(g, c, atol=2e-4)
    np.testing.assert_array_equal(g.reshape(nt, nh, hd)[..., n_rot:], x[..., n_rot:])


# ---- mul_mat: the matvec (m <= 64, in tiles of columns above 8) and the tensor-core GEMM ----


@pytest.mark.parametrize("m", [1, 3, 8, 9, 40, 64, 65, 200])
@pytest.mark.parametrize("type_", WEIGHT_TYPES, ids=NAMES.get)
def test_mul_mat_every_weight_type(api, cpu, gpu, type_, m):
    rng = np.random.default_rng(7 + m)
    k, n = 512, 300 if m == 200 else 72
    raw = weight_bytes(type_, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wd, _ = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_get_rows(gr.ctx, table(gr, type_, raw, k),
                                                                 gr.input(np.arange(n, dtype=np.int32))))
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_mul_mat(gr.ctx, table(gr, type_, raw, k), gr.input(x)))
    g, c = g.reshape(m, n), c.reshape(m, n)
    ref = x.astype(np.float64) @ wd.astype(np.float64).T
    scale = np.abs(x) @ np.abs(wd).T
    # The 32-element quantized types read x as the CPU does, q8 codes (the matvec: the CPU's
    # integer products, so the two agree to the order of the float sums); the GEMM multiplies
    # f16 operands with f32 sums; the other types' matvec is f32 throughout.
    q8 = type_ in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
    tol = (2e-3 if q8 else 1e-5) if m <= 64 else 3e-3
    assert np.all(np.abs(g - ref) <= tol * scale + 1e-5), np.max(np.abs(g - ref) / scale)
    close = 2e-6 if q8 and m <= 64 else 5e-3
    assert np.all(np.abs(g - c) <= close * scale + 1e-5), np.max(np.abs(g - c) / scale)


@pytest.mark.parametrize("mvq", [0, 1], ids=["tile", "warp_slots"])
@pytest.mark.parametrize("type_", WEIGHT_TYPES, ids=NAMES.get)
def test_mul_mat_columns_have_the_same_bits_at_any_width(api, gpu, type_, mvq):
    """A column of a product of 1, 5, 8, 40 or 64 columns: the same bits (a decoding sequence's
    logits do not depend on how many sequences share its step). The 32-element formats also
    with rows of 6 blocks (the matvec's groups of 2 blocks instead of 4), of 144 blocks (36
    groups of 4: a lane of the matvec sums two groups, four of its 32 slots) and of 130 blocks
    (65 groups of 2), on both kernels of 9-64 columns (iq_cu_mvq_tile, and iq_cu_mvq: the
    variant "mvq" 1); 72 rows (the tile kernel's blocks of 32 rows: a part block at the end)."""
    if mvq and type_ not in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        pytest.skip("the variant picks between kernels of the 32-element formats")
    rng = np.random.default_rng(11)
    n = 72
    _, lib = api
    assert lib.iq_cuda_set_variant(b"mvq", mvq) == 0
    try:
        for k in [512, 192, 4608, 4160] if type_ in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) else [512]:
            raw = weight_bytes(type_, n, k, rng)
            x = rng.standard_normal((64, k)).astype(np.float32)

            def product(rows):
                g = Graph(api, mem=8 << 20)
                try:
                    out = g.compute(gpu, g.lib.iq_mul_mat(g.ctx, table(g, type_, raw, k), g.input(x[rows])))
                    return out.reshape(len(rows), n)
                finally:
                    g.close()

            wide = product(list(range(64)))
            for rows in ([0], [63], list(range(5)), list(range(33, 41)), list(range(40)), list(range(9, 26))):
                np.testing.assert_array_equal(product(rows), wide[rows], err_msg=f"k {k}, rows {rows[0]}..{rows[-1]}")
    finally:
        lib.iq_cuda_set_variant(b"mvq", 0)


@pytest.mark.parametrize("type_", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0], ids=NAMES.get)
def test_gemm_on_blocks_has_the_bits_of_the_f16_copy(api, gpu, type_):
    """The GEMM of the 32-element formats reads W's blocks and turns them into f16 tiles itself
    (iq_cu_gemm_wq); with the variant "gemm_w16" it multiplies W's f16 copy. Both give the same
    bits: rows and columns past the tiles' edges (300 rows: two tiles of 128 and a part; 65, 200
    and 300 columns), k of 2, 6, 130 and 144 blocks, and rows of an odd number of blocks (3), which
    take the copy either way."""
    rng = np.random.default_rng(23)
    _, lib = api

    def product(raw, x, k, n):
        g = Graph(api, mem=64 << 20)
        try:
            return g.compute(gpu, g.lib.iq_mul_mat(g.ctx, table(g, type_, raw, k), g.input(x))).reshape(len(x), n)
        finally:
            g.close()

    for k, n, m in [(64, 130, 65), (192, 300, 200), (4160, 72, 300), (4608, 256, 129), (96, 40, 70)]:
        raw = weight_bytes(type_, n, k, rng)
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, :32] *= 50.0  # a block of large values: x's q8 rounding and f16's range
        blocks = product(raw, x, k, n)
        assert lib.iq_cuda_set_variant(b"gemm_w16", 1) == 0
        try:
            copy = product(raw, x, k, n)
        finally:
            lib.iq_cuda_set_variant(b"gemm_w16", 0)
        np.testing.assert_array_equal(blocks, copy, err_msg=f"k {k}, n {n}, m {m}")
        assert np.all(np.isfinite(blocks))


@pytest.mark.parametrize("m", [1, 8, 9, 32, 40, 257])
@pytest.mark.parametrize("k,n", [(128, 128), (64, 64), (256, 256), (96, 40)])
def test_mul_mat_small_f32_in_f32(api, cpu, gpu, k, n, m):
    """A small f32 W (the cache's rotation, D x D) takes a kernel of its own in f32 for any
    number of columns, where larger products round x to f16 for the GEMM: the GPU agrees with
    the CPU and a float64 reference to f32 rounding."""
    rng = np.random.default_rng(k + n + m)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    c, g = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_mul_mat(gr.ctx, gr.input(w), gr.input(x)))
    g, c = g.reshape(m, n), c.reshape(m, n)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x) @ np.abs(w).T
    assert np.all(np.abs(g - ref) <= 1e-5 * scale + 1e-6), np.max(np.abs(g - ref) / scale)
    assert np.all(np.abs(g - c) <= 2e-5 * scale + 1e-6), np.max(np.abs(g - c) / scale)


@pytest.mark.parametrize("hd,n_rot", [(128, 128), (64, 32)])
def test_rope_then_rotation(api, cpu, gpu, hd, n_rot):
    """A ROPE and the small f32 product that reads it (the cache's rotation of queries and keys)
    run as one launch on the GPU: the product equals the CPU's, and so does the rope's own result
    where another node reads it too."""
    rng = np.random.default_rng(hd + n_rot)
    nh, nt = 3, 4
    x = rng.standard_normal((nt, nh, hd)).astype(np.float32)
    pos = np.array([0, 5, 300, 32000], dtype=np.int32)
    w, _ = np.linalg.qr(rng.standard_normal((hd, hd)))
    w = w.astype(np.float32)

    def rotated(gr):
        r = gr.lib.iq_rope(gr.ctx, gr.input(x), gr.input(pos), gr.ffi.NULL, n_rot, 500000.0, 1.0)
        return gr.lib.iq_mul_mat(gr.ctx, gr.input(w), r)

    def both(gr):
        r = gr.lib.iq_rope(gr.ctx, gr.input(x), gr.input(pos), gr.ffi.NULL, n_rot, 500000.0, 1.0)
        return gr.lib.iq_add(gr.ctx, gr.lib.iq_mul_mat(gr.ctx, gr.input(w), r), r)

    for build in (rotated, both):
        c, g = on_both(api, cpu, gpu, build)
        np.testing.assert_allclose(g, c, atol=5e-4)
    # the product is the rope's rows times W^T (float64 reference on the CPU's rope)
    r_cpu, _ = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_rope(gr.ctx, gr.input(x), gr.input(pos), gr.ffi.NULL, n_rot,
                                                                500000.0, 1.0))
    ref = r_cpu.reshape(-1, hd).astype(np.float64) @ w.astype(np.float64).T
    c, g = on_both(api, cpu, gpu, rotated)
    np.testing.assert_allclose(g.reshape(-1, hd), ref, atol=5e-4)


def hadamard_rotation(d, rng):
    """T H T / sqrt(d) with random signs T, as the KV cache builds its rotation (src/kv-cache.c)."""
    i = np.arange(d)
    h = np.array([[1 - 2 * (bin(a & b).count("1") % 2) for b in i] for a in i], dtype=np.float64)
    t = np.where(rng.random(d) < 0.5, -1.0, 1.0)
    return (t[:, None] * h * t[None, :] / np.sqrt(d)).astype(np.float32)


HADAMARD = 4  # IQ_FLAG_HADAMARD


@pytest.mark.parametrize("hd,n_rot", [(128, 128), (64, 32), (256, 256), (128, 96)])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_hadamard_rotation(api, cpu, gpu, hd, n_rot, rope):
    """A W flagged IQ_FLAG_HADAMARD (the cache's rotation) runs on the GPU as a Walsh-Hadamard
    transform per row, fused with the ROPE it reads: the CPU's product (the plain matrix) and a
    float64 reference to f32 rounding, also where another node reads the rope's rows; a matrix
    of the same shape without the flag still takes the product."""
    rng = np.random.default_rng(7 * hd + n_rot)
    nh, nt = 5, 3
    x = rng.standard_normal((nt, nh, hd)).astype(np.float32)
    pos = np.array([0, 17, 40000], dtype=np.int32)
    w = hadamard_rotation(hd, rng)

    def src(gr):
        a = gr.input(x)
        return gr.lib.iq_rope(gr.ctx, a, gr.input(pos), gr.ffi.NULL, n_rot, 500000.0, 1.0) if rope else a

    def rotated(gr, flag=True):
        t = gr.input(w)
        t.flags |= HADAMARD if flag else 0
        return gr.lib.iq_mul_mat(gr.ctx, t, src(gr))

    def both(gr):
        t = gr.input(w)
        t.flags |= HADAMARD
        r = src(gr)
        return gr.lib.iq_add(gr.ctx, gr.lib.iq_mul_mat(gr.ctx, t, r), r)

    r_cpu, _ = on_both(api, cpu, gpu, src)
    ref = r_cpu.reshape(-1, hd).astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(r_cpu.reshape(-1, hd)) @ np.abs(w).T.astype(np.float64)
    for build, tol in ((rotated, scale), (both, scale + np.abs(r_cpu.reshape(-1, hd))), (lambda gr: rotated(gr, False), scale)):
        c, g = on_both(api, cpu, gpu, build)
        assert np.all(np.abs(g - c).reshape(-1, hd) <= 2e-5 * tol + 1e-6), np.max(np.abs(g - c).reshape(-1, hd) / tol)
    c, g = on_both(api, cpu, gpu, rotated)
    assert np.all(np.abs(g.reshape(-1, hd) - ref) <= 1e-5 * scale + 1e-6), np.max(np.abs(g.reshape(-1, hd) - ref) / scale)


def test_hadamard_rotations_in_one_launch(api, cpu, gpu):
    """Rotations of q and k (each after its rope) and of v next to each other in the graph (the
    model's order) run as one launch on the GPU: each equals the CPU's product."""
    rng = np.random.default_rng(11)
    hd, nt = 128, 2
    x = [rng.standard_normal((nt, nh, hd)).astype(np.float32) for nh in (8, 8, 8)]
    pos = np.array([3, 900], dtype=np.int32)
    w = hadamard_rotation(hd, rng)

    def build(gr):
        t = gr.input(w)
        t.flags |= HADAMARD
        p = gr.input(pos)
        q, k = (gr.lib.iq_mul_mat(gr.ctx, t, gr.lib.iq_rope(gr.ctx, gr.input(a), p, gr.ffi.NULL, hd, 500000.0, 1.0))
                for a in x[:2])
        v = gr.lib.iq_mul_mat(gr.ctx, t, gr.input(x[2]))
        # add(q, add(k, v)): the graph's order is rope q, q's rotation, rope k, k's, v's
        return gr.lib.iq_add(gr.ctx, q, gr.lib.iq_add(gr.ctx, k, v))

    c, g = on_both(api, cpu, gpu, build)
    np.testing.assert_allclose(g, c, rtol=0, atol=2e-5 * np.abs(c).max())


@pytest.mark.parametrize("k,m,type_,rows", [(512, 1, Q4_0, (72, 24, 24)), (576, 1, Q4_0, (72, 24, 24)),
                                            (576, 3, Q4_1, (72, 24, 24)), (192, 1, Q8_0, (72, 24, 24)),
                                            (512, 100, Q4_0, (300, 130, 24)), (576, 300, Q5_1, (72, 256, 129))],
                         ids=["rows-of-16-blocks", "rows-of-18-blocks", "18-blocks-3-columns", "q8_0-6-blocks",
                              "gemm-100-columns", "gemm-300-columns"])
def test_products_of_one_x_in_one_launch(api, cpu, gpu, k, m, type_, rows):
    """Three products of the same x next to each other in the graph (q, k, v) run as one launch
    on the GPU: the matvec's (iq_cu_matvec_s where rows are whole groups of 4 blocks,
    iq_cu_matvec_g with groups of 2 otherwise: SmolLM2's 576 = 18 blocks), or above IQ_MVQ_COLS
    columns the GEMM's on W's blocks (iq_cu_gemm_wq, each product its own tiles of 128 rows, the
    last of each part partial here): each equals the CPU's, and each has the bits of the same
    product launched alone."""
    rng = np.random.default_rng(12)
    raws = [quant(rng.standard_normal((n, k)), type_)[0] for n in rows]
    x = rng.standard_normal((m, k)).astype(np.float32)
    outs = []
    for be in (cpu, gpu):
        gr = Graph(api, mem=4 << 20)
        try:
            xi = gr.input(x)
            outs.append(gr.compute_all(be, [gr.lib.iq_mul_mat(gr.ctx, table(gr, type_, raw, k), xi) for raw in raws]))
        finally:
            gr.close()
    for i, raw in enumerate(raws):
        _, alone = on_both(api, cpu, gpu, lambda gr: gr.lib.iq_mul_mat(gr.ctx, table(gr, type_, raw, k), gr.input(x)))
        c, g = outs[0][i], outs[1][i]
        # the GEMM multiplies f16 operands (test_mul_mat_every_weight_type), the matvec q8 codes
        np.testing.assert_allclose(g, c, rtol=0, atol=(1e-5 if m <= 64 else 2e-3) * np.abs(c).max())
        np.testing.assert_array_equal(g, alone)


@pytest.mark.parametrize("hd", [64, 128])
def test_hadamard_rotation_then_q4_0_product(api, cpu, gpu, hd):
    """The rotation of the attention's output and the output projection that reads it (a q4_0
    W): the GPU makes the product's q8_1 copy of x in the rotation's launch (8 lanes per block at
    head_dim 128, 16 at 64); the product equals the CPU's (which quantizes x to q8 itself) to the
    rounding of a few of x's codes, and the float64 product to the q8 rounding of x."""
    rng = np.random.default_rng(3)
    nh, n = 8, 64
    w = hadamard_rotation(hd, rng)
    raw, wd = quant(rng.standard_normal((n, hd * nh)), Q4_0)
    for nt in (1, 3):
        a = rng.standard_normal((nt, nh, hd)).astype(np.float32)

        def build(gr):
            t = gr.input(w)
            t.flags |= HADAMARD
            r = gr.lib.iq_mul_mat(gr.ctx, t, gr.lib.iq_reshape_2d(gr.ctx, gr.input(a), hd, nh * nt))
            return gr.lib.iq_mul_mat(gr.ctx, table(gr, Q4_0, raw, hd * nh), gr.lib.iq_reshape_2d(gr.ctx, r, hd * nh, nt))

        c, g = on_both(api, cpu, gpu, build)
        g, c = g.reshape(nt, n), c.reshape(nt, n)
        x = (a.astype(np.float64) @ w.T.astype(np.float64)).reshape(nt, hd * nh)
        ref = x @ wd.astype(np.float64).T
        scale = np.abs(x) @ np.abs(wd.astype(np.float64)).T
        assert np.all(np.abs(g - c) <= 1e-4 * scale + 1e-5), np.max(np.abs(g - c) / scale)
        assert np.all(np.abs(g - ref) <= 2e-3 * scale + 1e-5), np.max(np.abs(g - ref) / scale)


# ---- the KV cache and attention ----


ATTN_CASES = [
    # type, head_dim, n_kv_head, r, n_tokens, n_past
    (F32, 64, 3, 3, 1, 37),
    (F16, 64, 3, 3, 1, 1000),    # decode over a long cache: split positions, exact merge
    (F16, 128, 8, 4, 1, 3000),
    (F16, 128, 2, 1, 7, 70),
    (Q8_0, 64, 3, 3, 30, 100),   # several query tiles
    (Q4_0, 128, 1, 3, 5, 64),
    (F16, 64, 3, 3, 12, 0),      # a first prompt chunk: the batch alone
    (Q8_0, 128, 4, 4, 300, 600),
    # head_dim 256 (Gemma 3): the f32 kernel at every batch size (attention-fa.cuh has no D 256)
    (F16, 256, 1, 4, 1, 1000),
    (Q8_0, 256, 2, 2, 40, 130),
    (F32, 256, 1, 4, 70, 0),
]


@pytest.mark.parametrize("decode", [False, True], ids=["batch", "decode"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention(api, cpu, gpu, case, decode):
    type_, hd, n_kv, r, nt, n_past = case
    seed = hash(case) % 2**32
    rng = np.random.default_rng(seed)
    nh = n_kv * r
    q = rng.standard_normal((nt, nh, hd)).astype(np.float32)
    k, v = kv_rows(rng, nt, n_kv, hd)
    scale = 1.0 / np.sqrt(hd)
    outs, caches = [], []
    for be in (cpu, gpu):
        g = Graph(api)
        cache = Cache(g, be, type_, hd, n_kv, n_past + nt + 3, np.random.default_rng(seed), shuffle=False)
        a = g.lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), cache.layer,
                               seqs_input(g, [(0, n_past, len(q))]), cache.pages, scale)
        g.lib.iq_attention_set_decode_semantics(a, decode)
        outs.append(g.compute(be, a))
        caches.append(cache)
        g.keep.append(cache)
        cache.g = g
    c, gp = outs
    fa = type_ == F16 and hd in (64, 128)  # the tensor-core kernel at any batch size (f16 operands)
    vmax = max(np.abs(v).max(), np.abs(caches[0].v).max())
    assert_attention_close(gp, c, fa, vmax)
    if not decode:
        ref = attention_ref(q, k, v, caches[0].k, caches[0].v, n_past, scale)
        assert_attention_close(gp.reshape(ref.shape), ref, fa, vmax)
    for cache in caches:
        cache.free()
        cache.g.close()


WINDOW_CASES = [
    # type, head_dim, n_kv_head, r, sequences [(n_past, n_tokens)], window
    (F16, 128, 2, 4, [(1000, 1)], 40),      # decode: the window's positions, split
    (F16, 64, 2, 4, [(100, 77)], 16),       # a prompt batch on the tensor-core kernel
    (F16, 128, 1, 8, [(3000, 33)], 100),    # ... over a long cache (splits wholly below the window)
    (Q8_0, 128, 1, 2, [(0, 90)], 33),       # the f32 kernel, several query tiles, the batch alone
    (Q4_0, 64, 3, 3, [(37, 5)], 64),        # a window longer than what the queries reach
    (F16, 256, 1, 4, [(700, 1)], 16),
    (F16, 256, 1, 4, [(50, 70)], 16),
    (F32, 64, 2, 2, [(40, 1), (100, 30), (0, 80), (500, 3)], 24),  # several sequences
    (F16, 128, 1, 4, [(1000, 1), (70, 70), (5, 2)], 64),
    (F16, 256, 1, 4, [(300, 1), (30, 40), (90, 4)], 16),
]


@pytest.mark.parametrize("decode", [False, True], ids=["batch", "decode"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "{}-D{}-H{}-r{}-{}-w{}".format(
    NAMES[c[0]], c[1], c[2], c[3], "+".join(f"{p}:{n}" for p, n in c[4]), c[5]))
def test_attention_sliding_window(api, cpu, gpu, case, decode):
    """ATTENTION of a layer with a sliding window (iq_kv_layer.window): the GPU's kernels (f32 and
    tensor-core, one sequence and several in a step) give the CPU's output, and without decode
    semantics the float64 oracle's."""
    type_, hd, n_kv, r, parts, window = case
    seed = hash((hd, n_kv, r, window, len(parts))) % 2**32
    rng = np.random.default_rng(seed)
    nt = sum(n for _, n in parts)
    q = rng.standard_normal((nt, n_kv * r, hd)).astype(np.float32)
    k, v = kv_rows(rng, nt, n_kv, hd)
    scale = 1.0 / np.sqrt(hd)
    n_ctx = max(p + n for p, n in parts) + 3
    outs = []
    for be in (cpu, gpu):
        g = Graph(api, mem=16 << 20)
        cache = Cache(g, be, type_, hd, n_kv, n_ctx, np.random.default_rng(seed), n_slots=len(parts))
        try:
            cache.layer.window = window
            seqs = seqs_input(g, [(s, p, n) for s, (p, n) in enumerate(parts)])
            a = g.lib.iq_attention(g.ctx, g.input(q), g.input(k), g.input(v), cache.layer, seqs, cache.pages, scale)
            g.lib.iq_attention_set_decode_semantics(a, decode)
            outs.append(g.compute(be, a).reshape(nt, -1))
            ck, cv = cache.k, cache.v
            rows = [(cache.seq_rows(ck, s), cache.seq_rows(cv, s)) for s in range(len(parts))]
        finally:
            cache.free()
            g.close()
    fa = type_ == F16 and hd in (64, 128)  # the tensor-core kernel at any batch size (f16 operands)
    vmax = max(np.abs(v).max(), np.abs(cv).max())
    assert_attention_close(outs[1], outs[0], fa, vmax)
    if not decode:
        t0 = 0
        for s, (p, n) in enumerate(parts):
            want = attention_ref(q[t0:t0 + n], k[t0:t0 + n], v[t0:t0 + n], rows[s][0], rows[s][1], p, scale, window)
            assert_attention_close(outs[1][t0:t0 + n], want, fa, vmax, err_msg=f"sequence {s}")
            t0 += n


@pytest.mark.parametrize("types", [(F32, F32), (F16, F16), (Q8_0, Q8_0), (Q4_0, Q4_0), (Q8_0, F16)],
                         ids=lambda t: f"{NAMES[t[0]]}-{NAMES[t[1]]}")
def test_kv_store_bytes_equal_the_cpu(api, cpu, gpu, types):
    hd, n_kv, nt, n_past, n_ctx = 128, 2, 5, 9, 16
    rng = np.random.default_rng(11)
    k, v = kv_rows(rng, nt, n_kv, hd)
    stored = []
    for be in (cpu, gpu):
        g = Graph(api)
        cache = Cache(g, be, types[0], hd, n_kv, n_ctx, np.random.default_rng(3), shuffle=False)
        if types[1] != types[0]:  # a V tensor of another type
            lib, L = g.lib, cache.layer
            L.type_v = types[1]
            L.v = lib.iq_new_tensor_3d(g.ctx, types[1], hd, cache.rows, n_kv)
            cache.vbuf = lib.iq_backend_alloc_buffer(be, lib.iq_nbytes(L.v))
            lib.iq_tensor_place(L.v, cache.vbuf, 0)
            zero = bytes(lib.iq_nbytes(L.v))
            lib.iq_tensor_set(L.v, zero, 0, len(zero))
        after = np.ones((nt, 32), np.float32)
        g.compute(be, g.lib.iq_kv_store(g.ctx, g.input(after), g.input(k), g.input(v), cache.layer,
                                        seqs_input(g, [(0, n_past, nt)]), cache.pages))
        got = []
        for t in (cache.layer.k, cache.layer.v):
            n = g.lib.iq_nbytes(t)
            buf = g.ffi.new("char[]", n)
            g.lib.iq_tensor_get(t, buf, 0, n)
            got.append(bytes(g.ffi.buffer(buf)))
        stored.append(got)
        if types[1] != types[0]:
            g.lib.iq_buffer_free(cache.vbuf)
        cache.free()
        g.close()
    assert stored[0][0] == stored[1][0] and stored[0][1] == stored[1][1]


def test_decode_token_by_token_equals_batch_with_decode_semantics(api, gpu):
    """On the GPU: kv_store + attention one token at a time == one batch with decode semantics."""
    rng = np.random.default_rng(12)
    hd, n_kv, r, n, n_past = 64, 2, 3, 6, 40
    q = rng.standard_normal((n, n_kv * r, hd)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    for type_ in (F16, Q8_0, Q4_0):
        outs = []
        for batched in (True, False):
            cg = Graph(api)
            cache = Cache(cg, gpu, type_, hd, n_kv, 64, np.random.default_rng(5), shuffle=False)
            rows = []
            steps = [(0, n)] if batched else [(i, 1) for i in range(n)]
            for i0, m in steps:
                g = Graph(api)
                lib = g.lib
                ki, vi = g.input(k[i0:i0 + m]), g.input(v[i0:i0 + m])
                seqs = seqs_input(g, [(0, n_past + i0, m)])
                a = lib.iq_attention(g.ctx, g.input(q[i0:i0 + m]), ki, vi, cache.layer, seqs, cache.pages, 0.125)
                lib.iq_attention_set_decode_semantics(a, True)
                rows.append(g.compute(gpu, lib.iq_kv_store(g.ctx, a, ki, vi, cache.layer, seqs, cache.pages))
                            .reshape(m, -1))
                g.close()
            outs.append(np.concatenate(rows))
            cache.free()
            cg.close()
        np.testing.assert_allclose(outs[0], outs[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("decode", [False, True], ids=["batch", "decode"])
@pytest.mark.parametrize("type_", [F16, Q8_0], ids=NAMES.get)
def test_attention_of_several_sequences(api, cpu, gpu, type_, decode):
    """One op over four sequences of a shared pool, their pages in any order (decoding ones, a
    short prompt chunk, and one of 64 query vectors and more, which takes the tensor-core kernel
    where the cache is f16): the CPU's results, and each sequence the same bits as the op of that
    sequence alone on the GPU."""
    rng = np.random.default_rng(21)
    hd, n_kv, r = 64, 2, 3
    parts = [(2, 300, 1), (0, 0, 25), (3, 130, 1), (1, 64, 5)]  # (slot, n_past, n_tokens)
    nt = sum(p[2] for p in parts)
    q = rng.standard_normal((nt, n_kv * r, hd)).astype(np.float32)
    k, v = kv_rows(rng, nt, n_kv, hd)

    def attention(be, cache, x, seqs):
        g = Graph(api)
        try:
            t0, t1 = x
            lib = g.lib
            a = lib.iq_attention(g.ctx, g.input(q[t0:t1]), g.input(k[t0:t1]), g.input(v[t0:t1]), cache.layer,
                                 seqs_input(g, seqs), cache.pages, 0.125)
            lib.iq_attention_set_decode_semantics(a, decode)
            return g.compute(be, a).reshape(t1 - t0, -1)
        finally:
            g.close()

    outs, caches = [], []
    for be in (cpu, gpu):
        cg = Graph(api)
        cache = Cache(cg, be, type_, hd, n_kv, 320, np.random.default_rng(5), n_slots=4)
        caches.append((cache, cg))
        outs.append(attention(be, cache, (0, nt), parts))
    try:
        fa = type_ == F16  # the tensor-core kernel at any batch size (f16 operands)
        vmax = max(np.abs(v).max(), np.abs(caches[0][0].v).max())
        assert_attention_close(outs[1], outs[0], fa, vmax)
        t0 = 0
        for slot, n_past, n in parts:
            sl = slice(t0, t0 + n)
            if not decode:
                cache = caches[0][0]
                ref = attention_ref(q[sl], k[sl], v[sl], cache.seq_rows(cache.k, slot), cache.seq_rows(cache.v, slot),
                                    n_past, 0.125)
                assert_attention_close(outs[1][sl].reshape(ref.shape), ref, fa, vmax)
            alone = attention(gpu, caches[1][0], (t0, t0 + n), [(slot, n_past, n)])
            np.testing.assert_array_equal(outs[1][sl], alone, err_msg=f"slot {slot}")
            t0 += n
    finally:
        for cache, cg in caches:
            cache.free()
            cg.close()


@pytest.mark.parametrize("type_", [F16, Q8_0, Q4_0], ids=NAMES.get)
def test_kv_store_of_several_sequences_equals_the_cpu(api, cpu, gpu, type_):
    """KV_STORE of three sequences' rows (one across a page edge) into a pool whose pages are in
    any order: the GPU writes the CPU's bytes, row by row through each sequence's page table."""
    hd, n_kv = 64, 2
    parts = [(1, 62, 4), (2, 0, 3), (0, 100, 1)]
    nt = sum(p[2] for p in parts)
    rng = np.random.default_rng(14)
    k, v = kv_rows(rng, nt, n_kv, hd)
    stored = []
    for be in (cpu, gpu):
        g = Graph(api)
        cache = Cache(g, be, type_, hd, n_kv, 128, np.random.default_rng(3), n_slots=3)
        after = np.ones((nt, 32), np.float32)
        g.compute(be, g.lib.iq_kv_store(g.ctx, g.input(after), g.input(k), g.input(v), cache.layer,
                                        seqs_input(g, parts), cache.pages))
        stored.append([cache.read(cache.layer.k), cache.read(cache.layer.v)])
        cache.free()
        g.close()
    np.testing.assert_array_equal(stored[1][0], stored[0][0])
    np.testing.assert_array_equal(stored[1][1], stored[0][1])


def test_tensor_copy_between_host_and_device(api, cpu, gpu):
    ffi, lib = api
    x = np.random.default_rng(13).standard_normal((3, 64)).astype(np.float32)
    g = Graph(api)
    try:
        h = lib.iq_new_tensor_2d(g.ctx, F32, 64, 3)
        d = lib.iq_new_tensor_2d(g.ctx, F32, 64, 3)
        back = lib.iq_new_tensor_2d(g.ctx, F32, 64, 3)
        hb, db, bb = (lib.iq_backend_alloc_buffer(be, x.nbytes) for be in (cpu, gpu, cpu))
        for t, b in ((h, hb), (d, db), (back, bb)):
            lib.iq_tensor_place(t, b, 0)
        lib.iq_tensor_set(h, x.tobytes(), 0, x.nbytes)
        assert lib.iq_tensor_copy(d, h) and lib.iq_tensor_copy(back, d)
        np.testing.assert_array_equal(read_f32(ffi, lib, back), x)
        small = lib.iq_new_tensor_2d(g.ctx, F32, 64, 2)
        lib.iq_tensor_place(small, db, 0)
        assert not lib.iq_tensor_copy(small, h)
        for b in (hb, db, bb):
            lib.iq_buffer_free(b)
    finally:
        g.close()
