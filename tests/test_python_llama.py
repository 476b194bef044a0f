"""innerq.Llama driven for real, on SmolLM2-135M and on tiny generated models.

Oracles: the native innerq-cli (same prompt, seed and sampling must give the same text), the
numpy reference forward pass (logits), an independent Jinja2 rendering of the GGUF's chat
template read with gguf.GGUFReader, and each API against its own other form (streaming vs
not, completion vs generate)."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

import reference
import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq import Llama  # noqa: E402

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(head_dim=64, n_head_kv=2, n_ctx_train=256))


@pytest.fixture(scope="module")
def smollm2_fields(smollm2):
    import gguf

    return gguf.GGUFReader(str(smollm2)).fields


@pytest.fixture(scope="module")
def small(smollm2):
    with Llama(smollm2, n_ctx=512, n_threads=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny(tiny_path):
    with Llama(tiny_path, n_ctx=256, n_threads=1) as llm:
        yield llm


def native_cli(model, prompt: str, n: int, *extra: str) -> str:
    """What innerq-cli prints for the prompt (without the prompt itself and the final newline)."""
    cmd = [innerq.cli_path(), "-m", str(model), "-p", prompt, "-n", str(n), "--no-display-prompt", "-t", "2", *extra]
    r = subprocess.run(cmd, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode("utf-8")
    assert out.endswith("\n")
    return out[:-1]


# ---- generation against the native CLI ----

@pytest.mark.parametrize("model", ["small", "tiny"])
def test_greedy_generate_equals_native_cli(request, model):
    llm = request.getfixturevalue(model)
    text = llm.generate(PROMPT, max_tokens=24, temperature=0)
    assert text == native_cli(llm.model_path, PROMPT, 24, "--temp", "0", "-c", str(llm.n_ctx()))
    assert llm.last_run.completion_tokens == 24 or llm.last_run.finish_reason == "stop"


def test_seeded_sampling_equals_native_cli(small):
    text = small.generate(PROMPT, max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02,
                          repeat_penalty=1.1, seed=1234)
    cli = native_cli(small.model_path, PROMPT, 16, "--temp", "0.9", "--top-k", "50", "--top-p", "0.9",
                     "--min-p", "0.02", "--repeat-penalty", "1.1", "--seed", "1234", "-c", "512")
    assert text == cli
    assert small.generate(PROMPT, max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02,
                          repeat_penalty=1.1, seed=1234) == text


@pytest.mark.parametrize("knob", [None, "kv_hybrid", "kv_norm", "kv_debias", "kv_norm_pairs", "kv_search",
                                  "kv_value_scales"])
def test_greedy_on_quantized_cache_equals_native_cli(tiny_path, knob):
    """The InnerQ knobs reach the cache as the CLI's flags do (kv_x=False is --no-kv-x)."""
    if not {"innerq3", "innerq2"} <= set(innerq.kv_types()):
        pytest.skip("this build has no InnerQ cache types yet")
    off = {knob: False} if knob else {}
    with Llama(tiny_path, n_ctx=256, n_threads=1, kv_type="innerq", kv_sink=4, kv_recent=8, kv_group=32,
               **off) as llm:
        text = llm.generate("hello there, the", max_tokens=40, temperature=0)
    cli = native_cli(tiny_path, "hello there, the", 40, "--temp", "0", "-c", "256", "--kv", "innerq",
                     "--kv-sink", "4", "--kv-recent", "8", "--kv-group", "32",
                     *(["--no-" + knob.replace("_", "-")] if knob else []))
    assert text == cli


@pytest.mark.parametrize("knob", ["kv_value_scales", "kv_params8", "kv_key_levels"])
def test_opt_in_cache_options_equal_native_cli(tiny_path, knob):
    """The InnerQ options that are off by default reach the cache as the CLI's flags do
    (kv_x=1 is --kv-x), and a state records them (one saved with them does not load without)."""
    if not {"innerq3", "innerq2"} <= set(innerq.kv_types()):
        pytest.skip("this build has no InnerQ cache types yet")
    kw = dict(n_ctx=256, n_threads=1, kv_type="innerq", kv_sink=4, kv_recent=8, kv_group=32)
    with Llama(tiny_path, **kw, **{knob: 1}) as llm:
        text = llm.generate("hello there, the", max_tokens=40, temperature=0)
        state = llm.save_state()
    with Llama(tiny_path, **kw) as llm:
        llm.generate("hello there, the", max_tokens=40, temperature=0)
        with pytest.raises(innerq.StateMismatchError):
            llm.load_state(state)
    cli = native_cli(tiny_path, "hello there, the", 40, "--temp", "0", "-c", "256", "--kv", "innerq",
                     "--kv-sink", "4", "--kv-recent", "8", "--kv-group", "32", "--" + knob.replace("_", "-"))
    assert text == cli


