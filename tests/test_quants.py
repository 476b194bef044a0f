"""Weight block formats and CPU dot products, against gguf.quants and numpy.

gguf.quants (the PyPI package's numpy implementation of ggml's formats) is the oracle for
dequantization of every weight type and for the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 quantizers; the
activation formats gguf.quants lacks (Q8_1, Q8_K) are written here from ggml's definition.
Every kernel row this machine runs (scalar, AVX2, AVX-512 with and without VNNI, NEON, NEON with
dotprod) is checked, through every subset of its CPU features: fast
row dequantization and activation quantization must give the reference's exact floats and
bytes, dot products must match the scalar reference and a float64 numpy product.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from cffi import FFI
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

import conftest

CDEF = """
typedef void (*iq_to_float_fn)(const void * x, float * y, int64_t n);
typedef void (*iq_from_float_fn)(const float * x, void * y, int64_t n);
typedef void (*iq_vec_dot_fn)(int64_t n, float * s, const void * x, const void * y);
struct iq_type_traits {
    const char * name;
    int64_t blck_size;
    size_t type_size;
    bool is_quantized;
    iq_to_float_fn to_float;
    iq_from_float_fn from_float;
};
typedef void (*iq_vec_dot_cols_fn)(int64_t n, float * s, size_t bs, const void * x, const void * y, size_t by,
                                   const float * ys, size_t bys, int ncols);
struct iq_cpu_type_traits {
    int vec_dot_type;
    iq_from_float_fn from_float;
    iq_vec_dot_fn vec_dot;
    iq_to_float_fn to_float;
    iq_vec_dot_cols_fn vec_dot_cols;
    void (*vec_dot_lanes)(int64_t n, float * s, size_t bs, const void * x, size_t bx, int nrows,
                          const void * y, int lanes, int ncols);
};
const struct iq_type_traits * iq_type_traits_get(int type);
bool iq_type_is_valid(int type);
const char * iq_type_name(int type);
size_t iq_row_size(int type, int64_t n);
float iq_fp16_to_fp32(uint16_t h);
uint16_t iq_fp32_to_fp16(float f);
float iq_bf16_to_fp32(uint16_t h);
uint16_t iq_fp32_to_bf16(float f);
unsigned iq_cpu_features_detect(void);
unsigned iq_cpu_features_active(void);
bool iq_cpu_features_set(unsigned f);
const char * iq_cpu_features_name(unsigned f);
const struct iq_cpu_type_traits * iq_cpu_traits_for(int type, unsigned f);
void iq_cpu_act_scales(int vec_dot_type, const void * y, int64_t n, float * ys);
int64_t iq_cpu_act_scales_size(int vec_dot_type, int64_t n);
void iq_cpu_act_lanes(const void * y, int64_t n, void * pack, int lanes, int lane);
"""
TYPE_COUNT = 70  # IQ_TYPE_COUNT
# The weight types, with their ggml names.
WEIGHTS = {
    T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q5_0: "q5_0",
    T.Q5_1: "q5_1", T.Q8_0: "q8_0", T.Q2_K: "q2_K", T.Q3_K: "q3_K", T.Q4_K: "q4_K", T.Q5_K: "q5_K",
    T.Q6_K: "q6_K", T.IQ4_NL: "iq4_nl", T.IQ4_XS: "iq4_xs",
}
ACTIVATIONS = {T.Q8_1: "q8_1", T.Q8_K: "q8_K"}
PLAIN_INTS = {T.I8: "i8", T.I16: "i16", T.I32: "i32"}
VEC_DOT_TYPE = {
    T.F32: T.F32, T.F16: T.F32, T.BF16: T.F32, T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q8_0: T.Q8_0,
    T.Q4_1: T.Q8_1, T.Q5_1: T.Q8_1, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K,
    T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.IQ4_NL: T.Q8_0, T.IQ4_XS: T.Q8_K,
}
GGUF_QUANTIZES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Block sizes; Q8_1 is 36 bytes in ggml (gguf-py's table still says 40, an old layout).
SIZES = {**{t: GGML_QUANT_SIZES[t] for t in (*WEIGHTS, *PLAIN_INTS, T.Q8_K)}, T.Q8_1: (32, 36)}
# Byte offsets of the fp16 scale fields of the block types that are tested from random bytes.
FP16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.Q2_K: [80, 82], T.Q3_K: [108], T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}


@pytest.fixture(scope="module")
def lib():
    ffi = FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(conftest.lib_path())


def isa_kernels(ffi, lib):
    """(label, traits getter) for every set of the machine's features (so every kernel row, e.g.
    AVX-512 without VNNI too), the scalar set first; the label names the set's bits."""
    def label(f):
        return ffi.string(lib.iq_cpu_features_name(f)).decode() + f"/{f:#x}"
    return [(label(f), (lambda t, f=f: lib.iq_cpu_traits_for(int(t), f)))
            for f in conftest.feature_sets(lib.iq_cpu_features_detect())]


