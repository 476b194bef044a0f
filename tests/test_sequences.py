"""Many sequences in one context (docs/DESIGN.md 3.6): innerq_decode_batch and innerq_seq_*.

* A sequence gets the same logits, bit for bit, whichever other sequences share its steps:
  several sequences of different lengths, some reading prompts (in chunks), some decoding, some
  joining later, against each sequence evaluated alone in the same calls, for every cache type,
  with and without decode semantics.
* A prompt given to several sequences (several sequence ids per token) is stored once, and
  each sequence continues as it would from the prompt alone.
* Removing a sequence's last tokens and copying a sequence keep the stored rows as they were,
  byte for byte (read from the sequences' states, whose layout is parsed here); a quantized
  sequence cut inside a block drops that block's tokens.
* A sequence's state loads into another sequence and context and continues there.
* Bad batches and bad sequence calls fail with a message and change nothing.
"""
from __future__ import annotations

import struct

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
from innerq.errors import InnerQError  # noqa: E402

S, R, G = 8, 16, 32  # small InnerQ windows: a first flush at S + R + G = 56 tokens
N_BATCH = 24
CFG = TinyConfig(head_dim=32, n_head=4, n_head_kv=2, n_layer=2, seed=9)
# name -> (kv_k, kv_v, extra params)
CACHES = {
    "f32": ("f32", None, {}),
    "f16": ("f16", None, {}),
    "q8_0": ("q8_0", None, {}),
    "q4_0": ("q4_0", None, {}),
    "innerq": ("innerq", None, {"kv_group": G, "kv_sink": S, "kv_recent": R}),
    "innerq+row-scales": ("innerq", None, {"kv_group": G, "kv_sink": S, "kv_recent": R, "kv_value_scales": 1}),
    "innerq+params8": ("innerq", None, {"kv_group": G, "kv_sink": S, "kv_recent": R, "kv_params8": 1,
                                        "kv_value_scales": 1}),
    "innerq+key-levels": ("innerq", None, {"kv_group": G, "kv_sink": S, "kv_recent": R, "kv_key_levels": 1,
                                           "kv_params8": 1, "kv_value_scales": 1}),
    "innerq4/innerq2": ("innerq4", "innerq2", {"kv_group": G, "kv_sink": S, "kv_recent": R}),
    "kivi2": ("kivi2", None, {"kv_group": G}),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ModelHandle.load(tiny_model.write_tiny_model(tmp_path_factory.mktemp("seq") / "m.gguf", CFG))


def make(model, kind, n_seq=8, n_ctx=2048, decode_semantics=False, **kw):
    kv_k, kv_v, extra = CACHES[kind]
    ctx = ContextHandle.init(model, n_ctx=n_ctx, n_seq_max=n_seq, n_batch=N_BATCH, n_threads=2, kv_k=kv_k,
                             kv_v=kv_v, **extra, **kw)
    ctx.set_batch_mode(False, decode_semantics)
    return ctx


def toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


# Calls of a schedule: per call, the (sequence, tokens) parts in order. Prompts of different
# lengths (two past the first flush, one longer than n_batch), decoders, and sequences joining
# while others decode.
def schedule(n_seq: int) -> list[list[tuple[int, list[int]]]]:
    lengths = [5, 90, 1, 33, 60, 12, 130, 2]
    calls = [[(s, toks(lengths[s % 8] + s // 8, 100 + s)) for s in range(0, n_seq, 2)]]
    for step in range(6):
        parts = [(s, toks(1, 1000 * step + s)) for s in range(0, n_seq, 2)]
        if step == 1:
            parts += [(s, toks(lengths[s % 8] + 3, 200 + s)) for s in range(1, n_seq, 2)]
        if step > 1:
            parts += [(s, toks(1 + (step == 4) * 25, 3000 * step + s)) for s in range(1, n_seq, 2)]
        calls.append(parts)
    return calls


def run(ctx, calls, only=None):
    """Runs the calls (the parts of sequence `only`, or all); {seq: logits of its tokens in order}."""
    out = {}
    for parts in calls:
        parts = [p for p in parts if only is None or p[0] == only]
        if not parts:
            continue
        tokens = [t for _, ts in parts for t in ts]
        seqs = [s for s, ts in parts for _ in ts]
        ctx.decode_batch(tokens, seqs, logits=[True] * len(tokens))
        for i, s in enumerate(seqs):
            out.setdefault(s, []).append(ctx.logits(i))
    return {s: np.stack(v) for s, v in out.items()}


@pytest.mark.parametrize("decode_semantics", [False, True], ids=["batch", "decode-semantics"])
@pytest.mark.parametrize("kind", list(CACHES))
def test_batched_sequences_equal_each_alone(model, kind, decode_semantics):
    n_seq = 8
    calls = schedule(n_seq)
    together = run(make(model, kind, n_seq, decode_semantics=decode_semantics), calls)
    assert sorted(together) == list(range(n_seq))
    for s in range(n_seq):
        alone = run(make(model, kind, n_seq, decode_semantics=decode_semantics), calls, only=s)[s]
        np.testing.assert_array_equal(together[s], alone, err_msg=f"{kind}: sequence {s}")


@pytest.mark.parametrize("wtype", ["Q4_1", "Q8_0"])
def test_batched_sequences_equal_each_alone_on_quantized_weights(tmp_path, wtype):
    """Quantized weights: the products take several activation rows at once (vec_dot_cols) and
    still give each row its own bits."""
    cfg = TinyConfig(wtype=wtype, head_dim=32, n_head=4, n_head_kv=2, n_layer=2, seed=9)
    m = ModelHandle.load(tiny_model.write_tiny_model(tmp_path / "q.gguf", cfg))
    calls = schedule(8)
    together = run(make(m, "innerq", 8), calls)
    for s in (0, 3, 6):
        np.testing.assert_array_equal(together[s], run(make(m, "innerq", 8), calls, only=s)[s], err_msg=f"{s}")


@pytest.mark.parametrize("kind", ["innerq", "f16"])
def test_sixty_four_sequences(model, kind):
    """64 sequences in one batch of 64 decoding steps at once (and their prompts before)."""
    n_seq = 64
    calls = schedule(n_seq)[:4]
    together = run(make(model, kind, n_seq, n_ctx=8192), calls)
    for s in (0, 1, 17, 63):
        alone = run(make(model, kind, n_seq, n_ctx=8192), calls, only=s)[s]
        np.testing.assert_array_equal(together[s], alone, err_msg=f"{kind}: sequence {s}")


@pytest.mark.parametrize("kind", ["innerq", "f16", "kivi2"])
def test_one_prompt_for_several_sequences_is_stored_once(model, kind):
    prompt = toks(200, 7)  # past the first flush of each type (KIVI: R 128 + G)
    ctx = make(model, kind, 4)
    ctx.decode_batch(prompt, [[0, 1, 2, 3]] * len(prompt))
    shared = ctx.pool()
    one = make(model, kind, 4)
    one.decode_batch(prompt, [0] * len(prompt))
    assert shared["n_pages_used"] == one.pool()["n_pages_used"] > 0  # the prompt's pages, held by all four
    assert shared["n_tokens"] == 4 * len(prompt)
    for s in range(4):
        assert ctx.seq_pos_max(s) == len(prompt) - 1
    rest = {s: toks(40, 50 + s) for s in range(4)}
    got = run(ctx, [[(s, rest[s]) for s in range(4)]])
    for s in range(4):
        alone = make(model, kind, 4)
        alone.decode_batch(prompt, [0] * len(prompt))
        want = run(alone, [[(0, rest[s])]])[0]
        np.testing.assert_array_equal(got[s], want, err_msg=f"{kind}: sequence {s}")


# ---- the rows a sequence keeps ----

def parse_seq_state(state: bytes, kind: str) -> dict:
    """A sequence's state (src/state.c, src/kv-state.c) cut into its parts: counters, and per
    layer the stored rows as arrays ([heads][rows][bytes]; quantized: norms, sink, window, blocks)."""
    body = state[:-8]
    assert body[:8] == b"INNERQSQ"
    pos = 12 + 8 * 4 + 8 + 15 * 4  # magic, version, model, fingerprint, cache configuration
    # rotation, window-only layers, row scales (8), params8 (16), key levels (32: the same bytes)
    flags = struct.unpack_from("<i", body, pos - 2 * 4)[0]
    n_past, n_sink, n_quant, norms, n_runs = struct.unpack_from("<5i", body, pos)
    pos += 20 + 12 * n_runs
    H, D = CFG.n_head_kv, CFG.head_dim
    out = {"n_past": n_past, "n_sink": n_sink, "n_quant": n_quant, "layers": []}

    def take(shape, size):
        nonlocal pos
        a = np.frombuffer(body, np.uint8, size * int(np.prod(shape)), pos).reshape(*shape, size)
        pos += a.size
        return a

    kv_k, kv_v, _ = CACHES[kind]
    if kind in ("f32", "f16", "q8_0", "q4_0"):
        row = {"f32": 4 * D, "f16": 2 * D, "q8_0": D // 32 * 34, "q4_0": D // 32 * 18}[kind]
        for _ in range(CFG.n_layer):
            out["layers"].append({"k": take((H, n_past), row), "v": take((H, n_past), row)})
    else:
        bits = struct.unpack_from(f"<{2 * CFG.n_layer}i", body, pos + 4)
        pos += 4 + 8 * CFG.n_layer
        n_recent = n_past - n_sink - n_quant
        for il in range(CFG.n_layer):
            bk, bv = bits[2 * il], bits[2 * il + 1]
            layer = {"norm": take((1,), 4 * H * D)}
            for name, rows in (("sink_k", n_sink), ("sink_v", n_sink), ("recent_k", n_recent), ("recent_v", n_recent)):
                layer[name] = take((H, rows), 2 * D)
            for name, b in (("quant_k", bk), ("quant_v", bv)):
                scales = G if name == "quant_v" and flags & 8 else 0  # a row scale byte per token
                params = 8 + 2 * D if flags & 16 else 4 * D  # 8-bit group parameters (16) or fp16 (d, m)
                layer[name] = take((H, n_quant // G), D * G * b // 8 + params + scales)
            out["layers"].append(layer)
    assert pos == len(body), (pos, len(body))
    return out


def assert_kept(before: dict, after: dict, kind: str):
    """Every row `after` holds is `before`'s row of that position, byte for byte."""
    for lb, la in zip(before["layers"], after["layers"]):
        for name, rows in la.items():
            if name == "norm":
                if after["n_quant"] > 0:
                    np.testing.assert_array_equal(rows, lb[name])
                continue
            n = rows.shape[1]
            np.testing.assert_array_equal(rows, lb[name][:, :n], err_msg=f"{kind} {name}")


@pytest.mark.parametrize("kind", list(CACHES))
def test_removing_last_tokens_keeps_the_stored_rows(model, kind):
    ctx = make(model, kind, 2)
    ctx.decode_batch(toks(230, 3), [1] * 230)
    before = parse_seq_state(ctx.save_seq_state(1), kind)
    quantized = kind not in ("f32", "f16", "q8_0", "q4_0")
    sink, quant = before["n_sink"], before["n_quant"]
    assert not quantized or quant >= 2 * G
    state = ctx.save_seq_state(1)
    cuts = (sink + quant + 3, sink + quant, sink + quant - 5, sink + G + 1, sink + 1) if quantized else (200, 64, 63)
    for n in (229,) + cuts + (3, 0):
        ctx.load_seq_state(1, state)
        ctx.seq_rm(1, n, -1)
        kept = ctx.seq_pos_max(1) + 1
        if not quantized or n >= sink + quant or n <= sink:
            assert kept == n, (kind, n, kept)
        else:  # a cut inside the quantized region keeps the blocks below it
            assert kept == sink + (n - sink) // G * G, (kind, n, kept)
        after = parse_seq_state(ctx.save_seq_state(1), kind)
        assert after["n_past"] == kept
        assert_kept(before, after, kind)


@pytest.mark.parametrize("kind", ["innerq", "q8_0", "kivi2"])
def test_copy_shares_and_keeps_the_stored_rows(model, kind):
    ctx = make(model, kind, 3)
    prompt = toks(200, 4)
    ctx.decode_batch(prompt, [0] * 200)
    used = ctx.pool()["n_pages_used"]
    before = parse_seq_state(ctx.save_seq_state(0), kind)
    ctx.seq_cp(0, 2, -1, -1)
    assert ctx.pool()["n_pages_used"] == used  # shared, not copied
    assert ctx.save_seq_state(2) == ctx.save_seq_state(0)
    ctx.seq_cp(0, 1, 0, 150)
    assert_kept(before, parse_seq_state(ctx.save_seq_state(1), kind), kind)
    # the copy and the source go their own ways, and the source is as it was
    a, b = toks(30, 5), toks(30, 6)
    got = run(ctx, [[(0, a), (2, b)]])
    for s, t in ((0, a), (2, b)):
        alone = make(model, kind, 3)
        alone.decode_batch(prompt, [0] * 200)
        np.testing.assert_array_equal(got[s], run(alone, [[(0, t)]])[0], err_msg=f"{kind} {s}")


@pytest.mark.parametrize("kind", ["innerq", "f16"])
def test_sequence_state_moves_to_another_context(model, kind):
    a = make(model, kind, 4)
    a.decode_batch(toks(120, 8) + toks(70, 9), [3] * 120 + [1] * 70)
    state = a.save_seq_state(3)
    b = make(model, kind, 4)
    b.decode_batch(toks(40, 10), [0] * 40)
    b.load_seq_state(2, state)
    assert b.seq_pos_max(2) == 119 and b.seq_pos_max(0) == 39
    nxt = toks(20, 11)
    np.testing.assert_array_equal(run(a, [[(3, nxt)]])[3], run(b, [[(2, nxt)]])[2])


def test_bad_batches_and_calls_change_nothing(model):
    ctx = make(model, "innerq", 2, n_ctx=256)
    ctx.decode_batch(toks(60, 12), [0] * 60)
    state = ctx.save_state()
    bad = [
        (lambda: ctx.decode_batch([5, 6], [0, 2]), "sequence 2"),
        (lambda: ctx.decode_batch([5, 6], [1, 1], pos=[0, 5]), "position"),
        (lambda: ctx.decode_batch([5, 10 ** 6], [1, 1]), "vocabulary"),
        (lambda: ctx.decode_batch(toks(250, 13), [1] * 250), "pool"),
        (lambda: ctx.decode_batch([5, 6], [[1, 0], [1, 0]]), "empty"),
        (lambda: ctx.seq_rm(0, 10, 20), "middle"),
        (lambda: ctx.seq_cp(0, 1, 5, -1), "position 0"),
        (lambda: ctx.seq_rm(3, 0, -1), "sequence 3"),
    ]
    for call, word in bad:
        with pytest.raises(InnerQError, match=word):
            call()
        assert ctx.save_state() == state


def test_python_sequences(model, tmp_path):
    """innerq.Sequences, the public face of the calls above: its logits are the C context's."""
    path = tiny_model.write_tiny_model(tmp_path / "m.gguf", CFG)
    seqs = innerq.Sequences(path, n_seq_max=3, n_ctx=1024, n_batch=N_BATCH, n_threads=2, kv_type="innerq",
                            kv_group=G, kv_sink=S, kv_recent=R)
    a, b = toks(100, 20), toks(70, 21)
    seqs.decode(a + b, [0] * 100 + [2] * 70, logits=[True] * 170)
    assert seqs.n_tokens(0) == 100 and seqs.n_tokens(2) == 70 and seqs.n_tokens(1) == 0
    ctx = make(model, "innerq", 3, n_ctx=1024)
    want = run(ctx, [[(0, a), (2, b)]])
    np.testing.assert_array_equal(seqs.logits(99), want[0][-1])
    np.testing.assert_array_equal(seqs.logits(169), want[2][-1])
    assert seqs.copy(0, 1) == 100
    assert seqs.remove(0, 50) == S + (50 - S) // G * G
    assert seqs.pool()["n_seq"] == 3
    state = seqs.save_state(1)
    seqs.keep(2)
    assert seqs.n_tokens(1) == 0
    seqs.load_state(1, state)
    assert seqs.n_tokens(1) == 100


@pytest.mark.parametrize("decode_semantics", [False, True], ids=["batch", "decode-semantics"])
def test_kv_bits_in_a_pool_keeps_sequences_alone(model, decode_semantics):
    """kv_bits with n_seq_max > 1 lays the layers out in the preset's fixed order (no prompt
    chooses them): mixed layers, and each sequence batched gets the bits it gets alone."""
    def make_pool():
        ctx = ContextHandle.init(model, n_ctx=2048, n_seq_max=8, n_batch=N_BATCH, n_threads=2, kv_k="innerq",
                                 kv_group=G, kv_sink=S, kv_recent=R, kv_bits=7.0)
        ctx.set_batch_mode(False, decode_semantics)
        return ctx

    probe = make_pool()
    layers = [(probe.layer_info(il)["bits_k"], probe.layer_info(il)["bits_v"]) for il in range(CFG.n_layer)]
    assert layers != [(2, 2)] * CFG.n_layer and probe.kv_memory()["bits"] <= 7.0, layers
    calls = schedule(8)
    together = run(make_pool(), calls)
    for s in range(8):
        np.testing.assert_array_equal(together[s], run(make_pool(), calls, only=s)[s], err_msg=f"sequence {s}")
