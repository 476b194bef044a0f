"""Long-range copy (induction) accuracy of a KV cache at a model's full context.

Random token sequences are shown early in the context (after the sink window, so that a
quantized cache holds them quantized), natural text fills the context, and the sequences are
shown again, in another order, at its end. Each token of a repeat after its first is a
prediction the model can only get right by copying from the early copy: the score is how many
of them the greedy next token gets right, with each cache against f16's. The early copy sits
n_ctx - 2 n_seqs seq_len tokens before the repeats.

    python tools/copy_test.py -m MODEL -c 8192 --kv f16,innerq,innerq2,innerq4 [--trials 2]

prints one row per cache: effective bits per element at n_ctx, correct / predictions,
accuracy, and its difference from f16's in points. --kv takes cache names, or NAME@k=v,k=v for
context parameters (e.g. innerq@kv_bits=4.5).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from innerq._native import ContextHandle  # noqa: E402
from innerq.gguf_model import Model  # noqa: E402

FIRST_COPY = 256  # where the sequences start: after the default sink (at most 128 tokens)


def cache_params(spec: str) -> dict:
    """"innerq2" -> kv_k = kv_v = innerq2; "innerq@kv_bits=4.5,kv_sink=32" adds parameters;
    kv_layer_bits' items are separated by ';' there ("innerq@kv_layer_bits=0:4:3;1:4:2")."""
    name, _, extra = spec.partition("@")
    params = {"kv_k": name, "kv_v": name}
    for item in filter(None, extra.split(",")):
        key, _, value = item.partition("=")
        params[key] = value.replace(";", ",") if key == "kv_layer_bits" else float(value) if "." in value else int(value)
    return params


def cache_specs(text: str) -> list[str]:
    """--kv's comma-separated caches, where an item k=v without @ adds to the cache before it:
    "f16,innerq@kv_bits=4.5,kv_sink=32" -> ["f16", "innerq@kv_bits=4.5,kv_sink=32"]."""
    specs: list[str] = []
    for item in filter(None, text.split(",")):
        if "=" in item and "@" not in item and specs and "@" in specs[-1]:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def layout(model: Model, filler: list[int], n_ctx: int, n_seqs: int, seq_len: int, seed: int):
    """(prefix tokens, repeat tokens, the repeats' sequences in order): BOS and text up to
    FIRST_COPY, the sequences, text up to the repeats, the repeats in a shuffled order."""
    rng = np.random.default_rng(seed)
    # ordinary tokens: past the control ids at the start of the vocabulary
    seqs = rng.integers(1000, model.n_vocab, size=(n_seqs, seq_len)).tolist()
    head = ([model.token_bos()] if model.add_bos else [])
    shown = [t for s in seqs for t in s]
    n_fill = n_ctx - FIRST_COPY - 2 * len(shown)
    if n_fill < 0 or len(filler) < FIRST_COPY + n_fill:
        raise SystemExit(f"copy test: n_ctx {n_ctx} holds no {n_seqs} x {seq_len} tokens twice, or the text is short")
    start = int(rng.integers(0, len(filler) - FIRST_COPY - n_fill + 1))
    text = filler[start:start + FIRST_COPY + n_fill]
    prefix = head + text[:FIRST_COPY - len(head)] + shown + text[FIRST_COPY:]
    order = rng.permutation(n_seqs).tolist()
    repeats = [seqs[i] for i in order]
    return prefix, [t for s in repeats for t in s], repeats


def filler_tokens(model: Model, path: Path, n_ctx: int) -> list[int]:
    """The text's tokens, enough to fill n_ctx (about 12 characters a token at most)."""
    return model.tokenize(path.read_text()[:12 * n_ctx], add_bos=False)


def copy_accuracy(model: Model, params: dict, filler: list[int], n_ctx: int, n_seqs: int, seq_len: int,
                  seed: int) -> tuple[int, int, float]:
    """(correct, predictions, effective bits at n_ctx) of one trial with one cache."""
    prefix, tail, repeats = layout(model, filler, n_ctx, n_seqs, seq_len, seed)
    ctx = ContextHandle.init(model.handle, n_ctx=n_ctx, **params)
    ctx.decode(prefix)
    ctx.set_batch_mode(logits_all=True)
    ctx.decode(tail)
    correct = total = 0
    for k, seq in enumerate(repeats):
        for j in range(seq_len - 1):  # the logits after token j of the repeat predict token j + 1
            correct += int(np.argmax(ctx.logits(k * seq_len + j)) == seq[j + 1])
            total += 1
    return correct, total, ctx.kv_memory()["bits"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-c", "--n-ctx", type=int, default=0, help="context (default 0: the model's training context)")
    ap.add_argument("--kv", default="f16,innerq", help="caches, comma-separated (the first is the reference)")
    ap.add_argument("--n-seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=1, help="layouts (seeds 0 ..), each with every cache")
    ap.add_argument("-f", "--filler", default=str(ROOT / "tests/data/sense-and-sensibility.txt"))
    ap.add_argument("-t", "--threads", type=int, default=0)
    a = ap.parse_args(argv)
    with Model(a.model) as model:
        n_ctx = a.n_ctx or model.n_ctx_train
        filler = filler_tokens(model, Path(a.filler), n_ctx)
        rows = []
        for spec in cache_specs(a.kv):
            params = {**cache_params(spec), "n_threads": a.threads}
            got = [copy_accuracy(model, params, filler, n_ctx, a.n_seqs, a.seq_len, s) for s in range(a.trials)]
            correct, total = sum(g[0] for g in got), sum(g[1] for g in got)
            rows.append((spec, got[0][2], correct, total))
        ref = rows[0][2] / rows[0][3]
        print(f"copy test: n_ctx {n_ctx}, {a.n_seqs} sequences of {a.seq_len} random tokens x {a.trials} trials, "
              f"first copy at {FIRST_COPY}, repeats in the last {a.n_seqs * a.seq_len} tokens")
        print(f"| cache | effective bits | correct | accuracy | vs {rows[0][0]} (points) |")
        print("|---|---:|---:|---:|---:|")
        for spec, bits, correct, total in rows:
            acc = correct / total
            print(f"| {spec} | {bits:.3f} | {correct} / {total} | {100 * acc:.2f} % | {100 * (acc - ref):+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
