"""llama-cpp-python's high-level API on innerq, beyond its own test suite (tests/peer/): prefix
reuse against fresh evaluations in every region of the quantized caches, states, grammars and
response formats, logprobs, logit_bias and penalties, and the arguments innerq does not have.

Oracles: a fresh context evaluating the same tokens; the JSON schema a response must satisfy;
numpy's log-softmax of the logits the context kept; the same call without the argument."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TEXT

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq import Llama, LlamaGrammar  # noqa: E402
from innerq.errors import InnerQError, InvalidArgumentError, StateMismatchError, UnsupportedError  # noqa: E402
from innerq.grammar import GrammarError, MatchState, feed_bytes  # noqa: E402

GRAMMARS = ROOT / "tests" / "peer" / "grammars"
# The cache regions of the defaults: kv_sink 32 tokens, then quantized groups, and the last 96
# tokens (kv_recent) in f16. A prompt of 300 tokens fills all three.
PROMPT_LEN = 300
DIVERGE = {"sink": 16, "quantized": 120, "recent": 260}


@pytest.fixture(scope="module")
def text_tokens(smollm2):
    with Llama(smollm2, vocab_only=True) as vocab:
        return vocab.tokenize(TEXT.read_text(encoding="utf-8")[:20000].encode(), add_bos=False)


@pytest.fixture(scope="module")
def small(smollm2):
    with Llama(smollm2, n_ctx=512, n_threads=2) as llm:
        yield llm


def first_logits_and_greedy(llm: Llama, tokens: list[int], n: int = 8) -> tuple[np.ndarray, list[int]]:
    """The logits after tokens (scores keeps the last row) and the next n greedy tokens."""
    gen = llm.generate(tokens, temp=0.0)
    out = [next(gen)]
    logits = llm.scores[-1].copy()
    out += [next(gen) for _ in range(n - 1)]
    gen.close()
    return logits, out


@pytest.mark.parametrize("kv_type", ["innerq", "kivi2", "f16"])
@pytest.mark.parametrize("region", sorted(DIVERGE))
def test_prefix_reuse_equals_a_fresh_evaluation(smollm2, text_tokens, kv_type, region):
    """With kv_rewind_exact, a prompt that shares a prefix with what the context holds evaluates
    only the rest, and gives exactly what a fresh context gives for it: the kept prefix is a
    multiple of n_batch (where a fresh evaluation cuts its calls) that the cache's rewind could
    keep (docs/INNERQ.md, "Rewinding the cache"); the rest is evaluated in the calls a fresh
    evaluation makes."""
    n_batch = 16
    first = text_tokens[:PROMPT_LEN]
    d = DIVERGE[region]
    second = first[:d] + text_tokens[1000:1000 + PROMPT_LEN - d]
    assert second[:d] == first[:d] and second[d] != first[d]
    with Llama(smollm2, n_ctx=512, n_batch=n_batch, n_threads=2, kv_type=kv_type, kv_rewind_exact=True) as llm:
        first_logits_and_greedy(llm, first)
        evaluated = []
        decode = llm._decode
        llm._decode = lambda ids, progress=None: (evaluated.append(len(ids)), decode(ids, progress))
        got_logits, got_tokens = first_logits_and_greedy(llm, second)
    # the rest of the prompt in one evaluation, then one per generated token
    n_kept = len(second) - evaluated[0]
    assert n_kept % n_batch == 0 and n_kept <= d and evaluated[1:] == [1] * (len(evaluated) - 1), evaluated
    if kv_type == "f16" or (kv_type == "innerq" and region != "quantized"):
        # nothing re-evaluated before the divergence: a plain cache, the f16 sink, a recent window
        # a fresh run shares
        assert n_kept == d - d % n_batch
    with Llama(smollm2, n_ctx=512, n_batch=n_batch, n_threads=2, kv_type=kv_type) as fresh:
        want_logits, want_tokens = first_logits_and_greedy(fresh, second)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5 * np.abs(want_logits).max())
    assert got_tokens == want_tokens


def kld(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of the softmaxes of two rows of logits."""
    lp = p_logits - np.logaddexp.reduce(p_logits.astype(np.float64))
    lq = q_logits - np.logaddexp.reduce(q_logits.astype(np.float64))
    return float(np.sum(np.exp(lp) * (lp - lq)))


