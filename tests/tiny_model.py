"""Tiny random Llama models written as GGUF files, for testing the forward pass.

The files look like what llama.cpp's converter writes for the llama architecture: the
llama.* hyper-parameters, a small byte-level BPE (gpt2) vocabulary, and tensors named
token_embd / blk.N.* / output_norm / output (optional: tied to token_embd when absent) /
rope_freqs (optional). A weight of PyTorch shape (out, in) is stored as a numpy array of
shape (out, in), i.e. GGUF ne = [in, out]. Q/K rows are taken to be already in the order
of RoPE NORMAL mode (adjacent pairs), as the converter leaves them; with random weights no
permutation is needed.

    python tests/tiny_model.py OUT.gguf --wtype Q4_0 --head-dim 32 --n-head-kv 2
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from make_shape_gguf import add_llama_hparams  # noqa: E402

QTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
}

FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
# A few merges so the BPE has something to do; each merged token is appended to the vocabulary.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "Ġ a", "o n", "Ġ s", "r e"]


@dataclass(frozen=True)
class TinyConfig:
    wtype: str = "F32"        # type of the 2-D weights (norms and rope_freqs stay F32)
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4        # < n_head: grouped-query attention
    head_dim: int = 16
    n_ff: int = 0             # 0: 3/2 * n_embd rounded up to 32
    n_ctx_train: int = 512
    tied: bool = False        # no output.weight: the output projection is token_embd
    rope_freqs: bool = False  # write rope_freqs.weight (per-pair frequency divisors)
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    pooling_type: int | None = None  # llama.pooling_type (llama.cpp's enum); absent in LLM GGUFs

    @property
    def n_embd(self) -> int:
        return self.n_head * self.head_dim

    @property
    def ff(self) -> int:
        return self.n_ff or (3 * self.n_embd // 2 + 31) // 32 * 32


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, indexed by byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocab_tokens() -> tuple[list[str], list[int]]:
    tokens = SPECIAL_TOKENS + byte_symbols() + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, [int(t) for t in types]


def _random_tensors(cfg: TinyConfig, n_vocab: int) -> dict[str, np.ndarray]:
    """f32 weights scaled so activations stay O(1) through the layers (std 1/sqrt(fan_in))."""
    rng = np.random.default_rng(cfg.seed)
    e, ff, hd = cfg.n_embd, cfg.ff, cfg.head_dim

    def mat(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": rng.standard_normal((n_vocab, e)).astype(np.float32)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(e)
        t[p + "attn_q.weight"] = mat(cfg.n_head * hd, e)
        t[p + "attn_k.weight"] = mat(cfg.n_head_kv * hd, e)
        t[p + "attn_v.weight"] = mat(cfg.n_head_kv * hd, e)
        t[p + "attn_output.weight"] = mat(e, cfg.n_head * hd)
        t[p + "ffn_norm.weight"] = norm(e)
        t[p + "ffn_gate.weight"] = mat(ff, e)
        t[p + "ffn_up.weight"] = mat(ff, e)
        t[p + "ffn_down.weight"] = mat(e, ff)
    t["output_norm.weight"] = norm(e)
    if not cfg.tied:
        t["output.weight"] = mat(n_vocab, e)
    if cfg.rope_freqs:
        # Llama 3 style divisors: 1 for high frequencies, up to 8 for the lowest.
        t["rope_freqs.weight"] = np.linspace(1.0, 8.0, hd // 2).astype(np.float32)
    return t


def _add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, wtype: str) -> None:
    if data.ndim == 1 or wtype == "F32":
        w.add_tensor(name, data)
    elif wtype == "F16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        qtype = QTYPES[wtype]
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def write_tiny_model(path: str | Path, cfg: TinyConfig = TinyConfig()) -> Path:
    """Writes a random llama model described by cfg to path and returns the path."""
    if cfg.wtype not in QTYPES:
        raise ValueError(f"unknown weight type {cfg.wtype}; one of {', '.join(QTYPES)}")
    if cfg.n_head % cfg.n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    tokens, types = vocab_tokens()
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_file_type(int(FILE_TYPES[cfg.wtype]))
    add_llama_hparams(w, cfg.n_layer, cfg.n_ctx_train, cfg.n_embd, cfg.ff, cfg.n_head, cfg.n_head_kv, cfg.rope_base,
                      cfg.head_dim, cfg.rms_eps)
    if cfg.pooling_type is not None:
        w.add_pooling_type(gguf.PoolingType(cfg.pooling_type))
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the name llama.cpp gives the GPT-2 pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    for name, data in _random_tensors(cfg, len(tokens)).items():
        _add_tensor(w, name, data, cfg.wtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_converted_model(src: str | Path, dst: str | Path, wtype: str = "F32") -> Path:
    """Copies a GGUF model with every 2-D weight converted to wtype (F32: the model exactly
    as its quantized weights dequantize), so a real model can be checked without
    activation rounding in the products."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    dst = Path(dst)
    w = gguf.GGUFWriter(str(dst), arch)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    w.add_file_type(int(FILE_TYPES[wtype]))
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        _add_tensor(w, t.name, data, wtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    defaults = asdict(TinyConfig())
    for key, value in defaults.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, type=type(value), default=value)
    args = vars(ap.parse_args())
    out = args.pop("out")
    print(write_tiny_model(out, TinyConfig(**args)))


if __name__ == "__main__":
    main()
