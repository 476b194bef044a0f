"""The architectures besides llama (qwen2, qwen3, gemma3, phi3) against the numpy reference
(reference.py), on tiny random models written by tiny_model.py.

* F32 weights, f32 cache: only float32 rounding differs from the float64 reference (1e-4, as
  test_model.py's llama models); batch and one token at a time alike.
* gemma3's local layers attend through a sliding window shorter than the prompt (and its
  global layers do not), with a RoPE base of their own.
* RoPE scaling (linear, YaRN) as the file's rope.scaling.* say, on top of rope_freqs; gemma3's
  local layers unscaled (llama.cpp's convention); Phi-3's LongRoPE factors by the context;
  heads rotated in part (Phi-4-mini) with YaRN's or LongRoPE's scale of cos and sin.
* The InnerQ cache (the default) against the model's own f16 cache, 300 tokens decoded: its
  KLD is in line with llama's on the same tokens (bound: 3x llama's).
* A file that lacks a tensor its architecture needs, or has one of the wrong shape or type, is
  an error that names it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import reference  # noqa: E402
import tiny_model  # noqa: E402
from logit_stats import kl_divergence, relative_error  # noqa: E402
from tiny_model import TinyConfig  # noqa: E402

innerq = pytest.importorskip("innerq")

ARCH_MODELS = {
    "qwen2": TinyConfig(arch="qwen2", head_dim=32, n_head_kv=2),
    "qwen3": TinyConfig(arch="qwen3", head_dim=32, n_head_kv=2, embd=96),  # n_embd != n_head * head_dim
    "qwen3-partial-rope": TinyConfig(arch="qwen3", head_dim=32, n_head_kv=2, rope_freqs=True, seed=1),
    "gemma3": TinyConfig(arch="gemma3", head_dim=32, n_head_kv=1, embd=96, n_layer=3, sliding_window=16,
                         swa_pattern=3, rope_base_swa=100.0, seed=2),
    "gemma3-no-window": TinyConfig(arch="gemma3", head_dim=32, n_head_kv=2, seed=3),
    "gemma3-swa-layers": TinyConfig(arch="gemma3", head_dim=32, n_head_kv=2, n_layer=3, sliding_window=8,
                                    swa_layers=(False, True, True), seed=9),
    "phi3": TinyConfig(arch="phi3", head_dim=32, n_head_kv=2, tied=True, seed=4),
    # RoPE scaling as the file says (the numbers of positions past n_ctx_orig are what YaRN bends)
    "qwen2-linear": TinyConfig(arch="qwen2", head_dim=32, n_head_kv=2, rope_scaling="linear", rope_factor=4.0, seed=5),
    "qwen3-yarn": TinyConfig(arch="qwen3", head_dim=32, n_head_kv=2, rope_scaling="yarn", rope_factor=4.0,
                             n_ctx_orig=16, seed=6),
    "llama-yarn-ropefreqs": TinyConfig(head_dim=32, n_head_kv=2, rope_freqs=True, rope_scaling="yarn",
                                       rope_factor=8.0, n_ctx_orig=16, seed=7),
    "gemma3-linear": TinyConfig(arch="gemma3", head_dim=32, n_head_kv=1, embd=96, n_layer=3, sliding_window=16,
                                swa_pattern=3, rope_scaling="linear", rope_factor=8.0, seed=8),
    # partly rotated heads with a magnitude factor (Phi-4-mini: 96 of 128 channels, LongRoPE, attn_factor):
    # cos and sin scaled on the rotated channels only; n_ctx 64 > n_ctx_orig: the long factors
    "phi3-partial-longrope": TinyConfig(arch="phi3", head_dim=64, n_rot=48, n_head_kv=2, longrope=True, n_ctx_orig=32,
                                        rope_attn_factor=1.19, n_ctx_train=256, seed=11),
    "qwen3-yarn-partial": TinyConfig(arch="qwen3", head_dim=32, n_rot=16, n_head_kv=2, rope_scaling="yarn",
                                     rope_factor=4.0, n_ctx_orig=16, seed=12),
    "llama-yarn-partial": TinyConfig(head_dim=32, n_rot=24, n_head_kv=2, rope_freqs=True, rope_scaling="yarn",
                                     rope_factor=8.0, n_ctx_orig=16, rope_attn_factor=1.1, seed=13),
}
N_PROMPT = 40


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {name: tiny_model.write_tiny_model(root / f"{name}.gguf", cfg) for name, cfg in ARCH_MODELS.items()}


def prompt(n_vocab: int, n: int = N_PROMPT, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, n_vocab, n)]


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_f32_weights_match_reference(Session, made, name):
    path = made[name]
    with Session(path, n_ctx=64, n_batch=16, kv_k="f32", kv_v="f32") as s:
        tokens = prompt(s.n_vocab)
        batched = s.eval(tokens)
        s.clear()
        one_by_one = s.eval_one_by_one(tokens)
    want = reference.forward(reference.load(path, 64), tokens)
    for got in (batched, one_by_one):
        err = relative_error(got, want)
        assert err.max() < 1e-4, f"worst position {err.argmax()}: {err.max():.3g}"


def test_the_window_masks(made):
    """The reference's gemma3 without its window differs: the test above saw the window work."""
    w = reference.load(made["gemma3"])
    tokens = prompt(w.n_vocab)
    windowed = reference.forward(w, tokens)
    w.n_swa = 0
    assert relative_error(reference.forward(w, tokens), windowed)[20:].min() > 1e-3