def act_rows(ffi, lib, qtype, rng):
    """A maker of random activation rows of n elements in the type qtype's vec_dot reads."""
    atype = VEC_DOT_TYPE[qtype]
    quantize = lib.iq_type_traits_get(int(atype)).from_float
    return lambda n: from_float(ffi, quantize, random_rows(rng, n), atype)


def kernels_having(ffi, lib, qtype, field):
    """(label, traits of qtype) for every kernel set this machine can run whose field is set."""
    return [(label, ct) for label, traits in isa_kernels(ffi, lib)
            for ct in [traits(qtype)] if ct is not None and getattr(ct, field) != ffi.NULL]


def ptr(ffi, a: np.ndarray):
    return ffi.from_buffer("float[]" if a.dtype == np.float32 else "uint8_t[]", a)


def to_float(ffi, fn, blob: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.nan, dtype=np.float32)
    fn(ptr(ffi, blob), ptr(ffi, out), n)
    return out


def from_float(ffi, fn, x: np.ndarray, qtype) -> np.ndarray:
    bs, ts = SIZES[qtype]
    out = np.zeros(x.size // bs * ts, dtype=np.uint8)
    fn(ptr(ffi, np.ascontiguousarray(x, dtype=np.float32)), ptr(ffi, out), x.size)
    return out


# ---- numpy oracles for the activation formats gguf.quants lacks ----

def np_quantize_q8_1(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_1_ref: q8_0's codes and d, plus s = fp16(d * sum(codes)) with
    d before its rounding to fp16."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    q8_0 = gq.quantize(blocks, T.Q8_0).reshape(-1, 34)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    codes = q8_0[:, 2:].view(np.int8)
    with np.errstate(over="ignore"):  # sums of huge blocks overflow fp16, as in ggml
        s = (codes.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d).astype(np.float16)
    return np.concatenate([q8_0[:, :2], s.view(np.uint8), q8_0[:, 2:]], axis=1).reshape(-1)


def np_dequantize_q8_1(b: np.ndarray) -> np.ndarray:
    b = b.reshape(-1, 36)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return (b[:, 4:].view(np.int8).astype(np.float32) * d).reshape(-1)


def np_quantize_q8_K(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref: scale -127/max (max = first element of largest
    magnitude, signed), codes rounded to nearest even and capped at 127, sums per 16."""
    blocks = []
    for xb in x.astype(np.float32).reshape(-1, 256):
        out = np.zeros(292, dtype=np.uint8)
        i = int(np.argmax(np.abs(xb)))
        if xb[i] != 0:
            iscale = np.float32(-127.0) / xb[i]
            q = np.minimum(np.rint(iscale * xb), 127).astype(np.int8)
            out[:4] = np.array([np.float32(1.0) / iscale], dtype=np.float32).view(np.uint8)
            out[4:260] = q.view(np.uint8)
            out[260:] = q.astype(np.int16).reshape(16, 16).sum(axis=1).astype(np.int16).view(np.uint8)
        blocks.append(out)
    return np.concatenate(blocks)


def np_dequantize_q8_K(b: np.ndarray) -> np.ndarray:
    b = b.reshape(-1, 292)
    d = b[:, :4].copy().view(np.float32)
    return (d * b[:, 4:260].view(np.int8).astype(np.float32)).reshape(-1)


def oracle_dequantize(blob: np.ndarray, qtype) -> np.ndarray:
    if qtype == T.Q8_1:
        return np_dequantize_q8_1(blob)
    if qtype == T.Q8_K:
        return np_dequantize_q8_K(blob)
    return gq.dequantize(blob, qtype).reshape(-1).astype(np.float32)


def oracle_quantize(x: np.ndarray, qtype) -> np.ndarray:
    if qtype == T.Q8_1:
        return np_quantize_q8_1(x)
    if qtype == T.Q8_K:
        return np_quantize_q8_K(x)
    if qtype == T.F32:
        return x.astype(np.float32).view(np.uint8)
    return gq.quantize(x.astype(np.float32), qtype).reshape(-1).view(np.uint8)


# ---- test data ----

def random_rows(rng, n: int) -> np.ndarray:
    """Activation-like data: normal with a few outliers, some exact zeros."""
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, n // 64 + 1)] *= 8
    x[rng.integers(0, n, n // 128 + 1)] = 0
    return x


def random_weight_blob(rng, qtype, n: int) -> np.ndarray:
    """Blocks of qtype for n elements: random bytes (so every code pattern occurs) with finite,
    sane fp16 scales; for the formats gguf.quants can quantize, half the blocks are quantized
    from data instead."""
    bs, ts = SIZES[qtype]
    if qtype == T.F32:
        return random_rows(rng, n).view(np.uint8)
    if qtype in (T.F16, T.BF16):
        return oracle_quantize(random_rows(rng, n), qtype)
    blocks = rng.integers(0, 256, (n // bs, ts), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = rng.uniform(0.001, 0.05, n // bs).astype(np.float16)
        if qtype in (T.Q4_1, T.Q5_1) and off == 2:  # min: signed
            scale = (scale * rng.choice([-4, 4], n // bs)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype in GGUF_QUANTIZES and n // bs >= 2:
        half = n // bs // 2
        q = gq.quantize(random_rows(rng, half * bs).reshape(-1, bs), qtype).reshape(half, ts)
        blocks[:half] = q
    return blocks.reshape(-1)


# ---- type table, fp16 / bf16 ----

def test_type_table_matches_ggml(lib):
    ffi, L = lib
    named = {**WEIGHTS, **ACTIVATIONS, **PLAIN_INTS}
    for t, name in named.items():
        tt = L.iq_type_traits_get(int(t))
        assert tt != ffi.NULL, name
        assert ffi.string(tt.name).decode() == name
        assert (tt.blck_size, tt.type_size) == SIZES[t], name
        assert bool(tt.is_quantized) == (SIZES[t][0] > 1), name
        assert L.iq_type_is_valid(int(t))
        assert ffi.string(L.iq_type_name(int(t))).decode() == name
        assert L.iq_row_size(int(t), 4096) == 4096 // SIZES[t][0] * SIZES[t][1]
        if SIZES[t][0] > 1:
            assert L.iq_row_size(int(t), SIZES[t][0] + 1) == 0
    assert L.iq_type_traits_get(int(T.Q4_K)).from_float == ffi.NULL  # no reference quantizer
    for t in range(-3, TYPE_COUNT + 3):
        known = t in [int(k) for k in named]
        if t < 40 or t >= TYPE_COUNT:  # cache-only ids (64..) gain rows elsewhere
            assert bool(L.iq_type_is_valid(t)) == known, t
            assert (L.iq_type_traits_get(t) == ffi.NULL) == (not known), t
        if not L.iq_type_is_valid(t):
            assert L.iq_row_size(t, 256) == 0


def test_fp16_all_values(lib):
    ffi, L = lib
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ours = np.array([L.iq_fp16_to_fp32(int(v)) for v in h], dtype=np.float32)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(ours[nan]).all()


def test_fp32_to_fp16_and_bf16_round_to_nearest_even(lib):
    ffi, L = lib
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    # Around every rounding boundary: fp16 subnormals, normals, overflow, bf16 ties.
    edges = np.array([0x33000000, 0x33000001, 0x387fc000, 0x387fe000, 0x38800000, 0x477fe000,
                      0x477ff000, 0x477fefff, 0x47800000, 0x7f7fffff, 0x7f800000, 0x3f808000,
                      0x3f818000, 0x3f8080ff, 0x00000001, 0x80000000], dtype=np.uint32)
    bits = np.concatenate([bits, edges, edges | 0x80000000])
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    f16 = L.iq_type_traits_get(int(T.F16)).from_float
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint8)
    assert np.array_equal(from_float(ffi, f16, x, T.F16), want)
    bf16 = L.iq_type_traits_get(int(T.BF16)).from_float
    assert np.array_equal(from_float(ffi, bf16, x, T.BF16), oracle_quantize(x, T.BF16))
    assert np.isnan(L.iq_fp16_to_fp32(L.iq_fp32_to_fp16(float("nan"))))
    assert np.isnan(L.iq_bf16_to_fp32(L.iq_fp32_to_bf16(float("nan"))))


# ---- dequantization ----

@pytest.mark.parametrize("qtype", list(WEIGHTS) + list(ACTIVATIONS), ids=lambda t: t.name)
def test_dequantize_matches_gguf(lib, qtype):
    ffi, L = lib
    rng = np.random.default_rng(int(qtype) + 10)
    n = 4096
    if qtype in ACTIVATIONS:
        blob = oracle_quantize(random_rows(rng, n), qtype)
    else:
        blob = random_weight_blob(rng, qtype, n)
    want = oracle_dequantize(blob, qtype)
    ref = to_float(ffi, L.iq_type_traits_get(int(qtype)).to_float, blob, n)
    assert np.array_equal(ref, want)
    if qtype in WEIGHTS:
        for label, traits in isa_kernels(ffi, L):
            ct = traits(qtype)
            if ct is not None and ct.to_float != ffi.NULL:
                assert np.array_equal(to_float(ffi, ct.to_float, blob, n), want), label


# ---- quantization ----

def tricky_rows(rng, bs: int) -> np.ndarray:
    """Blocks that exercise the rounding rules: ties at .5, zeros, constants, a negative
    extreme, equal-magnitude opposite extremes, tiny and huge values."""
    ties = (np.arange(bs) % 64 - 32).astype(np.float32) + np.float32(0.5)
    ties[0] = -127.0 if bs == 256 else 127.0  # pins the q8 scales to 1: x * id keeps the .5
    rows = [
        ties,
        np.zeros(bs, np.float32),
        np.full(bs, 3.25, np.float32),
        np.where(np.arange(bs) == 5, -9.0, rng.standard_normal(bs)).astype(np.float32),
        np.where(np.arange(bs) % 7 == 0, 2.0, -2.0).astype(np.float32),
        (rng.standard_normal(bs) * 1e-6).astype(np.float32),
        (rng.standard_normal(bs) * 1e4).astype(np.float32),
    ]
    return np.concatenate(rows + [random_rows(rng, 64 * bs)])


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES + [T.Q8_1, T.Q8_K, T.F16, T.BF16], ids=lambda t: t.name)
def test_reference_quantizer_matches_ggml(lib, qtype):
    ffi, L = lib
    rng = np.random.default_rng(int(qtype) + 100)
    x = tricky_rows(rng, SIZES[qtype][0] if SIZES[qtype][0] > 1 else 32)
    fn = L.iq_type_traits_get(int(qtype)).from_float
    assert np.array_equal(from_float(ffi, fn, x, qtype), oracle_quantize(x, qtype))


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_activation_quantizer_matches_reference_on_every_isa(lib, wtype):
    ffi, L = lib
    atype = VEC_DOT_TYPE[wtype]
    rng = np.random.default_rng(int(wtype) + 200)
    x = tricky_rows(rng, SIZES[atype][0])
    want = from_float(ffi, L.iq_type_traits_get(int(atype)).from_float, x, atype)
    for label, traits in isa_kernels(ffi, L):
        ct = traits(wtype)
        assert ct.vec_dot_type == int(atype)
        if ct.from_float != ffi.NULL:
            assert np.array_equal(from_float(ffi, ct.from_float, x, atype), want), label


@pytest.mark.parametrize("wtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_activation_quantizer_nan_is_code_zero_on_every_isa(lib, wtype):
    """A NaN activation (an overflowed layer) gives code 0 beside its block's other codes, the
    same bytes on every ISA (the conversion of NaN to an integer is not left to the hardware)."""
    ffi, L = lib
    atype = VEC_DOT_TYPE[wtype]
    x = np.random.default_rng(7).standard_normal(256).astype(np.float32)
    x[[3, 40, 41, 100]] = np.nan
    x[200] = np.inf
    want = from_float(ffi, L.iq_type_traits_get(int(atype)).from_float, x, atype)
    off = 2 if atype == T.Q8_0 else 4
    codes = want.reshape(-1, off + 32)[:, off:].view(np.int8).reshape(-1)
    assert (codes[[3, 40, 41, 100]] == 0).all()
    for label, traits in isa_kernels(ffi, L):
        ct = traits(wtype)
        if ct.from_float != ffi.NULL:
            assert np.array_equal(from_float(ffi, ct.from_float, x, atype), want), label


# ---- dot products ----

def np_dot(w: np.ndarray, a: np.ndarray, qtype) -> tuple[float, float]:
    """The dot product in float64 from the dequantized rows, and the sum of the magnitudes
    of its terms (the scale of a float32 rounding error). For the asymmetric formats the
    min term uses q8_1's stored s = fp16(d * sum(q)), as the format defines."""
    atype = VEC_DOT_TYPE[qtype]
    terms = oracle_dequantize(w, qtype).astype(np.float64) * oracle_dequantize(a, atype).astype(np.float64)
    total, scale = terms.sum(), np.abs(terms).sum()
    if atype == T.Q8_1:
        wb = w.reshape(-1, SIZES[qtype][1])
        ab = a.reshape(-1, 36)
        m = wb[:, 2:4].copy().view(np.float16).astype(np.float64)
        d = ab[:, 0:2].copy().view(np.float16).astype(np.float64)
        s = ab[:, 2:4].copy().view(np.float16).astype(np.float64)
        qsum = ab[:, 4:].view(np.int8).astype(np.float64).sum(axis=1, keepdims=True)
        total += float((m * (s - d * qsum)).sum())
        scale += float(np.abs(m * s).sum())
    return total, scale + 1e-30


def lengths_for(qtype) -> list[int]:
    bs = SIZES[qtype][0]
    if bs == 1:
        return [1, 7, 37, 576, 1000, 4096]
    if bs == 32:
        return [32, 96, 256, 576, 1536, 4096]
    return [256, 1536, 4096]


@pytest.mark.parametrize("qtype", list(WEIGHTS), ids=lambda t: t.name)
def test_vec_dot_matches_scalar_and_numpy(lib, qtype):
    ffi, L = lib
    rng = np.random.default_rng(int(qtype) + 300)
    atype = VEC_DOT_TYPE[qtype]
    scalar = L.iq_cpu_traits_for(int(qtype), 0)
    assert scalar != ffi.NULL and scalar.vec_dot_type == int(atype)
    act_quantize = L.iq_type_traits_get(int(atype)).from_float
    kernels = isa_kernels(ffi, L)
    out = ffi.new("float *")
    for n in lengths_for(qtype):
        for _ in range(3):
            w = random_weight_blob(rng, qtype, n)
            a = from_float(ffi, act_quantize, random_rows(rng, n), atype)
            want, scale = np_dot(w, a, qtype)
            scalar.vec_dot(n, out, ptr(ffi, w), ptr(ffi, a))
            ref = out[0]
            assert abs(ref - want) <= 1e-5 * scale, (n, ref, want)
            for label, traits in kernels:
                ct = traits(qtype)
                ct.vec_dot(n, out, ptr(ffi, w), ptr(ffi, a))
                assert abs(out[0] - ref) <= 1e-5 * scale, (label, n, out[0], ref)
                assert abs(out[0] - want) <= 1e-5 * scale, (label, n, out[0], want)


@pytest.mark.parametrize("qtype", list(WEIGHTS), ids=lambda t: t.name)
def test_vec_dot_cols_equals_vec_dot_bit_for_bit(lib, qtype):
    """One weight row against 1 .. 4 activation rows at once gives each row the bits vec_dot of
    the same ISA gives it (a token's products do not depend on the tokens beside it)."""
    ffi, L = lib
    rng = np.random.default_rng(int(qtype) + 400)
    atype = VEC_DOT_TYPE[qtype]
    act = act_rows(ffi, L, qtype, rng)
    kernels = kernels_having(ffi, L, qtype, "vec_dot_cols")
    for label, ct in kernels:
        for n in lengths_for(qtype):
            w = random_weight_blob(rng, qtype, n)
            acts = [act(n) for _ in range(4)]
            row = len(acts[0])
            y = np.concatenate(acts)
            # each row's block scales as f32, as the product's driver converts them once per row
            per_row = L.iq_cpu_act_scales_size(int(atype), n)
            assert per_row == 2 * (n // 32)
            scales = ffi.new("float[]", 4 * per_row)
            for c, a in enumerate(acts):
                L.iq_cpu_act_scales(int(atype), ptr(ffi, a), n, scales + c * per_row)
            single = ffi.new("float *")
            for ncols in (1, 2, 3, 4):
                out = ffi.new("float[]", 8)
                ct.vec_dot_cols(n, out, 2, ptr(ffi, w), ptr(ffi, y), row, scales, per_row, ncols)  # results 2 apart
                for c in range(ncols):
                    ct.vec_dot(n, single, ptr(ffi, w), ptr(ffi, acts[c]))
                    assert out[2 * c] == single[0], (label, n, ncols, c)
                assert all(out[2 * c] == 0 for c in range(ncols, 4)), (label, ncols)
    if qtype in (T.Q4_0, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL) and L.iq_cpu_features_detect() & 1:
        assert kernels, "the 32-element block types have their columns' kernel from AVX2 on"


LANES_BLOCK = 320  # IQ_LANES_BLOCK: bytes of a pack per block of 32 elements


@pytest.mark.parametrize("qtype", list(WEIGHTS), ids=lambda t: t.name)
def test_vec_dot_lanes_equals_vec_dot_bit_for_bit(lib, qtype):
    """Several weight rows against up to 8 activation rows packed in lanes give each row the bits
    vec_dot of the same ISA gives it, whatever the lanes, the columns used and the rows."""
    ffi, L = lib
    rng = np.random.default_rng(int(qtype) + 500)
    act = act_rows(ffi, L, qtype, rng)
    kernels = kernels_having(ffi, L, qtype, "vec_dot_lanes")
    for label, ct in kernels:
        nrows = 3
        for n in lengths_for(qtype):
            w = np.concatenate([random_weight_blob(rng, qtype, n) for _ in range(nrows)])
            wrow = len(w) // nrows
            acts = [act(n) for _ in range(8)]
            single = ffi.new("float *")
            want = np.zeros((8, nrows), np.float32)
            for c, a in enumerate(acts):
                for r in range(nrows):
                    ct.vec_dot(n, single, ptr(ffi, w[r * wrow:]), ptr(ffi, a))
                    want[c, r] = single[0]
            for lanes, ncols_list in ((4, (1, 2, 3, 4)), (8, (5, 7, 8))):
                pack = ffi.new("char[]", (n // 32) * LANES_BLOCK)
                for c in range(lanes):
                    L.iq_cpu_act_lanes(ptr(ffi, acts[c]), n, pack, lanes, c)
                for ncols in ncols_list:
                    out = ffi.new("float[]", 8 * 4)  # column c's results at 4 c
                    ct.vec_dot_lanes(n, out, 4, ptr(ffi, w), wrow, nrows, pack, lanes, ncols)
                    got = np.frombuffer(ffi.buffer(out), np.float32).reshape(8, 4)
                    np.testing.assert_array_equal(got[:ncols, :nrows], want[:ncols], err_msg=f"{label} {n} {lanes} {ncols}")
                    assert not got[ncols:].any() and not got[:, nrows:].any(), (label, lanes, ncols)
    if qtype == T.Q4_1 and L.iq_cpu_features_detect() == 1:
        assert kernels, "q4_1 has its lanes kernel on AVX2"


def test_traits_cover_exactly_the_weight_types(lib):
    ffi, L = lib
    for t in range(-1, 41):
        ct = L.iq_cpu_traits_for(t, 0)
        assert (ct != ffi.NULL) == (t in [int(k) for k in WEIGHTS]), t
    assert L.iq_cpu_traits_for(int(T.Q4_1), 128) == ffi.NULL  # no such set of features


# ---- ISA selection ----

def test_isa_set_and_env_override(lib):
    ffi, L = lib
    best = L.iq_cpu_features_detect()
    levels = conftest.isa_levels(best)
    top = levels[-1][0]
    assert ffi.string(L.iq_cpu_features_name(best)).decode() == top
    before = L.iq_cpu_features_active()
    try:
        assert L.iq_cpu_features_set(0) and L.iq_cpu_features_active() == 0
        missing = next(b for b in (1 << i for i in range(7)) if not b & best)
        assert not L.iq_cpu_features_set(best | missing)
        assert L.iq_cpu_features_active() == 0
    finally:
        L.iq_cpu_features_set(before)
    code = (
        "import sys; from cffi import FFI; f = FFI(); "
        "f.cdef('unsigned iq_cpu_features_active(void); unsigned iq_cpu_features_detect(void);'); "
        "L = f.dlopen(sys.argv[1]); print(L.iq_cpu_features_active(), L.iq_cpu_features_detect())"
    )
    # a level names the most its kernels may use: the machine's best level gives all it has
    for env, want in [("scalar", 0), (top, best), ("bogus", best), *levels[1:2]]:
        r = subprocess.run([sys.executable, "-c", code, conftest.lib_path()], capture_output=True, text=True,
                           env={**os.environ, "INNERQ_ISA": env}, check=True)
        assert r.stdout.split() == [str(want), str(best)], env
        assert ("INNERQ_ISA" in r.stderr) == (env == "bogus")
