"""A numpy forward pass of the llama family (llama, qwen2, qwen3, gemma3, phi3), read from a
GGUF file: the oracle that innerq's logits are tested against.

Written from the math, not from innerq's code: weights are dequantized with gguf.quants
(the PyPI package's own implementation of ggml's formats) and every product is taken in
float64. Conventions are llama.cpp's: RMSNorm x / sqrt(mean(x^2) + eps) * w; RoPE rotates the
pairs of each head by theta_i = pos * base^(-2i/n_rot) / rope_freqs[i], NORMAL mode (adjacent
pairs (2i, 2i+1)) for llama, NEOX mode (pairs (i, i + n_rot/2)) for the others; query head h
reads KV head h // (n_head / n_head_kv); causal softmax attention scaled by 1/sqrt(head_dim);
SwiGLU FFN down(silu(gate x) * up x); the output projection is token_embd when output.weight
is absent. Per architecture: qwen2 adds biases to q, k, v; qwen3 RMS-norms each q and k head
before RoPE; phi3 stores q|k|v and gate|up fused; gemma3 scales the embeddings by
sqrt(n_embd), norms q and k heads, norms the attention's and the FFN's outputs before the
residual adds, gates with GELU (tanh form), and its local layers (all but every
sliding_window_pattern-th) attend to the last sliding_window positions with RoPE base
freq_base_swa.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np


@dataclass
class Weights:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rms_eps: float
    n_swa: int
    swa_pattern: int | list  # a period, or a bool per layer
    rope_base_swa: float
    rope_divisors: np.ndarray | None  # the global layers' RoPE angle divisors (rope_freqs, scaling)
    rope_mscale: float                # YaRN's (and attn_factor's) scale of cos and sin
    tensors: dict[str, np.ndarray] = field(repr=False)
    tokens: list[str] = field(repr=False)

    def layer(self, i: int, name: str, kind: str = "weight") -> np.ndarray | None:
        return self.tensors.get(f"blk.{i}.{name}.{kind}")

    @property
    def neox(self) -> bool:
        return self.arch != "llama"

    def is_swa(self, il: int) -> bool:
        if isinstance(self.swa_pattern, list):
            return self.n_swa > 0 and bool(self.swa_pattern[il])
        return self.n_swa > 0 and il % self.swa_pattern < self.swa_pattern - 1


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"{key} missing")
        return default
    return f.contents()


def load(path: str | Path, n_ctx: int = 0) -> Weights:
    """Hyper-parameters and float32 weights (PyTorch layout: (out, in)) of a GGUF model;
    phi3's fused tensors come split into attn_q/k/v and ffn_gate/up. n_ctx: the context the
    model runs in (LongRoPE's long factors beyond the original context)."""
    r = gguf.GGUFReader(str(path))
    a = _field(r, "general.architecture")
    if a not in ("llama", "qwen2", "qwen3", "gemma3", "phi3"):
        raise ValueError(f"architecture {a!r} is not one of the llama family")
    tensors = {}
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))
        tensors[t.name] = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
    n_embd = int(_field(r, f"{a}.embedding_length"))
    n_head = int(_field(r, f"{a}.attention.head_count"))
    n_head_kv = int(_field(r, f"{a}.attention.head_count_kv", n_head))
    head_dim = int(_field(r, f"{a}.attention.key_length", n_embd // n_head))
    for name in [n for n in tensors if n.endswith("attn_qkv.weight")]:
        qkv = tensors.pop(name)
        p = name[:-len("attn_qkv.weight")]
        q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
        tensors[p + "attn_q.weight"], tensors[p + "attn_k.weight"], tensors[p + "attn_v.weight"] = np.split(
            qkv, [q_rows, q_rows + kv_rows])
        tensors[p + "ffn_gate.weight"], tensors[p + "ffn_up.weight"] = np.split(tensors[p + "ffn_up.weight"], 2)
    tokens = list(_field(r, "tokenizer.ggml.tokens"))
    n_swa = int(_field(r, f"{a}.attention.sliding_window", 0)) if a == "gemma3" else 0
    n_rot = int(_field(r, f"{a}.rope.dimension_count", head_dim))
    base = float(_field(r, f"{a}.rope.freq_base", 10000.0))
    n_ctx_train = int(_field(r, f"{a}.context_length"))
    freqs = tensors.get("rope_freqs.weight")
    if freqs is None and "rope_factors_long.weight" in tensors:
        long = n_ctx > int(_field(r, f"{a}.rope.scaling.original_context_length", n_ctx_train))
        freqs = tensors["rope_factors_long.weight" if long else "rope_factors_short.weight"]
    divisors, mscale = _rope_scaling(r, a, n_rot, base, n_ctx_train, freqs)
    return Weights(
        arch=a,
        n_vocab=int(_field(r, f"{a}.vocab_size", len(tokens))),
        n_embd=n_embd,
        n_layer=int(_field(r, f"{a}.block_count")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=n_rot,
        rope_base=base,
        rms_eps=float(_field(r, f"{a}.attention.layer_norm_rms_epsilon")),
        n_swa=n_swa,
        swa_pattern=_swa_pattern(_field(r, f"{a}.attention.sliding_window_pattern", 6)),
        rope_base_swa=float(_field(r, f"{a}.rope.freq_base_swa", 10000.0)),
        rope_divisors=divisors,
        rope_mscale=mscale,
        tensors=tensors,
        tokens=tokens,
    )


def _swa_pattern(value) -> int | list:
    return [bool(v) for v in value] if isinstance(value, list) else int(value)


def _rope_scaling(r, a: str, n_rot: int, base: float, n_ctx_train: int, freqs):
    """(divisors of pair i's angle, scale of cos and sin) of ARCH.rope.scaling.*, as llama.cpp
    (YaRN after the YaRN paper: pair i mixes theta / factor and theta by a ramp between the
    dims whose wavelength fits n_ctx_orig / beta_fast and n_ctx_orig / beta_slow times)."""
    kind = _field(r, f"{a}.rope.scaling.type", "linear")  # longrope: its divisors are freqs
    factor = float(_field(r, f"{a}.rope.scaling.factor", 0.0))
    mscale = float(_field(r, f"{a}.rope.scaling.attn_factor", 1.0))
    file = np.ones(n_rot // 2) if freqs is None else freqs.astype(np.float64)
    if kind in ("none", "longrope") or factor in (0.0, 1.0):
        return freqs, mscale
    if kind == "linear":
        return file * factor, mscale
    orig = int(_field(r, f"{a}.rope.scaling.original_context_length", n_ctx_train))
    fast = float(_field(r, f"{a}.rope.scaling.yarn_beta_fast", 32.0))
    slow = float(_field(r, f"{a}.rope.scaling.yarn_beta_slow", 1.0))

    def dim(beta: float) -> float:
        return n_rot * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = max(0.0, np.floor(dim(fast))), min(n_rot - 1.0, np.ceil(dim(slow)))
    mix = 1 - np.clip((np.arange(n_rot // 2) - lo) / max(0.001, hi - lo), 0, 1)
    return file / (mix + (1 - mix) / factor), mscale * (1 + 0.1 * np.log(factor))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (n, in) times a weight stored (out, in)."""
    return x @ w.astype(np.float64).T


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, freq_factors: np.ndarray | None,
         neox: bool = False, mscale: float = 1.0) -> np.ndarray:
    """RoPE on x (n_tokens, n_heads, head_dim): NORMAL mode rotates pairs (2i, 2i+1) for
    2i < n_rot, NEOX mode pairs (i, i + n_rot/2); cos and sin times mscale."""
    i = np.arange(n_rot // 2)
    inv_freq = base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    theta = pos[:, None].astype(np.float64) * inv_freq[None, :]   # (n_tokens, n_rot/2)
    cos, sin = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]
    out = x.copy()
    first, second = (slice(0, n_rot // 2), slice(n_rot // 2, n_rot)) if neox else (slice(0, n_rot, 2), slice(1, n_rot, 2))
    x0, x1 = x[..., first], x[..., second]
    out[..., first] = x0 * cos - x1 * sin
    out[..., second] = x0 * sin + x1 * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0) -> np.ndarray:
    """Causal attention; q (n, n_head, d), k and v (n, n_head_kv, d); returns (n, n_head * d).
    window > 0: query i sees keys i - window < j <= i only."""
    n, n_head, d = q.shape
    group = n_head // k.shape[1]
    k = np.repeat(k, group, axis=1)  # query head h reads KV head h // group
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(d)
    seen = np.tril(np.ones((n, n), dtype=bool))
    if window > 0:
        seen &= ~np.tril(seen, -window)
    scores = np.where(seen[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v).reshape(n, n_head * d)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form (Gemma's gelu_pytorch_tanh, ggml's gelu)."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


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
    gemma = w.arch == "gemma3"
    x = w.tensors["token_embd.weight"][tokens].astype(np.float64)
    if gemma:
        x = x * np.sqrt(w.n_embd)

    def norm_opt(t: np.ndarray, name: str) -> np.ndarray:
        """t RMS-normed by layer il's `name` if the layer has it."""
        wt = w.layer(il, name)
        return t if wt is None else rms_norm(t, wt, w.rms_eps)

    for il in range(w.n_layer):
        h = rms_norm(x, w.layer(il, "attn_norm"), w.rms_eps)
        qkv = []
        for name, heads in (("attn_q", w.n_head), ("attn_k", w.n_head_kv), ("attn_v", w.n_head_kv)):
            y = linear(h, w.layer(il, name))
            if w.layer(il, name, "bias") is not None:
                y = y + w.layer(il, name, "bias")
            qkv.append(y.reshape(n, heads, w.head_dim))
        q, k, v = qkv
        q, k = norm_opt(q, "attn_q_norm"), norm_opt(k, "attn_k_norm")
        if w.is_swa(il):  # local layers: the file's rope_freqs only, no scaling (llama.cpp)
            rp = (w.rope_base_swa, w.tensors.get("rope_freqs.weight"), w.neox)
        else:
            rp = (w.rope_base, w.rope_divisors, w.neox, w.rope_mscale)
        q, k = rope(q, pos, w.n_rot, *rp), rope(k, pos, w.n_rot, *rp)
        # (a global layer calls attention as before windows: tests stand in their own for it)
        a = linear(attention(q, k, v, w.n_swa) if w.is_swa(il) else attention(q, k, v), w.layer(il, "attn_output"))
        x = x + norm_opt(a, "post_attention_norm")
        h = rms_norm(x, w.layer(il, "ffn_norm"), w.rms_eps)
        ff = (gelu if gemma else silu)(linear(h, w.layer(il, "ffn_gate"))) * linear(h, w.layer(il, "ffn_up"))
        x = x + norm_opt(linear(ff, w.layer(il, "ffn_down")), "post_ffw_norm")
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