# the InnerQ cache takes heads of a multiple of 64 channels
KLD_MODELS = {
    "llama": TinyConfig(head_dim=64, n_head_kv=2, n_layer=3, seed=5),
    "qwen2": TinyConfig(arch="qwen2", head_dim=64, n_head_kv=2, n_layer=3, seed=5),
    "qwen3": TinyConfig(arch="qwen3", head_dim=64, n_head_kv=2, embd=96, n_layer=3, seed=5),
    "gemma3": TinyConfig(arch="gemma3", head_dim=64, n_head_kv=1, embd=96, n_layer=4, sliding_window=100,
                         swa_pattern=2, rope_base_swa=1000.0, seed=5),
    "phi3": TinyConfig(arch="phi3", head_dim=64, n_head_kv=2, n_layer=3, seed=5),
    "qwen3-yarn": TinyConfig(arch="qwen3", head_dim=64, n_head_kv=2, n_layer=3, seed=6, rope_scaling="yarn",
                             rope_factor=4.0, n_ctx_orig=128),
    "gemma3-linear": TinyConfig(arch="gemma3", head_dim=64, n_head_kv=1, embd=96, n_layer=4, sliding_window=100,
                                swa_pattern=2, rope_base_swa=1000.0, seed=5, rope_scaling="linear", rope_factor=8.0),
    # LongRoPE: the llama.cpp test runs at n_ctx 512, past the original 256: the long factors
    "phi3-longrope": TinyConfig(arch="phi3", head_dim=64, n_head_kv=2, n_layer=3, seed=5, longrope=True,
                                n_ctx_orig=256, rope_attn_factor=1.19, n_ctx_train=1024),
    # Phi-4-mini's shape: 3/4 of each head rotated, the key norms' RoPE pairs below n_rot only
    "phi3-partial-longrope": TinyConfig(arch="phi3", head_dim=64, n_rot=48, n_head_kv=2, n_layer=3, seed=5,
                                        longrope=True, n_ctx_orig=256, rope_attn_factor=1.19, n_ctx_train=1024),
    # (phi3: llama.cpp's llama and qwen3 graphs assert that every channel is rotated)
    "phi3-yarn-partial": TinyConfig(arch="phi3", head_dim=64, n_rot=32, n_head_kv=2, n_layer=3, seed=6,
                                    rope_scaling="yarn", rope_factor=4.0, n_ctx_orig=128),
}


def innerq_kld(Session, path, n: int = 300) -> float:
    """Mean KLD of the InnerQ cache (the default) against the f16 cache, decoding n tokens."""
    with Session(path, n_ctx=512, kv_k="f16", kv_v="f16") as s:
        tokens = prompt(s.n_vocab, n, seed=5)
        base = s.eval_one_by_one(tokens)
    with Session(path, n_ctx=512, kv_k="innerq", kv_v="innerq") as s:
        return float(kl_divergence(base, s.eval_one_by_one(tokens)).mean())


@pytest.mark.parametrize("n_rot", [0, 24])
@pytest.mark.parametrize("n_ctx", [64, 128])
def test_longrope_factors_follow_the_context(Session, tmp_path, n_ctx, n_rot):
    """Phi-3's LongRoPE: the short factors up to the original context (64 here), the long ones
    beyond it, and cos and sin times attn_factor (every channel rotated: the attention's scale
    times attn_factor^2; n_rot 24 of 32, as Phi-4-mini: the rotated channels only)."""
    cfg = TinyConfig(arch="phi3", head_dim=32, n_rot=n_rot, n_head_kv=2, longrope=True, n_ctx_orig=64,
                     rope_attn_factor=1.19, seed=10)
    path = tiny_model.write_tiny_model(tmp_path / "lr.gguf", cfg)
    with Session(path, n_ctx=n_ctx, kv_k="f32", kv_v="f32") as s:
        tokens = prompt(s.n_vocab)
        batched = s.eval(tokens)
        s.clear()
        one_by_one = s.eval_one_by_one(tokens)
    want = reference.forward(reference.load(path, n_ctx), tokens)
    for got in (batched, one_by_one):
        assert relative_error(got, want).max() < 1e-4
    assert relative_error(batched, reference.forward(reference.load(path, 192 - n_ctx), tokens)).max() > 1e-2


