"""Tokenizers (src/vocab.c, src/vocab-tokenize.c, src/unicode.c) against independent ones.

* gpt2 (byte-level BPE): HF `tokenizers` built from the GGUF's own tokens and merges with the
  pre-tokenizer of each tokenizer.ggml.pre (smollm, llama-bpe, gpt-2, qwen2, tekken, gpt-4o), on
  SmolLM2's vocabulary;
  llama.cpp itself through llama-cpp-python when it is installed.
* llama (SentencePiece BPE): a test vocabulary written with gguf.GGUFWriter and a small Python
  implementation of the algorithm written from its description (spm_oracle below).
* The streaming detokenizer against Python's bytes.decode(errors="replace").
* Malformed tokenizer metadata: an error with a message, never a crash.

The vocabulary is driven through the internal entry points (gguf_open, vocab_load, vocab_*),
which the shared library exports; the public innerq_* functions are tested through a loaded
model where innerq_model_load works.
"""
from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import cffi
import gguf
import pytest

from conftest import ROOT, TEXT, lib_path

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: E402

INTERNAL_CDEF = """
struct gguf_file;
struct innerq_vocab;
innerq_status gguf_open(const char * path, bool use_mmap, struct gguf_file ** out);
void gguf_close(struct gguf_file * f);
innerq_status vocab_load(const struct gguf_file * f, struct innerq_vocab ** out);
void vocab_free(struct innerq_vocab * vocab);
int32_t vocab_n_tokens(const struct innerq_vocab * vocab);
innerq_token vocab_bos(const struct innerq_vocab * vocab);
innerq_token vocab_eos(const struct innerq_vocab * vocab);
bool vocab_is_eog(const struct innerq_vocab * vocab, innerq_token token);
bool vocab_add_bos(const struct innerq_vocab * vocab);
innerq_status vocab_tokenize(const struct innerq_vocab * vocab, const char * text, int32_t text_len,
                             bool add_special, bool parse_special,
                             innerq_token * tokens, int32_t n_tokens_max, int32_t * n_tokens);
innerq_status vocab_token_to_piece(const struct innerq_vocab * vocab, innerq_token token, bool render_special,
                                   char * buf, int32_t buf_size, int32_t * n_bytes);
innerq_status vocab_detokenize(const struct innerq_vocab * vocab, const innerq_token * tokens, int32_t n_tokens,
                               bool render_special, char * buf, int32_t buf_size, int32_t * n_bytes);
innerq_status vocab_detokenizer_init(const struct innerq_vocab * vocab, bool render_special,
                                     innerq_detokenizer ** out);
"""

OK, BUFFER_TOO_SMALL = 0, 7
FORMAT, UNSUPPORTED = 3, 4

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's spelling of (?i:'s|...): only ASCII letters fold to these, and Oniguruma's
# (?i:) would also fold U+017F (long s) to 's'
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen2's tokenizer.json: LLAMA3's with one digit per word
QWEN2_REGEX = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Mistral's tekken (Mistral-Nemo's tokenizer.json) and GPT-4o's (o200k, as converted for Phi-4-mini):
# letter words cut by case
UPPER, LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
LEAD = r"[^\r\n\p{L}\p{N}]?"
TEKKEN_REGEX = (LEAD + UPPER + "*" + LOWER + "+|" + LEAD + UPPER + "+" + LOWER + "*|"
                r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_REGEX = (LEAD + UPPER + "*" + LOWER + "+" + CONTRACTIONS + "?|" + LEAD + UPPER + "+" + LOWER + "*" + CONTRACTIONS +
               r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex, and whether a word that is a token skips the merges
HF_PRE = {"gpt-2": (GPT2_REGEX, False), "llama-bpe": (LLAMA3_REGEX, True), "qwen2": (QWEN2_REGEX, False),
          "tekken": (TEKKEN_REGEX, True), "gpt-4o": (GPT4O_REGEX, False)}


# ---- the library ----

@pytest.fixture(scope="module")
def native():
    path = lib_path()
    from innerq._ffi import cdef_from_header

    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header((ROOT / "src" / "innerq.h").read_text()))
    ffi.cdef(INTERNAL_CDEF)
    return ffi, ffi.dlopen(path)


class VocabError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"status {status}: {message}")
        self.status = status
        self.message = message


