"""innerq_cache_truncate: a rewound cache continues exactly as a fresh evaluation does.

The claim (docs/INNERQ.md, "Rewinding the cache"): after truncate(n_keep) -> n_kept the cache
holds what a fresh context holds after one innerq_decode of the first n_kept tokens. Checked
two ways for every cache type and rewind points at every region edge (sink, first flush, G
blocks, recent window, batch edges, the end of a prompt, generated tokens):
* n_kept is what the rule gives, computed here independently by brute force (every candidate
  n is tested against the fresh run's batches and counters, no shortcut);
* the rewound context, given the rest of a new token sequence, gives the logits and greedy
  tokens of a fresh context given the same sequence as decode(first n_kept) + decode(rest).
"""
from __future__ import annotations

import numpy as np
import pytest

import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq._native import ContextHandle, ModelHandle  # noqa: E402

N_BATCH = 16
S, R, G = 8, 16, 32  # InnerQ windows of the tiny tests: a first flush at S + R + G = 56 tokens
# name -> (kv_k, kv_v, sink, recent): KIVI keeps its own windows (no sink, R = 128)
CACHES = {
    "innerq": ("innerq", None, S, R),
    "innerq4/innerq2": ("innerq4", "innerq2", S, R),
    "innerq2/innerq4": ("innerq2", "innerq4", S, R),
    "kivi2": ("kivi2", None, 0, 128),
    "kivi4": ("kivi4", None, 0, 128),
    "f16": ("f16", None, None, None),
    "q8_0": ("q8_0", None, None, None),
    "q4_0": ("q4_0", None, None, None),
    "f32": ("f32", None, None, None),
}
# the decode calls that filled the cache before the rewind
HISTORIES = {
    "one-call": [100],
    "prompt+generated": [70] + [1] * 30,
    "before-first-flush": [50],
    "short-calls": [20, 20, 20, 1, 1],
}
KIVI_HISTORIES = {"one-call": [260], "prompt+generated": [200] + [1] * 60}


def fresh_batches(n: int) -> list[tuple[int, int]]:
    return [(p, min(p + N_BATCH, n)) for p in range(0, n, N_BATCH)]


def batches_of(calls: list[int]) -> list[tuple[int, int]]:
    out, p = [], 0
    for n in calls:
        out += [(p + a, p + b) for a, b in fresh_batches(n)]
        p += n
    return out


def n_quant(n: int, sink: int, recent: int) -> int:
    """Quantized tokens a fresh run of n tokens holds (docs/DESIGN.md 3.2), by simulating its flushes."""
    q = 0
    while n - min(n, sink) - q >= recent + G:
        q += G
    return q


def expected_kept(calls, n_keep, kind, sink, recent) -> int:
    """The rule, by brute force: the largest n <= n_keep whose fresh state this cache holds."""
    hist = batches_of(calls)
    n_past = sum(calls)
    for n in range(min(n_keep, n_past), -1, -1):
        if kind != "f32":  # the batches of tokens [0, n) must be those of one fresh call
            mine = [(a, min(b, n)) for a, b in hist if a < n]
            if mine != fresh_batches(n):
                continue
        if sink is not None:  # the quantized cache must still hold the fresh run's window
            if n_quant(n, sink, recent) != n_quant(n_past, sink, recent) and n > sink:
                continue
        return n
    raise AssertionError("0 is always a rewind point")


