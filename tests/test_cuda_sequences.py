"""Many sequences in one context on the GPU (docs/DESIGN.md 3.6): innerq_decode_batch and
innerq_seq_* with every layer on the CUDA backend, tests/test_sequences.py's schedules and calls.

* Sequences that read their prompts (steps of 9 to 64 tokens) and then decode together (up to 8
  at once, and steps of 40 decoding sequences), some on a copied prefix, one cut back by a remove
  (its pages then lie anywhere in the pool), get the logits each gets alone on the GPU, bit for
  bit: the attention cuts a sequence by its own length and the context's shapes only, and a
  product of up to 64 columns takes the matvec, whose sums of a column are the same at any
  width. F32 and Q4_0 weights (the generic matvec and the 32-element formats' one); plain and
  quantized caches, the quantized ones with the CTA kernel (a small pool) and the warp kernel (a
  pool whose slots reach 4096 tokens).
* Mixed steps (prompt chunks of any length next to decoding sequences, decode semantics on and
  off): close to each sequence alone. Not the same bits: a product of more than 64 columns
  takes the tensor-core GEMM (f16 operands), where a token alone takes the matvec, so a token's
  logits move by that rounding when its step holds more than 64 tokens: measured 3.7e-4 to
  4.8e-4 of the logits' scale on the H200 (every cache type here), 2e-3 allowed.
* The GPU's batched logits are the CPU's within the GPU's product rounding (measured 6.2e-4 of
  the scale with f16, 9.0e-3 with InnerQ, whose decode kernels on each round the query and the
  probabilities their own way).

Skipped without a GPU (INNERQ_LIB must be a CUDA build).
"""
from __future__ import annotations

import numpy as np
import pytest

import innerq
import tiny_model
from test_sequences import make, run, schedule, toks
from tiny_model import TinyConfig

from innerq._native import ModelHandle  # noqa: E402

GPU = innerq.cuda_device_count() > 0
pytestmark = pytest.mark.skipif(not GPU, reason="the loaded library has no CUDA backend or sees no device")

CFG = TinyConfig(head_dim=64, n_head=4, n_head_kv=2, n_layer=2, seed=9)
# kind (test_sequences.CACHES) and pool: n_ctx, n_seq_max. "innerq-big": slots of 4608 tokens,
# so that decoding takes the quantized cache's warp kernel (qattention-mma.cu).
KINDS = {"f16": ("f16", 2048), "q8_0": ("q8_0", 2048), "innerq": ("innerq", 2048), "kivi2": ("kivi2", 2048),
         "innerq-big": ("innerq", 8 * 4608)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("cseq") / "m.gguf", CFG)


@pytest.fixture(scope="module")
def gpu_model(paths):
    return ModelHandle.load(paths, n_gpu_layers=-1)


@pytest.fixture(scope="module")
def gpu_model_q4(tmp_path_factory):
    cfg = TinyConfig(**{**CFG.__dict__, "wtype": "Q4_0"})
    return ModelHandle.load(tiny_model.write_tiny_model(tmp_path_factory.mktemp("cseq4") / "m.gguf", cfg),
                            n_gpu_layers=-1)


@pytest.fixture(scope="module")
def cpu_model(paths):
    return ModelHandle.load(paths)


