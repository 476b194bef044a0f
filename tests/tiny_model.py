"""Tiny random models written as GGUF files, for testing the forward pass.

The files look like what llama.cpp's converter writes for the architecture (llama, qwen2,
qwen3, gemma3, phi3): the ARCH.* hyper-parameters, a small byte-level BPE (gpt2) vocabulary,
and tensors named token_embd / blk.N.* / output_norm / output (optional: tied to token_embd
when absent) / rope_freqs (optional), with each architecture's own block tensors (qwen2's
q/k/v biases, qwen3's and gemma3's per-head q/k norms, gemma3's post-attention and post-
feed-forward norms, phi3's fused attn_qkv and gate/up). A weight of PyTorch shape (out, in) is
stored as a numpy array of shape (out, in), i.e. GGUF ne = [in, out]. With random weights the
order of Q/K rows needs no care (llama: NORMAL RoPE pairs; the others: NEOX pairs).

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
    "Q2_K": gguf.GGMLQuantizationType.Q2_K,
    "Q3_K": gguf.GGMLQuantizationType.Q3_K,
    "IQ4_NL": gguf.GGMLQuantizationType.IQ4_NL,
    "IQ4_XS": gguf.GGMLQuantizationType.IQ4_XS,
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
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "IQ4_NL": gguf.LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS,
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2
# A few merges so the BPE has something to do; each merged token is appended to the vocabulary.
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "Ġ a", "o n", "Ġ s", "r e"]


ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3")


@dataclass(frozen=True)
class TinyConfig:
    arch: str = "llama"       # general.architecture, one of ARCHS
    wtype: str = "F32"        # type of the 2-D weights (norms and rope_freqs stay F32)
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4        # < n_head: grouped-query attention
    head_dim: int = 16
    embd: int = 0             # n_embd; 0: n_head * head_dim (else written as key_length, as Qwen3's and Gemma 3's)
    n_ff: int = 0             # 0: 3/2 * n_embd rounded up to 32
    n_ctx_train: int = 512
    tied: bool = False        # no output.weight: the output projection is token_embd
    rope_freqs: bool = False  # write rope_freqs.weight (per-pair frequency divisors)
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    pooling_type: int | None = None  # llama.pooling_type (llama.cpp's enum); absent in LLM GGUFs
    sliding_window: int = 0   # gemma3: ARCH.attention.sliding_window (0: not written)
    swa_pattern: int = 0      # gemma3: ARCH.attention.sliding_window_pattern (0: not written, llama.cpp's 6)
    swa_layers: tuple = ()    # gemma3: ... or that key as a bool per layer (True: local), as newer converters write it
    rope_base_swa: float = 0.0  # gemma3: ARCH.rope.freq_base_swa (0: not written, llama.cpp's 10000)
    rope_scaling: str = ""    # ARCH.rope.scaling.type ("linear", "yarn"; "": not written)
    rope_factor: float = 0.0  # ARCH.rope.scaling.factor
    n_ctx_orig: int = 0       # ARCH.rope.scaling.original_context_length (0: not written)
    longrope: bool = False    # rope_factors_short / _long.weight (Phi-3's LongRoPE divisors)
    rope_attn_factor: float = 0.0  # ARCH.rope.scaling.attn_factor (0: not written)
    n_rot: int = 0            # ARCH.rope.dimension_count (0: head_dim); < head_dim: partly rotated heads (Phi-4-mini)

    @property
    def n_embd(self) -> int:
        return self.embd or self.n_head * self.head_dim

    @property
    def ff(self) -> int:
        return self.n_ff or (3 * self.n_embd // 2 + 31) // 32 * 32

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim


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
    e, ff, hd, rot = cfg.n_embd, cfg.ff, cfg.head_dim, cfg.rot

    def mat(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.5 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": rng.standard_normal((n_vocab, e)).astype(np.float32)}
    if cfg.arch == "gemma3":
        t["token_embd.weight"] /= np.sqrt(e)  # the graph scales it back by sqrt(n_embd)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(e)
        q, k, v = mat(cfg.n_head * hd, e), mat(cfg.n_head_kv * hd, e), mat(cfg.n_head_kv * hd, e)
        if cfg.arch == "phi3":
            t[p + "attn_qkv.weight"] = np.concatenate([q, k, v])
        else:
            t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"] = q, k, v
        if cfg.arch == "qwen2":
            t[p + "attn_q.bias"], t[p + "attn_k.bias"] = bias(cfg.n_head * hd), bias(cfg.n_head_kv * hd)
            t[p + "attn_v.bias"] = bias(cfg.n_head_kv * hd)
        if cfg.arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(hd), norm(hd)
        t[p + "attn_output.weight"] = mat(e, cfg.n_head * hd)
        if cfg.arch == "gemma3":
            t[p + "post_attention_norm.weight"] = norm(e)
        t[p + "ffn_norm.weight"] = norm(e)
        gate, up = mat(ff, e), mat(ff, e)
        if cfg.arch == "phi3":
            t[p + "ffn_up.weight"] = np.concatenate([gate, up])
        else:
            t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = gate, up
        t[p + "ffn_down.weight"] = mat(e, ff)
        if cfg.arch == "gemma3":
            t[p + "post_ffw_norm.weight"] = norm(e)
    t["output_norm.weight"] = norm(e)
    if not cfg.tied:
        t["output.weight"] = mat(n_vocab, e)
    if cfg.rope_freqs:
        # Llama 3 style divisors: 1 for high frequencies, up to 8 for the lowest.
        t["rope_freqs.weight"] = np.linspace(1.0, 8.0, rot // 2).astype(np.float32)
    if cfg.longrope:
        t["rope_factors_short.weight"] = np.linspace(1.0, 2.0, rot // 2).astype(np.float32)
        t["rope_factors_long.weight"] = np.linspace(1.0, 16.0, rot // 2).astype(np.float32)
    return t


# ---- block formats gguf.quants can read but not write: plain round-to-nearest quantizers ----
# (not llama.cpp's error-minimizing ones: any valid blocks make a valid test model)

IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to fp16: (its bytes, its float32 value)."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(*x.shape[:-1], -1), h.astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _pack_k2(q: np.ndarray) -> np.ndarray:
    """q2_K / q3_K codes 0..3 of blocks (nb, 256) -> qs (nb, 64): element 128 h + 32 j + l in
    bits 2j, 2j+1 of byte 32 h + l."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(-1, 64)


