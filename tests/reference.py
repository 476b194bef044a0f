"""A numpy forward pass of the llama architecture, read from a GGUF file: the oracle that
innerq's logits are tested against.

Written from the math, not from innerq's code: weights are dequantized with gguf.quants
(the PyPI package's own implementation of ggml's formats) and every product is taken in
float64. Conventions are llama.cpp's for the llama arch: RMSNorm x / sqrt(mean(x^2) + eps) * w;
RoPE NORMAL mode, which rotates adjacent pairs (2i, 2i+1) of each head by
theta_i = pos * base^(-2i/n_rot) / rope_freqs[i]; query head h reads KV head
h // (n_head / n_head_kv); causal softmax attention scaled by 1/sqrt(head_dim); SwiGLU FFN
down(silu(gate x) * up x); the output projection is token_embd when output.weight is absent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np


@dataclass
class Weights:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rms_eps: float
    tensors: dict[str, np.ndarray] = field(repr=False)
    tokens: list[str] = field(repr=False)

    def layer(self, i: int, name: str) -> np.ndarray:
        return self.tensors[f"blk.{i}.{name}.weight"]


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"{key} missing")
        return default
    return f.contents()


def load(path: str | Path) -> Weights:
    """Hyper-parameters and float32 weights (PyTorch layout: (out, in)) of a llama GGUF."""
    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"architecture {arch!r} is not llama")
    tensors = {}
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))
        tensors[t.name] = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
    n_embd = int(_field(r, "llama.embedding_length"))
    n_head = int(_field(r, "llama.attention.head_count"))
    head_dim = n_embd // n_head
    tokens = list(_field(r, "tokenizer.ggml.tokens"))
    return Weights(
        n_vocab=int(_field(r, "llama.vocab_size", len(tokens))),
        n_embd=n_embd,
        n_layer=int(_field(r, "llama.block_count")),
        n_head=n_head,
        n_head_kv=int(_field(r, "llama.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_rot=int(_field(r, "llama.rope.dimension_count", head_dim)),
        rope_base=float(_field(r, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
        tensors=tensors,
        tokens=tokens,
    )


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (n, in) times a weight stored (out, in)."""
    return x @ w.astype(np.float64).T


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, freq_factors: np.ndarray | None) -> np.ndarray:
    """RoPE NORMAL on x (n_tokens, n_heads, head_dim): pairs (2i, 2i+1) for 2i < n_rot."""
    i = np.arange(n_rot // 2)
    inv_freq = base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    theta = pos[:, None].astype(np.float64) * inv_freq[None, :]   # (n_tokens, n_rot/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = x0 * cos - x1 * sin
    out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention; q (n, n_head, d), k and v (n, n_head_kv, d); returns (n, n_head * d)."""
    n, n_head, d = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)  # query head h reads KV head h // group
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v).reshape(n, n_head * d)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(w: Weights, tokens) -> np.ndarray:
    """Logits (n_tokens, n_vocab), float64, of a sequence starting at position 0."""
    out = w.tensors.get("output.weight", w.tensors["token_embd.weight"])
    return linear(hidden(w, tokens), out)


def hidden(w: Weights, tokens) -> np.ndarray:
    """The final hidden states after the output norm (n_tokens, n_embd), float64: what
    llama.cpp calls the embeddings of a Llama model."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    pos = np.arange(n)
    freq_factors = w.tensors.get("rope_freqs.weight")
    x = w.tensors["token_embd.weight"][tokens].astype(np.float64)
    for il in range(w.n_layer):
        h = rms_norm(x, w.layer(il, "attn_norm"), w.rms_eps)
        q = linear(h, w.layer(il, "attn_q")).reshape(n, w.n_head, w.head_dim)
        k = linear(h, w.layer(il, "attn_k")).reshape(n, w.n_head_kv, w.head_dim)
        v = linear(h, w.layer(il, "attn_v")).reshape(n, w.n_head_kv, w.head_dim)
        q = rope(q, pos, w.n_rot, w.rope_base, freq_factors)
        k = rope(k, pos, w.n_rot, w.rope_base, freq_factors)
        x = x + linear(attention(q, k, v), w.layer(il, "attn_output"))
        h = rms_norm(x, w.layer(il, "ffn_norm"), w.rms_eps)
        ff = silu(linear(h, w.layer(il, "ffn_gate"))) * linear(h, w.layer(il, "ffn_up"))
        x = x + linear(ff, w.layer(il, "ffn_down"))
    return rms_norm(x, w.tensors["output_norm.weight"], w.rms_eps)


def token_ids(w: Weights, pieces: list[str]) -> list[int]:
    """Ids of whole vocabulary entries (e.g. ["The", "Ġcapital"]): input without a tokenizer."""
    index = {t: i for i, t in enumerate(w.tokens)}
    return [index[p] for p in pieces]


def greedy(w: Weights, tokens: list[int], n: int) -> list[int]:
    """n greedy tokens after tokens (recomputes the whole sequence each step: for small n)."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(np.argmax(forward(w, seq)[-1])))
    return seq[len(tokens):]


def piece_text(w: Weights, ids: list[int]) -> str:
    """The text of byte-level BPE tokens (GPT-2's byte symbols mapped back to bytes)."""
    from tiny_model import byte_symbols

    to_byte = {s: b for b, s in enumerate(byte_symbols())}
    data = bytes(to_byte[c] for i in ids for c in w.tokens[i] if c in to_byte)
    return data.decode("utf-8", errors="replace")
