"""The sampler (src/sampler.c) against a numpy model of llama.cpp's default chain.

The oracle below is written from the specification (penalty, top-k, top-p, min-p,
temperature, draw), independently of the C code. Truncation thresholds are placed midway
between neighbouring values so float rounding can't move a token across a boundary.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import lib_path

N_DRAWS = 20000


@pytest.fixture(scope="module")
def api():
    lib_path()  # skips when the library isn't built
    from innerq._ffi import ffi, lib

    return ffi, lib


def make_params(lib, **kw):
    p = lib.innerq_sampler_default_params()
    p.seed = 1234
    for k, v in kw.items():
        setattr(p, k, v)
    return p


class Sampler:
    def __init__(self, api, **kw):
        self.ffi, self.lib = api
        out = self.ffi.new("innerq_sampler **")
        st = self.lib.innerq_sampler_init(self.ffi.new("innerq_sampler_params *", make_params(self.lib, **kw)), out)
        assert st == self.lib.INNERQ_OK, self.ffi.string(self.lib.innerq_last_error())
        self.ptr = self.ffi.gc(out[0], self.lib.innerq_sampler_free)
        self.tok = self.ffi.new("innerq_token *")

    def sample(self, logits: np.ndarray) -> int:
        buf = self.ffi.cast("const float *", self.ffi.from_buffer(logits))
        st = self.lib.innerq_sampler_sample(self.ptr, buf, len(logits), self.tok)
        assert st == self.lib.INNERQ_OK, self.ffi.string(self.lib.innerq_last_error())
        return self.tok[0]

    def accept(self, *tokens):
        for t in tokens:
            self.lib.innerq_sampler_accept(self.ptr, t)

    def draws(self, logits: np.ndarray, n: int = N_DRAWS) -> np.ndarray:
        return np.array([self.sample(logits) for _ in range(n)])


# ---- the oracle ----

def penalize(logits, history, penalty):
    out = logits.astype(np.float32).copy()
    for t in set(history):
        if 0 <= t < len(out):
            out[t] = out[t] / np.float32(penalty) if out[t] > 0 else out[t] * np.float32(penalty)
    return out


def expected_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Probabilities of each token under penalty-free truncation + temperature."""
    l = logits.astype(np.float64)
    order = np.lexsort((np.arange(len(l)), -l))  # best first, ties by id
    keep = order
    if 0 < top_k < len(keep):
        keep = keep[:top_k]
    if top_p < 1.0:
        p = np.exp(l[keep] - l[keep].max())
        cum = np.cumsum(p / p.sum())
        keep = keep[: int(np.searchsorted(cum, top_p)) + 1]
    if min_p > 0.0:
        keep = keep[l[keep] >= l.max() + math.log(min_p)]
    w = np.exp((l[keep] - l.max()) / temperature)
    probs = np.zeros(len(l))
    probs[keep] = w / w.sum()
    return probs


