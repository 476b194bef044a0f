"""Per-layer cache layouts: kv_layer_bits (bits of single layers) and kv_bits, the automatic
layout (src/kv-auto.c) that chooses every layer's bits at the first flush within a budget.

The layout chosen spends the budget and no more, in memory too; it travels with a state and
a rewind gives it back as a fresh evaluation would choose it; attention over layers of
different formats in one graph is each layer's reference attention; and a bad kv_bits or
kv_layer_bits is a clear error before any model is read.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

import tiny_model
from conftest import tool_path
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq._native import ContextHandle, context_params, lib  # noqa: E402
from innerq.errors import FormatError, InvalidArgumentError, StateMismatchError  # noqa: E402
from innerq.gguf_model import Model  # noqa: E402

CFG = TinyConfig(head_dim=32, n_head=4, n_head_kv=2, n_layer=4, seed=11)
G, S, R = 32, 8, 16
KW = dict(n_ctx=4096, n_batch=32, n_threads=1, kv_group=G, kv_sink=S, kv_recent=R)
CHOICE = S + R + G - 1  # tokens stored when the layout is chosen (before the first flush)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return Model(tiny_model.write_tiny_model(tmp_path_factory.mktemp("auto") / "m.gguf", CFG))


@pytest.fixture(scope="module")
def model(gguf):
    return gguf.handle


def toks(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def layout(ctx):
    return [(i["bits_k"], i["bits_v"]) for i in (ctx.layer_info(il) for il in range(CFG.n_layer))]


def units(mem):
    """The code bits (b_k + b_v summed over the layers) of a cache whose quantized region takes
    mem["quant_bits"] per element ((d, m): 32/G per element of keys and of values)."""
    return round(CFG.n_layer * (2 * mem["quant_bits"] - 64 / G))


def elements(n_ctx):
    return 2 * n_ctx * CFG.n_layer * CFG.n_head_kv * CFG.head_dim


# one code bit more for one tensor of one layer: n_pages G D / 8 bytes per KV head, about 1 / (2
# n_layer) bits per element of the whole cache
UNIT_BITS = 1 / (2 * CFG.n_layer)


@pytest.mark.parametrize("kv_bits", [3.25, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0])
def test_layout_spends_the_budget(model, kv_bits):
    """kv_bits is the whole cache's effective bits at n_ctx, windows included: the layout takes
    what is left after them, as much as fits (a budget past 5-bit everything: that)."""
    ctx = ContextHandle.init(model, kv_bits=kv_bits, **KW)
    mem = ctx.kv_memory()
    assert mem["bytes"] == lib.innerq_cache_size(ctx.ptr) and mem["bits"] <= kv_bits
    assert mem["bits"] > kv_bits - 1.1 * UNIT_BITS or units(mem) == 10 * CFG.n_layer
    ctx.decode(toks(CHOICE))
    assert layout(ctx) == [(2, 2)] * CFG.n_layer  # before the choice: the smallest format
    ctx.decode(toks(150, 1))
    chosen = layout(ctx)
    assert all(2 <= b <= 5 for pair in chosen for b in pair)
    assert sum(map(sum, chosen)) == units(mem)
    info = [ctx.layer_info(il) for il in range(CFG.n_layer)]
    assert all(i["n_quant"] > 0 and 0 <= i["sym_k"] <= 1 and 0 <= i["sym_v"] <= 1 for i in info)
    # what the choice measured: every candidate's error, 2 bits worse than 4, 4 worse than 5
    assert all(i["err_k"][0] > i["err_k"][2] > i["err_k"][3] > 0 and i["err_v"][0] > i["err_v"][2] > i["err_v"][3] > 0
               for i in info)


def cache_size(model, **params):
    ctx = ContextHandle.init(model, **KW, **params)  # alive while the library reads it
    return lib.innerq_cache_size(ctx.ptr)


@pytest.mark.parametrize("n_ctx", [1024, 4096, 16384])
def test_memory_is_the_budgets(gguf, model, n_ctx):
    """The cache takes the budget's bytes at n_ctx, windows included, whatever n_ctx is: up to
    one code bit of one layer's tensor less, not those of the largest format."""
    kw = {**KW, "n_ctx": n_ctx}
    for b in (4.0, 4.75, 5.5):
        size = lib.innerq_cache_size(ContextHandle.init(model, **{**kw, "kv_bits": b}).ptr)
        assert (b - 1.1 * UNIT_BITS) * elements(n_ctx) / 8 < size <= b * elements(n_ctx) / 8, (b, n_ctx, size)
        assert gguf.kv_memory(kv_bits=b, **kw)["bytes"] == size
    # without n_ctx (bytes per token): the budget is the quantized region's
    assert gguf.kv_bytes_per_token(kv_bits=4.0, **KW) == gguf.kv_bytes_per_token("innerq3", **KW)


