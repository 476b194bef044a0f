"""Writes a Llama GGUF of a named shape with random weights and a real tokenizer.

Speed runs of large shapes (a 7B-class GGUF is several GB) need the shape, not the trained
weights: this writes the llama.* hyper-parameters of the shape, the tokenizer.* keys copied
from another GGUF (so prompts tokenize as with a real model), and random weights of the
given type, streamed tensor by tensor so memory stays at one tensor.

    python tools/make_shape_gguf.py llama3-8b OUT.gguf --tokenizer SmolLM2.gguf --wtype Q4_0

Quantized weights are random codes with one scale for all blocks, chosen so that a weight has
about the standard deviation `--std` (activations then stay finite through every layer).
The token embedding table has as many rows as the tokenizer has tokens.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    rope_base: float
    tied: bool  # no output.weight: the output projection is token_embd


SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 8192, 100000.0, True),
    "llama3-8b": Shape(4096, 32, 32, 8, 14336, 131072, 500000.0, False),
    "llama2-7b": Shape(4096, 32, 32, 32, 11008, 4096, 10000.0, False),
}

# Types whose blocks start with one fp16 scale d (then m for the _1 types) before the codes.
QTYPES = {
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "F16": gguf.GGMLQuantizationType.F16,
}
# Code spread (standard deviation of the dequantized value per unit of d) of random codes.
CODE_STD = {"Q4_0": 4.6, "Q4_1": 4.6, "Q5_0": 9.2, "Q5_1": 9.2, "Q8_0": 73.9}


def tokenizer_fields(path: Path):
    """(key, value, type, sub type) of every tokenizer.* key of a GGUF file."""
    r = gguf.GGUFReader(path)
    out = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), f.types[0], sub))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    return out, n_vocab


def add_llama_hparams(w: gguf.GGUFWriter, n_layer: int, n_ctx_train: int, n_embd: int, n_ff: int, n_head: int,
                      n_head_kv: int, rope_base: float, n_rot: int, rms_eps: float) -> None:
    """The llama.* hyper-parameters innerq reads (also used by tests/tiny_model.py)."""
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(n_rot)
    w.add_layer_norm_rms_eps(rms_eps)


def random_weight(rng: np.random.Generator, wtype: str, n_rows: int, n_cols: int, std: float) -> np.ndarray:
    """Bytes of a [n_rows, n_cols] weight (GGUF ne = [n_cols, n_rows]) of type wtype."""
    if wtype == "F16":
        return (rng.standard_normal((n_rows, n_cols), dtype=np.float32) * std).astype(np.float16)
    qt = QTYPES[wtype]
    blck, size = gguf.GGML_QUANT_SIZES[qt]
    n_blocks = n_rows * n_cols // blck
    raw = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    d = np.float16(std / CODE_STD[wtype])
    raw[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    if wtype in ("Q4_1", "Q5_1"):  # m = -(levels/2) * d centres the codes on zero
        m = np.float16(-(8.0 if wtype == "Q4_1" else 16.0) * float(d))
        raw[:, 2:4] = np.frombuffer(m.tobytes(), dtype=np.uint8)
    return raw.reshape(n_rows, n_cols // blck * size)


def write(shape_name: str, out: Path, tokenizer: Path, wtype: str, std: float, seed: int) -> None:
    s = SHAPES[shape_name]
    fields, n_vocab = tokenizer_fields(tokenizer)
    rng = np.random.default_rng(seed)
    head_dim = s.n_embd // s.n_head
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random {shape_name} {wtype}")
    add_llama_hparams(w, s.n_layer, s.n_ctx_train, s.n_embd, s.n_ff, s.n_head, s.n_head_kv, s.rope_base, head_dim, 1e-5)
    w.add_vocab_size(n_vocab)
    for key, val, vtype, sub in fields:
        w.add_key_value(key, val, vtype, sub)

    # (name, rows, cols, type): a 2-D weight of PyTorch shape (rows, cols); norms are F32 rows.
    kv = s.n_head_kv * head_dim
    tensors = [("token_embd.weight", n_vocab, s.n_embd, wtype)]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", 1, s.n_embd, "F32"),
                    (b + "attn_q.weight", s.n_embd, s.n_embd, wtype),
                    (b + "attn_k.weight", kv, s.n_embd, wtype),
                    (b + "attn_v.weight", kv, s.n_embd, wtype),
                    (b + "attn_output.weight", s.n_embd, s.n_embd, wtype),
                    (b + "ffn_norm.weight", 1, s.n_embd, "F32"),
                    (b + "ffn_gate.weight", s.n_ff, s.n_embd, wtype),
                    (b + "ffn_up.weight", s.n_ff, s.n_embd, wtype),
                    (b + "ffn_down.weight", s.n_embd, s.n_ff, wtype)]
    tensors.append(("output_norm.weight", 1, s.n_embd, "F32"))
    if not s.tied:
        tensors.append(("output.weight", n_vocab, s.n_embd, wtype))

    for name, rows, cols, t in tensors:
        if t == "F32":
            w.add_tensor_info(name, [cols], np.dtype(np.float32), cols * 4)
        elif t == "F16":
            w.add_tensor_info(name, [rows, cols], np.dtype(np.float16), rows * cols * 2)
        else:
            blck, size = gguf.GGML_QUANT_SIZES[QTYPES[t]]
            w.add_tensor_info(name, [rows, cols // blck * size], np.dtype(np.uint8), rows * cols // blck * size,
                              raw_dtype=QTYPES[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, rows, cols, t in tensors:
        if t == "F32":
            w.write_tensor_data(np.ones(cols, dtype=np.float32))
        else:
            w.write_tensor_data(random_weight(rng, t, rows, cols, std))
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="GGUF whose tokenizer.* keys are copied")
    ap.add_argument("--wtype", default="Q4_0", choices=sorted(QTYPES))
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of a weight")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not a.tokenizer.is_file():
        ap.error(f"{a.tokenizer}: no such file")
    write(a.shape, a.out, a.tokenizer, a.wtype, a.std, a.seed)
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