def test_greedy_tokens_equal_numpy_reference(tiny_path):
    w = reference.load(tiny_path)
    with Llama(tiny_path, n_ctx=64, kv_type="f32") as llm:
        prompt = llm.tokenize("the theater")
        expected = reference.greedy(w, prompt, 6)
        text = llm.generate(prompt, max_tokens=6, temperature=0)
        got = llm.last_run.tokens
        assert got == expected[:len(got)]
        ends = bool(got) and llm.model.is_eog(got[-1])
        assert len(got) == len(expected) or ends  # only an end-of-generation token stops it early
        assert text == reference.piece_text(w, got[:len(got) - ends])


# ---- streaming and stop strings ----

@pytest.mark.parametrize("model", ["small", "tiny"])
def test_stream_yields_the_same_text(request, model):
    llm = request.getfixturevalue(model)
    whole = llm.generate(PROMPT, max_tokens=16, temperature=0)
    pieces = list(llm.generate(PROMPT, max_tokens=16, temperature=0, stream=True))
    assert len(pieces) > 1 and all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == whole


def test_stop_strings_stop_before_the_match(small):
    pieces = list(small.generate(PROMPT, max_tokens=20, temperature=0, stream=True))
    whole = "".join(pieces)
    assert len(whole) > 12
    for stop in (whole[5:9], [whole[8:10], whole[3:6]]):
        first = min(whole.find(s) for s in ([stop] if isinstance(stop, str) else stop))
        cut = small.generate(PROMPT, max_tokens=20, temperature=0, stop=stop)
        assert cut == whole[:first]
        assert small.last_run.finish_reason == "stop"
    # streamed: a stop string split across two pieces is caught and never partly emitted
    i = next(i for i in range(1, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    assert "".join(small.generate(PROMPT, max_tokens=20, temperature=0, stop=stop, stream=True)) == \
        whole[:whole.find(stop)]
    # a stop string that never appears changes nothing
    assert small.generate(PROMPT, max_tokens=20, temperature=0, stop=["\x00never"]) == whole


def test_length_and_context_limits(tiny):
    tiny.generate("the", max_tokens=5, temperature=0)
    assert tiny.last_run.finish_reason in ("length", "stop")
    if tiny.last_run.finish_reason == "length":
        assert tiny.last_run.completion_tokens == 5
    # max_tokens None: runs until the context is full (or an end-of-generation token)
    tiny.generate("the", max_tokens=None, temperature=0)
    r = tiny.last_run
    assert r.finish_reason == "stop" or r.prompt_tokens + r.completion_tokens == tiny.n_ctx()


# ---- tokens, eval and logits ----

def test_tokenize_roundtrip(small):
    text = "Hello, world! Ünïcödé and <|im_start|> tokens."
    ids = small.tokenize(text, add_bos=False)
    assert small.detokenize(ids).decode() == text
    assert small.tokenize(text.encode(), add_bos=False) == ids
    special = small.tokenize("<|im_start|>user", add_bos=False, special=True)
    assert len(special) < len(small.tokenize("<|im_start|>user", add_bos=False))
    assert small.detokenize(special, special=True) == b"<|im_start|>user"


def test_logits_are_a_float32_view_equal_to_reference(tiny_path):
    w = reference.load(tiny_path)
    with Llama(tiny_path, n_ctx=64, kv_type="f32") as llm:  # f32 cache: float32 rounding only
        ids = llm.tokenize("the rain in spain")
        llm.eval(ids)
        assert llm.n_past == len(ids)
        logits = llm.logits
        assert logits.dtype == np.float32 and logits.shape == (llm.n_vocab(),)
        assert not logits.flags.owndata and not logits.flags.writeable  # a view of the C buffer
        ref = reference.forward(w, ids)[-1]
        np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        # one more token, evaluated against the cache
        nxt = int(np.argmax(logits))
        llm.eval([nxt])
        ref = reference.forward(w, ids + [nxt])[-1]
        np.testing.assert_allclose(llm.logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        llm.reset()
        assert llm.n_past == 0


def test_logits_all_rows(tiny_path):
    w = reference.load(tiny_path)
    with Llama(tiny_path, n_ctx=64, logits_all=True, kv_type="f32") as llm:
        ids = llm.tokenize("an onion")
        llm.eval(ids)
        ref = reference.forward(w, ids)
        for i in range(len(ids)):
            np.testing.assert_allclose(llm.get_logits(i), ref[i], rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_logits_stay_readable_after_close(tiny_path):
    llm = Llama(tiny_path, n_ctx=32)
    llm.eval(llm.tokenize("the"))
    logits = llm.logits
    expected = logits.copy()
    llm.close()
    np.testing.assert_array_equal(logits, expected)  # the view keeps the context alive


# ---- completions ----

def test_completion_dict_shape(small):
    out = small.create_completion(PROMPT, max_tokens=8, temperature=0)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert isinstance(out["created"], int) and out["model"] == small.model_path
    (choice,) = out["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["text"] == small.generate(PROMPT, max_tokens=8, temperature=0)
    assert choice["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["prompt_tokens"] == len(small.tokenize(PROMPT, special=True))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert small(PROMPT, max_tokens=8, temperature=0, echo=True)["choices"][0]["text"] == PROMPT + choice["text"]


def test_completion_stream_chunks(small):
    out = small.create_completion(PROMPT, max_tokens=12, temperature=0)
    chunks = list(small.create_completion(PROMPT, max_tokens=12, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]


def _jinja_oracle(fields, messages):
    """The chat prompt, rendered here straight from the GGUF file's template."""
    import jinja2

    source = fields["tokenizer.chat_template"].contents()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, bos_token="<|im_start|>",
                                          eos_token="<|im_end|>")


MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_prompt_renders_the_gguf_template(small, smollm2_fields):
    prompt = small.chat_prompt(MESSAGES)
    assert prompt == _jinja_oracle(smollm2_fields, MESSAGES)
    assert prompt.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    # OpenAI content parts render as their text
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                                       {"type": "text", "text": "of France?"}]}]
    assert small.chat_prompt(parts) == prompt


def test_chat_completion(small):
    out = small.create_chat_completion(MESSAGES, max_tokens=12, temperature=0)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    content = choice["message"]["content"]
    # the same as completing the rendered prompt
    assert content == small.generate(small.chat_prompt(MESSAGES), max_tokens=12, temperature=0)
    u = out["usage"]
    assert u["prompt_tokens"] == len(small.tokenize(small.chat_prompt(MESSAGES), special=True))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]

    chunks = list(small.create_chat_completion(MESSAGES, max_tokens=12, temperature=0, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == content


def test_chat_without_template_falls_back_to_chatml(tiny):
    assert tiny.model.chat_template is None
    assert tiny.chat_prompt([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = tiny.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert out["usage"]["prompt_tokens"] == len(tiny.tokenize(tiny.chat_prompt([{"role": "user", "content": "hi"}]),
                                                               special=True))


def test_metadata_and_model_facts(small, smollm2_fields):
    f = smollm2_fields
    meta = small.metadata
    assert meta["general.architecture"] == "llama"
    assert int(meta["llama.block_count"]) == f["llama.block_count"].contents() == small.model.n_layer
    assert small.n_vocab() == len(f["tokenizer.ggml.tokens"].contents())
    assert small.token_eos() == f["tokenizer.ggml.eos_token_id"].contents()
    hd = small.model.head_dim
    assert hd * small.model.n_head == f["llama.embedding_length"].contents()
    f16 = small.model.kv_bytes_per_token("f16", "f16")
    assert f16 == small.model.n_layer * small.model.n_head_kv * hd * 2 * 2
    assert small.model.kv_bytes_per_token("q8_0", "q8_0") == f16 * 34 / 64  # 34 bytes per 32 values
