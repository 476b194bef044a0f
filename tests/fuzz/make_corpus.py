"""Seed corpora of the fuzz targets in tests/fuzz, from tiny models (tests/tiny_model.py).

    python tests/fuzz/make_corpus.py OUT   # OUT/gguf, OUT/tokenizer, OUT/kld-base, OUT/tiny.gguf,
                                           # OUT/state, OUT/state.gguf, OUT/grammar

gguf: small models of each weight type and shape option (each a few kB, so that mutations
stay fast); tokenizer: texts of every kind the tokenizers split differently (the tokenizer
target reads OUT/tiny.gguf or another model as its vocabulary); kld-base: valid base files
in the layout of tools/common/kld-base.h; state: states saved by the library under test (if
the innerq package can load it) from contexts on OUT/state.gguf as fuzz-state.c makes them, the
first byte naming the cache type; grammar: llama.cpp's example grammars (tests/peer/grammars)
and JSON schemas, each with a text, in fuzz_grammar.py's layout.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent.parent / "python"))  # innerq of this checkout
import tiny_model  # noqa: E402
from tiny_model import TinyConfig  # noqa: E402

KLD_MAGIC, KLD_VERSION, KLD_RANGE = b"IQKLBASE", 1, 32.0

TEXTS = [
    b"Hello, world!", b"The capital of France is", b"  leading and  double  spaces\n\ttabs\r\n",
    "café naïve Ångström 中文 日本語 👍👨‍👩‍👧‍👦 🇫🇷".encode(), b"I'M you'Re WE'VE don't 12345 3.14159",
    b"<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", b"\x80\xff\xfe\xc0\xc1\xf5 broken \xe2\x82 utf8 \xed\xa0\x80",
    b"\x00\x01\x04\x06\x13\x7f", b"def f(x):\n    return x ** 2  # square\n",
]


def kld_base(n_ctx: int, n_vocab: int, n_chunks: int, seed: int) -> bytes:
    """A base file as innerq-perplexity writes it, of random log-probabilities."""
    rng = np.random.default_rng(seed)
    out = KLD_MAGIC + struct.pack("<I3id", KLD_VERSION, n_ctx, n_vocab, n_chunks, KLD_RANGE)
    out += rng.integers(0, n_vocab, n_chunks * n_ctx, dtype=np.int32).tobytes()
    for _ in range(n_chunks * (n_ctx - 1 - n_ctx // 2)):
        logits = rng.standard_normal(n_vocab) * 3
        lp = logits - np.log(np.exp(logits).sum())
        top = int(lp.argmax())
        lo = lp[top] - KLD_RANGE
        code = np.clip(np.floor((lp - lo) * 65535.0 / KLD_RANGE + 0.5), 0, 65535).astype(np.uint16)
        out += struct.pack("<ddi", float(-lp[0]), float(lo), top) + code.tobytes()
    return out


def main(out: Path) -> None:
    for d in ("gguf", "tokenizer", "kld-base"):
        (out / d).mkdir(parents=True, exist_ok=True)
    small = dict(n_layer=1, n_head=1, n_head_kv=1, head_dim=16, n_ctx_train=64, tied=True)
    configs = {
        "f32": TinyConfig(**small),
        "q4_0-gqa": TinyConfig(**{**small, "n_head": 2}, wtype="Q4_0"),
        "q8_0-rope": TinyConfig(**{**small, "head_dim": 32}, wtype="Q8_0", rope_freqs=True),
        "f16-2layers-output": TinyConfig(**{**small, "n_layer": 2, "tied": False}, wtype="F16"),
    }
    for name, cfg in configs.items():
        tiny_model.write_tiny_model(out / "gguf" / f"{name}.gguf", cfg)
    tiny_model.write_tiny_model(out / "tiny.gguf", TinyConfig(**small))
    for i, text in enumerate(TEXTS):
        for flags in (0, 3):  # plain; add_special + parse_special
            (out / "tokenizer" / f"{i}-{flags}").write_bytes(bytes([flags]) + text)
    for n_ctx, n_vocab, n_chunks in ((4, 8, 1), (8, 5, 2), (6, 32, 1)):
        (out / "kld-base" / f"{n_ctx}x{n_vocab}x{n_chunks}").write_bytes(kld_base(n_ctx, n_vocab, n_chunks, n_ctx))
    grammars(out)
    states(out)


# fuzz-state.c's contexts: the cache types by first byte, and their parameters
STATE_KINDS = ["innerq", "kivi2", "f16", "q4_0"]
STATE_PARAMS = dict(n_ctx=256, n_batch=16, n_threads=1, kv_group=32, kv_sink=8, kv_recent=16)


def states(out: Path) -> None:
    model = tiny_model.write_tiny_model(out / "state.gguf", TinyConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim=32,
                                                                       n_ctx_train=256, tied=True))
    try:
        from innerq._native import ContextHandle, ModelHandle
    except Exception as e:  # the library is not built: the target starts from nothing
        print(f"make_corpus: no state seeds ({e})", file=sys.stderr)
        return
    (out / "state").mkdir(parents=True, exist_ok=True)
    m = ModelHandle.load(model)
    for i, kind in enumerate(STATE_KINDS):
        ctx = ContextHandle.init(m, kv_k=kind, **STATE_PARAMS)
        for calls in ([], [5], [40, 1, 1], [70]):  # empty, sink only, window, past the first flush
            ctx.truncate(0)
            for n in calls:
                ctx.decode([3 + (7 * j) % 60 for j in range(n)])
            (out / "state" / f"{kind}-{sum(calls)}").write_bytes(bytes([i]) + ctx.save_state())


# fuzz_grammar.py's seeds: (JSON schema, a text it accepts or not)
GRAMMAR_SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
      "required": ["name"]}, '{"name": "x", "tags": ["a"]}'),
    ({"type": "object", "properties": {f"p{i}": {"type": ["number", "null"]} for i in range(6)}}, '{"p1": 1.5e3}'),
    ({"$defs": {"n": {"type": "object", "properties": {"v": {"const": 1}, "k": {"type": "array",
                                                                                  "items": {"$ref": "#/$defs/n"}}}}},
      "$ref": "#/$defs/n"}, '{"v": 1, "k": [{"v": 1}]}'),
    ({"anyOf": [{"enum": ["a", 2, None]}, {"type": "boolean"}]}, "true"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "minLength": 2}]}, '[1, "ab"]'),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {}}, "required": ["b"]}]},
     '{"a": 1, "b": [null]}'),
]


def grammars(out: Path) -> None:
    d = out / "grammar"
    d.mkdir(parents=True, exist_ok=True)
    for path in sorted((Path(__file__).resolve().parent.parent / "peer" / "grammars").glob("*.gbnf")):
        (d / path.stem).write_bytes(b"\0" + path.read_bytes() + b"\0" + b'{"a": [1, "x"]}')
    for i, (schema, text) in enumerate(GRAMMAR_SCHEMAS):
        (d / f"schema-{i}").write_bytes(b"\1" + json.dumps(schema).encode() + b"\0" + text.encode())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