def rewind_points(n_past: int, sink, recent) -> list[int]:
    pts = {0, 1, n_past - 1, n_past, 15, 16, 17, 69, 70, 71}
    if sink is not None:
        pts |= {sink - 1, sink, sink + 1}
        for k in range(0, n_past // G + 1):  # the window's edges at each block count
            e = sink + recent + G + k * G
            pts |= {e - 1, e, e + 1, sink + recent + k * G}
    return sorted(p for p in pts if 0 <= p <= n_past)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_model.write_tiny_model(tmp_path_factory.mktemp("rewind") / "m.gguf",
                                       TinyConfig(head_dim=32, n_head_kv=2, n_layer=2, seed=5))
    return ModelHandle.load(path)


def make(model, kind):
    kv_k, kv_v, sink, recent = CACHES[kind]
    extra = {"kv_group": G, "kv_sink": sink, "kv_recent": recent} if sink is not None and kind.startswith("innerq") \
        else {"kv_group": G} if sink is not None else {}
    return ContextHandle.init(model, n_ctx=400, n_batch=N_BATCH, n_threads=1, kv_k=kv_k, kv_v=kv_v,
                              kv_rewind_exact=True, **extra)


def tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def greedy(ctx, n=5):
    """logits of the last token, then n greedy steps: (stacked logits, tokens)."""
    lg, out = [ctx.logits()], []
    for _ in range(n):
        out.append(int(np.argmax(lg[-1])))
        ctx.decode([out[-1]])
        lg.append(ctx.logits())
    return np.stack(lg), out


def check_rewinds(model, kind, calls):
    _, _, sink, recent = CACHES[kind]
    n_past = sum(calls)
    hist = tokens(n_past, 1)
    ctx = make(model, kind)
    p = 0
    for n in calls:
        ctx.decode(hist[p:p + n])
        p += n
    state = ctx.save_state()
    checked = set()
    for n_keep in rewind_points(n_past, sink, recent):
        ctx.load_state(state)
        n_kept = ctx.truncate(n_keep)
        assert n_kept == expected_kept(calls, n_keep, kind, sink, recent), (kind, calls, n_keep)
        assert ctx.n_past() == n_kept
        if n_kept in checked:
            continue
        checked.add(n_kept)
        # a new sequence: the kept prefix, the old tokens up to n_keep, then new ones
        new = hist[:n_keep] + tokens(12, n_keep + 7)
        ctx.decode(new[n_kept:])
        got, got_toks = greedy(ctx)
        fresh = make(model, kind)
        if n_kept:
            fresh.decode(new[:n_kept])
        fresh.decode(new[n_kept:])
        want, want_toks = greedy(fresh)
        assert got_toks == want_toks, (kind, calls, n_keep, n_kept)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"{kind} {calls} rewind to {n_keep} (kept {n_kept})")
    return checked


@pytest.mark.parametrize("kind", [k for k in CACHES if not k.startswith("kivi")])
@pytest.mark.parametrize("history", list(HISTORIES))
def test_rewind_equals_fresh(model, kind, history):
    kept = check_rewinds(model, kind, HISTORIES[history])
    if history in ("one-call", "before-first-flush") or (history == "prompt+generated" and kind[0] != "i"):
        # rewinds reach inside the cache, not only to its sink
        assert max(kept) > S + R, kept


@pytest.mark.parametrize("kind", ["kivi2", "kivi4"])
@pytest.mark.parametrize("history", list(KIVI_HISTORIES))
def test_rewind_equals_fresh_kivi(model, kind, history):
    check_rewinds(model, kind, KIVI_HISTORIES[history])


def test_rewind_quantized_keeps_window_and_resets_norms(model):
    """The two sides of the rule on the default-like InnerQ cache: a rewind inside the window
    that the quantized region allows keeps every token; one before the flushed blocks' window
    falls back to the sink, where the key normalization is reset as in a fresh context."""
    ctx = make(model, "innerq")
    hist = tokens(100, 2)
    ctx.decode(hist)  # window 92 -> 64 quantized; the state of n >= 8 + 16 + 64 = 88 tokens is there
    assert ctx.truncate(95) == 95
    assert ctx.truncate(90) == 90
    assert ctx.truncate(87) == S
    # after the reset, a flush sets the normalization again from the new tokens: a fresh run's
    new = hist[:S] + tokens(80, 3)
    ctx.decode(new[S:])
    fresh = make(model, "innerq")
    fresh.decode(new[:S])
    fresh.decode(new[S:])
    np.testing.assert_allclose(ctx.logits(), fresh.logits(), rtol=0, atol=1e-5 * np.abs(fresh.logits()).max())


