"""A study of KV cache layouts before they are built: a llama model's forward pass in numpy
(float32, the weights of tests/reference.py) with its cache simulated, each layout's mean KLD
against the same forward with an f16 cache on a chunk of a text.

The simulated cache is the InnerQ preset's arithmetic: keys, values (and queries) rotated by
R = S H S / sqrt(D) (random signs), rows rounded to f16, the searched quantizer of
ggml_innerq/iq-qcache-math.h (iq_quant_search_group: both grids over six ranges, least-squares
refit, fp16 (d, m)) on keys per token along the head's channels and on values per channel
along the G tokens of a block, f16 sink (S) and recent (R) windows, and decode semantics: query
t sees block b quantized once b was flushed before it (the recent window passes R + G rows).
It is not innerq's build (other signs, no key normalization, float32 where the C code rounds
otherwise): its KLD runs about 0.8x innerq-perplexity's on the same chunk, with the same order
between layouts (docs/ACCURACY.md, "Sinks chosen by attention"). For relative comparisons only.

The lever it was written for, `heavy` H: at each block's flush the H tokens of the block that
received the most attention until then (summed over the queries so far and the query heads of
the KV head) keep their f16 rows, for every later query; a layout's effective bits count them at
16 bits each on top of the quantized codes (which stay, as a block's format would keep them).

    python tools/kv_sim.py -f tests/data/sense-and-sensibility.txt -c 2048 \\
        --layouts "S32R128 S8R32 S8R32H4 S8R32H2"

Other levers, screened the same way (docs/ACCURACY.md, "Levers screened before building"):
`C1` / `C3` keys centred on the mean of the first flush's window rows / of its first block
(`C2`: of every key of the chunk, an oracle) before they are quantized and the mean added back
(softmax does not see a constant shift of a query's scores); `W` keys rounded channel by
channel with the error fed forward against the queries' second moment (GPTQ's rounding, the
queries of the first flush's window); `N` value rows divided by their RMS as an 8-bit code
holds it (an eighth of an octave) before their channels are quantized along tokens, counted in
the effective bits (the library's value row scales, docs/INNERQ.md). `K0` / `V0` leave keys /
values unquantized (what each alone costs). `P` keeps each group's (d, m) in 8 bits of its
block (params8: |d| on a 1/16-octave grid under the block's largest, m on 255 steps between the
block's least and largest), which frees 0.25 bits per element for codes; its effective bits
count that (the bits of K<b>V<b> other than K3 V2 are not counted: innerq's preset prices them).
`A1` / `A2` scale each key channel (RoPE pairs together) by sqrt(sigma_q / sigma_k) before the
rotation and its query by the inverse (the score unchanged; the rotated keys' error then weighs
by the queries' use of each channel), with the RMS of the first flush's window rows / of the whole
chunk; `B1` / `B2` the same for values with the output projection's column norms in place of
sigma_q (the output divided back).

`L` puts keys on the non-uniform Lloyd-Max levels of N(0, 1) (quant_levels: the same search of
ranges and least-squares refit, the same bytes), not the uniform grid.

`Y<b100>` (key widths) quantizes the keys in RoPE's own basis (no rotation) with a width per
channel: from the first flush's window rows, each channel's mean square over the keys, e_k, and
over the queries of its KV head, e_q (RoPE pairs sharing both), weigh it by lam = e_k e_q, the
expected square of its part of a score; channels sorted by lam form units of `Z<n>` (4 where not
given) that share a width, and widths go one bit at a time to the unit whose error
(lam 4^-b) a bit lowers most (reverse water-filling), b100 / 100 bits per channel on average,
at most `M<n>` (8 where not given); `U` keeps the channels in their own order, units of 4
consecutive ones (two RoPE pairs), so that a block needs no permutation. Each channel has a static step, sqrt(e_k) times the clip of
its width (the best uniform quantizer's range for a Gaussian, in standard deviations) over
2^(b-1); a token's codes sit on symmetric mid-rise levels d (u - (2^b - 1) / 2) of that step, with
one f16 scale d per token searched over 23 multiples of its RMS in steps plus a least-squares
refit (the error weighed by e_q); a width-0 channel is 0. Its bytes: the codes and 16 bits a
token, so Y425 costs what 4-bit keys with f16 (d, m) do. `E` takes lam = e_k^2 (the keys alone,
what a flush sees without the queries). `X<b100>` is the same allocation in the basis that
whitens the window's queries and decorrelates its keys (a D x D transform per KV head, the
keys centred): the best basis for the window, not for the tokens after it.

Layouts: S<sink>R<recent>[H<heavy>][K<bits>V<bits>][G<group>][C<n>][W][N][P][A<n>][B<n>][L][X<b100>][Y<b100>[Z<n>][U][M<n>][E]]
(K3 V2 G64 where not given; with Y or X the keys' K bits are not used).
`--lloyd-max` prints instead what non-uniform levels could gain over the uniform grid on
Gaussian data (rotated keys are near it).
One JSON line per layout: mean KLD, its standard error, 99% KLD, same top token, effective bits
at n_ctx (innerq's allocation for the windows, plus the heavy rows). Slow: on two cores about a
minute per layout at n_ctx 2048 and three to five at 4096, and as long for the f16 base.
"""
from __future__ import annotations