@pytest.mark.parametrize("region", sorted(DIVERGE))
def test_prefix_reuse_keeps_the_stored_prefix(smollm2, text_tokens, region):
    """By default a shared prefix is kept as it is stored: only what follows the divergence is
    evaluated (and, where it falls in the quantized region, the rest of its block of G tokens),
    and the logits differ from a fresh evaluation's by less than the cache differs from f16."""
    d = DIVERGE[region]
    first = text_tokens[:PROMPT_LEN]
    second = first[:d] + text_tokens[1000:1000 + PROMPT_LEN - d]
    with Llama(smollm2, n_ctx=512, n_batch=16, n_threads=2) as llm:
        first_logits_and_greedy(llm, first)
        evaluated = []
        decode = llm._decode
        llm._decode = lambda ids, progress=None: (evaluated.append(len(ids)), decode(ids, progress))
        got, _ = first_logits_and_greedy(llm, second)
    sink, recent, group = 32, 96, 64  # the defaults at n_ctx 512 (docs/DEFAULTS.md)
    quantized = max(0, (PROMPT_LEN + 8 - sink - recent) // group * group)  # the first run's, generated included
    kept = d if d < sink or d >= sink + quantized else sink + (d - sink) // group * group
    assert evaluated[0] == len(second) - kept, (evaluated, kept)
    with Llama(smollm2, n_ctx=512, n_batch=16, n_threads=2) as fresh:
        want, _ = first_logits_and_greedy(fresh, second)
    with Llama(smollm2, n_ctx=512, n_batch=16, n_threads=2, kv_type="f16") as f16:
        exact, _ = first_logits_and_greedy(f16, second)
    assert kld(want, got) < kld(exact, want), (kld(want, got), kld(exact, want))


@pytest.mark.parametrize("exact", [False, True], ids=["stored", "exact"])
def test_repeated_prompt_is_not_evaluated_again(smollm2, text_tokens, exact):
    """The same prompt again (after its completion): its tokens and the logits that ended its
    evaluation are at hand, so nothing of it is evaluated (the first evaluation is the generated
    token's) and the completion is the same."""
    prompt = text_tokens[:70]
    with Llama(smollm2, n_ctx=256, n_batch=32, n_threads=2, kv_rewind_exact=exact) as llm:
        first = llm.create_completion(prompt, max_tokens=4, temperature=0)
        evaluated = []
        decode = llm._decode
        llm._decode = lambda ids, progress=None: (evaluated.append(len(ids)), decode(ids, progress))
        again = llm.create_completion(prompt, max_tokens=4, temperature=0)
    assert evaluated[0] == 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


# ---- states ----

def test_state_roundtrip_and_mismatch(smollm2, text_tokens):
    prompt = text_tokens[:200]
    with Llama(smollm2, n_ctx=512, n_threads=2) as a:
        a.eval(prompt)
        state = a.save_state()
        assert state.n_tokens == 200 and state.input_ids[:200].tolist() == prompt
        assert state.llama_state_size == len(state.llama_state)
        want = first_logits_and_greedy(a, prompt)
    with Llama(smollm2, n_ctx=512, n_threads=2) as b:
        b.eval(text_tokens[300:350])  # something else first
        b.load_state(state)
        assert b.n_tokens == 200
        got = first_logits_and_greedy(b, prompt)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]
    with Llama(smollm2, n_ctx=512, n_threads=2, kv_type="f16") as other:
        other.eval(text_tokens[:10])
        with pytest.raises(StateMismatchError):
            other.load_state(state)
        assert other.n_tokens == 10  # left as it was
    with Llama(smollm2, n_ctx=512, n_threads=2, kv_type="f16") as f16:
        f16.eval(prompt)
        # the innerq cache's state is packed: smaller than the f16 cache's for the same tokens
        assert len(state.llama_state) < len(f16.save_state().llama_state)