def test_rewind_decode_semantics(model):
    """With decode semantics every token is what one-token decoding gives, so tokens evaluated
    one at a time and in batches are the same: no rewind is held back by how calls were cut."""
    kw = dict(n_ctx=400, n_batch=N_BATCH, n_threads=1, kv_k="innerq", kv_group=G, kv_sink=S, kv_recent=R)
    hist = tokens(110, 4)
    ctx = ContextHandle.init(model, **kw)
    ctx.set_batch_mode(decode_semantics=True)
    ctx.decode(hist[:70])
    for t in hist[70:]:
        ctx.decode([t])
    n_kept = ctx.truncate(105)
    assert n_kept == 105  # 110 tokens: 64 quantized, the state of n >= 88 is there
    new = hist[:105] + tokens(10, 5)
    ctx.decode(new[105:])
    fresh = ContextHandle.init(model, **kw)
    fresh.set_batch_mode(decode_semantics=True)
    fresh.decode(new[:105])
    fresh.decode(new[105:])
    np.testing.assert_allclose(ctx.logits(), fresh.logits(), rtol=0, atol=1e-5 * np.abs(fresh.logits()).max())


def test_truncate_bad_arguments(model):
    ctx = make(model, "f16")
    with pytest.raises(innerq.InvalidArgumentError):
        ctx.truncate(-1)
    assert ctx.truncate(10) == 0  # nothing stored
    ctx.decode(tokens(20, 6))  # batches [0, 16), [16, 20): one call's
    assert ctx.truncate(10**6) == 20  # past the end counts as the end
    ctx.decode([7])  # [20, 21) alone, where one call of 21 would evaluate [16, 21)
    assert ctx.truncate(21) == 20


@pytest.mark.parametrize("kv", ["innerq", "f16"])
def test_rewind_smollm2(smollm2, kv):
    """The trained model with the default InnerQ windows (S 32, R 96, G 64): a 300-token prompt
    in batches of 64 quantizes 128 tokens, so rewinds to 256..300 keep every token and earlier
    ones fall back to the sink; f16 keeps every rewind of the prompt."""
    from conftest import TEXT

    from innerq.gguf_model import Model

    model = Model(smollm2)
    m = model.handle
    ids = model.tokenize(TEXT.read_text()[:4000], add_bos=False)
    hist, extra = ids[:300], ids[300:340]

    def make_ctx():
        return ContextHandle.init(m, n_ctx=512, n_batch=64, n_threads=2, kv_k=kv, kv_rewind_exact=True)

    ctx = make_ctx()
    ctx.decode(hist)
    state = ctx.save_state()
    expect = {31: 31, 32: 32, 33: 32, 255: 32, 256: 256, 257: 257, 299: 299} if kv == "innerq" else \
        {31: 31, 33: 33, 255: 255, 299: 299}
    for n_keep, n_kept in expect.items():
        ctx.load_state(state)
        assert ctx.truncate(n_keep) == n_kept
        if n_kept in (32, 33, 257):  # the fresh runs to compare with, one per region
            new = hist[:n_keep] + extra
            ctx.decode(new[n_kept:])
            got, got_toks = greedy(ctx, 4)
            fresh = make_ctx()
            fresh.decode(new[:n_kept])
            fresh.decode(new[n_kept:])
            want, want_toks = greedy(fresh, 4)
            assert got_toks == want_toks
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())



@pytest.mark.parametrize("kv", ["innerq", "innerq4"])
def test_decode_semantics_batch_is_decoding_bit_for_bit(smollm2, kv):
    """The trained model with a quantized cache on the CPU: 100 tokens in batches of 37 with
    decode semantics give the logits of decoding them one at a time, bit for bit, across the
    flushes (docs/INNERQ.md, "Decode semantics at batch speed"); without decode semantics the
    batches read their own rows unrounded, and the logits differ (the check can fail)."""
    from conftest import TEXT

    from innerq.gguf_model import Model

    model = Model(smollm2)
    ids = model.tokenize(TEXT.read_text()[:6000], add_bos=False)[:300]

    def run(batched, semantics=True):
        ctx = ContextHandle.init(model.handle, n_ctx=512, n_batch=64, n_threads=2, kv_k=kv, logits_all=True)
        ctx.decode(ids[:200])
        rows = []
        if batched:
            ctx.set_batch_mode(True, semantics)
            for i in range(200, 300, 37):
                chunk = ids[i:i + 37]
                ctx.decode(chunk)
                rows += [np.array(ctx.logits(j)) for j in range(len(chunk))]
        else:
            for t in ids[200:300]:
                ctx.decode([t])
                rows.append(np.array(ctx.logits(0)))
        return np.stack(rows)

    one = run(False)
    np.testing.assert_array_equal(run(True), one)
    assert np.abs(run(True, semantics=False) - one).max() > 1e-3
