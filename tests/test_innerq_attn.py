"""The InnerQ / KIVI cache: stores and flushes, storage layout, reference attention and the CPU
kernels of every ISA.

Oracles: the storage is decoded from its raw bytes by numpy following the layout described
in iq-qcache.h, and compared with the numpy group quantizer of test_innerq_quant applied to
the f16-rounded inputs; attention is numpy's softmax(q K^T scale) V over the decoded cache.
The scalar reference must match numpy to float rounding; every ISA's kernels must match the
scalar kernels (the specification of the q8 / p8 arithmetic) to float rounding, and the
scalar kernels the reference to within that arithmetic's quantization.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import feature_sets
from innerq_ffi import QCache, fptr, load
from test_innerq_quant import KEY_CENTRE, KEY_LEVELS, quant_group_np

CH, TOK = 0, 1  # enum iq_qaxis
HYBRID, SEARCH = 0, 3


def innerq_cfg(bits_k=3, bits_v=2, G=64, S=32, R=96, norm=True, mode=HYBRID, correction=True, vscale=False, p8=False,
               levels=False):
    return dict(bits_k=bits_k, bits_v=bits_v, axis_k=CH, axis_v=TOK, group=G, n_sink=S, n_recent=R, mode=mode,
                key_norm=norm, score_correction=correction, value_scales=vscale, params8=p8, key_levels=levels)


def levels_cfg(bits_k=3, bits_v=2, G=64, **kw):
    """Keys on the key levels: the searched quantizer, no score correction (iq_qcache_config.key_levels)."""
    return innerq_cfg(bits_k, bits_v, G, mode=SEARCH, correction=False, levels=True, **kw)


def kivi_cfg(bits=2, G=32, R=128):
    return dict(bits_k=bits, bits_v=bits, axis_k=TOK, axis_v=CH, group=G, n_sink=0, n_recent=R, mode=1, key_norm=False)


# ---- numpy model of the spec ----

def schedule(S, R, G, steps):
    """(n_tokens, n_sink, n_quant, n_recent) after each store of steps[i] tokens (docs/DESIGN.md 3.2)."""
    n = sink = quant = recent = 0
    out = []
    for k in steps:
        to_sink = min(k, S - sink)
        sink += to_sink
        recent += k - to_sink
        while recent >= R + G:
            recent -= G
            quant += G
        n += k
        out.append((n, sink, quant, recent))
    return out


def params8_np(raw: np.ndarray, bits: int, D: int, off: int, lv: bool = False):
    """d[D], m[D] (float16) of a block with 8-bit group parameters, from its bytes at off (the
    fp16 references dref, mlo, mhi, then dc[D], mc[D]), by their definition in float32 and each
    rounded to fp16 (iq-qcache-math.h, "8-bit group parameters"); lv: a symmetric group's centre
    is the key levels'."""
    f32 = np.float32
    dref, mlo, mhi = (f32(v) for v in raw[off:off + 6].view(np.float16))
    dc, mc = raw[off + 8:off + 8 + D].astype(np.int64), raw[off + 8 + D:off + 8 + 2 * D].astype(np.int64)
    factor = np.array([f32(2.0 ** (-(c % 16) / 16)) * f32(2.0 ** -(c // 16)) for c in dc], np.float32)
    a = (dref * factor).astype(np.float32)
    d = np.where(mc == 254, -a, a).astype(np.float16)
    step = f32(f32(mhi - mlo) / f32(253))
    m_asym = (mlo + (mc.astype(np.float32) * step).astype(np.float32)).astype(np.float32)
    m_sym = (f32(-(KEY_CENTRE if lv else 2 ** bits // 2)) * d.astype(np.float32)).astype(np.float32)
    return d, np.where(mc >= 254, m_sym, m_asym).astype(np.float16)


def decode_block(raw: np.ndarray, axis: int, bits: int, D: int, G: int, p8: bool = False, lv: bool = False):
    """(codes [G tokens][D channels], d[D], m[D] float16, group index [G][D]) from a block's bytes
    (lv: 3-bit codes on the key levels, which the codes returned are)."""
    lv = lv and bits == 3
    n_tiles, tb = D * G // 64, 8 * bits
    tiles = raw[:n_tiles * tb].reshape(n_tiles, tb).astype(np.int64)
    p = np.arange(64)
    if bits >= 4:
        codes = (tiles[:, p % 32] >> (4 * (p // 32))) & 15
        if bits == 5:
            codes |= ((tiles[:, 32 + p // 8] >> (p % 8)) & 1) << 4
    else:
        codes = (tiles[:, p % 16] >> (2 * (p // 16))) & 3
        if bits == 3:
            codes |= ((tiles[:, 16 + p // 8] >> (p % 8)) & 1) << 2
    if p8:
        d, m = params8_np(raw, bits, D, n_tiles * tb, lv)
    else:
        params = raw[n_tiles * tb:n_tiles * tb + 4 * D].view(np.float16)
        d, m = params[:D], params[D:]
    t, c = np.meshgrid(np.arange(G), np.arange(D), indexing="ij")
    lane, sub = (t, c) if axis == CH else (c, t)
    lane_len, sub_len = (G, D) if axis == CH else (D, G)
    tile = (lane // 16) * (sub_len // 4) + sub // 4
    u = codes[tile, 4 * (lane % 16) + sub % 4]
    group = (sub // G) * lane_len + lane
    return (KEY_LEVELS[u] if lv else u), d, m, group


def row_scale_codes_np(x: np.ndarray) -> np.ndarray:
    """The row scale code of each row of x [G][D] (iq-qcache-math.h), from its definition:
    round(8 log2 rms) + 128 within 0 .. 255, in float64."""
    ms = (x.astype(np.float64) ** 2).mean(-1)
    return np.clip(np.round(4 * np.log2(np.maximum(ms, 1e-300))) + 128, 0, 255).astype(np.uint8)


def row_scales_np(raw: np.ndarray, bits: int, D: int, G: int, p8: bool = False) -> np.ndarray:
    """The row scales 2^((s - 128) / 8) of a value block, from its codes after its (d, m)."""
    off = D * G * bits // 8 + (8 + 2 * D if p8 else 4 * D)
    return np.exp2((raw[off:off + G].astype(np.float64) - 128) / 8)


def dense_cache(qc: QCache):
    """K, V float64 [H][n_tokens][D] as attention must read them, decoded from raw bytes."""
    c, D, G = qc.c, qc.D, qc.G
    K = np.zeros((qc.H, c.n_tokens, D))
    V = np.zeros((qc.H, c.n_tokens, D))
    q0, q1 = c.n_sink, c.n_sink + c.n_quant
    K[:, :q0], V[:, :q0] = qc.sink(False)[:, :q0], qc.sink(True)[:, :q0]
    K[:, q1:], V[:, q1:] = qc.recent(False)[:, :c.n_recent], qc.recent(True)[:, :c.n_recent]
    norms = qc.norms().astype(np.float64)
    cfg = c.cfg
    for h in range(qc.H):
        for j in range(c.n_quant // G):
            for is_v, out in ((False, K), (True, V)):
                u, d, m, grp = decode_block(qc.block_bytes(is_v, h, j), cfg.axis_v if is_v else cfg.axis_k,
                                            cfg.bits_v if is_v else cfg.bits_k, D, G, cfg.params8,
                                            cfg.key_levels and not is_v)
                x = d.astype(np.float64)[grp] * u + m.astype(np.float64)[grp]
                if is_v and cfg.value_scales:
                    x = x * row_scales_np(qc.block_bytes(True, h, j), cfg.bits_v, D, G, cfg.params8)[:, None]
                out[h, q0 + j * G:q0 + (j + 1) * G] = x if is_v else x * norms[h]
    return K, V


def score_correction(qc: QCache):
    """(d^2 [H][n_tokens][D/G] of every quantized key group, 0 in the windows; the norms), what
    the score correction reads (iq_qcache_config.score_correction), or None where it is off."""
    c, D, G = qc.c, qc.D, qc.G
    if not c.cfg.score_correction or c.cfg.axis_k != CH:
        return None
    d2 = np.zeros((qc.H, c.n_tokens, D // G))
    for h in range(qc.H):
        for j in range(c.n_quant // G):
            _, d, _, _ = decode_block(qc.block_bytes(False, h, j), CH, c.cfg.bits_k, D, G, c.cfg.params8)
            # d[gi * G + t]: group gi of token t
            d2[h, c.n_sink + j * G:c.n_sink + (j + 1) * G] = d.astype(np.float64).reshape(D // G, G).T ** 2
    return d2, qc.norms().astype(np.float64)


def attention_np(q, K, V, scale, kb=None, vb=None, correction=None):
    """q [n_q][n_head][D]; K, V [H][n][D]; kb, vb [n_q][H][D] with the causal mask; correction:
    score_correction(), whose var_t / 2 = sum_g d_tg^2 / 24 sum_{c in g} (scale q_c n_c)^2 is
    subtracted from the stored tokens' scores."""
    n_q, n_head, D = q.shape
    r = n_head // K.shape[0]
    out = np.zeros((n_q, n_head, D))
    for i in range(n_q):
        for hq in range(n_head):
            h = hq // r
            keys, vals = K[h], V[h]
            if kb is not None:
                keys = np.concatenate([keys, kb[:i + 1, h]])
                vals = np.concatenate([vals, vb[:i + 1, h]])
            s = keys @ q[i, hq].astype(np.float64) * scale
            if correction is not None:
                d2, norms = correction
                qn2 = ((scale * q[i, hq].astype(np.float64) * norms[h]) ** 2).reshape(d2.shape[2], -1).sum(axis=1)
                s[:d2.shape[1]] -= d2[h] @ qn2 / 24
            p = np.exp(s - s.max())
            out[i, hq] = p @ vals / p.sum()
    return out


# ---- C entry points ----

def attention_ref(qc: QCache, q, scale, kb=None, vb=None):
    ffi, lib = qc.ffi, qc.lib
    q = np.ascontiguousarray(q, np.float32)
    out = np.zeros(q.shape, np.float32)
    kp = fptr(ffi, np.ascontiguousarray(kb, np.float32)) if kb is not None else ffi.NULL
    vp = fptr(ffi, np.ascontiguousarray(vb, np.float32)) if vb is not None else ffi.NULL
    assert lib.iq_qcache_attention_ref(qc.c, fptr(ffi, q), q.shape[1], kp, vp, q.shape[0], scale, fptr(ffi, out))
    return out


def kernels():
    """(name, kernel table) for every kernel row this machine runs (scalar first)."""
    ffi, lib = load()
    out = {}
    for f in feature_sets(lib.iq_cpu_features_detect()):
        kt = lib.iq_innerq_kernels_for(f)
        out.setdefault(ffi.string(kt.name).decode(), kt)
    return list(out.items())


def new_states(qc: QCache, r: int):
    st = np.zeros(r * (qc.D + 2), np.float32)
    qc.lib.iq_attn_state_init(fptr(qc.ffi, st), r, qc.D)
    return st


def finish(qc: QCache, st, r):
    out = np.zeros((r, qc.D), np.float32)
    qc.lib.iq_attn_state_finish(fptr(qc.ffi, st), r, qc.D, fptr(qc.ffi, out))
    return out


def attend_kernel(qc: QCache, kt, q, scale, kb=None, vb=None, splits=None):
    """The CPU path for every query and KV head: prep, cache tokens (in the token ranges of
    splits, merged), batch rows with the causal mask."""
    ffi, lib = qc.ffi, qc.lib
    n_q, n_head, D = q.shape
    r = n_head // qc.H
    out = np.zeros(q.shape, np.float32)
    qp = ffi.new("struct iq_innerq_query *")
    bounds = splits or [0, qc.c.n_tokens]
    for i in range(n_q):
        for h in range(qc.H):
            qh = np.ascontiguousarray(q[i, h * r:(h + 1) * r], np.float32)
            assert lib.iq_innerq_query_prep(qc.c, h, fptr(ffi, qh), r, scale, qp)
            st = new_states(qc, r)
            for t0, t1 in zip(bounds[:-1], bounds[1:]):
                part = new_states(qc, r)
                lib.iq_innerq_attend(kt, qc.c, h, qp, t0, t1, fptr(ffi, part))
                lib.iq_attn_state_merge(fptr(ffi, st), fptr(ffi, part), r, D)
            if kb is not None:
                rows_k = np.ascontiguousarray(kb[:i + 1], np.float32)
                rows_v = np.ascontiguousarray(vb[:i + 1], np.float32)
                kt.rows_f32(fptr(ffi, rows_k) + h * D, fptr(ffi, rows_v) + h * D, qc.H * D, i + 1, qp, fptr(ffi, st))
            out[i, h * r:(h + 1) * r] = finish(qc, st, r)
    return out


def filled_cache(cfg, D, H, n_tokens, steps, seed=0, n_ctx=None, outlier=True, spread=None):
    """A cache with n_tokens stored in chunks of steps (cycled), keys with outlier channels;
    value rows of sizes spread over 8 octaves where the cache has row scales (or spread says)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_tokens, H, D)).astype(np.float32)
    if outlier:
        k[:, :, 3] *= 12.0
        k[:, :, D - 7] += 5.0
    v = rng.standard_normal((n_tokens, H, D)).astype(np.float32)
    if cfg.get("value_scales") if spread is None else spread:  # rows of very different sizes
        v *= np.exp2(rng.uniform(-4.0, 4.0, (n_tokens, H, 1))).astype(np.float32)
    qc = QCache(cfg, D, H, n_ctx or n_tokens + 16)
    t = 0
    i = 0
    while t < n_tokens:
        n = min(steps[i % len(steps)], n_tokens - t)
        assert qc.store(k[t:t + n], v[t:t + n])
        t += n
        i += 1
    return qc, k, v


# ---- stores, flushes, normalization ----

@pytest.mark.parametrize("S,R,G,steps", [
    (32, 96, 64, [1] * 300),
    (32, 96, 64, [500, 1, 1, 70, 3, 64, 200]),
    (4, 16, 32, [7, 100, 1, 1, 33, 2, 90]),
    (0, 0, 32, [31, 1, 1, 64, 5]),
    (16, 40, 128, [10, 10, 300, 1, 127, 128]),
])
def test_flush_schedule(S, R, G, steps):
    H = 2
    qc = QCache(innerq_cfg(G=G, S=S, R=R), G, H, sum(steps))  # head_dim = G: one key group
    rng = np.random.default_rng(1)
    for step, expect in zip(steps, schedule(S, R, G, steps)):
        k = rng.standard_normal((step, H, qc.D)).astype(np.float32)
        assert qc.store(k, k)
        assert qc.state() == expect


def test_norms_fixed_after_first_flush_and_cleared_on_reset():
    S, R, G, D, H = 8, 32, 32, 64, 2
    qc = QCache(innerq_cfg(G=G, S=S, R=R), D, H, 1024)
    rng = np.random.default_rng(2)
    k = (rng.standard_normal((600, H, D)) * rng.uniform(0.1, 20, D)).astype(np.float32)
    assert qc.store(k[:40], k[:40])  # sink + 32 in the window: no flush yet
    assert not qc.norms_ready and np.all(qc.norms() == 1.0)
    assert qc.store(k[40:300], k[40:300])  # first flush: 300 - 8 = 292 in the window -> 8 blocks
    n_flushed = qc.c.n_quant
    assert n_flushed == 256
    k16 = k.astype(np.float16).astype(np.float32)
    mx = np.abs(k16[S:S + n_flushed]).max(axis=0)  # [H][D]
    expect = np.where(mx > 0, np.sqrt(mx), np.float32(1.0)).astype(np.float32)
    np.testing.assert_array_equal(qc.norms(), expect)
    assert qc.norms_ready
    assert qc.store(k[300:600] * 50, k[300:600])  # larger keys later: the norms stay
    np.testing.assert_array_equal(qc.norms(), expect)
    qc.clear()
    assert qc.state() == (0, 0, 0, 0) and not qc.norms_ready and np.all(qc.norms() == 1.0)
    k2 = k[:300] * 0.5
    k2[:, :, 5] = 0.0  # a channel that is zero in the first flush: n = 1
    assert qc.store(k2, k2)
    mx2 = np.abs(k2.astype(np.float16).astype(np.float32)[S:S + qc.c.n_quant]).max(axis=0)
    np.testing.assert_array_equal(qc.norms(), np.where(mx2 > 0, np.sqrt(mx2), np.float32(1.0)))
    assert np.all(qc.norms()[:, 5] == 1.0)


@pytest.mark.parametrize("rope_dims", [64, 48, 0])
def test_norms_shared_by_rope_pairs(rope_dims):
    """Channels below rope_dims pair up as RoPE rotates them, (2i, 2i+1), and share one n from
    the max over both; the others keep their own (0: every channel, docs/DESIGN.md 3.3 as written)."""
    S, R, G, D, H = 8, 32, 32, 64, 2
    qc = QCache(dict(innerq_cfg(G=G, S=S, R=R), rope_dims=rope_dims), D, H, 1024)
    rng = np.random.default_rng(3)
    k = (rng.standard_normal((300, H, D)) * rng.uniform(0.1, 20, D)).astype(np.float32)
    k[:, :, 7] = 0.0             # in a pair: takes channel 6's n
    k[:, :, 40:42] = 0.0         # a zero pair (or two zero channels): n = 1
    k[:, :, 60] = 0.0
    assert qc.store(k, k)
    mx = np.abs(k.astype(np.float16).astype(np.float32)[S:S + qc.c.n_quant]).max(axis=0)  # [H][D]
    both = np.maximum(mx[:, 0:rope_dims:2], mx[:, 1:rope_dims:2])
    mx[:, 0:rope_dims:2] = both
    mx[:, 1:rope_dims:2] = both
    np.testing.assert_array_equal(qc.norms(), np.where(mx > 0, np.sqrt(mx), np.float32(1.0)))
    n = qc.norms()
    assert np.all(n[:, 40:42] == 1.0)
    assert np.all(n[:, 60] == 1.0) == (rope_dims <= 60)
    assert np.all(n[:, 7] == n[:, 6]) == (rope_dims > 0) and np.all(n[:, 7] > 1.0) == (rope_dims > 0)


@pytest.mark.parametrize("rope_dims", [-2, 63, 66])
def test_rope_dims_must_be_even_and_within_the_head(rope_dims):
    ffi, lib = load()
    cfg = ffi.new("struct iq_qcache_config *", dict(innerq_cfg(), rope_dims=rope_dims))
    assert lib.iq_qcache_size(cfg, 64, 1, 256) == 0
    assert "rope_dims" in ffi.string(lib.iq_error_get()).decode()


def test_exp_of_the_kernels():
    """The softmax exp every ISA shares (iq_innerq_exp): relative error under 1e-5 on [-87, 0],
    exactly 1 at 0 (the block's top token gets p8 = 255), clamped to exp(-87) below."""
    ffi, lib = load()
    x = np.concatenate([np.linspace(-87.0, 0.0, 20001), -np.abs(np.random.default_rng(5).standard_normal(2000))])
    x = x.astype(np.float32)
    got = np.array([lib.iq_innerq_exp(float(v)) for v in x])
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=1e-5)
    assert lib.iq_innerq_exp(0.0) == 1.0
    assert lib.iq_innerq_exp(-1000.0) == lib.iq_innerq_exp(-87.0) > 0.0
    assert lib.iq_innerq_exp(float("-inf")) == lib.iq_innerq_exp(-87.0)


def test_store_past_context_fails():
    qc = QCache(innerq_cfg(), 64, 1, 100)
    x = np.zeros((90, 1, 64), np.float32)
    assert qc.store(x, x)
    assert not qc.store(x[:11], x[:11])
    assert b"exceed" in qc.ffi.string(qc.lib.iq_error_get())
    assert qc.state()[0] == 90


def test_query_prep_refuses_too_many_heads():
    qc = QCache(innerq_cfg(), 64, 2, 256)
    q = np.zeros((9, 64), np.float32)
    qp = qc.ffi.new("struct iq_innerq_query *")
    assert not qc.lib.iq_innerq_query_prep(qc.c, 0, fptr(qc.ffi, q), 9, 1.0, qp)
    assert not qc.lib.iq_innerq_query_prep(qc.c, 2, fptr(qc.ffi, q), 1, 1.0, qp)
    assert qc.lib.iq_innerq_query_prep(qc.c, 1, fptr(qc.ffi, q), 8, 1.0, qp)


def test_invalid_configurations_are_refused():
    ffi, lib = load()
    for cfg, D in [(innerq_cfg(G=48), 64), (innerq_cfg(bits_k=6), 64), (kivi_cfg(bits=5), 64), (innerq_cfg(G=128), 64),
                   (innerq_cfg(), 72), (kivi_cfg(G=128), 64),
                   # key levels: the searched quantizer's grid, without the uniform grid's score correction
                   (innerq_cfg(levels=True, correction=False), 64), (innerq_cfg(levels=True, mode=SEARCH), 64),
                   (dict(kivi_cfg(), mode=SEARCH, key_levels=True), 64)]:
        assert lib.iq_qcache_size(ffi.new("struct iq_qcache_config *", cfg), D, 2, 256) == 0
        assert ffi.string(lib.iq_error_get())
    c = ffi.new("struct iq_qcache_config *")
    assert not lib.iq_qcache_config_default(lib.IQ_TYPE_INNERQ3, lib.IQ_TYPE_KIVI2, 0, c)
    assert lib.iq_qcache_config_default(lib.IQ_TYPE_INNERQ3, lib.IQ_TYPE_INNERQ2, 0, c)
    assert (c.bits_k, c.bits_v, c.group, c.n_sink, c.n_recent, c.key_norm) == (3, 2, 64, 32, 96, True)
    assert lib.iq_qcache_config_default(lib.IQ_TYPE_KIVI4, lib.IQ_TYPE_KIVI4, 32, c)
    assert (c.bits_k, c.axis_k, c.axis_v, c.n_sink, c.n_recent, c.key_norm) == (4, TOK, CH, 0, 128, False)


@pytest.mark.parametrize("cfg,D", [
    (innerq_cfg(3, 2, 64), 64),
    (innerq_cfg(4, 3, 32, S=4, R=40), 128),
    (innerq_cfg(2, 4, 128, S=0, R=20, mode=2), 128),
    (innerq_cfg(3, 2, 64, vscale=True), 64),
    (innerq_cfg(4, 3, 32, S=4, R=40, vscale=True), 128),
    (levels_cfg(3, 2, 64), 64),
    (levels_cfg(3, 3, 32, S=4, R=40, vscale=True), 128),
    (kivi_cfg(2, 32), 64),
    (kivi_cfg(4, 64), 64),
])
def test_storage_matches_numpy_quantizer(cfg, D):
    """Every stored byte region against numpy: f16 windows, and each block's codes and (d, m)
    = the numpy quantizer on the f16-rounded tokens (keys divided by the norms)."""
    H, n = 2, 420
    qc, k, v = filled_cache(cfg, D, H, n, [150, 1, 1, 37, 5])
    S, G, c = cfg["n_sink"], cfg["group"], qc.c
    k16, v16 = (x.astype(np.float16) for x in (k, v))
    np.testing.assert_array_equal(qc.sink(False)[:, :S], k16[:S].transpose(1, 0, 2))
    np.testing.assert_array_equal(qc.sink(True)[:, :S], v16[:S].transpose(1, 0, 2))
    q1 = S + c.n_quant
    np.testing.assert_array_equal(qc.recent(False)[:, :c.n_recent], k16[q1:].transpose(1, 0, 2))
    np.testing.assert_array_equal(qc.recent(True)[:, :c.n_recent], v16[q1:].transpose(1, 0, 2))
    assert c.n_quant >= 2 * G
    modes = {0: "hybrid", 1: "asym", 2: "sym", 3: "search"}
    norms = qc.norms()
    for h in range(H):
        for j in range(c.n_quant // G):
            toks = slice(S + j * G, S + (j + 1) * G)
            for is_v, src, axis, bits in ((False, k16, cfg["axis_k"], cfg["bits_k"]),
                                          (True, v16, cfg["axis_v"], cfg["bits_v"])):
                x = src[toks, h].astype(np.float32)
                if not is_v:
                    x = x / norms[h]
                raw = qc.block_bytes(is_v, h, j)
                if is_v and cfg.get("value_scales"):  # rows divided by their scales first
                    codes = raw[D * G * bits // 8 + 4 * D:][:G]
                    np.testing.assert_array_equal(codes, row_scale_codes_np(x))
                    x = x / row_scales_np(raw, bits, D, G)[:, None].astype(np.float32)
                u, d, m, grp = decode_block(raw, axis, bits, D, G)
                for gi in range(D):
                    sel = grp == gi
                    # group elements in their natural order: channels (axis CH) or tokens
                    xs = x[sel] if axis == CH else x.T[gi]
                    us = u[sel] if axis == CH else u.T[gi]
                    un, dn, mn = quant_group_np(xs, bits, modes[cfg["mode"]], cfg.get("key_levels") and not is_v)
                    assert d[gi].view(np.uint16) == dn.view(np.uint16) and m[gi].view(np.uint16) == mn.view(np.uint16)
                    np.testing.assert_array_equal(us, un)


@pytest.mark.parametrize("bits_v", [2, 3])
def test_row_scales_lower_the_error_of_rows_of_different_sizes(bits_v):
    """The same values (rows spread over 8 octaves) stored with and without row scales: each
    row's error relative to its own size falls several times, and no row's error grows much."""
    D, H, n = 64, 2, 420
    rel = {}
    for vscale in (False, True):
        cfg = innerq_cfg(3, bits_v, 64, vscale=vscale)
        qc, _, v = filled_cache(cfg, D, H, n, [150, 1, 1, 37, 5], spread=True)
        _, V = dense_cache(qc)
        q0, q1 = qc.c.n_sink, qc.c.n_sink + qc.c.n_quant
        x = v[q0:q1].astype(np.float16).astype(np.float64).transpose(1, 0, 2)  # [H][tokens][D]
        err = np.sqrt(((V[:, q0:q1] - x) ** 2).mean(-1)) / np.sqrt((x ** 2).mean(-1))
        rel[vscale] = err
    assert np.median(rel[True]) < 0.5 * np.median(rel[False]), (np.median(rel[True]), np.median(rel[False]))
    assert np.quantile(rel[True], 0.99) < np.quantile(rel[False], 0.99)


# ---- attention ----

CONFIGS = [  # (cfg, D, n_kv_head, r)
    (innerq_cfg(3, 2, 64), 64, 3, 3),
    (innerq_cfg(3, 2, 64), 128, 2, 4),
    (innerq_cfg(4, 3, 32, S=4, R=40), 64, 2, 1),
    (innerq_cfg(2, 4, 128, S=16, R=64), 128, 1, 8),
    (innerq_cfg(3, 2, 64, mode=1), 64, 2, 3),
    (innerq_cfg(3, 2, 64, correction=False), 64, 3, 3),
    (innerq_cfg(5, 3, 64), 64, 3, 3),                 # 5-bit keys (4 + 1 planes)
    (innerq_cfg(5, 5, 32, S=4, R=40), 128, 2, 2),     # 5-bit values
    (innerq_cfg(3, 2, 64, vscale=True), 64, 3, 3),    # value row scales
    (innerq_cfg(4, 3, 32, S=4, R=40, vscale=True), 128, 2, 4),
    (innerq_cfg(3, 2, 64, p8=True), 64, 3, 3),        # 8-bit group parameters
    (innerq_cfg(2, 4, 128, S=16, R=64, p8=True), 128, 1, 8),
    (innerq_cfg(4, 3, 32, S=4, R=40, vscale=True, p8=True), 128, 2, 4),
    (levels_cfg(3, 2, 64), 64, 3, 3),                 # keys on the key levels
    (levels_cfg(3, 2, 64, norm=False), 128, 2, 4),
    (levels_cfg(3, 3, 32, S=4, R=40, vscale=True, p8=True), 128, 2, 4),
    (levels_cfg(3, 2, 64, p8=True), 64, 1, 8),
    (levels_cfg(4, 2, 64), 64, 3, 3),                 # 4-bit keys stay uniform
]
KIVI_CONFIGS = [
    (kivi_cfg(2, 32), 64, 3, 3),
    (kivi_cfg(4, 64), 128, 2, 4),
]


def make_case(cfg, D, H, r, n=700, n_q=1, seed=3):
    qc, _, _ = filled_cache(cfg, D, H, n, [400, 1, 63, 1, 100, 7], seed=seed)
    rng = np.random.default_rng(seed + 1)
    q = rng.standard_normal((n_q, H * r, D)).astype(np.float32)
    kb = rng.standard_normal((n_q, H, D)).astype(np.float32)
    vb = rng.standard_normal((n_q, H, D)).astype(np.float32)
    return qc, q, kb, vb, 1.0 / np.sqrt(D)


@pytest.mark.parametrize("cfg,D,H,r", CONFIGS + KIVI_CONFIGS)
def test_reference_matches_numpy(cfg, D, H, r):
    qc, q, kb, vb, scale = make_case(cfg, D, H, r, n_q=3)
    c = qc.c
    assert c.n_sink == cfg["n_sink"] and c.n_quant > 0 and c.n_recent > 0  # all three regions
    K, V = dense_cache(qc)
    vmax = np.abs(V).max()
    for i in range(2):  # decode: one query; then a batch of 3 with its own rows, causal
        qq = q[:1] if i == 0 else q
        args = () if i == 0 else (kb, vb)
        out = attention_ref(qc, qq, scale, *args)
        expect = attention_np(qq, K, V, scale, *args, correction=score_correction(qc))
        np.testing.assert_allclose(out, expect, rtol=1e-4, atol=2e-5 * vmax)


@pytest.mark.parametrize("cfg,D,H,r", CONFIGS[:2] + KIVI_CONFIGS[:1])
def test_reference_split_and_merge_equals_whole(cfg, D, H, r):
    qc, q, _, _, scale = make_case(cfg, D, H, r)
    ffi, lib = qc.ffi, qc.lib
    n = qc.c.n_tokens
    rng = np.random.default_rng(5)
    qh = np.ascontiguousarray(q[0, :r])
    whole = new_states(qc, r)
    lib.iq_qcache_attend_ref(qc.c, 0, fptr(ffi, qh), r, scale, 0, n, fptr(ffi, whole))
    for _ in range(3):
        cuts = [0] + sorted(rng.choice(np.arange(1, n), 5, replace=False).tolist()) + [n]
        merged = new_states(qc, r)
        for t0, t1 in zip(cuts[:-1], cuts[1:]):
            part = new_states(qc, r)
            lib.iq_qcache_attend_ref(qc.c, 0, fptr(ffi, qh), r, scale, t0, t1, fptr(ffi, part))
            lib.iq_attn_state_merge(fptr(ffi, merged), fptr(ffi, part), r, qc.D)
        np.testing.assert_allclose(finish(qc, merged, r), finish(qc, whole, r), rtol=1e-5, atol=1e-6)


def kernel_tolerance(V):
    return dict(rtol=2e-5, atol=2e-6 * np.abs(V).max())


def assert_within_q8_p8(got, ref, V):
    """got differs from ref only by the kernels' int8 query / u8 probability quantization:
    about 1% of the values' size (the outputs themselves are 10-20% of it here, so a layout or
    parameter bug shows as an error of that size)."""
    err = got - ref
    rms, rms_v = np.sqrt(np.mean(err ** 2)), np.sqrt(np.mean(V ** 2))
    assert rms < 0.02 * rms_v and np.abs(err).max() < 0.05 * np.abs(V).max(), (rms / rms_v, np.abs(err).max())


@pytest.mark.parametrize("cfg,D,H,r", CONFIGS + KIVI_CONFIGS)
def test_every_isa_matches_scalar_kernels(cfg, D, H, r):
    qc, q, kb, vb, scale = make_case(cfg, D, H, r, n_q=2)
    _, V = dense_cache(qc)
    scalar = kernels()[0][1]
    expect = attend_kernel(qc, scalar, q, scale, kb, vb)
    for name, kt in kernels()[1:]:
        got = attend_kernel(qc, kt, q, scale, kb, vb)
        np.testing.assert_allclose(got, expect, **kernel_tolerance(V), err_msg=name)


@pytest.mark.parametrize("cfg,D,H,r", CONFIGS + KIVI_CONFIGS)
def test_scalar_kernels_match_reference(cfg, D, H, r):
    """Exact where the kernels are exact (windows, batch rows, KIVI); within the q8 / p8
    quantization for InnerQ blocks."""
    qc, q, kb, vb, scale = make_case(cfg, D, H, r, n_q=2)
    _, V = dense_cache(qc)
    ref = attention_ref(qc, q, scale, kb, vb)
    got = attend_kernel(qc, kernels()[0][1], q, scale, kb, vb)
    if cfg["axis_k"] == TOK:  # KIVI: f32, no integer arithmetic
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5 * np.abs(V).max())
    else:
        assert_within_q8_p8(got, ref, V)


def test_kernels_exact_without_quantized_tokens():
    """With every token in the sink and the window the kernels are plain f16 attention."""
    cfg = innerq_cfg(3, 2, 64, S=32, R=96)
    qc, q, kb, vb, scale = make_case(cfg, 64, 2, 3, n=150, n_q=2)
    assert qc.c.n_quant == 0
    ref = attention_ref(qc, q, scale, kb, vb)
    for name, kt in kernels():
        np.testing.assert_allclose(attend_kernel(qc, kt, q, scale, kb, vb), ref, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("cfg,D,H,r", [CONFIGS[0], CONFIGS[3], KIVI_CONFIGS[0]])
def test_kernel_splits_merge_to_whole(cfg, D, H, r):
    qc, q, _, _, scale = make_case(cfg, D, H, r)
    n = qc.c.n_tokens
    _, V = dense_cache(qc)
    ffi, lib = qc.ffi, qc.lib
    for name, kt in kernels():
        whole = attend_kernel(qc, kt, q, scale)
        for parts in (2, 3, 7):  # thread splits: block-aligned, so identical p8
            bounds = [0]
            for p in range(parts):
                t0, t1 = ffi.new("int32_t *"), ffi.new("int32_t *")
                lib.iq_qcache_split(qc.c, parts, p, t0, t1)
                assert t0[0] == bounds[-1]
                bounds.append(t1[0])
            assert bounds[-1] == n
            np.testing.assert_allclose(attend_kernel(qc, kt, q, scale, splits=bounds), whole,
                                       **kernel_tolerance(V), err_msg=name)
        # arbitrary cuts (inside blocks): the same up to where p8 is quantized
        cuts = [0, 1, 40, 77, 300, 301, n - 5, n]
        assert_within_q8_p8(attend_kernel(qc, kt, q, scale, splits=cuts), whole, V)