def test_disk_cache_serves_a_later_context(smollm2, tmp_path):
    cache = innerq.LlamaDiskCache(str(tmp_path / "cache"))
    prompt = "The Dashwoods had long been settled in Sussex, and their estate was"
    with Llama(smollm2, n_ctx=256, n_threads=2) as writer:
        writer.set_cache(cache)
        want = writer(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    with Llama(smollm2, n_ctx=256, n_threads=2) as reader:
        reader.set_cache(innerq.LlamaDiskCache(str(tmp_path / "cache")))
        loads = []
        load = reader.load_state
        reader.load_state = lambda s: (loads.append(s.n_tokens), load(s))
        assert reader(prompt, max_tokens=6, temperature=0)["choices"][0]["text"] == want
        assert loads  # the state was read back from the files


# ---- grammars and response formats ----

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "London", "Rome", "Other"]}},
          "required": ["name", "age", "city"]}
SUBJECTS = ["a baker", "a pilot", "a teacher", "a doctor", "a painter", "a farmer", "a poet", "a nurse",
            "a sailor", "a judge", "a chef", "a student", "a singer", "a miner", "a writer", "a banker",
            "a tailor", "a dancer", "a monk", "a potter"]


def valid(value) -> bool:
    """SCHEMA, checked by hand: the keys, their types, the string bound and the enum."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"}
            and isinstance(value["name"], str) and len(value["name"]) <= 16
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and value["city"] in SCHEMA["properties"]["city"]["enum"])


def test_json_schema_chat_output_validates_on_20_prompts(small):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for subject in SUBJECTS:
        out = small.create_chat_completion(
            [{"role": "user", "content": f"Describe {subject} as JSON with name, age and city."}],
            response_format=fmt, temperature=0, max_tokens=48)
        content = out["choices"][0]["message"]["content"]
        assert out["choices"][0]["finish_reason"] == "stop", content
        assert valid(json.loads(content)), content


def test_json_object_response_is_json(small):
    """The reply is held to JSON: a whole object where the model stopped, a prefix of one where
    max_tokens cut it (which of the two a 135M model reaches in 40 tokens is up to rounding)."""
    from innerq.llama_grammar import JSON_GBNF

    out = small.create_chat_completion([{"role": "user", "content": "A JSON object with a colour."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=40)
    choice = out["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert choice["finish_reason"] == "length"
        g = LlamaGrammar.from_string(JSON_GBNF).parsed
        assert text.lstrip().startswith("{") and feed_bytes(g, MatchState(g.initial()), text.encode()) is not None
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)  # cut: not yet a whole object
    # text that is no JSON object is refused: the check can fail
    g = LlamaGrammar.from_string(JSON_GBNF).parsed
    assert feed_bytes(g, MatchState(g.initial()), b"A colour: red") is None


@pytest.mark.parametrize("name", ["json.gbnf", "arithmetic.gbnf", "list.gbnf", "json_arr.gbnf", "c.gbnf",
                                  "chess.gbnf", "english.gbnf", "japanese.gbnf"])
def test_llama_cpp_grammars_are_accepted(name):
    grammar = LlamaGrammar.from_file(GRAMMARS / name)
    assert grammar._n_rules > 0


def test_arithmetic_grammar_constrains_a_completion(small):
    grammar = LlamaGrammar.from_file(GRAMMARS / "arithmetic.gbnf")
    text = small("Compute: ", max_tokens=12, temperature=0, grammar=grammar)["choices"][0]["text"]
    g = grammar.parsed
    assert text and feed_bytes(g, MatchState(g.initial()), text.encode()) is not None, text  # a prefix of the language


@pytest.mark.parametrize("source, needle", [('root ::= ("a"', "expected '\\)'"),
                                            ("root ::= undefined-rule", "'undefined-rule' is used but not defined"),
                                            ('root ::= [a-', "unterminated character class"),
                                            ('rot ::= "a"', "no 'root' rule")])
def test_invalid_grammar_is_a_clear_error(source, needle):
    with pytest.raises(GrammarError, match=needle):
        LlamaGrammar.from_string(source)


def test_grammar_must_be_a_llama_grammar(small):
    with pytest.raises(InvalidArgumentError, match="LlamaGrammar"):
        small("x", max_tokens=2, grammar='root ::= "a"')


# ---- logprobs, logit_bias, penalties ----

def test_completion_logprobs_are_the_log_softmax_of_the_logits(smollm2):
    with Llama(smollm2, n_ctx=256, n_threads=2, logits_all=True) as llm:
        out = llm("The capital of France is", max_tokens=4, temperature=0, logprobs=3, echo=True)
        lp = out["choices"][0]["logprobs"]
        ids = llm.tokenize(b"The capital of France is", add_bos=True, special=True)
        n_prompt = len(ids) - (ids[0] == llm.token_bos())
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == n_prompt + out["usage"]["completion_tokens"]
        rows = llm.scores[:llm.n_tokens].astype(np.float64)
        ref = rows - np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1, keepdims=True)) - rows.max(1, keepdims=True)
        all_ids = llm.input_ids[:llm.n_tokens].tolist()
        start = len(ids) - n_prompt
        for k in range(1, len(lp["tokens"])):
            pos = start + k
            if pos >= len(all_ids):
                break
            assert lp["token_logprobs"][k] == pytest.approx(ref[pos - 1, all_ids[pos]], abs=1e-4)
            assert len(lp["top_logprobs"][k]) >= 1
        # greedy: each generated token is the likeliest
        for k in range(n_prompt, len(lp["tokens"])):
            assert lp["token_logprobs"][k] == pytest.approx(max(lp["top_logprobs"][k].values()), abs=1e-5)


def test_chat_logprobs(small):
    out = small.create_chat_completion([{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for item in content:
        assert item["logprob"] <= 0 and 1 <= len(item["top_logprobs"]) <= 3
    assert "".join(item["token"] for item in content) == out["choices"][0]["message"]["content"]


def test_logit_bias_and_penalties_change_the_choice(small):
    prompt = "One, two, three, four,"
    plain = small(prompt, max_tokens=1, temperature=0)
    first = small.tokenize(plain["choices"][0]["text"].encode(), add_bos=False)[0]
    banned = small(prompt, max_tokens=1, temperature=0, logit_bias={first: -100.0})
    assert banned["choices"][0]["text"] != plain["choices"][0]["text"]
    loop = "ab ab ab ab ab ab ab ab ab ab ab ab"
    same = small(loop, max_tokens=4, temperature=0)["choices"][0]["text"]
    penalized = small(loop, max_tokens=4, temperature=0, presence_penalty=50.0, frequency_penalty=5.0)
    assert penalized["choices"][0]["text"] != same


# ---- arguments ----

def test_ordinary_llama_cpp_arguments_are_accepted(smollm2):
    with Llama(smollm2, n_ctx=64, n_batch=32, n_ubatch=32, n_threads=2, n_threads_batch=2, use_mlock=False,
               numa=False, main_gpu=0, tensor_split=None, split_mode=1, offload_kqv=True, flash_attn=True,
               last_n_tokens_size=32, verbose=False, type_k=1, type_v=1, chat_format="chatml") as llm:
        out = llm("Hello", max_tokens=2, temperature=0.0, logprobs=None, grammar=None, frequency_penalty=0.0,
                  presence_penalty=0.0, tfs_z=1.0, mirostat_mode=0, typical_p=1.0, stop=[], logit_bias=None)
        assert out["usage"]["completion_tokens"] <= 2
        chat = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2, tools=None,
                                          tool_choice=None, response_format=None, logprobs=None)
        assert chat["object"] == "chat.completion"
        with Llama(smollm2, n_ctx=64, n_threads=2, kv_type="f16") as f16:
            f16.eval([1, 2, 3])
            llm.eval([1, 2, 3])
            # type_k / type_v = 1 (GGML_TYPE_F16) is innerq's f16 cache: a state loads across
            f16.load_state(llm.save_state())


@pytest.mark.parametrize("kwargs, needle", [({"lora_path": "x.gguf"}, "LoRA"), ({"rope_freq_base": 5e5}, "RoPE"),
                                            ({"type_k": 12}, "ggml type"), ({"kv_overrides": {"a": 1}}, "metadata")])
def test_behaviours_innerq_lacks_are_clear_errors(smollm2, kwargs, needle):
    with pytest.raises(UnsupportedError, match=needle):
        Llama(smollm2, n_ctx=64, **kwargs)


@pytest.mark.parametrize("kwargs", [{"mirostat_mode": 2}, {"typical_p": 0.5}, {"tfs_z": 0.9}, {"suffix": "end"}])
def test_sampling_innerq_lacks_is_a_clear_error(small, kwargs):
    with pytest.raises(UnsupportedError):
        small("x", max_tokens=2, **kwargs)


def test_chat_formats(smollm2):
    from innerq import llama_chat_format

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    for name in ("chatml", "llama-2", "llama-3", "mistral-instruct", "zephyr"):
        assert llama_chat_format.get_chat_completion_handler(name)
    assert llama_chat_format.format_chatml(msgs).prompt == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert llama_chat_format.format_llama2(msgs).prompt == "[INST] <<SYS>>\nS\n<</SYS>> U [/INST]"
    assert llama_chat_format.format_llama3(msgs).prompt == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nU"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(InvalidArgumentError, match="Invalid chat handler"):
        llama_chat_format.get_chat_completion_handler("no-such-format")
    with Llama(smollm2, n_ctx=128, n_threads=2, chat_format="zephyr") as llm:
        out = llm.create_chat_completion(msgs, max_tokens=3, temperature=0)
        want = llm.tokenize(llama_chat_format.format_zephyr(msgs).prompt.encode(), special=True)
        assert out["usage"]["prompt_tokens"] == len(want)


def test_from_pretrained_offline_is_a_clear_error(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InnerQError, match="local cache"):
        Llama.from_pretrained("someone/absent-model-GGUF", "*.gguf", cache_dir=str(tmp_path))


def test_drop_in_names():
    import innerq as llama_cpp

    for name in ("Llama", "LlamaGrammar", "LlamaRAMCache", "LlamaDiskCache", "LlamaState", "LogitsProcessorList",
                 "StoppingCriteriaList", "llama_types", "llama_chat_format", "llama_grammar", "llama_speculative",
                 "llama_cache", "ChatCompletionRequestUserMessage", "CreateCompletionResponse"):
        assert getattr(llama_cpp, name) is not None, name
    assert llama_cpp.__version__


def test_speculative_decoding_equals_plain_greedy(smollm2):
    from innerq.llama_speculative import LlamaPromptLookupDecoding

    prompt = "one two three four five six seven eight nine ten one two three four five six seven"
    with Llama(smollm2, n_ctx=256, n_threads=2) as plain:
        want = plain(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
    with Llama(smollm2, n_ctx=256, n_threads=2, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4)) as spec:
        assert spec(prompt, max_tokens=24, temperature=0)["choices"][0]["text"] == want


def test_pickled_llama_loads_again(smollm2):
    import pickle

    with Llama(smollm2, n_ctx=64, n_threads=2, kv_type="f16") as llm:
        want = llm("The sky is", max_tokens=3, temperature=0)["choices"][0]["text"]
        with pickle.loads(pickle.dumps(llm)) as again:
            assert again.n_ctx() == 64 and again.model_path == llm.model_path
            assert again("The sky is", max_tokens=3, temperature=0)["choices"][0]["text"] == want
