"""The InnerQ group quantizer (docs/DESIGN.md 3.1) against an independent numpy implementation.

The oracle below follows the spec text: fp16-rounded (d, m), codes by round half away from
zero, symmetric mode on a two's complement grid anchored at the element of largest magnitude
(first one on ties), hybrid keeping the lower L1 error (summed in double, in order; tie:
asymmetric), constant groups d = 0, m = x; the searched mode (IQ_QUANT_SEARCH): both grids
over six ranges shrunk by 1 - 0.08 i, (d, m) refit by least squares to the codes, codes again,
the least squared error (double, in order; first on ties). Codes and fp16 bits must be identical.
The searched mode on the key levels (3 bits, iq-qcache-math.h): the same search with code u
standing for the level L[u] (asymmetric grid: levels 0 .. 43 over the range; symmetric: centred on
21.5, m = -21.5 d), each element on its nearest level (a tie: the upper).
"""
from __future__ import annotations

import numpy as np
import pytest

from innerq_ffi import load

ASYM, SYM, HYBRID = "asym", "sym", "hybrid"


def round_half_away(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float64)  # exact for float32 inputs
    return np.where(v >= 0, np.floor(v + 0.5), -np.floor(-v + 0.5))


def _asym(x: np.ndarray, levels: int):
    lo, hi = x.min(), x.max()
    d = np.float16(np.float32(hi - lo) / np.float32(levels - 1))
    m = np.float16(lo)
    df, mf = np.float32(d), np.float32(m)
    if df == 0:
        return np.zeros(x.size, np.uint8), d, m
    u = np.clip(round_half_away((x - mf) / df), 0, levels - 1)
    return u.astype(np.uint8), d, m


def _sym(x: np.ndarray, levels: int):
    a = x[int(np.argmax(np.abs(x)))]  # argmax: the first of equal magnitudes
    half = levels // 2
    d = np.float16(np.float32(-2.0) * a / np.float32(levels))
    df = np.float32(d)
    m = np.float16(np.float32(-half) * df)
    if df == 0:
        return np.full(x.size, half, np.uint8), d, m
    s = np.clip(round_half_away(x / df), -half, half - 1)
    return (s + half).astype(np.uint8), d, m


def l1_error(x: np.ndarray, u: np.ndarray, d, m) -> float:
    err = np.abs(x.astype(np.float64) - (np.float64(d) * u.astype(np.float64) + np.float64(m)))
    return float(np.cumsum(err)[-1])  # sequential, as the spec fixes the order


def quant_group_np(x: np.ndarray, bits: int, mode: str = HYBRID, key_levels: bool = False):
    """(codes uint8[G], d float16, m float16) of one group x (float32); key_levels: 3-bit codes of
    the searched mode on the key levels."""
    x = np.asarray(x, np.float32)
    levels = 1 << bits
    if np.all(x == x[0]):
        return np.zeros(x.size, np.uint8), np.float16(0), np.float16(x[0])
    if mode == SYM:
        return _sym(x, levels)
    if mode == SEARCH:
        return _search(x, levels, key_levels and bits == 3)
    qa = _asym(x, levels)
    if mode == ASYM:
        return qa
    qs = _sym(x, levels)
    return qs if l1_error(x, *qs) < l1_error(x, *qa) else qa


# The key levels: Max's levels for N(0, 1) at 3 bits (+-0.2451, +-0.7560, +-1.3440, +-2.1520)
# times 10, to the nearest half, about the centre 21.5 (iq-qcache-math.h).
MAX3 = np.array([0.2451, 0.7560, 1.3440, 2.1520])
KEY_LEVELS = np.concatenate([21.5 - np.round(20 * MAX3[::-1]) / 2, 21.5 + np.round(20 * MAX3) / 2]).astype(np.int64)
KEY_CENTRE = 21.5


def level_values(u: np.ndarray, lv: bool) -> np.ndarray:
    return KEY_LEVELS[u] if lv else u


def nearest_level(t: np.ndarray) -> np.ndarray:
    """The index of the key level nearest each t: the midpoints between levels at or below t (a
    tie: the upper level; NaN: 0)."""
    mids = (KEY_LEVELS[1:] + KEY_LEVELS[:-1]) / 2
    return np.where(np.isnan(t), 0, np.searchsorted(mids, t, side="right")).astype(np.uint8)