def chi2_threshold(df: int, z: float = 4.75) -> float:
    """Upper quantile (about 1e-6) of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_distribution(draws: np.ndarray, probs: np.ndarray):
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, f"drew excluded tokens {np.nonzero(counts * (probs == 0))[0]}"
    exp = probs[probs > 0] * len(draws)
    obs = counts[probs > 0].astype(np.float64)
    small = exp < 5  # merge sparse bins so the statistic stays chi-square
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if len(exp) < 2:
        return
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_threshold(len(exp) - 1), (stat, len(exp))


def midpoint_top_p(logits, top_k, rank):
    """A top_p that keeps exactly `rank` tokens, halfway between two cumulative sums."""
    l = np.sort(logits.astype(np.float64))[::-1]
    if 0 < top_k < len(l):
        l = l[:top_k]
    p = np.exp(l - l.max())
    cum = np.cumsum(p / p.sum())
    return float((cum[rank - 2] + cum[rank - 1]) / 2)


def midpoint_min_p(logits, rank):
    """A min_p whose threshold lies halfway between the rank-th and (rank+1)-th logit."""
    l = np.sort(logits.astype(np.float64))[::-1]
    return float(math.exp((l[rank - 1] + l[rank]) / 2 - l[0]))


@pytest.fixture
def logits():
    return np.random.default_rng(7).normal(0.0, 1.5, 40).astype(np.float32)


# ---- tests ----

def test_default_params(api):
    _, lib = api
    p = lib.innerq_sampler_default_params()
    assert p.temperature == pytest.approx(0.8) and p.top_k == 40
    assert p.top_p == pytest.approx(0.95) and p.min_p == pytest.approx(0.05)
    assert p.repeat_penalty == 1.0 and p.repeat_last_n == 64 and p.seed == 0xFFFFFFFF


def test_greedy_is_argmax(api):
    rng = np.random.default_rng(1)
    s = Sampler(api, temperature=0.0)
    for _ in range(50):
        x = rng.normal(size=1000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))
    ties = np.array([0.5, 2.0, -1.0, 2.0, 2.0], dtype=np.float32)
    assert s.sample(ties) == 1


def test_top_k_one_is_argmax(api):
    rng = np.random.default_rng(2)
    s = Sampler(api, temperature=1.5, top_k=1, top_p=1.0, min_p=0.0)
    for _ in range(50):
        x = rng.normal(size=5000).astype(np.float32)
        assert s.sample(x) == int(np.argmax(x))


def test_logits_are_not_modified(api, logits):
    s = Sampler(api, temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repeat_penalty=1.3)
    s.accept(0, 1, 2)
    before = logits.copy()
    s.draws(logits, 20)
    np.testing.assert_array_equal(logits, before)


def test_fixed_seed_repeats(api, logits):
    a = Sampler(api, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    b = Sampler(api, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    c = Sampler(api, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43)
    sa, sb, sc = a.draws(logits, 200), b.draws(logits, 200), c.draws(logits, 200)
    np.testing.assert_array_equal(sa, sb)
    assert not np.array_equal(sa, sc)
    a.lib.innerq_sampler_reset(a.ptr)
    np.testing.assert_array_equal(a.draws(logits, 200), sa)


@pytest.mark.parametrize(
    "temperature,top_k,rank_p,rank_min",
    [
        (1.0, 0, None, None),   # plain softmax
        (0.5, 0, None, None),   # temperature alone
        (2.0, 0, None, None),
        (1.0, 8, None, None),   # top-k
        (1.0, 0, 6, None),      # top-p
        (1.0, 0, None, 5),      # min-p
        (0.7, 12, 9, None),     # top-k then top-p, then temperature
        (1.3, 20, 12, 7),       # all of them; min-p cuts deeper than top-p
        (0.8, 10, 3, 8),        # all of them; top-p cuts deeper than min-p
    ],
)
def test_distribution(api, logits, temperature, top_k, rank_p, rank_min):
    top_p = midpoint_top_p(logits, top_k, rank_p) if rank_p else 1.0
    min_p = midpoint_min_p(logits, rank_min) if rank_min else 0.0
    s = Sampler(api, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = expected_probs(logits, temperature, top_k, top_p, min_p)
    expect_kept = min(r for r in (rank_p, rank_min, top_k or None, len(logits)) if r)
    assert (probs > 0).sum() == expect_kept
    assert_distribution(s.draws(logits), probs)


def test_top_p_large_vocabulary(api):
    # Top-p without top-k over a large vocabulary: the ordered prefix has to grow past its
    # first sizes (the kept set is a few hundred tokens).
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 1.0, 16384).astype(np.float32)
    x[rng.choice(len(x), 400, replace=False)] += 9.0
    top_p = midpoint_top_p(x, 0, 300)
    s = Sampler(api, temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
    probs = expected_probs(x, 1.0, 0, top_p)
    assert (probs > 0).sum() == 300
    draws = s.draws(x, 3000)
    counts = np.bincount(draws, minlength=len(x))
    assert counts[probs == 0].sum() == 0
    # Coarse bins (10 groups of 30 tokens by rank) keep the expected counts large.
    ranked = np.argsort(-probs)[:300].reshape(10, 30)
    obs, exp = counts[ranked].sum(axis=1), probs[ranked].sum(axis=1) * len(draws)
    assert float(((obs - exp) ** 2 / exp).sum()) < chi2_threshold(9)


def test_top_k_large_vocabulary(api):
    rng = np.random.default_rng(4)
    x = rng.normal(0.0, 2.0, 49152).astype(np.float32)
    s = Sampler(api, temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)
    probs = expected_probs(x, 1.0, 40)
    assert_distribution(s.draws(x, 8000), probs)


def test_repeat_penalty_distribution(api, logits):
    logits = logits.copy()
    logits[7] = -0.4  # a penalized token with a negative logit
    s = Sampler(api, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.7, repeat_last_n=4)
    s.accept(11, 3, 3, 5, 7)  # 11 falls out of the window of 4; 3 counts once
    pen = penalize(logits, [3, 5, 7], 1.7)
    assert_distribution(s.draws(logits), expected_probs(pen))


def nudge_up(v: float) -> np.float32:
    return np.nextafter(np.float32(v), np.float32(np.inf))


@pytest.mark.parametrize("base,penalized", [(3.0, 1.5), (-0.75, -1.5)])
def test_repeat_penalty_exact(api, base, penalized):
    # Token 0 is penalized by 2 (divided if positive, multiplied if negative): against a rival
    # holding exactly the penalized value it wins the tie (lower id); against the next float up
    # it loses. Accepting it twice must not penalize twice.
    for rival, winner in [(penalized, 0), (nudge_up(penalized), 1)]:
        s = Sampler(api, temperature=0.0, repeat_penalty=2.0, repeat_last_n=8)
        s.accept(0, 0, 99999, -5)  # out-of-vocabulary ids are ignored
        x = np.array([base, rival, -10.0], dtype=np.float32)
        assert s.sample(x) == winner


def test_repeat_window_and_reset(api):
    x = np.array([3.0, 2.0, -10.0], dtype=np.float32)
    s = Sampler(api, temperature=0.0, repeat_penalty=2.0, repeat_last_n=2)
    s.accept(0)
    assert s.sample(x) == 1
    s.accept(2, 2)  # pushes token 0 out of the window
    assert s.sample(x) == 0
    s.accept(0)
    assert s.sample(x) == 1
    s.lib.innerq_sampler_reset(s.ptr)
    assert s.sample(x) == 0


def test_bad_arguments(api):
    ffi, lib = api
    out = ffi.new("innerq_sampler **")
    assert lib.innerq_sampler_init(ffi.NULL, out) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert ffi.string(lib.innerq_last_error())
    bad = [
        {"temperature": float("nan")},
        {"top_p": float("nan")},
        {"min_p": float("nan")},
        {"repeat_penalty": float("nan")},
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -1},
    ]
    for kw in bad:
        p = ffi.new("innerq_sampler_params *", make_params(lib, **kw))
        assert lib.innerq_sampler_init(p, out) == lib.INNERQ_ERR_INVALID_ARGUMENT, kw
        assert out[0] == ffi.NULL

    s = Sampler(api)
    x = np.zeros(4, dtype=np.float32)
    xp = ffi.cast("const float *", ffi.from_buffer(x))
    tok = ffi.new("innerq_token *")
    assert lib.innerq_sampler_sample(s.ptr, ffi.NULL, 4, tok) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert lib.innerq_sampler_sample(s.ptr, xp, 0, tok) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert lib.innerq_sampler_sample(s.ptr, xp, -3, tok) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert lib.innerq_sampler_sample(s.ptr, xp, 4, ffi.NULL) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert lib.innerq_sampler_sample(ffi.NULL, xp, 4, tok) == lib.INNERQ_ERR_INVALID_ARGUMENT
    x[2] = np.nan
    assert lib.innerq_sampler_sample(s.ptr, xp, 4, tok) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert b"logit" in ffi.string(lib.innerq_last_error())
    lib.innerq_sampler_accept(ffi.NULL, 1)  # no-ops, no crash
    lib.innerq_sampler_reset(ffi.NULL)
    lib.innerq_sampler_free(ffi.NULL)


def test_masked_logits(api):
    # -inf logits (masked tokens) are never drawn; all masked still yields a token.
    x = np.array([-np.inf, 1.0, -np.inf, 0.5], dtype=np.float32)
    s = Sampler(api, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert set(s.draws(x, 300)) <= {1, 3}
    assert Sampler(api).sample(np.full(5, -np.inf, dtype=np.float32)) == 0