def ctx_of(model, name, decode_semantics=False, n_seq=8):
    kind, n_ctx = KINDS[name]
    return make(model, kind, n_seq, n_ctx=n_ctx * n_seq // 8, decode_semantics=decode_semantics)


# Prompts of 9 to 24 tokens (one chunk each, n_batch 24), in steps of 9 to 64 tokens, then
# decoding steps of at most 8 sequences of one token.
LENGTHS = [9, 24, 13, 17, 10, 20, 11, 15]


def decode_calls(seqs, steps, seed):
    return [[(s, toks(1, seed + 100 * i + s)) for s in seqs] for i in range(steps)]


def play(ctx, script, only=None):
    """Runs a script of calls (lists of parts, see test_sequences.run) and ("cp", src, dst, p1)
    / ("rm", seq, p0) operations; with `only`, the parts and operations of that sequence alone,
    and the parts of a copy's source up to the copy. {seq: its logits in order}."""
    out, need = {}, None
    if only is not None:
        need = {only} | {op[1] for op in script if isinstance(op, tuple) and op[0] == "cp" and op[2] == only}
    for op in script:
        if isinstance(op, tuple):
            if op[0] == "cp" and (need is None or op[2] in need):
                ctx.seq_cp(op[1], op[2], 0, op[3])
                need = {only} if need is not None else None  # the source is not evaluated further
            elif op[0] == "rm" and (need is None or op[1] in need):
                ctx.seq_rm(op[1], op[2], -1)
            continue
        parts = [p for p in op if need is None or p[0] in need]
        if parts:
            for s, lg in run(ctx, [parts]).items():
                out.setdefault(s, []).append(lg)
    return {s: np.concatenate(v) for s, v in out.items()}


def script_of():
    """Seven prompts; sequence 7 copies sequence 1's first 20 tokens and goes on from there; two
    more chunks for every sequence (past the first flush of the small InnerQ windows: quantized
    blocks in pages taken by turns); sequence 2 cut back to 5 tokens (its freed pages go to the
    others) reads 12 more; steps of 8, 5 and 8 decoding sequences between."""
    script = [[(s, toks(LENGTHS[s], 300 + s)) for s in range(4)], [(s, toks(LENGTHS[s], 300 + s)) for s in range(4, 7)]]
    script += [("cp", 1, 7, 20), [(7, toks(10, 377))]]
    script += decode_calls(range(8), 3, 1000)
    for r in range(2):
        for half in (range(4), range(4, 8)):
            script += [[(s, toks(LENGTHS[(s + 3 * r + 1) % 8], 500 + 10 * r + s)) for s in half]]
    script += [("rm", 2, 5), [(2, toks(12, 402))]]
    script += decode_calls([0, 2, 3, 5, 7], 4, 2000)
    script += decode_calls(range(8), 6, 3000)
    return script


def test_the_script_steps_take_the_matvec():
    assert max(sum(len(p[1]) for p in op) for op in script_of() if not isinstance(op, tuple)) <= 64


@pytest.mark.parametrize("wtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("name", list(KINDS))
def test_decoding_sequences_get_the_bits_they_get_alone(gpu_model, gpu_model_q4, name, wtype):
    model = gpu_model if wtype == "F32" else gpu_model_q4
    script = script_of()
    together = play(ctx_of(model, name), script)
    assert sorted(together) == list(range(8))
    for s in range(8):
        alone = play(ctx_of(model, name), script, only=s)[s]
        np.testing.assert_array_equal(together[s], alone, err_msg=f"{name}: sequence {s}")


@pytest.mark.parametrize("wtype", ["F32", "Q4_0"])
@pytest.mark.parametrize("name", ["f16", "innerq", "kivi2"])
def test_wide_decoding_steps_get_the_bits_they_get_alone(gpu_model, gpu_model_q4, name, wtype):
    """40 sequences decoding together (products of 40 columns, the matvec in tiles of columns),
    every fifth one on a copy of sequence 0's prompt: the bits of each alone."""
    model, n = (gpu_model if wtype == "F32" else gpu_model_q4), 40
    script = [[(s, toks(LENGTHS[s % 8] + s // 8, 700 + s))] for s in range(n) if s % 5 != 4]
    script += [("cp", 0, s, LENGTHS[0]) for s in range(4, n, 5)]
    script += decode_calls(range(n), 5, 4000)
    together = play(ctx_of(model, name, n_seq=n), script)
    for s in (0, 3, 4, 17, 29, 39):
        alone = play(ctx_of(model, name, n_seq=n), script, only=s)[s]
        np.testing.assert_array_equal(together[s], alone, err_msg=f"{name}: sequence {s}")


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("decode_semantics", [False, True], ids=["batch", "decode-semantics"])
@pytest.mark.parametrize("name", ["f16", "innerq", "innerq-big", "kivi2"])
def test_mixed_steps_are_close_to_each_alone(gpu_model, name, decode_semantics):
    """test_sequences.schedule: prompts of 1 to 130 tokens in chunks, sequences joining while
    others decode. A token whose step holds more than 64 tokens goes through the GEMM's f16
    operands (the module's docstring: measured below 5e-4 of the logits' scale)."""
    calls = schedule(8)
    together = run(ctx_of(gpu_model, name, decode_semantics), calls)
    for s in range(8):
        alone = run(ctx_of(gpu_model, name, decode_semantics), calls, only=s)[s]
        assert rel(together[s], alone) <= 2e-3, (name, s, rel(together[s], alone))


@pytest.mark.parametrize("name", ["f16", "innerq", "innerq-big"])
def test_batched_sequences_are_close_to_the_cpu(gpu_model, cpu_model, name):
    """The scripted steps (copies, a remove, batched decoding) on the GPU and on the CPU: the
    GPU's logits within its products' rounding of the CPU's (test_cuda_model's bound); the same
    cache configuration on both (test_sequences.CACHES: G 32)."""
    script = script_of()
    kind, n_ctx = KINDS[name]
    gpu = play(make(gpu_model, kind, 8, n_ctx=n_ctx), script)
    cpu = play(make(cpu_model, kind, 8, n_ctx=n_ctx, kv_value_scales=0), script)  # the GPU's value blocks
    for s in range(8):
        assert rel(gpu[s], cpu[s]) <= 2e-2, (name, s, rel(gpu[s], cpu[s]))