@pytest.mark.parametrize("n_ctx, sink, recent", [(4096, S, R), (512, S, R), (4096, 256, 1024)])
def test_a_budget_the_windows_exceed_is_a_clear_error(gguf, model, n_ctx, sink, recent):
    """The f16 windows with 2-bit keys and values take more than kv_bits: an error that says so,
    from the context and from the computed figure alike."""
    kw = {**KW, "n_ctx": n_ctx, "kv_sink": sink, "kv_recent": recent}
    smallest = (sink + recent + G) * 16 / n_ctx + (1 - (sink + recent) / n_ctx) * (2 + 32 / G)  # about
    for call in (lambda: ContextHandle.init(model, kv_bits=3.1, **kw), lambda: gguf.kv_memory(kv_bits=3.1, **kw)):
        with pytest.raises(InvalidArgumentError, match=f"kv_bits 3.1 cannot be met at n_ctx {n_ctx}: the f16 windows"):
            call()
    assert smallest > 3.1
    ContextHandle.init(model, kv_bits=round(smallest + 0.2, 2), **kw)  # a little more fits


def test_layer_bits_set_single_layers(model):
    ctx = ContextHandle.init(model, kv_layer_bits="0:4:3,3:2:4", **KW)
    assert layout(ctx) == [(4, 3), (3, 2), (3, 2), (2, 4)]
    same = ContextHandle.init(model, kv_layer_bits=",".join(f"{il}:3:2" for il in range(CFG.n_layer)), **KW)
    preset = ContextHandle.init(model, **KW)
    t = toks(120, 3)
    for c in (ctx, same, preset):
        c.set_batch_mode(logits_all=True)
        c.decode(t)
    np.testing.assert_array_equal(same.logits(), preset.logits())  # the per-layer path is the same path
    assert np.abs(ctx.logits() - preset.logits()).max() > 0


def measured(ctx):
    """What the choice measured per layer (the relative errors of every candidate)."""
    return [(i["err_k"], i["err_v"]) for i in (ctx.layer_info(il) for il in range(CFG.n_layer))]


def test_choice_is_the_prompts_however_it_is_cut(model):
    """The choice is made at one point of the sequence (the batch is cut there) and measured with
    the rows stored then and the next min(n_batch, KV_AUTO_AHEAD) tokens of the call that reaches
    it: the same prompt measures the same rows (to the rounding of how the tokens before were
    batched) however it is cut into calls that each reach that far, and chooses the same layout."""
    a = ContextHandle.init(model, kv_bits=3.5, **KW)
    b = ContextHandle.init(model, kv_bits=3.5, **KW)
    t = toks(200, 4)
    a.decode(t)
    for i in range(0, len(t), 50):
        b.decode(t[i:i + 50])
    np.testing.assert_allclose(np.array(measured(a)), np.array(measured(b)), rtol=2e-2)
    assert layout(a) == layout(b)