class Vocab:
    """A vocabulary loaded from a GGUF file through gguf_open + vocab_load."""

    def __init__(self, native, path: Path):
        self.ffi, self.lib = native
        f = self.ffi.new("struct gguf_file **")
        self._check(self.lib.gguf_open(str(path).encode(), True, f))
        self.file = f[0]
        v = self.ffi.new("struct innerq_vocab **")
        st = self.lib.vocab_load(self.file, v)
        if st != OK:
            err = self._error(st)
            self.lib.gguf_close(self.file)
            raise err
        self.v = v[0]

    def _error(self, st: int) -> VocabError:
        return VocabError(st, self.ffi.string(self.lib.innerq_last_error()).decode())

    def _check(self, st: int) -> None:
        if st != OK:
            raise self._error(st)

    def close(self) -> None:
        self.lib.vocab_free(self.v)
        self.lib.gguf_close(self.file)

    def tokenize(self, text: str | bytes, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        n = self.ffi.new("int32_t *")
        cap = len(data) // 4 + 1  # often too small: the retry path is exercised too
        for _ in range(2):
            out = self.ffi.new("innerq_token[]", cap)
            st = self.lib.vocab_tokenize(self.v, data, len(data), add_special, parse_special, out, cap, n)
            if st != BUFFER_TOO_SMALL:
                break
            assert n[0] > cap
            cap = n[0]
        self._check(st)
        return list(out[0:n[0]])

    def piece(self, token: int, render_special: bool = False) -> bytes:
        buf = self.ffi.new("char[]", 256)
        n = self.ffi.new("int32_t *")
        self._check(self.lib.vocab_token_to_piece(self.v, token, render_special, buf, 256, n))
        return self.ffi.buffer(buf, n[0])[:]

    def detokenize(self, tokens: list[int], render_special: bool = False) -> bytes:
        n = self.ffi.new("int32_t *")
        st = self.lib.vocab_detokenize(self.v, tokens, len(tokens), render_special, self.ffi.NULL, 0, n)
        if st == OK:
            return b""
        assert st == BUFFER_TOO_SMALL
        buf = self.ffi.new("char[]", n[0])
        self._check(self.lib.vocab_detokenize(self.v, tokens, len(tokens), render_special, buf, n[0], n))
        return self.ffi.buffer(buf, n[0])[:]

    def stream(self, tokens: list[int], render_special: bool = False) -> list[bytes]:
        """Chunks of the streaming detokenizer: one per pushed token, then the flush."""
        dt = self.ffi.new("innerq_detokenizer **")
        self._check(self.lib.vocab_detokenizer_init(self.v, render_special, dt))
        buf = self.ffi.new("char[]", 1024)
        n = self.ffi.new("int32_t *")
        chunks = []
        try:
            for t in tokens:
                self._check(self.lib.innerq_detokenizer_push(dt[0], t, buf, 1024, n))
                chunks.append(self.ffi.buffer(buf, n[0])[:])
            self._check(self.lib.innerq_detokenizer_flush(dt[0], buf, 1024, n))
            chunks.append(self.ffi.buffer(buf, n[0])[:])
        finally:
            self.lib.innerq_detokenizer_free(dt[0])
        return chunks


# ---- GGUF vocabularies ----

def read_gguf_metadata(path: Path, prefix: str) -> dict:
    """The key/value pairs whose key starts with prefix, read with struct from the GGUF spec
    (gguf.GGUFReader would also index every tensor: seconds on a real model)."""
    import mmap
    import struct

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = 0

        def take(fmt):
            nonlocal pos
            v = struct.unpack_from(fmt, m, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(m[pos - n:pos]).decode("utf-8", "surrogateescape")

        def value(t):
            if t == 8:
                return string()
            if t == 9:
                sub, n = take("<I"), take("<Q")
                return [value(sub) for _ in range(n)]
            return take(scalar[t])

        assert take("<I") == 0x46554747  # "GGUF"
        take("<I")  # version
        take("<Q")  # tensors
        out = {}
        for _ in range(take("<Q")):
            key = string()
            v = value(take("<I"))
            if key.startswith(prefix):
                out[key] = v
        return out


def write_vocab(path: Path, model: str | None, tokens: list[str] | None, types: list[int] | None = None,
                scores: list[float] | None = None, merges: list[str] | None = None, pre: str | None = None,
                name: str | None = None, **ids: int) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    if name is not None:
        w.add_name(name)
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in ids.items():
        if isinstance(value, bool):
            w.add_bool(f"tokenizer.ggml.{key}", value)
        else:
            w.add_uint32(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet, as the original encoder.py defines it."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHARS = bytes_to_unicode()


class SmolVocab:
    """SmolLM2's tokenizer metadata, read with the gguf package."""

    def __init__(self, path: Path):
        meta = read_gguf_metadata(path, "tokenizer.ggml.")
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.merges = meta["tokenizer.ggml.merges"]
        self.types = meta["tokenizer.ggml.token_type"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}

    def hf(self, pre: str) -> Tokenizer:
        bpe = models.BPE(vocab=self.ids, merges=[tuple(m.split(" ", 1)) for m in self.merges],
                         ignore_merges=HF_PRE[pre][1] if pre in HF_PRE else False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = hf_pre(pre, byte_level=True)
        return tok


def hf_pre(pre: str, byte_level: bool):
    """The pre-tokenizer of a tokenizer.ggml.pre, as HF tokenizer.json files spell it."""
    steps = [pre_tokenizers.Digits(individual_digits=True), Regex(GPT2_REGEX)] if pre == "smollm" else \
        [Regex(HF_PRE[pre][0])]
    out = [pre_tokenizers.Split(s, behavior="isolated") if isinstance(s, Regex) else s for s in steps]
    if byte_level:
        out.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(out)


@pytest.fixture(scope="module")
def smol_meta(smollm2) -> SmolVocab:
    return SmolVocab(smollm2)


@pytest.fixture(scope="module")
def smol(native, smollm2):
    v = Vocab(native, smollm2)
    yield v
    v.close()


# ---- test strings ----

CODE = [
    'def f(x):\n    return x ** 2  # square\n',
    'for (int i = 0; i < n; ++i) { sum += a[i]; }\n',
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n}\n',
    'SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;',
    '    if self._cache is None:\r\n        raise ValueError("no cache")\r\n',
    '<div class="x">&nbsp;&lt;tag&gt;</div>',
    "x = lambda a, b: a if a > b else b  # it's fine, isn't it?",
]
WORDS = [
    "café", "naïve", "résumé", "Ångström", "façade", "e\u0301", "Müller", "straße", "ĳ", "Œuvre",
    "中文", "日本語のテキスト", "한국어", "你好，世界！", "東京タワー",
    "Привет", "Ελληνικά", "עברית", "العربية", "हिन्दी", "ภาษาไทย", "ქართული",
    "👍", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏽‍💻", "🇫🇷🇯🇵", "❤️", "🤷‍♂️",
    "I'M", "you'Re", "WE'VE", "he'S", "they'LL", "she'D", "don't", "'ll", "'S", "it'x", "O'Neil",
    "HTMLParser", "McDonald's", "iPhone", "ÉCOLE", "École", "ǅemal", "ǈUBLJANA", "ʰello", "Aʰb", "ÀÉ\u0301x",
    "\u0301\u0301", "ﬁne", "ᾈᾀ", "Ⅻx", "camelCaseWORDS", "snake_CASE", "a/b//c\n/",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>",
]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t", "\u00a0", "\u3000", "\u2009", "\u2028", "    "]


def stable_codepoints(cased: bool = False) -> list[int]:
    """Assigned code points whose class (letter, number, other; with cased, also the letter's
    case and whether it is a mark) Unicode 3.2 and this Python agree on, so every
    implementation's Unicode tables class them the same."""
    old = unicodedata.ucd_3_2_0
    out = []
    for c in range(0x20, 0x30000):
        ch = chr(c)
        cat, was = unicodedata.category(ch), old.category(ch)
        if cat in ("Cn", "Cs", "Co") or was == "Cn":
            continue
        if cased and (cat[0] in "LM" or was[0] in "LM") and cat != was:
            continue
        if cat[0] == was[0] or (cat[0] not in "LN" and was[0] not in "LN"):
            out.append(c)
    return out


def make_strings(austen: str, n: int, seed: int, cased: bool = False) -> list[str]:
    rng = random.Random(seed)
    cps = stable_codepoints(cased)
    out = []
    kinds = ["austen", "code", "digits", "spaces", "words", "random", "mixed"]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "austen":
            a = rng.randrange(len(austen) - 400)
            s = austen[a:a + rng.randint(1, 400)]
        elif kind == "code":
            c = rng.choice(CODE)
            a = rng.randrange(len(c))
            s = c[a:a + rng.randint(1, len(c))]
        elif kind == "digits":
            parts = ["".join(rng.choices("0123456789", k=rng.randint(1, 12))) for _ in range(rng.randint(1, 4))]
            s = "".join(p + rng.choice([" ", ".", ",", "", "x", " $", "%", "-"]) for p in parts)
            s = rng.choice(["", " ", "a", "v"]) + s + rng.choice(["", "٣", "²", "Ⅻ"])
        elif kind == "spaces":
            s = "".join(rng.choice(SPACES) + rng.choice(["a", "word", "1", ".", "!", "", "Z"])
                        for _ in range(rng.randint(1, 8)))
        elif kind == "words":
            s = "".join(rng.choice(WORDS) + rng.choice(SPACES + ["", "", ",", "."]) for _ in range(rng.randint(1, 6)))
        elif kind == "random":
            s = "".join(chr(rng.choice(cps)) for _ in range(rng.randint(1, 24)))
        else:
            pool = [rng.choice(WORDS), rng.choice(SPACES), chr(rng.choice(cps)), rng.choice("0123456789'"),
                    austen[rng.randrange(len(austen) - 20):][:rng.randint(1, 20)]]
            s = "".join(rng.choice(pool) for _ in range(rng.randint(2, 12)))
        out.append(s)
    return out


@pytest.fixture(scope="module")
def austen() -> str:
    return TEXT.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def strings(austen) -> list[str]:
    return make_strings(austen, 1400, seed=1234)


def invalid_utf8_strings(seed: int, n: int) -> list[bytes]:
    """Byte strings with stray continuation bytes, cut-short sequences, overlongs, surrogates."""
    rng = random.Random(seed)
    bad = [b"\x80", b"\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe0\x80\x80",
           b"\xf4\x90\x80\x80", b"\xfe", b"\xff", b"\xc1", b"\xf8\x88\x80\x80\x80", b"\xa0\xa1"]
    good = ["a", "word", " ", "  ", "\n", "é", "中", "1", "23", "!", "'s", "👍", "x y"]
    return [b"".join(rng.choice(bad) if rng.random() < 0.4 else rng.choice(good).encode()
                     for _ in range(rng.randint(1, 10))) for _ in range(n)]


# ---- gpt2: SmolLM2 (pre-tokenizer "smollm") ----

def test_smollm_metadata(smol):
    lib, v = smol.lib, smol.v
    assert lib.vocab_n_tokens(v) == 49152
    assert lib.vocab_bos(v) == 1 and lib.vocab_eos(v) == 2
    assert not lib.vocab_add_bos(v)
    assert lib.vocab_is_eog(v, 2) and lib.vocab_is_eog(v, 0)  # <|im_end|>, <|endoftext|>
    assert not lib.vocab_is_eog(v, 1) and not lib.vocab_is_eog(v, 1000) and not lib.vocab_is_eog(v, -1)


def test_smollm_matches_hf(smol, smol_meta, strings):
    hf = smol_meta.hf("smollm")
    for s in strings:
        ids = smol.tokenize(s)
        assert ids == hf.encode(s).ids, repr(s)
        assert smol.detokenize(ids) == s.encode(), repr(s)


def test_smollm_long_text_matches_hf(smol, smol_meta, austen):
    text = austen[100_000:400_000]  # 300K characters, as one call
    assert smol.tokenize(text) == smol_meta.hf("smollm").encode(text).ids


def hf_bytes_oracle(hf: Tokenizer, pre, byte_ok: set[int], data: bytes) -> list[int]:
    """Byte-level BPE of arbitrary bytes: the regex sees every invalid byte as U+FFFD (as
    llama.cpp does), the merges see the byte itself, or U+FFFD's bytes where the vocabulary
    has no token for it."""
    s = data.decode("utf-8", "surrogateescape")  # one surrogate per invalid byte
    is_bad = [0xDC80 <= ord(c) <= 0xDCFF for c in s]
    placeholder = "".join("\ufffd" if bad else c for c, bad in zip(s, is_bad))
    ids = []
    for _, (a, b) in pre.pre_tokenize_str(placeholder):
        raw = b""
        for c, bad in zip(s[a:b], is_bad[a:b]):
            byte = ord(c) - 0xDC00
            raw += (bytes([byte]) if byte in byte_ok else "\ufffd".encode()) if bad else c.encode()
        ids += [t.id for t in hf.model.tokenize("".join(BYTE_CHARS[x] for x in raw))]
    return ids


def test_smollm_invalid_utf8(smol, smol_meta):
    hf = smol_meta.hf("smollm")
    pre = hf_pre("smollm", byte_level=False)
    byte_ok = {b for b, ch in BYTE_CHARS.items() if ch in smol_meta.ids}
    for data in invalid_utf8_strings(seed=5, n=600):
        ids = smol.tokenize(data)
        assert ids == hf_bytes_oracle(hf, pre, byte_ok, data), data
        if all(b in byte_ok for b in data):
            assert smol.detokenize(ids) == data, data
    # a stray byte between letters is a word of its own: exactly its byte token
    for b in range(0x80, 0xC0):
        ids = smol.tokenize(b"x" + bytes([b]) + b"y")
        assert ids == [smol_meta.ids["x"], smol_meta.ids[BYTE_CHARS[b]], smol_meta.ids["y"]]


def test_smollm_round_trip_loses_only_bytes_without_tokens(smol, smol_meta):
    """innerq.h's contract for detokenize(tokenize(x)): exact, except bytes whose byte-level
    character is not in the vocabulary: dropped inside a valid character, U+FFFD alone."""
    byte_ok = {b for b, ch in BYTE_CHARS.items() if ch in smol_meta.ids}
    missing = sorted(set(range(256)) - byte_ok)
    assert missing == [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]
    for b in range(256):
        alone = bytes([b])
        valid = b < 0x80  # a lone byte is a character only in ASCII
        expected = alone if b in byte_ok else b"" if valid else "\ufffd".encode()
        assert smol.detokenize(smol.tokenize(alone)) == expected, hex(b)
        assert smol.detokenize(smol.tokenize(b"a" + alone + b" z")) == b"a" + expected + b" z", hex(b)
    # a valid character (U+40000) whose first byte has no token: that byte is dropped
    assert smol.detokenize(smol.tokenize("\U00040000".encode())) == b"\x80\x80\x80"
    rng = random.Random(3)
    ok = sorted(byte_ok)
    for _ in range(300):
        data = bytes(rng.choice(ok) for _ in range(rng.randrange(1, 40)))
        assert smol.detokenize(smol.tokenize(data)) == data, data


def test_empty_pieces_with_no_buffer(smol, smol_meta):
    """A control token renders as nothing without render_special: the size query (no buffer)
    and the detokenizer must copy nothing (memcpy with a NULL pointer is undefined even for 0
    bytes; the sanitizer build stops on it)."""
    im_end = smol_meta.ids["<|im_end|>"]
    assert smol.detokenize([im_end]) == b""
    assert smol.detokenize([im_end, im_end]) == b""
    assert smol.stream([im_end, im_end]) == [b"", b"", b""]
    dt = smol.ffi.new("innerq_detokenizer **")
    assert smol.lib.vocab_detokenizer_init(smol.v, False, dt) == OK
    n = smol.ffi.new("int32_t *")
    try:
        assert smol.lib.innerq_detokenizer_push(dt[0], im_end, smol.ffi.NULL, 0, n) == OK and n[0] == 0
    finally:
        smol.lib.innerq_detokenizer_free(dt[0])


def special_partition(data: bytes, specials: list[tuple[bytes, int, bool]], parse_special: bool):
    """llama.cpp's split at special tokens, from its description: longest token first, each
    cutting every text fragment at all its occurrences; control tokens only if parse_special,
    user-defined ones always. specials: (text, id, user_defined)."""
    frags: list[bytes | int] = [data] if data else []
    for text, tid, user in sorted(specials, key=lambda s: (-len(s[0]), s[1])):
        if not (parse_special or user):
            continue
        out: list[bytes | int] = []
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                continue
            parts = f.split(text)
            for k, p in enumerate(parts):
                if k:
                    out.append(tid)
                if p:
                    out.append(p)
        frags = out
    return frags


def test_smollm_parse_special(smol, smol_meta):
    hf = smol_meta.hf("smollm")
    specials = [(t.encode(), i, False) for i, t in enumerate(smol_meta.tokens) if smol_meta.types[i] == 3]
    texts = ["<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
             "<|im_start|><|im_end|>", "a<|endoftext|>b", "<|im_start|", "x<reponame><repo_name>y", "<|im_end|> 12"]
    for s in texts:
        expect = []
        for f in special_partition(s.encode(), specials, True):
            expect += [f] if isinstance(f, int) else hf.encode(f.decode()).ids
        ids = smol.tokenize(s, parse_special=True)
        assert ids == expect, s
        assert smol.detokenize(ids, render_special=True) == s.encode()
        assert smol.detokenize(ids, render_special=False) == b"".join(
            b"" if isinstance(f, int) else f for f in special_partition(s.encode(), specials, True))
        assert smol.tokenize(s, parse_special=False) == hf.encode(s).ids
    assert smol.tokenize("hi", add_special=True) == smol.tokenize("hi")  # add_bos_token is false


def test_smollm_pieces(smol, smol_meta):
    assert smol.piece(smol_meta.ids["Ġthe"]) == b" the"
    assert smol.piece(smol_meta.ids["Ċ"]) == b"\n"
    assert smol.piece(smol_meta.ids[BYTE_CHARS[0xE4]]) == b"\xe4"  # a lone byte of a character
    assert smol.piece(1) == b"" and smol.piece(1, render_special=True) == b"<|im_start|>"
    buf = smol.ffi.new("char[]", 2)
    n = smol.ffi.new("int32_t *")
    assert smol.lib.vocab_token_to_piece(smol.v, smol_meta.ids["Ġthe"], False, buf, 2, n) == BUFFER_TOO_SMALL
    assert n[0] == 4
    for bad in (-1, 49152):
        assert smol.lib.vocab_token_to_piece(smol.v, bad, False, buf, 2, n) == 1  # invalid argument
        assert smol.lib.vocab_detokenize(smol.v, [bad], 1, False, buf, 2, n) == 1


def test_smollm_matches_llama_cpp(smollm2, smol, strings):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(str(smollm2), vocab_only=True, verbose=False)
    for s in strings:
        assert smol.tokenize(s) == ref.tokenize(s.encode(), add_bos=False, special=False), repr(s)
    chat = "<|im_start|>user\nHow many r's in 'strawberry'?<|im_end|>\n<|im_start|>assistant\n"
    assert smol.tokenize(chat, parse_special=True) == ref.tokenize(chat.encode(), add_bos=False, special=True)


# ---- gpt2: other pre-tokenizers on SmolLM2's vocabulary ----

@pytest.fixture(scope="module")
def cased_strings(austen) -> list[str]:
    """Strings for the case-aware regexes: random letters only where their case is stable."""
    return make_strings(austen, 1400, seed=4321, cased=True)


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "qwen2", "tekken", "gpt-4o"])
def test_pre_tokenizers_match_hf(native, smol_meta, strings, cased_strings, tmp_path, pre):
    """Each pre-tokenizer's regex through HF tokenizers (Oniguruma, a backtracking engine) on
    SmolLM2's vocabulary and merges, against innerq's hand-written matcher."""
    path = write_vocab(tmp_path / f"{pre}.gguf", "gpt2", smol_meta.tokens, smol_meta.types,
                       merges=smol_meta.merges, pre=pre, bos_token_id=1, eos_token_id=2)
    v = Vocab(native, path)
    try:
        hf = smol_meta.hf(pre)
        for s in cased_strings if pre in ("tekken", "gpt-4o") else strings:
            ids = v.tokenize(s)
            assert ids == hf.encode(s).ids, repr(s)
            assert v.detokenize(ids) == s.encode(), repr(s)
        # llama-bpe's and tekken's add_bos default to true (as llama.cpp), the others' to false
        bos = pre in ("llama-bpe", "tekken")
        assert v.tokenize("hi", add_special=True)[:1] == ([1] if bos else v.tokenize("hi")[:1])
    finally:
        v.close()


def test_unknown_pre_tokenizer_is_refused_unless_named(native, smol_meta, tmp_path, monkeypatch):
    """An unknown tokenizer.ggml.pre is an error that names it; INNERQ_PRE_TOKENIZER picks a
    known rule instead, deliberately; a gpt2 vocabulary without the key gets GPT-2's."""
    path = write_vocab(tmp_path / "x.gguf", "gpt2", smol_meta.tokens, smol_meta.types, merges=smol_meta.merges,
                       pre="no-such-pre")
    monkeypatch.delenv("INNERQ_PRE_TOKENIZER", raising=False)
    with pytest.raises(VocabError) as e:
        Vocab(native, path)
    assert e.value.status == UNSUPPORTED
    assert "'no-such-pre'" in e.value.message and "INNERQ_PRE_TOKENIZER" in e.value.message
    s = "It's 2024: 12345 apples  \n\tand more"
    for name in ("gpt-2", "qwen2"):
        monkeypatch.setenv("INNERQ_PRE_TOKENIZER", name)
        v = Vocab(native, path)
        try:
            assert v.tokenize(s) == smol_meta.hf(name).encode(s).ids
        finally:
            v.close()
    monkeypatch.setenv("INNERQ_PRE_TOKENIZER", "bogus")
    with pytest.raises(VocabError, match="INNERQ_PRE_TOKENIZER=bogus"):
        Vocab(native, path)
    monkeypatch.delenv("INNERQ_PRE_TOKENIZER")
    v = Vocab(native, write_vocab(tmp_path / "none.gguf", "gpt2", smol_meta.tokens, smol_meta.types,
                                  merges=smol_meta.merges))
    try:
        assert v.tokenize(s) == smol_meta.hf("gpt-2").encode(s).ids
    finally:
        v.close()


# ---- llama: SentencePiece BPE ----

ESC = "\u2581".encode()


def units(data: bytes) -> list[bytes]:
    """Characters of data; every invalid byte is one of its own."""
    out = []
    for c in data.decode("utf-8", "surrogateescape"):
        out.append(bytes([ord(c) - 0xDC00]) if 0xDC80 <= ord(c) <= 0xDCFF else c.encode())
    return out


class SpmVocab:
    """A small SentencePiece vocabulary: control and unknown tokens, 256 <0xXX> byte tokens, a
    user-defined and a control token, single characters (some missing, to need byte fallback)
    and pieces learnt from Austen with scores that often tie."""

    def __init__(self, austen: str, seed: int = 7):
        rng = random.Random(seed)
        self.tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|user|>", "<|ctrl|>"]
        self.types = [2, 3, 3] + [6] * 256 + [4, 3]
        chars = list("\u2581abcdefghijklmnoprstuvwyABCEHIMST.,;'!?-é中文") + ["\u2581\u2581"]
        pieces = self.learn(austen[:20000], chars, 200)
        self.tokens += pieces
        self.types += [1] * len(pieces)
        self.scores = [0.0] * (len(self.tokens) - len(pieces)) + [-rng.randint(0, 60) / 2 for _ in pieces]
        self.ids = {t.encode(): i for i, t in enumerate(self.tokens)}
        self.byte_ids = [self.ids[f"<0x{b:02X}>".encode()] for b in range(256)]
        self.specials = [(t.encode(), i, ty == 4) for i, (t, ty) in enumerate(zip(self.tokens, self.types))
                         if ty in (2, 3, 4)]

    @staticmethod
    def learn(text: str, chars: list[str], n_merges: int) -> list[str]:
        words = [["\u2581"] + [c if c in chars else "?" for c in w] for w in text.split()]
        pieces = list(chars)
        for _ in range(n_merges):
            counts: dict[tuple[str, str], int] = {}
            for w in words:
                for a, b in zip(w, w[1:]):
                    counts[(a, b)] = counts.get((a, b), 0) + 1
            (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
            pieces.append(a + b)
            for w in words:
                i = 0
                while i < len(w) - 1:
                    if w[i] == a and w[i + 1] == b:
                        w[i:i + 2] = [a + b]
                    i += 1
        return list(dict.fromkeys(pieces))

    def encode_text(self, data: bytes, space_prefix: bool) -> list[int]:
        """SentencePiece BPE from its description: spaces become U+2581 (one more in front if
        asked); then, while some neighbouring pair joins into a vocabulary piece, join the pair
        whose piece scores highest (the leftmost among equals); a piece left that is not in
        the vocabulary becomes its bytes' <0xXX> tokens."""
        syms = units(((b" " if space_prefix else b"") + data).replace(b" ", ESC))
        while True:
            best = None
            for i in range(len(syms) - 1):
                tid = self.ids.get(syms[i] + syms[i + 1])
                if tid is not None and (best is None or self.scores[tid] > best[0]):
                    best = (self.scores[tid], i)
            if best is None:
                break
            i = best[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        out = []
        for s in syms:
            out += [self.ids[s]] if s in self.ids else [self.byte_ids[b] for b in s]
        return out

    def encode(self, data: bytes, parse_special: bool, add_bos: bool = False, space_prefix: bool = True) -> list[int]:
        out = [1] if add_bos else []
        prev_special = True
        for f in special_partition(data, self.specials, parse_special):
            if isinstance(f, int):
                out.append(f)
            else:
                out += self.encode_text(f, space_prefix=space_prefix and prev_special)
            prev_special = isinstance(f, int)
        return out


@pytest.fixture(scope="module")
def spm_meta(austen) -> SpmVocab:
    return SpmVocab(austen)


@pytest.fixture(scope="module")
def spm(native, spm_meta, tmp_path_factory):
    path = write_vocab(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", spm_meta.tokens, spm_meta.types,
                       spm_meta.scores, bos_token_id=1, eos_token_id=2, unknown_token_id=0)
    v = Vocab(native, path)
    yield v
    v.close()


def spm_texts(strings: list[str], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    inserts = ["<s>", "</s>", "<|user|>", "<|ctrl|>", "<unk>", " <s> ", "<|user|><|ctrl|>"]
    out = []
    for s in strings:
        data = s.encode()
        if rng.random() < 0.3:
            k = rng.randint(0, len(data))
            data = data[:k] + rng.choice(inserts).encode() + data[k:]
        out.append(data)
    return out + invalid_utf8_strings(seed=seed, n=200)


def test_spm_matches_oracle(spm, spm_meta, strings):
    for data in spm_texts(strings, seed=3):
        for parse_special in (False, True):
            ids = spm.tokenize(data, parse_special=parse_special)
            assert ids == spm_meta.encode(data, parse_special), (data, parse_special)
            # the leading space added in front (and after special tokens) is taken off again
            assert spm.detokenize(ids, render_special=parse_special) == data, (data, parse_special)


def test_spm_without_space_prefix(native, spm_meta, strings, tmp_path):
    """Gemma's SentencePiece (llama.cpp's converter writes tokenizer.ggml.add_space_prefix = false
    for it): no U+2581 in front of the text, nor after BOS or any special token, and nothing is
    taken off when detokenizing."""
    path = write_vocab(tmp_path / "gemma.gguf", "llama", spm_meta.tokens, spm_meta.types, spm_meta.scores,
                       bos_token_id=1, eos_token_id=2, unknown_token_id=0, add_space_prefix=False)
    v = Vocab(native, path)
    try:
        for data in spm_texts(strings[:400], seed=5):
            for parse_special in (False, True):
                ids = v.tokenize(data, parse_special=parse_special)
                assert ids == spm_meta.encode(data, parse_special, space_prefix=False), (data, parse_special)
                assert v.detokenize(ids, render_special=parse_special) == data, (data, parse_special)
        assert v.tokenize("Hello world", add_special=True) == spm_meta.encode(b"Hello world", False, add_bos=True,
                                                                              space_prefix=False)
        assert v.detokenize(v.tokenize(" x", add_special=True)) == b" x"
    finally:
        v.close()


def test_phi3_special_tokens_take_the_whitespace_after_them(native, smol_meta, tmp_path):
    """llama.cpp marks Phi-3's special tokens (by general.name) as taking the whitespace on their
    right, as the rstrip of Phi-3's tokenizer.json's added tokens does; <|endoftext|> keeps it.
    Oracle: HF tokenizers with those added tokens, on SmolLM2's vocabulary."""
    from tokenizers import AddedToken

    path = write_vocab(tmp_path / "phi3.gguf", "gpt2", smol_meta.tokens, smol_meta.types, merges=smol_meta.merges,
                       pre="gpt-2", name="Phi-3-mini-4k-instruct")
    hf = smol_meta.hf("gpt-2")
    specials = [t for t, ty in zip(smol_meta.tokens, smol_meta.types) if ty == 3]
    hf.add_special_tokens([AddedToken(t, rstrip=t != "<|endoftext|>", normalized=False, special=True)
                           for t in specials])
    texts = ["<|im_start|>user\n  Hi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>  b",
             "<|im_end|> \t\r\n x", "<|im_start|>\n\n<|im_end|>", "x <|im_start|>y", "<|im_end|>   "]
    v = Vocab(native, path)
    try:
        for t in texts:
            assert v.tokenize(t, parse_special=True) == hf.encode(t).ids, repr(t)
    finally:
        v.close()


def test_spm_special_tokens(spm, spm_meta):
    lib, v = spm.lib, spm.v
    assert lib.vocab_bos(v) == 1 and lib.vocab_eos(v) == 2 and lib.vocab_add_bos(v)
    assert lib.vocab_is_eog(v, 2) and not lib.vocab_is_eog(v, 1)
    assert spm.tokenize("Hello world", add_special=True) == spm_meta.encode(b"Hello world", False, add_bos=True)
    assert spm.tokenize("", add_special=True) == [1] and spm.tokenize("") == []
    user, ctrl = spm_meta.ids[b"<|user|>"], spm_meta.ids[b"<|ctrl|>"]
    assert user in spm.tokenize("a<|user|>b") and ctrl not in spm.tokenize("a<|ctrl|>b")
    assert ctrl in spm.tokenize("a<|ctrl|>b", parse_special=True)
    assert spm.piece(user) == b"<|user|>"  # user-defined tokens always render
    assert spm.piece(ctrl) == b"" and spm.piece(ctrl, render_special=True) == b"<|ctrl|>"
    word = next(t for t in spm_meta.tokens if t.startswith("\u2581") and len(t) > 2)
    assert spm.piece(spm_meta.ids[word.encode()]) == b" " + word[1:].encode()
    assert spm.piece(spm_meta.byte_ids[0x41]) == b"A"
    assert spm.detokenize(spm.tokenize("x", add_special=True)) == b"x"


# ---- streaming detokenizer ----

def check_stream(v: Vocab, ids: list[int], render_special: bool = False) -> None:
    chunks = v.stream(ids, render_special)
    for c in chunks:
        c.decode("utf-8")  # every chunk is valid UTF-8 on its own
    assert b"".join(chunks) == v.detokenize(ids, render_special).decode("utf-8", "replace").encode()


def test_stream_smollm(smol, strings):
    for s in strings[:400]:
        ids = smol.tokenize(s)
        check_stream(smol, ids)
        assert b"".join(smol.stream(ids)) == s.encode()
    for data in invalid_utf8_strings(seed=9, n=200):
        check_stream(smol, smol.tokenize(data))
    # a character cut short at the end comes out as one U+FFFD
    e = smol.tokenize(b"\xe2\x82")
    assert smol.stream(e)[-1] == "\ufffd".encode()


def test_stream_spm(spm, strings):
    for data in spm_texts(strings[:300], seed=11):
        ids = spm.tokenize(data, parse_special=True)
        check_stream(spm, ids, render_special=True)


# ---- malformed metadata ----

def test_bad_metadata(native, spm_meta, tmp_path):
    toks, types, scores = spm_meta.tokens, spm_meta.types, spm_meta.scores
    cases = {
        "no tokens": (dict(model="llama", tokens=None), FORMAT, "tokens"),
        "no model": (dict(model=None, tokens=toks), FORMAT, "tokenizer.ggml.model"),
        "unknown model": (dict(model="bert", tokens=toks), UNSUPPORTED, "'bert'"),
        "short types": (dict(model="llama", tokens=toks, types=types[:-1]), FORMAT, "token_type"),
        "long scores": (dict(model="llama", tokens=toks, types=types, scores=scores + [0.0]), FORMAT, "scores"),
        "bos out of range": (dict(model="llama", tokens=toks, bos_token_id=len(toks)), FORMAT, "bos_token_id"),
        "duplicate token": (dict(model="llama", tokens=toks + ["a"]), FORMAT, "repeats"),
        "bad byte token": (dict(model="llama", tokens=toks[:3] + ["<0xZZ>"], types=[2, 3, 3, 6]), FORMAT, "<0xXX>"),
        "no merges": (dict(model="gpt2", tokens=["a", "b", "ab"]), FORMAT, "merges"),
        "merge of unknown token": (dict(model="gpt2", tokens=["a", "b", "ab"], merges=["a c"]), FORMAT, "merge 0"),
        "merge into unknown token": (dict(model="gpt2", tokens=["a", "b", "ab"], merges=["a b", "b a"]), FORMAT,
                                     "merge 1"),
        "merge without space": (dict(model="gpt2", tokens=["a", "b", "ab"], merges=["ab"]), FORMAT, "merge 0"),
        "add_bos without bos": (dict(model="gpt2", tokens=["a", "b", "ab"], merges=["a b"], add_bos_token=True),
                                FORMAT, "BOS"),
    }
    for name, (kw, status, words) in cases.items():
        model, tokens = kw.pop("model"), kw.pop("tokens")
        path = write_vocab(tmp_path / f"{name.replace(' ', '_')}.gguf", model, tokens, **kw)
        with pytest.raises(VocabError) as e:
            Vocab(native, path)
        assert e.value.status == status, name
        assert words in e.value.message, (name, e.value.message)
    # the smallest valid gpt2 vocabulary still works
    v = Vocab(native, write_vocab(tmp_path / "ok.gguf", "gpt2", ["a", "b", "ab"], merges=["a b"]))
    assert v.tokenize("abba") == [2, 1, 0]
    v.close()


# ---- the public functions, through a loaded model ----

@pytest.fixture(scope="module")
def model(native, smollm2):
    ffi, lib = native
    out = ffi.new("innerq_model **")
    try:
        params = lib.innerq_model_default_params()
        st = lib.innerq_model_load(str(smollm2).encode(), ffi.new("innerq_model_params *", params), out)
    except AttributeError:
        pytest.skip("innerq_model_load is not in the library yet")
    if st != OK:
        pytest.skip("innerq_model_load failed: " + ffi.string(lib.innerq_last_error()).decode())
    yield out[0]
    lib.innerq_model_free(out[0])


def test_public_api(native, model, smol):
    ffi, lib = native
    text = "Hello, world! 12 apples\n<|im_end|>"
    data = text.encode()
    n = ffi.new("int32_t *")
    assert lib.innerq_tokenize(model, data, len(data), False, True, ffi.NULL, 0, n) == BUFFER_TOO_SMALL
    ids = ffi.new("innerq_token[]", n[0])
    assert lib.innerq_tokenize(model, data, len(data), False, True, ids, n[0], n) == OK
    assert list(ids[0:n[0]]) == smol.tokenize(text, parse_special=True)
    buf = ffi.new("char[]", 256)
    assert lib.innerq_detokenize(model, ids, n[0], True, buf, 256, n) == OK
    assert ffi.buffer(buf, n[0])[:] == data
    assert lib.innerq_token_to_piece(model, 2, True, buf, 256, n) == OK and ffi.buffer(buf, n[0])[:] == b"<|im_end|>"
    dt = ffi.new("innerq_detokenizer **")
    assert lib.innerq_detokenizer_init(model, False, dt) == OK
    lib.innerq_detokenizer_free(dt[0])
    assert lib.innerq_tokenize(ffi.NULL, data, len(data), False, False, ids, 1, n) == 1