def _quantize_q2_K(b: np.ndarray) -> np.ndarray:
    g = b.reshape(-1, 16, 16)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    d_raw, dmin_raw = ((hi - lo) / 3).max(-1, keepdims=True) / 15, (-lo).max(-1, keepdims=True) / 15
    (d_bytes, d), (m_bytes, dmin) = _fp16(d_raw), _fp16(dmin_raw)
    sc = np.clip(np.rint(_div((hi - lo) / 3, d)), 0, 15)
    mn = np.clip(np.rint(_div(-lo, dmin)), 0, 15)
    q = np.clip(np.rint(_div(g + (dmin * mn)[..., None], (d * sc)[..., None])), 0, 3)
    scales = (sc + 16 * mn).astype(np.uint8)
    return np.concatenate([scales, _pack_k2(q.reshape(-1, 256)), d_bytes, m_bytes], axis=1)


def _quantize_q3_K(b: np.ndarray) -> np.ndarray:
    g = b.reshape(-1, 16, 16)
    scale = _signed_absmax(g) / -4
    d_bytes, d = _fp16(np.abs(scale).max(-1, keepdims=True) / 31)
    sc = np.clip(np.rint(_div(scale, d)), -32, 31)
    q = np.clip(np.rint(_div(g, (d * sc)[..., None])), -4, 3).reshape(-1, 256) + 4
    hmask = ((q >= 4).reshape(-1, 2, 4, 32).astype(np.uint8) << np.array([[0], [4]], np.uint8)[None, :, :, None]
             << np.arange(4, dtype=np.uint8)[None, None, :, None]).sum((1, 2), dtype=np.uint8)
    s6 = (sc + 32).astype(np.uint8)
    low = (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4)
    high = ((s6 >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(1, dtype=np.uint8)
    return np.concatenate([hmask, _pack_k2(q % 4), low, high, d_bytes], axis=1)


def _iq4_codes(x: np.ndarray, dl: np.ndarray) -> np.ndarray:
    """The nearest iq4_nl value codes of x (blocks of 32) at step dl, packed as q4_0's."""
    q = np.abs(x[..., None] - dl[..., None, None] * IQ4NL_VALUES).argmin(-1).astype(np.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def _quantize_iq4_nl(b: np.ndarray) -> np.ndarray:
    blocks = b.reshape(-1, 32)
    d_bytes, d = _fp16(_signed_absmax(blocks)[:, None] / -127)
    return np.concatenate([d_bytes, _iq4_codes(blocks[:, None, :], d)], axis=1)


def _quantize_iq4_xs(b: np.ndarray) -> np.ndarray:
    sub = b.reshape(-1, 8, 32)
    step = _signed_absmax(sub) / -127
    d_bytes, d = _fp16(np.abs(step).max(-1, keepdims=True) / 31)
    ls = np.clip(np.rint(_div(step, d)), -32, 31)
    s6 = (ls + 32).astype(np.uint16)
    scales_h = (((s6 >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(1, dtype=np.uint16)[:, None]
    scales_l = ((s6[:, 0::2] & 15) | ((s6[:, 1::2] & 15) << 4)).astype(np.uint8)
    return np.concatenate([d_bytes, scales_h.view(np.uint8), scales_l, _iq4_codes(sub, d * ls)], axis=1)


NUMPY_QUANTIZERS = {"Q2_K": _quantize_q2_K, "Q3_K": _quantize_q3_K, "IQ4_NL": _quantize_iq4_nl,
                    "IQ4_XS": _quantize_iq4_xs}


def quantize(data: np.ndarray, wtype: str) -> np.ndarray:
    """Rows of data as wtype's blocks (uint8, rows x row bytes), as gguf.quants.quantize gives."""
    if wtype not in NUMPY_QUANTIZERS:
        return gguf.quants.quantize(data, QTYPES[wtype])
    blocks = NUMPY_QUANTIZERS[wtype](data.astype(np.float32).reshape(-1, 256 if wtype != "IQ4_NL" else 32))
    return blocks.reshape(data.shape[0], -1)


def _add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, wtype: str) -> None:
    if data.ndim == 1 or wtype == "F32" or name.endswith(".bias"):
        w.add_tensor(name, data)
    elif wtype == "F16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        w.add_tensor(name, quantize(data, wtype), raw_dtype=QTYPES[wtype])


def write_tiny_model(path: str | Path, cfg: TinyConfig = TinyConfig(), split_max_tensors: int = 0) -> Path:
    """Writes a random model described by cfg to path and returns the path; with
    split_max_tensors, as a split model of files of at most that many tensors (the gguf
    package's writer, gguf-split's names) and returns the first file's path."""
    if cfg.arch not in ARCHS:
        raise ValueError(f"unknown architecture {cfg.arch}; one of {', '.join(ARCHS)}")
    if cfg.wtype not in QTYPES:
        raise ValueError(f"unknown weight type {cfg.wtype}; one of {', '.join(QTYPES)}")
    if cfg.n_head % cfg.n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    tokens, types = vocab_tokens()
    path = Path(path)
    w = gguf.GGUFWriter(str(path), cfg.arch, split_max_tensors=split_max_tensors)
    # not the architecture's name: llama.cpp gives a vocabulary named like Phi-3 Phi-3's special tokens
    w.add_name("tiny-model")
    w.add_file_type(int(FILE_TYPES[cfg.wtype]))
    add_llama_hparams(w, cfg.n_layer, cfg.n_ctx_train, cfg.n_embd, cfg.ff, cfg.n_head, cfg.n_head_kv, cfg.rope_base,
                      cfg.rot, cfg.rms_eps)
    if cfg.embd:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.swa_pattern:
        w.add_uint32(f"{cfg.arch}.attention.sliding_window_pattern", cfg.swa_pattern)
    if cfg.swa_layers:
        w.add_array(f"{cfg.arch}.attention.sliding_window_pattern", list(cfg.swa_layers))
    if cfg.rope_base_swa:
        w.add_float32(f"{cfg.arch}.rope.freq_base_swa", cfg.rope_base_swa)
    if cfg.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(cfg.rope_scaling))
        w.add_rope_scaling_factor(cfg.rope_factor)
    if cfg.n_ctx_orig:
        w.add_rope_scaling_orig_ctx_len(cfg.n_ctx_orig)
    if cfg.rope_attn_factor:
        w.add_rope_scaling_attn_factors(cfg.rope_attn_factor)
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
    if len(w.tensors) > 1:
        return path.with_name(f"{path.stem}-00001-of-{len(w.tensors):05d}.gguf")
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
