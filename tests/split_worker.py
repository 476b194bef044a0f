"""A model split between two devices, checked against the CPU alone; run by tests/test_split.py
in a process of its own with INNERQ_LIB set to libinnerq_test.so.

The library's test switch device_test_split_on_cpu puts a split's GPU layers on a second CPU
device: the graph is cut into splits over two backends, the hidden state, the positions and
the step's rows are copied at the boundaries, each device holds its layers' weights and KV
cache (and its own page table and rotation), exactly as with a GPU. The kernels are the CPU's
on both sides, so every logit must equal the CPU-only run's bit for bit; a wrong copy, a stale
page table or a layer's cache on the wrong device shows as a difference.

Usage: split_worker.py MODEL.gguf CASES.json, CASES a list of {"ngl": [..], "cache": {context
params}, "seqs": bool, "n_batch": int (24)}: with n_batch 64 the prompt's batches of 64 and
more tokens run the CPU layers' products on the second device (the offload rule). Prints one line per case; exits non-zero at the first difference.
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
ffi.cdef("void device_test_split_on_cpu(_Bool on);")
ffi.dlopen(os.environ["INNERQ_LIB"]).device_test_split_on_cpu(True)


def run(path: str, ngl: int, cache: dict, seqs: bool, n_batch: int) -> np.ndarray:
    """Logits of a schedule: two prompts of different lengths read together, steps decoding
    both, then (seqs) a copy of a sequence, a cut one, a sequence's state saved and loaded
    into another, and steps on all of them."""
    m = ModelHandle.load(path, n_gpu_layers=ngl)
    n_vocab = lib.innerq_model_n_vocab(m.ptr)
    ctx = ContextHandle.init(m, n_ctx=512, n_seq_max=4, n_batch=n_batch, n_threads=2, **cache)
    out = []

    def step(parts):
        schedule_steps.step(ctx, out, parts)

    step([(0, toks(70, 1, n_vocab)), (1, toks(9, 2, n_vocab))])
    for k in range(6):
        step([(0, toks(1, 10 + k, n_vocab)), (1, toks(1, 20 + k, n_vocab))])
    if seqs:
        ctx.seq_cp(0, 2)
        ctx.seq_rm(1, 12)
        ctx.load_seq_state(3, ctx.save_seq_state(0))
        for k in range(4):
            step([(s, toks(1, 30 + 4 * k + s, n_vocab)) for s in range(4)])
    return np.stack(out)


def main() -> int:
    path, cases = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    for case in cases:
        n_batch = case.get("n_batch", 24)
        want = run(path, 0, case["cache"], case["seqs"], n_batch)
        for ngl in case["ngl"]:
            got = run(path, ngl, case["cache"], case["seqs"], n_batch)
            if not np.array_equal(got, want):
                diff = np.abs(got - want)
                print(f"DIFFERENT ngl={ngl} cache={case['cache']}: max {diff.max()} at row "
                      f"{int(np.argwhere(diff > 0)[0][0])} of {len(want)}")
                return 1
            print(f"equal ngl={ngl} cache={case['cache']} rows={len(want)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