def _codes(x: np.ndarray, levels: int, sym: bool, d, m, lv: bool = False) -> np.ndarray:
    df, mf, half = np.float32(d), np.float32(m), levels // 2
    if df == 0:
        return np.full(x.size, half if sym else 0, np.uint8)
    if lv:
        return nearest_level((x - mf) / df)
    if sym:
        return (np.clip(round_half_away(x / df), -half, half - 1) + half).astype(np.uint8)
    return np.clip(round_half_away((x - mf) / df), 0, levels - 1).astype(np.uint8)


def l2_error(x: np.ndarray, u: np.ndarray, d, m, lv: bool = False) -> float:
    df, mf, err = float(np.float32(d)), float(np.float32(m)), 0.0
    for xi, ui in zip(x.tolist(), level_values(u, lv).tolist()):
        e = xi - (df * ui + mf)
        err += e * e
    return err


def _search_one(x, levels, sym, lo, hi, a, f, lv=False):
    f32 = np.float32
    centre, top = (KEY_CENTRE, KEY_LEVELS[-1]) if lv else (levels // 2, levels - 1)
    if sym:
        d = np.float16(f32(f32(f32(-2.0) * a) * f) / f32(2 * centre))
        m = np.float16(f32(-centre) * f32(d))
    else:
        c, r = f32(f32(0.5) * f32(lo + hi)), f32(f32(f32(0.5) * f32(hi - lo)) * f)
        d = np.float16(f32(f32(2.0) * r) / f32(top))
        m = np.float16(f32(c - r))
    u = _codes(x, levels, sym, d, m, lv)
    ss = s1 = sx = x1 = 0.0
    for xi, ui in zip(x.tolist(), level_values(u, lv).tolist()):
        si = float(ui - (centre if sym else 0))
        ss += si * si
        s1 += si
        sx += si * xi
        x1 += xi
    n = float(x.size)
    if sym:
        dd = sx / ss if ss > 0 else 0.0
        ok = dd * float(np.float32(d)) > 0
    else:
        det = n * ss - s1 * s1
        dd = (n * sx - s1 * x1) / det if det > 0 else 0.0
        mm = (x1 - dd * s1) / n if det > 0 else 0.0
        ok = dd > 0
    if ok:
        d = np.float16(np.float32(dd))
        m = np.float16(f32(-centre) * f32(d)) if sym else np.float16(np.float32(mm))
        u = _codes(x, levels, sym, d, m, lv)
    return l2_error(x, u, d, m, lv), (u, d, m)


def _search(x: np.ndarray, levels: int, lv: bool = False):
    lo, hi, a = x.min(), x.max(), x[int(np.argmax(np.abs(x)))]
    best, out = None, None
    for k in range(12):
        f = np.float32(np.float32(1.0) - np.float32(0.08) * np.float32(k // 2))
        e, q = _search_one(x, levels, k % 2 == 1, lo, hi, a, f, lv)
        if best is None or e < best:
            best, out = e, q
    return out


SEARCH = "search"
MODES = {ASYM: 1, SYM: 2, HYBRID: 0, SEARCH: 3}  # enum iq_quant_mode


def quant_group_c(x: np.ndarray, bits: int, mode: str = HYBRID, key_levels: bool = False):
    ffi, lib = load()
    x = np.ascontiguousarray(x, np.float32)
    u = np.zeros(x.size, np.uint8)
    d = ffi.new("iq_fp16_t *")
    m = ffi.new("iq_fp16_t *")
    lib.iq_quant_group(ffi.cast("float *", ffi.from_buffer(x)), x.size, bits, MODES[mode], key_levels,
                       ffi.cast("uint8_t *", ffi.from_buffer(u)), d, m)
    return u, np.uint16(d[0]).view(np.float16), np.uint16(m[0]).view(np.float16)


def assert_same(x, bits, mode, key_levels=False):
    uc, dc, mc = quant_group_c(x, bits, mode, key_levels)
    un, dn, mn = quant_group_np(x, bits, mode, key_levels)
    assert dc.view(np.uint16) == dn.view(np.uint16), (dc, dn)
    assert mc.view(np.uint16) == mn.view(np.uint16), (mc, mn)
    np.testing.assert_array_equal(uc, un)
    assert uc.max() < (1 << bits)


def random_groups(rng, G):
    yield rng.standard_normal(G)
    yield rng.standard_normal(G) * 40.0
    yield rng.uniform(0.0, 3.0, G)  # one-signed: asymmetric territory
    yield -rng.uniform(0.5, 1.0, G)
    x = rng.standard_normal(G) * 0.1
    x[rng.integers(G)] = 9.0  # an outlier channel
    yield x
    yield rng.standard_t(2, G)  # heavy tails
    yield np.round(rng.standard_normal(G) * 4) / 4  # exact grid points: ties in rounding
    x = rng.standard_normal(G)
    x[rng.random(G) < 0.5] = 0.0  # many exact zeros: symmetric territory
    yield x


@pytest.mark.parametrize("mode", [ASYM, SYM, HYBRID, SEARCH])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_random_groups_match_numpy(bits, G, mode):
    rng = np.random.default_rng(bits * 1000 + G + len(mode))
    for x in random_groups(rng, G):
        assert_same(x.astype(np.float32), bits, mode)


def degenerate_groups(G):
    yield np.full(G, 1.375)                   # constant
    yield np.zeros(G)                         # all zero
    yield np.full(G, -0.0)
    x = np.zeros(G)
    x[G // 3] = 2.5
    yield x                                   # one nonzero
    yield -x
    x = np.linspace(-1, 1, G)
    x[3], x[G - 5] = 3.0, -3.0
    yield x                                   # equal and opposite extremes, + first
    x[3], x[G - 5] = -3.0, 3.0
    yield x                                   # equal and opposite extremes, - first
    rng = np.random.default_rng(G)
    yield rng.standard_normal(G) * 1e-5       # fp16 subnormal d
    yield rng.standard_normal(G) * 3e-8       # d rounds to fp16 zero
    yield rng.standard_normal(G) * 6e-5       # around the smallest fp16 normal
    x = rng.standard_normal(G) * 1e-7
    x[0] = 1.0
    yield x                                   # subnormal residue next to a normal value
    yield np.full(G, 1e-9)                    # constant below fp16 precision


@pytest.mark.parametrize("mode", [ASYM, SYM, HYBRID, SEARCH])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_degenerate_groups_match_numpy(bits, G, mode):
    for x in degenerate_groups(G):
        assert_same(x.astype(np.float32), bits, mode)


@pytest.mark.parametrize("G", [32, 64, 128])
def test_key_levels_match_numpy(G):
    """The searched mode on the key levels, code for code and bit for bit, random and degenerate
    groups; at other widths the key levels leave the uniform grid as it is."""
    rng = np.random.default_rng(G + 3)
    for x in list(random_groups(rng, G)) + list(degenerate_groups(G)):
        x = x.astype(np.float32)
        assert_same(x, 3, SEARCH, key_levels=True)
        for bits in (2, 4):
            for a, b in zip(quant_group_c(x, bits, SEARCH, True), quant_group_c(x, bits, SEARCH)):
                np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


def test_key_levels_table():
    """The table from Max's levels (iq-qcache-math.h's IQ_KEY_LEVELS); ties between two levels
    go to the upper one."""
    assert KEY_LEVELS.tolist() == [0, 8, 14, 19, 24, 29, 35, 43]
    t = np.array([-5, 3.99, 4, 11, 16.5, 21.49, 21.5, 26.5, 32, 39, 38.99, 100, np.nan], np.float32)
    assert nearest_level(t).tolist() == [0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 6, 7, 0]


def test_key_levels_lower_the_error_of_gaussian_groups():
    """Groups of 64 from N(0, 1) (rotated keys are close to it) on the key levels: less squared
    error than the searched uniform grid (0.91x expected; the continuous Lloyd-Max bound)."""
    rng = np.random.default_rng(11)
    ratio = []
    for _ in range(300):
        x = (rng.standard_normal(64) * rng.uniform(0.1, 10)).astype(np.float32)
        on_levels = l2_error(x, *quant_group_c(x, 3, SEARCH, True), lv=True)
        ratio.append(on_levels / l2_error(x, *quant_group_c(x, 3, SEARCH)))
    assert np.mean(ratio) < 0.94, np.mean(ratio)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_search_never_loses_to_min_max(bits):
    """The searched grid includes the min-max ranges before their refit: its squared error is
    at most the hybrid's (up to the fp16 rounding of the refit parameters) and far lower at 2 bits."""
    rng = np.random.default_rng(bits)
    gain = []
    for _ in range(200):
        x = rng.standard_normal(64).astype(np.float32)
        e_search = l2_error(x, *quant_group_c(x, bits, SEARCH))
        e_hyb = l2_error(x, *quant_group_c(x, bits, HYBRID))
        assert e_search <= e_hyb * 1.001
        gain.append(e_search / e_hyb)
    assert np.mean(gain) < {2: 0.85, 3: 0.95, 4: 0.95, 5: 0.97}[bits]  # min-max is nearer the best with more levels


def test_constant_group_is_exact():
    for v in (0.0, -2.0, 1e-3, 1000.0):
        u, d, m = quant_group_c(np.full(64, v), 3, HYBRID)
        assert d == 0 and m == np.float16(v) and not u.any()


def test_rounding_is_half_away_from_zero():
    # asym, 2 bits: min 0, max 3 -> d = 1, m = 0; 0.5, 1.5, 2.5 are exact ties.
    x = np.array([0.0, 3.0, 0.5, 1.5, 2.5] + [1.0] * 27, np.float32)
    u, d, m = quant_group_c(x, 2, ASYM)
    assert (d, m) == (1.0, 0.0)
    assert list(u[2:5]) == [1, 2, 3]  # half-to-even would give 0, 2, 2
    # sym, 2 bits: a = -4 -> d = 2, m = -4; x/d = -0.5 and 0.5 round away from zero,
    # and +0.5 -> s = 1 -> u = 3 while -0.5 -> s = -1 -> u = 1.
    x = np.array([-4.0, -1.0, 1.0] + [0.0] * 29, np.float32)
    u, d, m = quant_group_c(x, 2, SYM)
    assert (d, m) == (2.0, -4.0)
    assert list(u[:3]) == [0, 1, 3]


def test_symmetric_grid_is_twos_complement():
    rng = np.random.default_rng(7)
    for bits in (2, 3, 4, 5):
        levels = 1 << bits
        x = rng.standard_normal(64).astype(np.float32)
        u, d, m = quant_group_c(x, bits, SYM)
        i = int(np.argmax(np.abs(x)))
        assert u[i] == 0  # the largest magnitude lands on the most negative code
        assert np.float32(m) == -(levels // 2) * np.float32(d)
        assert np.float32(d) * (levels // 2) + np.float32(m) == 0  # zero is a grid point


def test_hybrid_picks_symmetric_when_it_is_better():
    # Many exact zeros plus extremes -4 and 1.9: the symmetric grid {-4, -2, 0, 2} has zero on
    # it, the asymmetric one (min -4, max 1.9) misses 0 by 0.067 on every zero.
    x = np.zeros(64, np.float32)
    x[0], x[1] = -4.0, 1.9
    sym, asym, hyb = (quant_group_c(x, 2, mode) for mode in (SYM, ASYM, HYBRID))
    assert l1_error(x, *sym) < l1_error(x, *asym)
    assert hyb[1] == sym[1] and hyb[2] == sym[2] and np.array_equal(hyb[0], sym[0])


def test_hybrid_picks_asymmetric_when_it_is_better():
    x = np.linspace(1.0, 2.0, 64).astype(np.float32)  # one-signed, away from zero
    sym, asym, hyb = (quant_group_c(x, 3, mode) for mode in (SYM, ASYM, HYBRID))
    assert l1_error(x, *asym) < l1_error(x, *sym)
    assert hyb[1] == asym[1] and hyb[2] == asym[2] and np.array_equal(hyb[0], asym[0])


def test_hybrid_tie_goes_to_asymmetric():
    # Values {-2, 0, 2, 4}: both grids are exact (asym d = 2, m = -2; sym a = 4 -> d = -2,
    # m = 4), so the errors tie at 0 and the asymmetric parameters must be kept.
    x = np.tile(np.array([-2.0, 0.0, 2.0, 4.0], np.float32), 16)
    sym, asym, hyb = (quant_group_c(x, 2, mode) for mode in (SYM, ASYM, HYBRID))
    assert l1_error(x, *sym) == l1_error(x, *asym) == 0.0
    assert (float(sym[1]), float(asym[1])) == (-2.0, 2.0)
    assert float(hyb[1]) == 2.0 and float(hyb[2]) == -2.0


def pack_tile_np(u: np.ndarray, bits: int) -> np.ndarray:
    """The tile packing of iq-qcache.h, from its description."""
    u = u.astype(np.uint8)
    if bits >= 4:  # 4 bits: one nibble plane; 5: that plane, then the top bits' plane
        low, top = (u[:32] & 15) | ((u[32:] & 15) << 4), 4
    else:
        lo = u & 3
        low, top = lo[0:16] | (lo[16:32] << 2) | (lo[32:48] << 4) | (lo[48:64] << 6), 2
    if bits in (2, 4):
        return low
    hi = (u >> top) & 1
    plane1 = np.packbits(hi.reshape(8, 8), axis=1, bitorder="little").ravel()
    return np.concatenate([low, plane1])


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_tile_packing(bits):
    ffi, lib = load()
    rng = np.random.default_rng(bits)
    u = rng.integers(0, 1 << bits, 64).astype(np.uint8)
    packed = np.zeros(8 * bits, np.uint8)
    lib.iq_qtile_pack(ffi.cast("uint8_t *", ffi.from_buffer(u)), bits, ffi.cast("uint8_t *", ffi.from_buffer(packed)))
    np.testing.assert_array_equal(packed, pack_tile_np(u, bits))
    back = np.zeros(64, np.uint8)
    lib.iq_qtile_unpack(ffi.cast("uint8_t *", ffi.from_buffer(packed)), bits,
                        ffi.cast("uint8_t *", ffi.from_buffer(back)))
    np.testing.assert_array_equal(back, u)


def _search_blocks(rng):
    """Blocks whose groups are random_groups' and degenerate_groups' kinds, in every layout:
    (rows [G][D] as f16, axis, bits, D, G, fmt)."""
    for D, G in ((64, 64), (128, 32), (128, 128), (256, 64)):
        kinds = [x for x in random_groups(rng, G)] + [x for x in degenerate_groups(G)]
        for axis in (0, 1):  # channels (keys), tokens (values)
            if axis == 0 and G > D:
                continue
            rows = np.empty((G, D), np.float32)
            n_groups = D  # a block's groups: D of G elements
            for gi in range(n_groups):
                x = kinds[(gi * 7 + axis) % len(kinds)] * (0.5 + gi % 3)
                if axis == 0:  # group gi: token gi % G, channels gi // G * G ..
                    rows[gi % G, gi // G * G:gi // G * G + G] = x
                else:  # group gi: channel gi, every token
                    rows[:, gi] = x
            for bits in (2, 3, 4, 5):
                for fmt in (0, 2, 4 if axis == 0 else 1, 6 if axis == 0 else 3):
                    yield rows.astype(np.float16), axis, bits, D, G, fmt


def test_vector_search_gives_the_scalar_blocks():
    """iq_qblock_quantize's searched mode with each ISA's vector search (cpu/qsearch-lanes.h, the
    lanes of IQ_QSEARCH_LANES groups) gives the blocks of the scalar search, byte for byte, for
    every kind of group above, both axes, 2-5 bits, key levels, 8-bit parameters and row scales."""
    import cffi

    from conftest import isa_levels, lib_path
    ffi, lib = load()
    cpu = cffi.FFI()
    cpu.cdef("unsigned iq_cpu_features_detect(void); unsigned iq_cpu_features_active(void);"
             "bool iq_cpu_features_set(unsigned f); void iq_cpu_install_qsearch(void);")
    cl = cpu.dlopen(lib_path())
    blocks = list(_search_blocks(np.random.default_rng(7)))
    norm = np.random.default_rng(8).uniform(0.5, 3.0, 256).astype(np.float32)

    def quantize(rows, axis, bits, D, G, fmt):
        out = np.zeros(2 * D * G + 1024, np.uint8)  # more than a block: the rest stays 0
        lib.iq_qblock_quantize(ffi.cast("iq_fp16_t *", ffi.from_buffer(rows)), axis, bits, D, G, MODES[SEARCH],
                               ffi.cast("float *", ffi.from_buffer(norm)) if axis == 0 else ffi.NULL, fmt,
                               ffi.cast("uint8_t *", ffi.from_buffer(out)))
        return out

    lib.iq_qblock_set_search(ffi.NULL)
    want = [quantize(*b) for b in blocks]
    before = cl.iq_cpu_features_active()
    vector = 0
    try:
        for name, f in isa_levels(cl.iq_cpu_features_detect()):
            assert cl.iq_cpu_features_set(f)
            cl.iq_cpu_install_qsearch()
            for b, w in zip(blocks, want):
                np.testing.assert_array_equal(quantize(*b), w, err_msg=f"{name}: axis {b[1]} bits {b[2]} D {b[3]} "
                                                                        f"G {b[4]} fmt {b[5]}")
            vector += name in ("avx2", "avx512")
    finally:
        cl.iq_cpu_features_set(before)
        lib.iq_qblock_set_search(ffi.NULL)
    assert len(blocks) > 100
