"""tools/kv_sim.py, the cache-layout study: its quantizer against the library's searched one,
and its cache's mechanics on a tiny model (a layout that quantizes nothing, or keeps every
row of every flushed block, equals the f16 forward exactly; one that quantizes does not)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from innerq_ffi import load
from tiny_model import TinyConfig, write_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import kv_sim  # noqa: E402

SEARCH = 3  # enum iq_quant_mode


def dequant_c(x: np.ndarray, bits: int) -> np.ndarray:
    ffi, lib = load()
    x = np.ascontiguousarray(x, np.float32)
    u = np.zeros(x.size, np.uint8)
    d, m = ffi.new("iq_fp16_t *"), ffi.new("iq_fp16_t *")
    lib.iq_quant_group(ffi.cast("float *", ffi.from_buffer(x)), x.size, bits, SEARCH, False,
                       ffi.cast("uint8_t *", ffi.from_buffer(u)), d, m)
    df, mf = (np.float32(np.uint16(v[0]).view(np.float16)) for v in (d, m))
    return df * u.astype(np.float32) + mf


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantizer_is_the_librarys_searched_one(bits):
    """The simulation's vectorized quantizer gives the library's values for nearly every group
    (the rest: a least-squares sum in another order rounding to the next fp16), and the same
    squared error overall."""
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((400, 64)) * rng.uniform(0.1, 30.0, (400, 1))).astype(np.float32)
    x[::7, 3] *= 12.0  # outlier channels
    sim = kv_sim.quant_search(x, bits)
    lib = np.stack([dequant_c(g, bits) for g in x])
    same = np.all(sim == lib, axis=1).mean()
    assert same >= 0.98, same
    e_sim, e_lib = ((sim - x) ** 2).sum(), ((lib - x) ** 2).sum()
    assert abs(e_sim / e_lib - 1.0) < 0.01, (e_sim, e_lib)


@pytest.fixture(scope="module")
def tiny_sim(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("kvsim") / "tiny.gguf",
                            TinyConfig(n_head=4, n_head_kv=2, head_dim=16, n_layer=2, seed=5))
    ids = np.random.default_rng(0).integers(1, 200, 256).tolist()
    sim = kv_sim.Sim(str(path), ids)
    return sim, sim.log_probs(None)


def kld(base: np.ndarray, lq: np.ndarray) -> float:
    return float((np.exp(base) * (base - lq)).sum(-1).mean())


@pytest.mark.parametrize("layout,zero", [("S128R128", True), ("S8R32H64", True), ("S8R32", False),
                                         ("S8R32H4K2V2", False), ("S8R32K0V0C1WN", None), ("S8R32K0V2N", False),
                                         ("S8R32K3V0C1", False), ("S8R32K3V0W", False)])
def test_layouts_that_quantize_nothing_equal_the_f16_forward(tiny_sim, layout, zero):
    sim, base = tiny_sim
    lq = sim.log_probs(kv_sim.parse_layout(layout))
    if zero is None:  # nothing quantized, but the flushed rows' share summed apart: float rounding only
        # (f32 log-probabilities ~3e-6 apart, their KLD ~1e-8 from f32 normalization; every layout
        # that quantizes moves them by 0.1 or more)
        np.testing.assert_allclose(lq, base, rtol=0, atol=1e-4)
    elif zero:
        np.testing.assert_array_equal(lq, base)
    else:
        assert kld(base, lq) > 1e-6


def test_a_bad_layout_is_refused():
    with pytest.raises(SystemExit, match="not S<n>R<n>"):
        kv_sim.parse_layout("S8X32")


def test_weighted_rounding_with_a_flat_weight_is_nearest_rounding():
    """With H a multiple of the identity no error is fed forward: the codes are the nearest on
    the searched grid, the searched quantizer's own values."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((200, 64)) * rng.uniform(0.5, 4.0, (200, 1))).astype(np.float32)
    for bits in (2, 3):
        np.testing.assert_array_equal(kv_sim.quant_weighted(x, bits, np.eye(64) * 2.5), kv_sim.quant_search(x, bits))