def test_choice_measures_the_tokens_after_the_first_flush(model):
    """A prompt in one call adds its next n_batch tokens to the choice's measurement (a measuring
    step that stores nothing); a sequence that reaches the choice a token at a time measures the
    windows' rows alone. Both leave the cache as plain evaluation does: with the same layout the
    two give the same logits (decode semantics: a batch's tokens read each other as one-token
    decoding does)."""
    t = toks(200, 12)
    one = ContextHandle.init(model, kv_bits=3.5, **KW)
    each = ContextHandle.init(model, kv_bits=3.5, **KW)
    for c in (one, each):
        c.set_batch_mode(decode_semantics=True)
    one.decode(t)
    for x in t:
        each.decode([x])
    # 32 more rows measured: the 2-bit candidates' errors differ by more than rounding
    two_one, two_each = np.array(measured(one))[..., 0], np.array(measured(each))[..., 0]
    assert np.abs(two_one / two_each - 1).max() > 0.1
    assert layout(one) == layout(each)  # this tiny model's choice does not move with them
    np.testing.assert_allclose(one.logits(), each.logits(), rtol=0, atol=1e-4 * np.abs(each.logits()).max())


@pytest.mark.parametrize("n_batch", [32, 512])
def test_measuring_step_is_the_tokens_evaluation(model, n_batch):
    """Without decode semantics the measuring step's evaluation is kept: it evaluates the batch
    after the choice (n_batch tokens, at most KV_AUTO_KEEP = 512; the first 384 are measured),
    its tokens' logits are the call's and its keys and values are stored (a graph of KV_STORE
    ops after the choice) instead of evaluating those tokens again. What the cache then holds
    and every logit are those of a context given the chosen layout by hand and the prompt cut
    where the choice is made, where that batch is evaluated and stored as usual: bit for bit."""
    t, rest = toks(700, 13), toks(40, 14)
    kw = {**KW, "n_batch": n_batch}
    auto = ContextHandle.init(model, kv_bits=3.5, **kw)
    auto.set_batch_mode(logits_all=True)
    auto.decode(t)
    bits = layout(auto)
    assert len(set(bits)) > 1  # a layout no fixed preset has
    fixed = ContextHandle.init(model, kv_layer_bits=",".join(f"{il}:{k}:{v}" for il, (k, v) in enumerate(bits)), **kw)
    fixed.set_batch_mode(logits_all=True)
    step = min(n_batch, 512, len(t) - CHOICE)  # the measuring step's: KV_AUTO_KEEP at most
    parts = [t[:CHOICE], t[CHOICE:CHOICE + step], t[CHOICE + step:]]
    want = []
    for p in filter(None, parts):
        fixed.decode(p)
        want += [fixed.logits(i) for i in range(len(p))]
    np.testing.assert_array_equal(np.array([auto.logits(i) for i in range(len(t))]), np.array(want))
    auto.decode(rest)
    fixed.decode(rest)
    for i in range(len(rest)):  # the stored rows are the same
        np.testing.assert_array_equal(auto.logits(i), fixed.logits(i))


@pytest.mark.parametrize("cut", [CHOICE - 10, CHOICE, 150])
def test_state_roundtrip_keeps_the_layout(model, cut):
    """Before the choice (the state then holds the queries it will be measured with), at it and
    after it: the loaded context continues exactly and chooses, or has chosen, the same."""
    a = ContextHandle.init(model, kv_bits=3.5, **KW)
    a.decode(toks(cut, 5))
    state = a.save_state()
    b = ContextHandle.init(model, kv_bits=3.5, **KW)
    b.decode(toks(200, 6))  # another layout, replaced by the state's
    b.load_state(state)
    assert layout(b) == layout(a) and b.save_state() == state
    a.set_batch_mode(logits_all=True)
    b.set_batch_mode(logits_all=True)
    rest = toks(80, 7)
    a.decode(rest)
    b.decode(rest)
    np.testing.assert_array_equal(b.logits(), a.logits())
    assert layout(b) == layout(a)


