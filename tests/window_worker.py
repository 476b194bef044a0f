"""Sliding-window layers that keep no quantized blocks, checked against the same cache keeping
them; run by tests/test_window_cache.py in a process of its own with INNERQ_LIB set to
libinnerq_test.so.

A sliding-window layer of a quantized cache whose recent window holds the whole sliding window
reads every position it sees from the f16 sink and window, so it stores no blocks
(kv_config_window_only, docs/DESIGN.md 3.6). The library's test switch kv_test_window_blocks
makes such layers keep their blocks as the global layers do; the blocks are never read, so
every logit of a schedule must be the same bits either way (a block read by mistake, a flush
that moves the window wrongly or a state that loses rows shows as a difference).

Usage: window_worker.py MODEL.gguf CACHE.json, CACHE the context parameters of the cache.
Prints one JSON object: the schedule's logits equal or not, the memory and the layers' n_quant
of both, the state sizes.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import cffi
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from innerq._ffi import lib  # noqa: E402
from innerq._native import ContextHandle, ModelHandle  # noqa: E402
from schedule_steps import toks  # noqa: E402
import schedule_steps  # noqa: E402

ffi = cffi.FFI()
ffi.cdef("void kv_test_window_blocks(_Bool keep);")
switch = ffi.dlopen(os.environ["INNERQ_LIB"])


def run(m, n_vocab: int, cache: dict, keep_blocks: bool) -> dict:
    """Two prompts read together, steps decoding both, a copy, a shallow cut of one sequence,
    a sequence's state saved and loaded into another slot, steps on all of them."""
    switch.kv_test_window_blocks(keep_blocks)
    ctx = ContextHandle.init(m, n_ctx=1024, n_seq_max=4, n_batch=32, n_threads=2, **cache)
    switch.kv_test_window_blocks(False)
    out = []

    def step(parts):
        schedule_steps.step(ctx, out, parts)

    step([(0, toks(200, 1, n_vocab)), (1, toks(150, 2, n_vocab))])
    for k in range(40):
        step([(0, toks(1, 10 + k, n_vocab)), (1, toks(1, 60 + k, n_vocab))])
    ctx.seq_cp(0, 2)
    ctx.seq_rm(1, ctx.seq_pos_max(1) + 1 - 3)  # three tokens back: every layer keeps its rows
    kept = ctx.seq_pos_max(1) + 1
    state = ctx.save_seq_state(0)
    ctx.load_seq_state(3, state)
    for k in range(20):
        step([(s, toks(1, 100 * s + k, n_vocab)) for s in range(4)])
    n_layer = lib.innerq_model_n_layer(m.ptr)
    return {"logits": np.stack(out), "memory": ctx.kv_memory(), "kept": kept, "seq_state": len(state),
            "n_quant": [ctx.layer_info(il)["n_quant"] for il in range(n_layer)], "state": ctx.save_state()}


def main() -> None:
    path, cache = sys.argv[1], json.loads(sys.argv[2])
    m = ModelHandle.load(path)
    n_vocab = lib.innerq_model_n_vocab(m.ptr)
    kept, only = run(m, n_vocab, cache, True), run(m, n_vocab, cache, False)
    # a state of one layout does not load into a context of the other: a clear error
    switch.kv_test_window_blocks(False)
    ctx = ContextHandle.init(m, n_ctx=1024, n_seq_max=4, n_batch=32, n_threads=2, **cache)
    try:
        ctx.load_state(kept["state"])
        cross = "loaded"
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        cross = str(e)
    ctx.load_state(only["state"])
    print(json.dumps({
        "equal": bool(np.array_equal(kept["logits"], only["logits"])),
        "max_diff": float(np.abs(kept["logits"] - only["logits"]).max()),
        "memory": [kept["memory"], only["memory"]], "kept": [kept["kept"], only["kept"]],
        "n_quant": [kept["n_quant"], only["n_quant"]], "seq_state": [kept["seq_state"], only["seq_state"]],
        "state": [len(kept["state"]), len(only["state"])], "cross_load": cross,
    }))


if __name__ == "__main__":
    main()
