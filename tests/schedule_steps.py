"""Steps of several sequences at once, for the workers that compare two runs logit for logit
(tests/split_worker.py, tests/window_worker.py)."""
from __future__ import annotations

import numpy as np


def toks(n: int, seed: int, n_vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, n_vocab - 1, n)]


def step(ctx, out: list, parts) -> None:
    """One decode_batch of parts [(sequence, tokens), ...], one sequence after the other;
    every token's logits appended to out."""
    tokens = [t for _, ts in parts for t in ts]
    ids = [s for s, ts in parts for _ in ts]
    ctx.decode_batch(tokens, ids, logits=[True] * len(tokens))
    out.extend(ctx.logits(i) for i in range(len(tokens)))