def test_states_of_other_layouts_are_refused(model):
    auto = ContextHandle.init(model, kv_bits=3.5, **KW)
    auto.decode(toks(150, 8))
    state = auto.save_state()
    for other in (dict(kv_bits=4.0), dict(kv_k="innerq2"), dict(kv_layer_bits="1:4:4")):
        ctx = ContextHandle.init(model, **{**KW, **other})
        ctx.decode(toks(10))
        before = ctx.save_state()
        with pytest.raises(StateMismatchError):
            ctx.load_state(state)
        assert ctx.save_state() == before  # unchanged
    fixed = ContextHandle.init(model, kv_layer_bits="1:4:4", **KW)
    fixed.decode(toks(150, 8))
    with pytest.raises(StateMismatchError, match="bits per layer"):
        ContextHandle.init(model, kv_layer_bits="2:4:4", **KW).load_state(fixed.save_state())


def test_a_state_with_absurd_layer_bits_is_refused(model):
    """The layout in a state is untrusted input: bits far out of range (their sum would overflow
    an int) give a clear format error and leave the context as it was (found by fuzz-state)."""
    a = ContextHandle.init(model, kv_bits=3.5, **KW)
    a.decode(toks(150, 8))
    state = a.save_state()
    bits = np.array([1] + [b for kv in layout(a) for b in kv], dtype="<i4").tobytes()  # ready, then the pairs
    at = state.find(bits)
    assert at > 0 and state.find(bits, at + 1) < 0
    bad = np.frombuffer(bits, dtype="<i4").copy()
    bad[1:] = 1627390208
    body = state[:-8]  # then its hash (fnv1a64, below)
    body = body[:at] + bad.tobytes() + body[at + len(bits):]
    broken = body + np.array([fnv1a64(body)], dtype="<u8").tobytes()
    b = ContextHandle.init(model, kv_bits=3.5, **KW)
    b.decode(toks(20, 9))
    before = b.save_state()
    with pytest.raises(FormatError, match="layout"):
        b.load_state(broken)
    assert b.save_state() == before


def test_rewind_chooses_again(model):
    """A rewind to before the first flush drops the choice: the tokens evaluated again choose
    as a fresh context would (with decode semantics, where how the tokens are cut into calls
    changes nothing)."""
    t, other = toks(200, 9), toks(200, 10)
    a = ContextHandle.init(model, kv_bits=3.5, **KW)
    fresh = ContextHandle.init(model, kv_bits=3.5, **KW)
    for c in (a, fresh):
        c.set_batch_mode(decode_semantics=True)
    a.decode(t[:S] + other[S:])
    assert a.truncate(S) == S
    a.decode(t[S:])
    fresh.decode(t)
    assert layout(a) == layout(fresh)
    np.testing.assert_allclose(a.logits(), fresh.logits(), rtol=0, atol=1e-4 * np.abs(fresh.logits()).max())


BAD = [(dict(kv_bits=2.0), "kv_bits 2 is out of range"),
       (dict(kv_bits=16.5), "kv_bits 16.5 is out of range"),
       (dict(kv_bits=float("nan")), "out of range"),
       (dict(kv_bits=3.0, kv_k="innerq4"), "chooses the bits itself"),
       (dict(kv_bits=3.0, kv_k="f16"), "chooses the bits itself"),
       (dict(kv_bits=3.0, kv_layer_bits="0:4:4"), "give one"),
       (dict(kv_layer_bits="0:6:2"), "kv_layer_bits '0:6:2'"),
       (dict(kv_layer_bits="0:3"), "expected LAYER:K:V"),
       (dict(kv_layer_bits="x"), "expected LAYER:K:V"),
       (dict(kv_layer_bits="1:3:3", kv_k="q8_0"), "needs an InnerQ cache")]