import argparse
import math
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests"))

import reference as ref  # noqa: E402  (the numpy reference forward's weights and pieces)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quant_search(x: np.ndarray, bits: int, params: bool = False):
    """Rows x (N, n) -> their dequantized values under iq_quant_search_group (vectorized);
    with params, also each row's chosen (d, m, symmetric)."""
    n_g, n = x.shape
    levels = 1 << bits
    half = levels // 2
    lo, hi = x.min(1), x.max(1)
    a = x[np.arange(n_g), np.abs(x).argmax(1)]
    best = np.full(n_g, np.inf)
    out = np.zeros_like(x)
    bd, bm, bs = np.zeros(n_g, np.float32), np.zeros(n_g, np.float32), np.zeros(n_g, bool)
    for k in range(12):  # IQ_QSEARCH_N ranges x both grids
        sym, f = k % 2 == 1, np.float32(1.0 - 0.08 * (k // 2))
        if sym:
            d = f16(-2.0 * a * f / levels)
            m = f16(-half * d)
        else:
            c, r = 0.5 * (lo + hi), 0.5 * (hi - lo) * f
            d, m = f16(2.0 * r / (levels - 1)), f16(c - r)

        def codes(d, m):
            dd = np.where(d == 0, 1.0, d)[:, None]
            u = (np.clip(np.round(x / dd), -half, half - 1) + half if sym
                 else np.clip(np.round((x - m[:, None]) / dd), 0, levels - 1))
            return np.where(d[:, None] == 0, half if sym else 0, u)

        u = codes(d, m)
        s = u - (half if sym else 0)
        ss, s1, sx, x1 = (s * s).sum(1), s.sum(1), (s * x).sum(1), x.sum(1)
        if sym:
            dd = np.where(ss > 0, sx / np.where(ss > 0, ss, 1), 0.0)
            ok, d2 = dd * d > 0, f16(dd)
            m2 = f16(-half * d2)
        else:
            det = n * ss - s1 * s1
            dd = np.where(det > 0, (n * sx - s1 * x1) / np.where(det > 0, det, 1), 0.0)
            ok, d2, m2 = dd > 0, f16(dd), f16(np.where(det > 0, (x1 - dd * s1) / n, 0.0))
        d, m = np.where(ok, d2, d), np.where(ok, m2, m)
        y = d[:, None] * codes(d, m) + m[:, None]
        e = ((x - y) ** 2).sum(1)
        better = e < best
        best = np.where(better, e, best)
        out[better] = y[better]
        bd, bm, bs = np.where(better, d, bd), np.where(better, m, bm), np.where(better, sym, bs)
    const = (x == x[:, :1]).all(1)
    out[const] = x[const]
    if params:
        return out.astype(np.float32), bd, bm, bs
    return out.astype(np.float32)


def row_scale(v: np.ndarray) -> np.ndarray:
    """Each value row's scale as an 8-bit code would hold it: its RMS rounded to a power of
    2^(1/8) (codes 0..255: 2^-16 .. 2^15.875)."""
    rms = np.sqrt((v.astype(np.float64) ** 2).mean(-1, keepdims=True))
    code = np.clip(np.round(8 * np.log2(np.maximum(rms, 2.0 ** -16))) + 128, 0, 255)
    return np.exp2((code - 128) / 8).astype(np.float32)


def params8(x: np.ndarray, bits: int, d: np.ndarray, m: np.ndarray, sym: np.ndarray, bid: np.ndarray) -> np.ndarray:
    """Rows x (N, n) on the grids of their searched (d, m) with each parameter in 8 bits of its
    block (bid: each row's block): |d| as 2^(-c/16) of the block's largest (c 0..255), an
    asymmetric group's m on 255 steps between the block's least and largest m (a symmetric
    group's m is -half d); the codes chosen again on those grids."""
    levels, half = 1 << bits, (1 << bits) >> 1
    nb = int(bid.max()) + 1
    a = np.abs(d.astype(np.float64))  # a symmetric group's d carries the sign of its largest |x|
    dmax = np.zeros(nb, np.float64)
    np.maximum.at(dmax, bid, a)
    dm = dmax[bid]
    ratio = np.where((a > 0) & (dm > 0), a / np.where(dm > 0, dm, 1.0), 1.0)
    c = np.clip(np.round(-16.0 * np.log2(ratio)), 0, 255)
    d2 = np.where(a > 0, np.sign(d) * dm * np.exp2(-c / 16.0), 0.0)
    lo_b, hi_b = np.full(nb, np.inf), np.full(nb, -np.inf)
    am = ~sym
    np.minimum.at(lo_b, bid[am], m[am].astype(np.float64))
    np.maximum.at(hi_b, bid[am], m[am].astype(np.float64))
    lo, hi = lo_b[bid], hi_b[bid]
    step = np.where(np.isfinite(lo) & (hi > lo), (hi - lo) / 255.0, 0.0)
    m_a = np.where(step > 0, lo + np.round((m - np.where(np.isfinite(lo), lo, 0.0)) / np.where(step > 0, step, 1.0)) * step, m)
    m2 = np.where(sym, -half * d2, m_a)
    dd = np.where(d2 == 0, 1.0, d2)[:, None]
    u_s = np.clip(np.round(x / dd), -half, half - 1)
    u_a = np.clip(np.round((x - m2[:, None]) / dd), 0, levels - 1)
    y = np.where(sym[:, None], d2[:, None] * u_s, d2[:, None] * u_a + m2[:, None])
    y = np.where(d2[:, None] == 0, x.mean(1, keepdims=True), y)
    const = (x == x[:, :1]).all(1)
    y[const] = x[const]
    return y.astype(np.float32)


def quant_weighted(x: np.ndarray, bits: int, h: np.ndarray) -> np.ndarray:
    """Rows x (N, D) on the searched quantizer's grid (its d, m kept), the codes chosen channel
    by channel with the error fed forward (GPTQ's rounding) to lower e^T H e rather than |e|^2."""
    y, d, m, sym = quant_search(x, bits, params=True)
    levels, half = 1 << bits, (1 << bits) >> 1
    n_d = x.shape[1]
    hd = h + np.eye(n_d) * 0.01 * np.trace(h) / n_d
    u_chol = np.linalg.cholesky(np.linalg.inv(hd)).T  # upper: H^-1 = U^T U
    w = x.astype(np.float64).copy()
    out = np.zeros_like(w)
    dd = np.where(d == 0, 1.0, d)
    lo = np.where(sym, -half, 0)
    hi = np.where(sym, half - 1, levels - 1)
    for i in range(n_d):
        c = np.clip(np.round((w[:, i] - np.where(sym, 0.0, m)) / dd), lo, hi)
        qv = np.where(sym, d * c, d * c + m)
        qv = np.where(d == 0, y[:, i], qv)
        out[:, i] = qv
        err = (w[:, i] - qv) / u_chol[i, i]
        w[:, i + 1:] -= err[:, None] * u_chol[i, i + 1:][None, :]
    const = (x == x[:, :1]).all(1)
    out[const] = x[const]
    return out.astype(np.float32)


def pair_rms(x: np.ndarray, sl: slice, w) -> np.ndarray:
    """Each head's channels' RMS over the rows sl, (n, heads, d) -> (heads, d); the channels RoPE
    turns in pairs share their mean square."""
    ms = (x[sl].astype(np.float64) ** 2).mean(0)
    nr = w.n_rot
    a, b = (slice(0, nr // 2), slice(nr // 2, nr)) if w.neox else (slice(0, nr, 2), slice(1, nr, 2))
    mp = 0.5 * (ms[:, a] + ms[:, b])
    ms[:, a], ms[:, b] = mp, mp
    return np.sqrt(np.maximum(ms, 1e-12))


LLOYD_MAX = {}


def lloyd_max_levels(bits: int) -> np.ndarray:
    """The Lloyd-Max levels of N(0, 1) at bits, symmetric: Lloyd's iteration with each cell's
    centroid in closed form, (phi(a) - phi(b)) / (Phi(b) - Phi(a)) for the cell (a, b)."""
    if bits not in LLOYD_MAX:
        def phi(t: float) -> float:
            return math.exp(-t * t / 2) / math.sqrt(2 * math.pi) if math.isfinite(t) else 0.0

        def cdf(t: float) -> float:
            return 0.5 * (1 + math.erf(t / math.sqrt(2))) if math.isfinite(t) else float(t > 0)

        lv = list(np.linspace(-2, 2, 2 ** bits))
        for _ in range(500):
            edges = [-math.inf] + [(a + b) / 2 for a, b in zip(lv, lv[1:])] + [math.inf]
            lv = [(phi(a) - phi(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])]
        lv = np.array(lv)
        LLOYD_MAX[bits] = ((lv - lv[::-1]) / 2).astype(np.float32)  # exactly symmetric
    return LLOYD_MAX[bits]


def quant_levels(x: np.ndarray, bits: int) -> np.ndarray:
    """Rows x (N, n) -> their values on the non-uniform grid d * L[u] + m (L: lloyd_max_levels),
    searched as quant_search searches the uniform one: centred (m the range's middle) and
    symmetric (m = 0) grids over six ranges shrunk by 1 .. 0.6, nearest levels, a least-squares
    refit of (d, m) (d only for the symmetric grid), nearest levels again, fp16 (d, m), the
    candidate of least squared error."""
    lv = lloyd_max_levels(bits)
    mid = (lv[1:] + lv[:-1]) / 2
    n_g, n = x.shape
    lo, hi = x.min(1), x.max(1)
    amax = np.abs(x).max(1)
    best = np.full(n_g, np.inf)
    out = np.zeros_like(x)
    for k in range(12):
        sym, f = k % 2 == 1, np.float32(1.0 - 0.08 * (k // 2))
        if sym:
            d, m = f16(amax * f / lv[-1]), np.zeros(n_g, np.float32)
        else:
            d, m = f16(0.5 * (hi - lo) * f / lv[-1]), f16(0.5 * (lo + hi))

        def codes(d, m):
            dd = np.where(d == 0, 1.0, d)[:, None]
            return np.searchsorted(mid, (x - m[:, None]) / dd)

        s = lv[codes(d, m)]
        ss, s1, sx, x1 = (s * s).sum(1), s.sum(1), (s * x).sum(1), x.sum(1)
        if sym:
            dd = np.where(ss > 0, sx / np.where(ss > 0, ss, 1), 0.0)
            ok, d2, m2 = dd > 0, f16(dd), np.zeros(n_g, np.float32)
        else:
            det = n * ss - s1 * s1
            dd = np.where(det > 0, (n * sx - s1 * x1) / np.where(det > 0, det, 1), 0.0)
            ok, d2, m2 = dd > 0, f16(dd), f16(np.where(det > 0, (x1 - dd * s1) / n, 0.0))
        d, m = np.where(ok, d2, d), np.where(ok, m2, m)
        y = d[:, None] * lv[codes(d, m)] + m[:, None]
        e = ((x - y) ** 2).sum(1)
        better = e < best
        best = np.where(better, e, best)
        out[better] = y[better]
    const = (x == x[:, :1]).all(1)
    out[const] = x[const]
    return out.astype(np.float32)


# The clip of a width's levels in standard deviations: the range of the best uniform quantizer
# of N(0, 1) at that many bits, half of it on each side (1 bit: the levels +-0.8).
WIDTH_CLIP = {1: 1.6, 2: 2.0, 3: 2.34, 4: 2.68, 5: 3.0, 6: 3.3, 7: 3.6, 8: 3.9}


def width_plan(lam: np.ndarray, bavg: float, unit: int = 4, bmax: int = 8, natural: bool = False) -> np.ndarray:
    """Each channel's width (bits) for weights lam (d,): channels sorted by lam (stable; natural:
    in their own order) in units of `unit` sharing a width (the unit's mean lam), bits given one
    at a time to the unit whose lam 4^-b is largest, round(bavg * d) bits in all (fewer where
    every unit is at bmax)."""
    d = len(lam)
    order = np.arange(d) if natural else np.argsort(-lam, kind="stable")
    ul = lam[order].reshape(-1, unit).mean(1)
    ub = np.zeros(len(ul), int)
    for _ in range(int(round(bavg * d)) // unit):
        gain = np.where(ub < bmax, ul * 4.0 ** (-ub), -1.0)
        if gain.max() < 0:
            break
        ub[np.argmax(gain)] += 1
    b = np.zeros(d, int)
    b[order] = np.repeat(ub, unit)
    return b


def quant_widths(x: np.ndarray, e_k: np.ndarray, e_q: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows x (N, d) on each channel's static grid (widths b, steps from e_k) with one searched
    f16 scale per row: the dequantized rows (`Y` in the docstring)."""
    x = x.astype(np.float64)
    keep = b > 0
    half = np.where(keep, 2.0 ** (b - 1), 1.0)
    step = np.where(keep, np.sqrt(e_k) * np.array([WIDTH_CLIP.get(int(v), 1.0) for v in b]) / half, 1.0)
    rms = np.sqrt((x[:, keep] ** 2 / e_k[keep]).mean(1)) if keep.any() else np.zeros(len(x))
    best, out = np.full(len(x), np.inf), np.zeros_like(x)

    def levels(dt):
        dd = np.where(dt > 0, dt, 1.0)[:, None]
        c = np.clip(np.floor(x / (dd * step)), -half, half - 1) + 0.5
        return np.where(keep, dt[:, None] * step * c, 0.0), np.where(keep, step * c, 0.0)

    for f in np.linspace(0.5, 1.6, 23):
        y, u = levels(f16(rms * f).astype(np.float64))
        y2, _ = levels(f16((x * u).sum(1) / np.maximum((u * u).sum(1), 1e-30)).astype(np.float64))
        for yy in (y, y2):
            e = (e_q * (x - yy) ** 2).sum(1)
            better = e < best
            best = np.where(better, e, best)
            out[better] = yy[better]
    return out.astype(np.float32)


def quant_basis(k: np.ndarray, kcal: np.ndarray, qcal: np.ndarray, bavg: float) -> np.ndarray:
    """Keys (N, d) quantized in the basis that whitens the calibration queries qcal and
    decorrelates the calibration keys kcal (centred), widths as width_plan (units of 1): `X`."""
    kc, qc = kcal.astype(np.float64), qcal.astype(np.float64)
    mu = kc.mean(0)
    d = kc.shape[1]
    ck = (kc - mu).T @ (kc - mu) / len(kc) + np.eye(d) * 1e-6 * np.trace((kc - mu).T @ (kc - mu)) / len(kc) / d
    cq = qc.T @ qc / len(qc)
    cq += np.eye(d) * 1e-6 * np.trace(cq) / d
    ev, u = np.linalg.eigh(cq)
    s, si = u @ np.diag(np.sqrt(ev)) @ u.T, u @ np.diag(1 / np.sqrt(ev)) @ u.T
    lam, v = np.linalg.eigh(s @ ck @ s)
    lam = np.maximum(lam, 1e-30)
    t, ti = v.T @ s, si @ v  # k' = t (k - mu) has covariance diag(lam); q' = t^-T q is white
    b = width_plan(lam, bavg, unit=1)
    y = quant_widths((k.astype(np.float64) - mu) @ t.T, lam, np.ones(d), b)
    return (y @ ti.T + mu).astype(np.float32)


def parse_layout(s: str) -> dict:
    m = re.fullmatch(r"S(\d+)R(\d+)(?:H(\d+))?(?:K(\d)V(\d))?(?:G(\d+))?(?:C(\d))?(W)?(N)?(P)?(?:A(\d))?(?:B(\d))?(L)?"
                     r"(?:X(\d+))?(?:Y(\d+)(?:Z(\d+))?(U)?(?:M(\d))?(E)?)?", s)
    if m is None:
        raise SystemExit(f"kv_sim: layout {s!r} is not S<n>R<n>[H<n>][K<b>V<b>][G<n>][C<n>][W][N][P][A<n>][B<n>][L]"
                         "[X<b100>][Y<b100>[Z<n>][U][M<n>][E]]")
    S, R, H, kb, vb, G, C, W, N, P, A, B, L, X, Y, Z, U, MX, E = m.groups()
    return {"layout": s, "S": int(S), "R": int(R), "heavy": int(H or 0), "kb": int(3 if kb is None else kb),
            "vb": int(2 if vb is None else vb),
            "G": int(G or 64), "centre": int(C or 0), "weighted": W is not None, "vnorm": N is not None,
            "p8": P is not None, "kscale": int(A or 0), "vscale": int(B or 0), "levels": L is not None,
            "basis": int(X or 0) / 100, "widths": int(Y or 0) / 100, "unit": int(Z or 4), "natural": U is not None, "wmax": int(MX or 8),
            "keys_only": E is not None}


class Sim:
    def __init__(self, model: str, tokens: list[int]):
        self.w = ref.load(model)
        self.tokens = np.asarray(tokens)
        self.n = len(tokens)
        d = self.w.head_dim
        signs = np.where(np.random.default_rng(1234).random(d) < 0.5, -1.0, 1.0).astype(np.float32)
        h = np.array([[1.0]], np.float32)
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        self.rot = (signs[:, None] * h * signs[None, :] / np.sqrt(d)).astype(np.float32)  # symmetric, orthogonal

    def log_probs(self, lay: dict | None) -> np.ndarray:
        """Log-probabilities of the scored half (positions n/2 .. n - 2, as llama.cpp's perplexity)."""
        w, n, rot = self.w, self.n, self.rot
        nh, nkv, d = w.n_head, w.n_head_kv, w.head_dim
        r = nh // nkv
        pos = np.arange(n)
        causal = np.tril(np.ones((n, n), bool))
        if lay is not None:
            S, R, G = lay["S"], lay["R"], lay["G"]
            nf = np.maximum(0, (pos + 1 - S - R) // G)  # blocks flushed once token t is stored
            qm_all = (pos[None, :] >= S) & (pos[None, :] < (S + G * nf)[:, None])  # (t, j): j quantized for t
            n_blk = max(0, (n - S) // G)
            t_flush = np.full(n, n)
            for b in range(n_blk):
                after = np.nonzero(nf > b)[0]
                t_flush[S + G * b:S + G * (b + 1)] = after[0] if len(after) else n
        x = w.tensors["token_embd.weight"][self.tokens].astype(np.float32)
        for il in range(w.n_layer):
            h = ref.rms_norm(x, w.layer(il, "attn_norm"), w.rms_eps).astype(np.float32)
            q = (h @ w.layer(il, "attn_q").T).reshape(n, nh, d)
            k = (h @ w.layer(il, "attn_k").T).reshape(n, nkv, d)
            v = (h @ w.layer(il, "attn_v").T).reshape(n, nkv, d)
            rp = (w.n_rot, w.rope_base, w.rope_divisors, w.neox, w.rope_mscale)
            q = ref.rope(q, pos, *rp).astype(np.float32)
            k = ref.rope(k, pos, *rp).astype(np.float32)
            va = np.ones((nkv, d), np.float32)
            if lay is not None and lay["kscale"]:  # keys' channels weighed by the queries' (A)
                sl = slice(0, min(n, S + R + G - 1)) if lay["kscale"] == 1 else slice(0, n)
                sk = pair_rms(k, sl, w)
                sq = np.sqrt((pair_rms(q, sl, w).reshape(nkv, r, d) ** 2).mean(1))
                ka = np.sqrt(sq / sk)
                ka /= np.exp(np.log(ka).mean(-1, keepdims=True))
                k = k * ka[None].astype(np.float32)
                q = q / np.repeat(ka, r, 0)[None].astype(np.float32)
            if lay is not None and lay["vscale"]:  # values' channels weighed by the output projection's (B)
                sl = slice(0, min(n, S + R + G - 1)) if lay["vscale"] == 1 else slice(0, n)
                wo = w.layer(il, "attn_output").astype(np.float64)  # (n_embd, nh * d)
                wn = np.sqrt((wo.reshape(-1, nkv, r, d) ** 2).sum((0, 2)))  # (nkv, d)
                va = np.sqrt(wn / np.sqrt(np.maximum(((v[sl].astype(np.float64)) ** 2).mean(0), 1e-12)))
                va = (va / np.exp(np.log(va).mean(-1, keepdims=True))).astype(np.float32)
                v = v * va[None]
            q = q @ rot
            k = f16(k @ rot)
            v = f16(v @ rot)
            if lay is not None:
                mu = np.zeros((1, nkv, d), np.float32)
                if lay["centre"] == 1:  # the mean of the first flush's window rows, sink excluded
                    mu = f16(k[S:min(n, S + R + G - 1)].mean(0, keepdims=True))
                elif lay["centre"] == 3:  # the mean of the first flushed block, as the build computes it
                    mu = k[S:min(n, S + G)].mean(0, keepdims=True)
                elif lay["centre"] == 2:  # oracle: the mean of every key of the chunk
                    mu = f16(k.mean(0, keepdims=True))
                kg = lay.get("kg", d)
                if lay["kb"] == 0:
                    kq = k
                elif lay["p8"]:  # a block: G tokens of a KV head
                    xr = (k - mu).reshape(-1, kg)
                    _, kd, km, ks = quant_search(xr, lay["kb"], params=True)
                    ri = np.arange(len(xr))
                    bid = (ri // (nkv * (d // kg)) // G) * nkv + ri // (d // kg) % nkv
                    kq = params8(xr, lay["kb"], kd, km, ks, bid).reshape(n, nkv, d) + mu
                elif lay["levels"]:
                    kq = quant_levels((k - mu).reshape(-1, kg), lay["kb"]).reshape(n, nkv, d) + mu
                else:
                    kq = quant_search((k - mu).reshape(-1, kg), lay["kb"]).reshape(n, nkv, d) + mu
                sl = slice(0, min(n, S + R + G - 1))  # the first flush's window rows
                if (lay["widths"] or lay["basis"]) and kq is k:
                    kq = k.copy()
                if lay["widths"]:  # in RoPE's basis: rot is symmetric and rot @ rot = I
                    kr, qr = k @ rot, q @ rot
                    e_k = pair_rms(kr, sl, w) ** 2
                    e_q = e_k if lay["keys_only"] else (pair_rms(qr, sl, w).reshape(nkv, r, d) ** 2).mean(1)
                    for hk in range(nkv):
                        b = width_plan(e_k[hk] * e_q[hk], lay["widths"], lay["unit"], lay["wmax"], lay["natural"])
                        kq[:, hk] = quant_widths(kr[:, hk], e_k[hk], e_q[hk], b) @ rot
                elif lay["basis"]:
                    for hk in range(nkv):
                        kq[:, hk] = quant_basis(k[:, hk], k[sl, hk], q[sl, hk * r:(hk + 1) * r].reshape(-1, d), lay["basis"])
                if lay["weighted"] and lay["kb"]:
                    t_end = min(n, S + R + G - 1)  # the queries the window holds at the first flush
                    for hk in range(nkv):
                        qh = q[:t_end, hk * r:(hk + 1) * r].reshape(-1, d).astype(np.float64)
                        kq[:, hk] = quant_weighted(k[:, hk] - mu[:, hk], lay["kb"], qh.T @ qh / len(qh)) + mu[:, hk]
                vq = v.copy()
                if n_blk and lay["vb"]:
                    vs = v[S:S + G * n_blk]
                    vn = (row_scale(vs) if lay["vnorm"] else np.ones_like(vs[..., :1]))
                    blk = (vs / vn).reshape(n_blk, G, nkv, d).transpose(0, 2, 3, 1).reshape(-1, G)
                    if lay["p8"]:  # a block: the d channels of a KV head's G tokens
                        _, vd, vm, vsy = quant_search(blk, lay["vb"], params=True)
                        yq = params8(blk, lay["vb"], vd, vm, vsy, np.arange(len(blk)) // d)
                    else:
                        yq = quant_search(blk, lay["vb"])
                    vq[S:S + G * n_blk] = yq.reshape(n_blk, nkv, d, G).transpose(
                        0, 3, 1, 2).reshape(n_blk * G, nkv, d) * vn
            out = np.zeros((n, nh, d), np.float32)
            for hk in range(nkv):
                qs = np.ascontiguousarray(q[:, hk * r:(hk + 1) * r].transpose(1, 0, 2)) / np.sqrt(d)  # (r, n, d)
                sf = qs @ k[:, hk].T
                sq = qs @ kq[:, hk].T if lay is not None else None

                def attend(qm):
                    s = sf if qm is None else np.where(qm[None], sq, sf)
                    s = np.where(causal[None], s, -np.inf)
                    s -= s.max(-1, keepdims=True)
                    p = np.exp(s)
                    return p / p.sum(-1, keepdims=True)

                if lay is None:
                    out[:, hk * r:(hk + 1) * r] = (attend(None) @ v[:, hk]).transpose(1, 0, 2)
                    continue
                qm = qm_all
                if lay["heavy"]:
                    p = attend(qm_all)  # the attention each token received until its block's flush
                    got = (p * (pos[:, None] <= t_flush[None, :])[None]).sum((0, 1))
                    keep = np.zeros(n, bool)
                    for b in range(n_blk):
                        seg = got[S + G * b:S + G * (b + 1)]
                        keep[S + G * b + np.argsort(-seg, kind="stable")[:lay["heavy"]]] = True
                    qm = qm_all & ~keep[None, :]
                p = attend(qm)
                pq = np.where(qm[None], p, 0.0).astype(np.float32)
                out[:, hk * r:(hk + 1) * r] = (pq @ vq[:, hk] + (p - pq) @ v[:, hk]).transpose(1, 0, 2)
            out = (out @ rot) / np.repeat(va, r, 0)[None]
            x = x + out.reshape(n, nh * d) @ w.layer(il, "attn_output").T
            h = ref.rms_norm(x, w.layer(il, "ffn_norm"), w.rms_eps).astype(np.float32)
            g = h @ w.layer(il, "ffn_gate").T
            x = x + ((g / (1 + np.exp(-g))) * (h @ w.layer(il, "ffn_up").T)) @ w.layer(il, "ffn_down").T
        hs = ref.rms_norm(x, w.tensors["output_norm.weight"], w.rms_eps).astype(np.float32)[n // 2:n - 1]
        lg = hs @ w.tensors.get("output.weight", w.tensors["token_embd.weight"]).T
        lg -= lg.max(-1, keepdims=True)
        return lg - np.log(np.exp(lg).sum(-1, keepdims=True))


def effective_bits(model: str, n_ctx: int, lay: dict, n_layer: int, n_kv: int, d: int) -> float:
    """innerq's effective bits of the layout's windows and region at n_ctx, plus its heavy rows."""
    import innerq
    with innerq.Llama(model, n_ctx=n_ctx, kv_type="innerq", kv_sink=lay["S"], kv_recent=lay["R"],
                      kv_group=lay["G"], verbose=False) as llm:
        base = llm.kv_memory["bits"]
    n_blk = max(0, (n_ctx - lay["S"] - lay["R"]) // lay["G"])
    heavy_bits = n_blk * lay["heavy"] * 16 * 2 * d * n_kv * n_layer
    scale_bits = n_blk * lay["G"] * 8 * n_kv * n_layer if lay["vnorm"] else 0  # a code per quantized value row
    # 8-bit (d, m): 16 bits a group instead of 32 (keys: a token's d channels, values: a channel's
    # G tokens), plus the block's f16 largest d, least and largest m, for keys and values
    p8_bits = (n_blk * n_kv * n_layer * 2 * ((d * lay["G"] // d) * 16 - 48) if lay["p8"] else 0)
    return base + (heavy_bits + scale_bits - p8_bits) / (n_ctx * n_layer * n_kv * d * 2)


def lloyd_max_screen() -> None:
    """Squared error of the best uniform grid and of Lloyd-Max levels on N(0, 1), 2-4 bits
    (Monte Carlo): what non-uniform levels could gain on rotated, near-Gaussian keys."""
    x = np.random.default_rng(0).standard_normal(4_000_000)
    for b in (2, 3, 4):
        levels = 2 ** b
        uni = min((np.mean((np.clip(np.floor(x / st), -levels // 2, levels // 2 - 1) + 0.5 - x / st) ** 2) * st * st,
                   st) for st in np.linspace(0.2, 1.5, 261))
        lv = np.linspace(-2, 2, levels)
        for _ in range(200):
            idx = np.searchsorted((lv[1:] + lv[:-1]) / 2, x)
            lv = np.array([x[idx == i].mean() for i in range(levels)])
        lm = np.mean((lv[np.searchsorted((lv[1:] + lv[:-1]) / 2, x)] - x) ** 2)
        print(f"{b} bits: best uniform {uni[0]:.5f} (step {uni[1]:.3f}), Lloyd-Max {lm:.5f}: {lm / uni[0]:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=str(Path.home() / ".cache/innerq/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("-f", "--file")
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--layouts")
    ap.add_argument("--lloyd-max", action="store_true", help="only the uniform / Lloyd-Max screen on Gaussian data")
    args = ap.parse_args()
    if args.lloyd_max:
        lloyd_max_screen()
        return
    if not args.file or not args.layouts:
        ap.error("-f and --layouts are required")
    lays = [parse_layout(s) for s in args.layouts.split()]
    import innerq
    with innerq.Llama(args.model, vocab_only=True, verbose=False) as tok:
        ids = tok.tokenize(Path(args.file).read_bytes(), add_bos=False)
        bos = tok.token_bos()
    chunk = list(ids[args.chunk * args.ctx:(args.chunk + 1) * args.ctx])
    if len(chunk) < args.ctx:
        raise SystemExit(f"kv_sim: {args.file} has {len(ids)} tokens, fewer than chunk {args.chunk} of {args.ctx}")
    chunk[0] = bos  # as llama.cpp's perplexity starts a chunk
    t0 = time.time()
    sim = Sim(args.model, chunk)
    base = sim.log_probs(None)
    pb = np.exp(base)
    print(f"# {Path(args.file).name} chunk {args.chunk} of {args.ctx}: f16 base in {time.time() - t0:.0f} s", flush=True)
    w = sim.w
    for lay in lays:
        t1 = time.time()
        lq = sim.log_probs(lay)
        kl = (pb * (base - lq)).sum(-1)
        bits = effective_bits(args.model, args.ctx, lay, w.n_layer, w.n_head_kv, w.head_dim)
        print(json.dumps({"layout": lay["layout"], "bits": round(bits, 3), "kld": round(float(kl.mean()), 6),
                          "se": round(float(kl.std() / np.sqrt(len(kl))), 6),
                          "kld99": round(float(np.quantile(kl, 0.99)), 4),
                          "top1": round(float((base.argmax(-1) == lq.argmax(-1)).mean()), 4),
                          "s": round(time.time() - t1)}), flush=True)


if __name__ == "__main__":
    main()
