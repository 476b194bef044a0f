"""8-bit group parameters (iq-qcache-math.h, "8-bit group parameters"): the block
format against a numpy reading of its bytes, the parameters' codes from their definition, and
what the coded grids cost in squared error."""
from __future__ import annotations

import platform

import cffi
import numpy as np
import pytest

from conftest import lib_path
from innerq_ffi import fptr, load
from test_innerq_quant import KEY_CENTRE, KEY_LEVELS

SEARCH = 3  # enum iq_quant_mode
P8 = 2  # IQ_QBLOCK_P8
LEVELS = 4  # IQ_QBLOCK_LEVELS: 3-bit codes on the key levels


def blocks(bits, axis, D=64, G=64, seed=0, fmt=0):
    """A block of format fmt without and with 8-bit parameters: the rows, both blocks' bytes and
    values, and the second's codes."""
    ffi, lib = load()
    rng = np.random.default_rng(seed + bits)
    x = rng.standard_normal((G, D)) * rng.uniform(0.2, 3.0, (G, 1)) + rng.uniform(-1, 1, (1, D))
    x[:, 5] *= 9.0  # an outlier channel
    rows = x.astype(np.float16)
    ax = lib.IQ_QAXIS_CHANNELS if axis == "channels" else lib.IQ_QAXIS_TOKENS
    plain = np.zeros(D * G * bits // 8 + 4 * D, np.uint8)  # codes, then d[D], m[D] (fp16)
    p8 = np.zeros(D * G * bits // 8 + 8 + 2 * D, np.uint8)  # codes, the references, dc[D], mc[D]
    rp = ffi.cast("iq_fp16_t *", ffi.from_buffer(rows))
    lib.iq_qblock_quantize(rp, ax, bits, D, G, SEARCH, ffi.NULL, fmt, ffi.cast("uint8_t *", ffi.from_buffer(plain)))
    lib.iq_qblock_quantize(rp, ax, bits, D, G, SEARCH, ffi.NULL, P8 | fmt, ffi.cast("uint8_t *", ffi.from_buffer(p8)))

    def deq(fmt, blk):
        out = np.zeros((G, D), np.float32)
        lib.iq_qblock_dequantize(ffi.cast("uint8_t *", ffi.from_buffer(blk)), ax, bits, D, G, ffi.NULL, fmt, 0, G,
                                 fptr(ffi, out))
        return out

    u = np.zeros((G, D), np.uint8)
    lib.iq_qblock_codes(ffi.cast("uint8_t *", ffi.from_buffer(p8)), ax, bits, D, G, 0, G, ffi.cast("uint8_t *", ffi.from_buffer(u)))
    return rows.astype(np.float32), plain, p8, deq(fmt, plain), deq(P8 | fmt, p8), u


@pytest.mark.parametrize("axis", ["channels", "tokens"])
@pytest.mark.parametrize("bits,lv", [(2, False), (3, False), (4, False), (3, True)])
def test_the_block_reads_as_its_bytes_say(bits, lv, axis):
    """lv: 3-bit codes on the key levels, read as L[u], with the symmetric grid's m = -21.5 d."""
    D = G = 64
    x, plain, p8, y_plain, y8, u = blocks(bits, axis, fmt=LEVELS if lv else 0)
    off = D * G * bits // 8
    assert len(p8) == off + 8 + 2 * D and len(plain) == off + 4 * D
    refs = p8[off:off + 8].view(np.float16).astype(np.float32)
    dc, mc = p8[off + 8:off + 8 + D].astype(np.float64), p8[off + 8 + D:].astype(np.float64)
    a = refs[0] * np.exp2(-dc / 16)
    sym = mc >= 254
    d = np.where(mc == 254, -a, a).astype(np.float16).astype(np.float64)  # decoded, then rounded to fp16
    centre = KEY_CENTRE if lv else 2 ** bits // 2
    m = np.where(sym, -centre * d, refs[1] + mc * (refs[2] - refs[1]) / 253).astype(np.float16).astype(np.float64)
    t, c = np.meshgrid(np.arange(G), np.arange(D), indexing="ij")
    g = (c // G) * G + t if axis == "channels" else c  # iq_qblock_group_of
    want = d[g] * (KEY_LEVELS[u] if lv else u) + m[g]
    np.testing.assert_allclose(y8, want, rtol=2e-6, atol=2e-6 * np.abs(x).max())  # float32 against float64
    # the plain block's (d, m) set the references: the largest |d| rounded up to fp16, the asymmetric m's range
    dp = plain[off:off + 2 * D].view(np.float16).astype(np.float32)
    assert refs[0] >= np.abs(dp).max() and np.float16(refs[0]) == np.float16(np.abs(dp).max()) or \
        refs[0] == np.nextafter(np.float16(np.abs(dp).max()), np.float16(np.inf))
    nz = dp != 0
    want_dc = np.clip(np.round(16 * np.log2(refs[0] / np.abs(dp[nz]))), 0, 255)
    assert np.mean(dc[nz] == want_dc) > 0.95 and np.all(np.abs(dc[nz] - want_dc) <= 1)


@pytest.mark.parametrize("axis", ["channels", "tokens"])
def test_coded_parameters_cost_little(axis):
    """The squared error with 8-bit parameters is within a few percent of the fp16 ones'."""
    for bits, fmt, bound in ((2, 0, 1.03), (3, 0, 1.06), (4, 0, 1.12), (3, LEVELS, 1.06)):
        x, _, _, y_plain, y8, _ = blocks(bits, axis, seed=10, fmt=fmt)
        ratio = float(((x - y8) ** 2).sum() / ((x - y_plain) ** 2).sum())
        assert ratio < bound, (bits, ratio)


def test_vector_decode_has_the_portable_bits():
    """The AVX2 + F16C decode of the attention kernels (cpu/x86/qcache-avx2.c) gives the bits
    of the portable iq_p8_decode_block (through iq_qblock_params_of) for every code of d and m,
    symmetric groups of both signs, and references from tiny to large."""
    ffi, lib = load()
    flags = open("/proc/cpuinfo").read() if platform.machine() in ("x86_64", "AMD64") else ""
    if " avx2" not in flags or " f16c" not in flags:
        pytest.skip("no AVX2 + F16C here")
    ffi2 = cffi.FFI()
    ffi2.cdef("void iq_p8_decode_avx2(const uint8_t * params, int32_t head_dim, float centre, uint16_t * dm);")
    vec = ffi2.dlopen(lib_path())
    rng = np.random.default_rng(5)
    D = 128
    for bits, fmt in ((2, 0), (3, 0), (4, 0), (3, LEVELS)):
        centre = KEY_CENTRE if fmt else 2 ** bits // 2
        for trial in range(64):
            scale = 10.0 ** rng.uniform(-6, 3)
            mlo, mhi = np.sort(rng.uniform(-1, 1, 2) * scale * 4)
            refs = np.array([scale, mlo, mhi, 0], np.float16)
            codes = rng.integers(0, 256, 2 * D, dtype=np.uint8)
            codes[:D][:8] = [0, 1, 15, 16, 17, 127, 254, 255]  # every octave's edge
            codes[D:][:8] = [0, 1, 126, 253, 254, 255, 254, 255]  # asymmetric ends, both symmetric signs
            params = np.concatenate([refs.view(np.uint8), codes])
            block = np.concatenate([np.zeros(D * 64 * bits // 8, np.uint8), params])
            want = np.zeros(2 * D, np.uint16)
            p = lib.iq_qblock_params_of(ffi.cast("uint8_t *", ffi.from_buffer(block)), bits, D, 64, P8 | fmt,
                                        ffi.cast("iq_fp16_t *", ffi.from_buffer(want)))
            want = np.frombuffer(ffi.buffer(p, 4 * D), np.uint16).copy()
            got = np.zeros(2 * D, np.uint16)
            vec.iq_p8_decode_avx2(ffi2.cast("uint8_t *", ffi2.from_buffer(params)), D, centre,
                                  ffi2.cast("uint16_t *", ffi2.from_buffer(got)))
            np.testing.assert_array_equal(got, want, err_msg=f"bits {bits}, format {fmt}, trial {trial}")