@pytest.mark.parametrize("params, needle", BAD, ids=lambda x: str(x)[:40])
def test_bad_values_are_clear_errors(params, needle):
    with pytest.raises(InvalidArgumentError, match=needle.replace("(", r"\(")):
        context_params(**{**KW, **params})


def test_layer_beyond_the_model_is_an_error(model):
    with pytest.raises(InvalidArgumentError, match="a layer of the model"):
        ContextHandle.init(model, kv_layer_bits=f"{CFG.n_layer}:3:3", **KW)


@pytest.mark.parametrize("flags, needle", [(["--kv-bits", "1.5"], "kv_bits 1.5 is out of range"),
                                           (["--kv-bits", "3", "--kv", "q4_0"], "chooses the bits itself"),
                                           (["--kv-bits", "abc"], "--kv-bits expects a number"),
                                           (["--kv-layer-bits", "0:9:9"], "kv_layer_bits '0:9:9'")])
@pytest.mark.parametrize("tool", ["innerq-cli", "innerq-bench", "innerq-perplexity"])
def test_tools_refuse_a_bad_value(tmp_path, tool, flags, needle):
    args = [tool_path(tool), "-m", tmp_path / "absent.gguf", *flags]
    res = subprocess.run(args + (["-f", tmp_path / "absent.txt"] if tool == "innerq-perplexity" else []),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and needle in res.stderr and "absent.gguf" not in res.stderr, res.stderr


def test_perplexity_reports_the_layers(gguf, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["alpha beta gamma delta"] * 200))
    res = subprocess.run([tool_path("innerq-perplexity"), "-m", gguf.path, "-f", text, "-c", "128", "--chunks", "1",
                          "-t", "1", "--kv-group", "32", "--kv-sink", "8", "--kv-recent", "16", "--kv-bits", "11",
                          "--kv-stats"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "KV cache per layer" in res.stdout and "bits per layer: keys" in res.stderr
    rows = [ln.split() for ln in res.stdout.split("KV cache per layer")[1].splitlines()[3:3 + CFG.n_layer]]
    mem = gguf.kv_memory(kv_bits=11.0, **{**KW, "n_ctx": 128})
    assert f"{mem['bits']:.3f} bits per element at n_ctx 128" in res.stderr
    assert sum(float(r[1]) + float(r[2]) for r in rows) == units(mem)
    assert all(r[3].endswith("%") for r in rows)


# ---- attention over layers of different formats in one graph ----

from test_attention_innerq import api, batch_of, layer_of  # noqa: E402,F401  (api: fixture)
from test_innerq_attn import assert_within_q8_p8, attention_ref, dense_cache, filled_cache, innerq_cfg  # noqa: E402
from test_ops import Graph  # noqa: E402


@pytest.mark.parametrize("bits", [((4, 2), (2, 3)), ((2, 4), (3, 3), (4, 4))], ids=["k4v2+k2v3", "k2v4+k3v3+k4v4"])
def test_mixed_formats_match_the_reference(api, bits):  # noqa: F811
    """Each layer's ATTENTION reads its own format from its op (bits per op, as the runtime's
    layers hold them): the sum of the layers' outputs of one graph is the sum of their
    reference attentions."""
    ffi, lib = api
    D, H, r, n_past, nt = 64, 2, 3, 400, 2
    rng = np.random.default_rng(7)
    q = rng.standard_normal((nt, H * r, D)).astype(np.float32)
    k = rng.standard_normal((nt, H, D)).astype(np.float32)
    v = rng.standard_normal((nt, H, D)).astype(np.float32)
    caches = [filled_cache(innerq_cfg(bk, bv, 64, S=8, R=64), D, H, n_past, [200, 1, 63, 7], seed=il,
                           n_ctx=n_past + nt) for il, (bk, bv) in enumerate(bits)]
    be = lib.iq_backend_cpu_init(2)
    g = Graph(api)
    try:
        qt, kt, vt = g.input(q), g.input(k), g.input(v)
        out = None
        for (qc, _, _), (bk, bv) in zip(caches, bits):
            a = lib.iq_attention(g.ctx, qt, kt, vt, layer_of(api, g, qc, innerq_cfg(bk, bv, 64, S=8, R=64)),
                                 *batch_of(g, qc, nt)[:2], 1.0 / np.sqrt(D))
            out = a if out is None else lib.iq_add(g.ctx, out, a)
        got = g.compute(be, out).reshape(nt, H * r, D)
    finally:
        g.close()
        lib.iq_backend_free(be)
    ref = sum(attention_ref(qc, q, 1.0 / np.sqrt(D), k, v) for qc, _, _ in caches)
    V = np.concatenate([dense_cache(qc)[1] for qc, _, _ in caches], axis=1)
    assert_within_q8_p8(got, ref, V * len(bits))


# ---- states of version 2 (one configuration for all layers) ----

def fnv1a64(data: bytes) -> int:
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def as_version3(state: bytes, n_vocab: int) -> bytes:
    """A version 4 state of one sequence (sequence 0), written as version 3 wrote it: no count of
    sequences and no sequence id before the cache's part."""
    import struct

    body = state[:-8]
    assert body[:8] == b"INNERQST" and struct.unpack_from("<I", body, 8)[0] == 4
    cfg = 12 + 8 * 4 + 8  # magic, version, the model, its fingerprint
    n_logits = struct.unpack_from("<i", body, cfg + 15 * 4)[0]
    seqs = cfg + 16 * 4 + 4 * n_logits * n_vocab
    assert struct.unpack_from("<ii", body, seqs) == (1, 0)  # one sequence, sequence 0
    old = body[:8] + struct.pack("<I", 3) + body[12:seqs] + body[seqs + 8:]
    return old + struct.pack("<Q", fnv1a64(old))


def as_version2(state: bytes, n_vocab: int, quantized: bool) -> bytes:
    """A version 4 state of a cache of one configuration, written as version 2 wrote it: 14
    configuration fields (no kv_bits) and no layout record in the cache's part."""
    import struct

    body = as_version3(state, n_vocab)[:-8]
    cfg = 12 + 8 * 4 + 8  # magic, version, the model, its fingerprint
    assert struct.unpack_from("<i", body, cfg + 14 * 4)[0] == 0  # kv_bits 0
    n_logits = struct.unpack_from("<i", body, cfg + 15 * 4)[0]
    kv = cfg + 16 * 4 + 4 * n_logits * n_vocab
    n_runs = struct.unpack_from("<i", body, kv + 16)[0]
    layout = kv + 20 + 12 * n_runs
    old = (body[:8] + struct.pack("<I", 2) + body[12:cfg + 14 * 4] + body[cfg + 15 * 4:layout] +
           body[layout + (4 + 8 * CFG.n_layer if quantized else 0):])
    return old + struct.pack("<Q", fnv1a64(old))


@pytest.mark.parametrize("kv", ["innerq", "f16"])
def test_version2_and_3_states_still_load(model, kv):
    a = ContextHandle.init(model, kv_k=kv, **KW)
    a.decode(toks(150, 12))
    state = a.save_state()
    b = ContextHandle.init(model, kv_k=kv, **KW)
    n_vocab = lib.innerq_model_n_vocab(model.ptr)
    b.load_state(as_version3(state, n_vocab))
    assert b.save_state() == state  # saved again as version 4
    b = ContextHandle.init(model, kv_k=kv, **KW)
    old = as_version2(state, n_vocab, kv == "innerq")
    b.load_state(old)
    assert b.save_state() == state
    with pytest.raises(StateMismatchError, match="kv_bits"):
        ContextHandle.init(model, kv_bits=3.5, **KW).load_state(old)