def test_weighted_rounding_lowers_the_weighted_error():
    """Against a strongly anisotropic H (one direction holding most of the weight, as a query
    mean does), the fed-forward codes lower e^T H e and raise |e|^2."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((500, 64)).astype(np.float32)
    v = rng.standard_normal(64)
    h = np.eye(64) + 60.0 * np.outer(v, v) / (v @ v)
    e_n = x - kv_sim.quant_search(x, 3)
    e_w = x - kv_sim.quant_weighted(x, 3, h)
    weighted = lambda e: float(np.einsum("ni,ij,nj->", e, h, e))  # noqa: E731
    assert weighted(e_w) < 0.8 * weighted(e_n)
    assert (e_w ** 2).sum() > (e_n ** 2).sum()


def test_row_scales_are_eighth_octaves_of_the_rms():
    rng = np.random.default_rng(5)
    v = (rng.standard_normal((300, 64)) * np.exp2(rng.uniform(-10, 10, (300, 1)))).astype(np.float32)
    s = kv_sim.row_scale(v)
    rms = np.sqrt((v.astype(np.float64) ** 2).mean(-1, keepdims=True))
    steps = 8 * np.log2(s)
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)  # a power of 2^(1/8): what an 8-bit code holds
    assert np.all(np.abs(np.log2(s / rms)) <= 1 / 16 + 1e-6)


def test_8_bit_parameters_alone_in_their_block_are_the_searched_ones():
    """A block of one group keeps its (d, m) exactly (its d is the block's largest, its m both
    ends of the block's range): the codes chosen again on them are the searched quantizer's."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((300, 64)) * rng.uniform(0.1, 8.0, (300, 1)) + rng.uniform(-3, 3, (300, 1))).astype(np.float32)
    for bits in (2, 3, 4):
        y, d, m, sym = kv_sim.quant_search(x, bits, params=True)
        assert sym.any() and (~sym).any()
        np.testing.assert_array_equal(kv_sim.params8(x, bits, d, m, sym, np.arange(len(x))), y)


def test_8_bit_parameters_stay_on_their_grids_and_cost_little():
    """Blocks of 64 groups: each group's |d| is a 1/16-octave step under its block's largest,
    its values on that d's grid; the squared error grows by a few percent at most (the grid of
    a d rounded by up to 2^(1/32))."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((1024, 64)) * rng.uniform(0.3, 3.0, (1024, 1)) + rng.uniform(-1, 1, (1024, 1))).astype(np.float32)
    bid = np.arange(len(x)) // 64
    for bits, bound in ((2, 1.02), (3, 1.04), (4, 1.08)):
        y, d, m, sym = kv_sim.quant_search(x, bits, params=True)
        y8 = kv_sim.params8(x, bits, d, m, sym, bid)
        ratio = float(((x - y8) ** 2).sum() / ((x - y) ** 2).sum())
        assert 1.0 < ratio < bound, (bits, ratio)
        # each symmetric row's values are integer multiples of a d whose ratio to the block's
        # largest |d| is a power of 2^(1/16)
        dmax = np.maximum.reduceat(np.abs(d), np.arange(0, len(x), 64))[bid]
        for i in np.nonzero(sym)[0][:20]:
            steps = np.unique(np.abs(np.diff(np.unique(y8[i]))))
            k = -16 * np.log2(steps.min() / dmax[i])
            assert abs(k - round(k)) < 1e-3, (bits, i, k)


def test_lloyd_max_levels_are_max_1960s():
    """The non-uniform levels of the `L` lever: Max's (1960) optimal levels for a unit Gaussian,
    to the table's four digits, symmetric and sorted."""
    published = {2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3440, 2.1520]}
    for bits, pos in published.items():
        lv = kv_sim.lloyd_max_levels(bits)
        assert np.all(np.diff(lv) > 0) and np.array_equal(lv, -lv[::-1])
        assert np.allclose(lv[len(lv) // 2:], pos, atol=1e-3), (bits, lv)


def test_levels_quantizer_fits_gaussian_groups_better():
    """quant_levels on near-Gaussian groups (rotated keys): each row on at most 2^bits values,
    less squared error than the uniform searched grid at 3 and 4 bits (about 0.91x and 0.87x)."""
    x = np.random.default_rng(7).standard_normal((4000, 64)).astype(np.float32)
    for bits in (3, 4):
        y = kv_sim.quant_levels(x, bits)
        assert max(len(np.unique(r)) for r in y) <= 2 ** bits
        ratio = ((x - y) ** 2).mean() / ((x - kv_sim.quant_search(x, bits)) ** 2).mean()
        assert 0.8 < ratio < 0.95, (bits, ratio)


def test_width_plan_spends_the_budget_by_weight():
    """Widths follow the channels' weights (a heavier channel never gets fewer bits), units of
    channels share one, the bits add up to the budget, and no width passes the cap."""
    rng = np.random.default_rng(8)
    lam = np.exp(rng.uniform(-6, 6, 64))
    for bavg, unit, bmax in ((4.25, 4, 8), (3.25, 4, 7), (4.5, 2, 6), (2.0, 1, 8)):
        b = kv_sim.width_plan(lam, bavg, unit, bmax)
        assert b.sum() == round(bavg * 64) and b.max() <= bmax
        order = np.argsort(-lam, kind="stable")
        assert np.all(np.diff(b[order]) <= 0)  # sorted by weight, widths never rise
        assert np.all(b[order].reshape(-1, unit) == b[order][::unit, None])
    assert kv_sim.width_plan(np.ones(16), 9.0, 4, 8).tolist() == [8] * 16  # every unit at the cap


def test_quant_widths_error_falls_with_the_budget():
    """Gaussian channels of spreads 2^-3 .. 2^3 on the widths width_plan gives them: the squared
    error falls 2.5x-6x per bit of the average (about 4x, the per-row scale searched), and a
    width-0 channel comes back 0."""
    rng = np.random.default_rng(9)
    sd = np.exp2(rng.uniform(-3, 3, 16))
    x = rng.standard_normal((4000, 16)) * sd
    errs = []
    for bavg in (2.0, 3.0, 4.0, 5.0, 6.0):
        b = kv_sim.width_plan(sd ** 2, bavg, unit=1)
        y = kv_sim.quant_widths(x, sd ** 2, np.ones(16), b)
        assert np.all(y[:, b == 0] == 0)
        errs.append(((x - y) ** 2).sum())
    assert (kv_sim.width_plan(sd ** 2, 2.0, unit=1) == 0).any()
    ratios = np.array(errs[:-1]) / np.array(errs[1:])
    assert np.all((2.5 < ratios) & (ratios < 6.0)), ratios


@pytest.mark.parametrize("layout", ["S8R32K0V0Y300", "S8R32K0V0Y500Z2M6E", "S8R32K0V0Y400UM7E", "S8R32K0V0X400"])
def test_key_widths_quantize_the_keys_alone(tiny_sim, layout):
    """The key-width layouts change the keys (K0V0 otherwise quantizes nothing), less with more bits."""
    sim, base = tiny_sim
    k0 = kld(base, sim.log_probs(kv_sim.parse_layout(layout)))
    assert k0 > 1e-7
    if layout.startswith("S8R32K0V0Y300"):
        assert kld(base, sim.log_probs(kv_sim.parse_layout("S8R32K0V0Y700"))) < k0