@pytest.mark.parametrize("name", ["qwen2-linear", "qwen3-yarn", "llama-yarn-ropefreqs", "gemma3-linear",
                                  "qwen3-yarn-partial", "llama-yarn-partial"])
def test_rope_scaling_matters(made, name):
    """Without its scaling the reference differs: the test above saw the scaling applied."""
    w = reference.load(made[name])
    tokens = prompt(w.n_vocab)
    scaled = reference.forward(w, tokens)
    w.rope_divisors, w.rope_mscale = w.tensors.get("rope_freqs.weight"), 1.0
    assert relative_error(reference.forward(w, tokens), scaled)[1:].min() > 1e-3


@pytest.mark.parametrize("name", [n for n in KLD_MODELS if n != "llama"])
def test_innerq_cache_kld_in_line_with_llama(Session, tmp_path, name):
    arch = innerq_kld(Session, tiny_model.write_tiny_model(tmp_path / "a.gguf", KLD_MODELS[name]))
    llama = innerq_kld(Session, tiny_model.write_tiny_model(tmp_path / "l.gguf", KLD_MODELS["llama"]))
    assert arch < 3 * llama, (arch, llama)


# ---- bad files ----

def copy_with(src: Path, dst: Path, edit) -> Path:
    """src's metadata and tensors, each tensor through edit(name, array) (None: dropped)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = edit(t.name, np.array(t.data).reshape(tuple(int(n) for n in reversed(t.shape))))
        if data is not None:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


BAD = {
    "missing post norm": ("gemma3", lambda n, a: None if n == "blk.1.post_ffw_norm.weight" else a,
                          "missing tensor 'blk.1.post_ffw_norm.weight'"),
    "missing bias": ("qwen2", lambda n, a: None if n == "blk.0.attn_k.bias" else a, "missing tensor 'blk.0.attn_k.bias'"),
    "short head norm": ("qwen3", lambda n, a: a[:16] if n == "blk.0.attn_q_norm.weight" else a,
                        r"tensor 'blk.0.attn_q_norm.weight' has shape \[16, 1, 1, 1\], expected \[32, 1\]"),
    "f16 bias": ("qwen2", lambda n, a: a.astype(np.float16) if n == "blk.1.attn_q.bias" else a,
                 "tensor 'blk.1.attn_q.bias' has type f16; only f32 is supported for it"),
    "fused qkv short": ("phi3", lambda n, a: a[:-32] if n == "blk.0.attn_qkv.weight" else a,
                        r"tensor 'blk.0.attn_qkv.weight' has shape \[128, 224, 1, 1\], expected \[128, 256\]"),
    # (phi3's block has 6 tensors: a file with fewer is refused before any is looked up)
    "no fused gate/up": ("phi3", lambda n, a: None if n == "blk.1.ffn_up.weight" else a,
                         r"phi3.block_count = 2 needs at least 14 tensors \(6 per block"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_file_is_an_error_naming_the_tensor(made, tmp_path, case):
    name, edit, message = BAD[case]
    path = copy_with(made[name], tmp_path / "bad.gguf", edit)
    with pytest.raises(innerq.InnerQError, match=message):
        innerq.Llama(str(path), n_ctx=32)


# a string of the metadata changed in place (same length): a value no converter writes
UNKNOWN_VALUES = {
    "architecture": (TinyConfig(arch="qwen2"), b"general.architecture", b"qwen2", b"qwen9",
                     "architecture 'qwen9' is not supported"),
    "rope scaling": (TinyConfig(arch="phi3", rope_scaling="yarn", rope_factor=4.0), b"rope.scaling.type", b"yarn",
                     b"ntk2", "RoPE scaling 'ntk2' is not supported"),
}


@pytest.mark.parametrize("case", UNKNOWN_VALUES)
def test_an_unknown_value_is_an_error_naming_it(tmp_path, case):
    cfg, key, old, new, message = UNKNOWN_VALUES[case]
    path = tiny_model.write_tiny_model(tmp_path / "x.gguf", cfg)
    data = bytearray(path.read_bytes())
    at = data.index(old, data.index(key))
    data[at:at + len(old)] = new
    path.write_bytes(bytes(data))
    with pytest.raises(innerq.InnerQError, match=message):
        innerq.Llama(str(path), n_ctx=32)
