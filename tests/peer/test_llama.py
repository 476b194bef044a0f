import ctypes
import itertools
import multiprocessing

from pathlib import Path

import numpy as np

# peer copy: scipy's log_softmax was imported and never used: the import is left out.
# peer copy: huggingface_hub's hf_hub_download is left out: the fixtures below name the model
# the suite uses (tests/conftest.py's smollm2 fixture, pulled by innerq's own tooling).

import pytest

import innerq as llama_cpp  # peer copy: innerq in place of llama_cpp
# peer copy: llama_cpp._internals (the low-level ctypes API) has no innerq counterpart.

LOW_LEVEL = "low-level llama.cpp API, not part of innerq's high-level compatibility"
NOT_TRANSFORMER = "innerq loads transformer (Llama-family) models only: no {} architecture"

MODEL = str(Path(__file__).parent / "data" / "ggml-vocab-llama-spm.gguf")


def test_llama_cpp_version():
    assert llama_cpp.__version__


def test_llama_cpp_tokenization():
    llama = llama_cpp.Llama(model_path=MODEL, vocab_only=True, verbose=False)

    assert llama
    assert llama._ctx.ctx is not None

    text = b"Hello World"

    tokens = llama.tokenize(text)
    assert tokens[0] == llama.token_bos()
    assert tokens == [1, 15043, 2787]
    detokenized = llama.detokenize(tokens)
    assert detokenized == text

    tokens = llama.tokenize(text, add_bos=False)
    assert tokens[0] != llama.token_bos()
    assert tokens == [15043, 2787]

    detokenized = llama.detokenize(tokens)
    assert detokenized != text

    text = b"Hello World</s>"
    tokens = llama.tokenize(text)
    assert tokens[-1] != llama.token_eos()
    assert tokens == [1, 15043, 2787, 829, 29879, 29958]

    tokens = llama.tokenize(text, special=True)
    assert tokens[-1] == llama.token_eos()
    assert tokens == [1, 15043, 2787, 2]

    text = b""
    tokens = llama.tokenize(text, add_bos=True, special=True)
    assert tokens[-1] != llama.token_eos()
    assert tokens == [llama.token_bos()]
    assert text == llama.detokenize(tokens)


# peer copy: every model fixture is SmolLM2-135M-Instruct Q4_1 (Qwen3.5-0.8B, stories15M and
# bge-small-en-v1.5 upstream), the recurrent (mamba) and hybrid (Falcon-H1) ones are skipped.
@pytest.fixture
def llama_cpp_model_path(smollm2):
    return str(smollm2)


@pytest.fixture
def llama_cpp_transformer_model_path(smollm2):
    return str(smollm2)


@pytest.fixture
def llama_cpp_embedding_model_path(smollm2):
    return str(smollm2)


@pytest.fixture
def llama_cpp_recurrent_model_path():
    pytest.skip(NOT_TRANSFORMER.format("recurrent (mamba)"))


@pytest.fixture
def llama_cpp_hybrid_model_path():
    pytest.skip(NOT_TRANSFORMER.format("hybrid (Falcon-H1)"))


@pytest.mark.skip(reason=LOW_LEVEL)
def test_real_model(llama_cpp_model_path):
    import os

    assert os.path.exists(llama_cpp_model_path)

    params = llama_cpp.llama_model_default_params()
    if llama_cpp.llama_supports_mmap() and llama_cpp.llama_supports_mlock():
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    elif llama_cpp.llama_supports_mlock():
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MLOCK
    elif llama_cpp.llama_supports_mmap():
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    else:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    params.check_tensors = False

    model = internals.LlamaModel(path_model=llama_cpp_model_path, params=params)

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 16
    cparams.n_batch = 16
    cparams.n_ubatch = 16
    cparams.n_threads = multiprocessing.cpu_count()
    cparams.n_threads_batch = multiprocessing.cpu_count()
    cparams.logits_all = False
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED

    context = internals.LlamaContext(model=model, params=cparams)
    tokens = model.tokenize(b"Hello, world!", add_bos=True, special=True)

    assert tokens == [9419, 11, 1814, 0]

    tokens = model.tokenize(
        b"The quick brown fox jumps over the lazy dog. The quick brown fox jumps ",
        add_bos=True,
        special=True,
    )
    prompt_token_count = len(tokens)

    batch = internals.LlamaBatch(n_tokens=len(tokens), embd=0, n_seq_max=1)

    seed = 1337
    sampler = internals.LlamaSampler()
    sampler.add_top_k(50)
    sampler.add_top_p(0.9, 1)
    sampler.add_temp(0.8)
    sampler.add_dist(seed)

    result = tokens
    n_eval = 0
    for _ in range(4):
        batch.set_batch(tokens, n_past=n_eval, logits_all=False)
        context.decode(batch)
        n_eval += len(tokens)
        token_id = sampler.sample(context, -1)
        tokens = [token_id]
        result += tokens

    output = result[prompt_token_count:]
    output_text = model.detokenize(output, special=True)
    # Low-level sampling output varies across CPU and Metal backends.
    assert len(output) == 4
    assert output_text

    model.close()
    assert context.ctx is None


def test_real_llama(llama_cpp_model_path):
    model = llama_cpp.Llama(
        llama_cpp_model_path,
        n_ctx=32,
        n_batch=32,
        n_ubatch=32,
        n_threads=multiprocessing.cpu_count(),
        n_threads_batch=multiprocessing.cpu_count(),
        logits_all=False,
        flash_attn=True,
    )

    output = model.create_completion(
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        max_tokens=6,
        top_k=50,
        top_p=0.9,
        temperature=0.0,
        seed=1337,
    )
    # peer copy: SmolLM2's greedy continuation (Qwen3.5's upstream is " jumps over the lazy dog.")
    assert output["choices"][0]["text"] == " is a classic example of a"

    output = model.create_completion(
        "The capital of france is paris, 'true' or 'false'?:\n",
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=0.8,
        seed=1337,
        grammar=llama_cpp.LlamaGrammar.from_string("""
root ::= "true" | "false"
"""),
    )
    assert output["choices"][0]["text"] == "true"

    suffix = b"rot"
    tokens = model.tokenize(suffix, add_bos=True, special=True)

    def logit_processor_func(input_ids, logits):
        for token in tokens:
            logits[token] *= 1000
        return logits

    logit_processors = llama_cpp.LogitsProcessorList([logit_processor_func])

    output = model.create_completion(
        "The capital of france is par",
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=0.8,
        seed=1337,
        logits_processor=logit_processors,
    )
    assert output["choices"][0]["text"].lower().startswith("rot")

    model.set_seed(1337)

    state = model.save_state()

    output = model.create_completion(
        "Pick a number from 1 to 10?:\n",
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=1.0,
        grammar=llama_cpp.LlamaGrammar.from_string("""
root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"
"""),
    )
    number_1 = output["choices"][0]["text"]

    output = model.create_completion(
        "Pick a number from 1 to 10?:\n",
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=1.0,
        grammar=llama_cpp.LlamaGrammar.from_string("""
root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"
"""),
    )
    number_2 = output["choices"][0]["text"]

    model.load_state(state)

    output = model.create_completion(
        "Pick a number from 1 to 10?:\n",
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=1.0,
        grammar=llama_cpp.LlamaGrammar.from_string("""
root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"
"""),
    )
    number_3 = output["choices"][0]["text"]

    assert number_1 != number_2
    assert number_1 == number_3


def test_real_llama_repeated_prompt_cache(llama_cpp_model_path):
    model = llama_cpp.Llama(
        llama_cpp_model_path,
        n_ctx=32,
        n_batch=32,
        n_ubatch=32,
        n_threads=multiprocessing.cpu_count(),
        n_threads_batch=multiprocessing.cpu_count(),
        logits_all=False,
        flash_attn=True,
        verbose=False,
    )
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"

    output_1 = model.create_completion(
        prompt,
        max_tokens=6,
        temperature=0.0,
        seed=1337,
    )
    output_2 = model.create_completion(
        prompt,
        max_tokens=6,
        temperature=0.0,
        seed=1337,
    )

    # peer copy: SmolLM2's greedy continuation (Qwen3.5's upstream is " jumps over the lazy dog.")
    assert output_1["choices"][0]["text"] == " is a classic example of a"
    assert output_2["choices"][0]["text"] == output_1["choices"][0]["text"]


def _assert_prompt_cache_reset_handles_history_edit(
    model_path,
    *,
    is_recurrent: bool,
    is_hybrid: bool,
):
    model = llama_cpp.Llama(
        model_path,
        n_ctx=32,
        n_batch=32,
        n_ubatch=32,
        n_threads=multiprocessing.cpu_count(),
        n_threads_batch=multiprocessing.cpu_count(),
        logits_all=False,
        verbose=False,
    )

    assert model._is_recurrent is is_recurrent
    assert model._is_hybrid is is_hybrid

    first_prompt = "The quick brown fox"
    second_prompt = "The slow brown fox"
    first_tokens = model.tokenize(first_prompt.encode(), add_bos=True, special=True)
    second_tokens = model.tokenize(second_prompt.encode(), add_bos=True, special=True)

    assert first_tokens != second_tokens
    assert first_tokens[0] == second_tokens[0]

    first_output = model.create_completion(
        first_prompt,
        max_tokens=1,
        temperature=0.0,
    )
    assert isinstance(first_output["choices"][0]["text"], str)

    second_output = model.create_completion(
        second_prompt,
        max_tokens=1,
        temperature=0.0,
    )
    assert isinstance(second_output["choices"][0]["text"], str)


def test_recurrent_model_prompt_cache_reset(llama_cpp_recurrent_model_path):
    _assert_prompt_cache_reset_handles_history_edit(
        llama_cpp_recurrent_model_path,
        is_recurrent=True,
        is_hybrid=False,
    )


def test_hybrid_model_prompt_cache_reset(llama_cpp_hybrid_model_path):
    _assert_prompt_cache_reset_handles_history_edit(
        llama_cpp_hybrid_model_path,
        is_recurrent=False,
        is_hybrid=True,
    )


def _create_test_model(model_path):
    return llama_cpp.Llama(
        model_path,
        n_ctx=64,
        n_batch=64,
        n_ubatch=64,
        n_threads=multiprocessing.cpu_count(),
        n_threads_batch=multiprocessing.cpu_count(),
        logits_all=False,
        verbose=False,
    )


def _generate_test_tokens(model, tokens, max_tokens=3):
    return list(
        itertools.islice(
            model.generate(
                tokens,
                temp=0.0,
            ),
            max_tokens,
        )
    )


MODEL_CACHE_CASES = (
    ("llama_cpp_transformer_model_path", False, False),
    ("llama_cpp_recurrent_model_path", True, False),
    ("llama_cpp_hybrid_model_path", False, True),
)

RESTORED_CACHE_CASES = MODEL_CACHE_CASES


def _eval_alternate_same_length_prompt(model, tokens, expected_next_token):
    replacement_tokens = (
        model.token_eos(),
        model.token_nl(),
        0,
        1,
        2,
        model.n_vocab() - 1,
    )

    for replacement_token in replacement_tokens:
        alternate_tokens = list(tokens)
        alternate_tokens[-1] = replacement_token
        if alternate_tokens == tokens:
            continue

        model.reset()
        model.eval(alternate_tokens)
        if model.sample(temp=0.0, idx=len(tokens) - 1) != expected_next_token:
            return

    raise AssertionError("failed to find an alternate same-length prompt")


def _assert_exact_cached_prompt_reuse_matches_fresh(
    model_path,
    *,
    is_recurrent: bool,
    is_hybrid: bool,
):
    prompt = "The quick brown fox"
    fresh = _create_test_model(model_path)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)

    assert fresh._is_recurrent is is_recurrent
    assert fresh._is_hybrid is is_hybrid

    expected_tokens = _generate_test_tokens(fresh, tokens)

    cached = _create_test_model(model_path)
    assert cached._is_recurrent is is_recurrent
    assert cached._is_hybrid is is_hybrid

    cached.eval(tokens)
    assert cached.n_tokens == len(tokens)
    assert cached.input_ids[: cached.n_tokens].tolist() == tokens
    assert cached.sample(temp=0.0, idx=len(tokens) - 1) == expected_tokens[0]

    reset_calls = 0
    original_reset = cached.reset

    def reset_tracker():
        nonlocal reset_calls
        reset_calls += 1
        original_reset()

    cached.reset = reset_tracker

    cached_tokens = _generate_test_tokens(cached, tokens)
    assert reset_calls == 0
    assert cached_tokens == expected_tokens
    assert cached.n_tokens == len(tokens) + len(cached_tokens) - 1


def _assert_loaded_exact_cached_prompt_reuse_matches_fresh(
    model_path,
    *,
    is_recurrent: bool,
    is_hybrid: bool,
):
    prompt = "The quick brown fox"
    fresh = _create_test_model(model_path)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)
    expected_tokens = _generate_test_tokens(fresh, tokens)

    source = _create_test_model(model_path)
    assert source._is_recurrent is is_recurrent
    assert source._is_hybrid is is_hybrid

    source.eval(tokens)
    state = source.save_state()

    loaded = _create_test_model(model_path)
    assert loaded._is_recurrent is is_recurrent
    assert loaded._is_hybrid is is_hybrid

    _eval_alternate_same_length_prompt(
        loaded,
        tokens,
        expected_tokens[0],
    )
    loaded.load_state(state)

    assert loaded.n_tokens == len(tokens)
    assert loaded.input_ids[: loaded.n_tokens].tolist() == tokens

    loaded_tokens = _generate_test_tokens(loaded, tokens)
    assert loaded_tokens == expected_tokens
    assert loaded.n_tokens == len(tokens) + len(loaded_tokens) - 1


def _assert_ram_cache_exact_prompt_hit_matches_fresh(
    model_path,
    *,
    is_recurrent: bool,
    is_hybrid: bool,
):
    prompt = "The quick brown fox"
    fresh = _create_test_model(model_path)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)
    expected = fresh.create_completion(
        tokens,
        max_tokens=1,
        temperature=0.0,
        seed=1337,
    )

    cache = llama_cpp.LlamaRAMCache()
    writer = _create_test_model(model_path)
    writer.set_cache(cache)
    writer.create_completion(
        tokens,
        max_tokens=1,
        temperature=0.0,
        seed=1337,
    )

    cached = _create_test_model(model_path)
    assert cached._is_recurrent is is_recurrent
    assert cached._is_hybrid is is_hybrid
    cached.set_cache(cache)

    load_state_calls = 0
    original_load_state = cached.load_state

    def load_state_tracker(state):
        nonlocal load_state_calls
        load_state_calls += 1
        original_load_state(state)

    cached.load_state = load_state_tracker

    actual = cached.create_completion(
        tokens,
        max_tokens=1,
        temperature=0.0,
        seed=1337,
    )

    assert load_state_calls == 1
    assert actual["choices"][0]["text"] == expected["choices"][0]["text"]
    assert (
        actual["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    )


def _assert_shorter_prompt_prefix_reuse_matches_fresh(
    model_path,
    *,
    is_recurrent: bool,
    is_hybrid: bool,
):
    prompt = "The quick brown fox"
    history = " jumps over the lazy dog"
    fresh = _create_test_model(model_path)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)
    history_tokens = fresh.tokenize(history.encode(), add_bos=False, special=True)
    expected_tokens = _generate_test_tokens(fresh, tokens)

    cached = _create_test_model(model_path)
    assert cached._is_recurrent is is_recurrent
    assert cached._is_hybrid is is_hybrid

    cached.eval(tokens + history_tokens)
    assert cached.n_tokens > len(tokens)
    assert cached.input_ids[: len(tokens)].tolist() == tokens

    cached_tokens = _generate_test_tokens(cached, tokens)
    assert cached_tokens == expected_tokens


@pytest.mark.parametrize(
    ("model_path_fixture", "is_recurrent", "is_hybrid"), MODEL_CACHE_CASES
)
def test_exact_cached_prompt_reuse_matches_fresh(
    request,
    model_path_fixture,
    is_recurrent,
    is_hybrid,
):
    _assert_exact_cached_prompt_reuse_matches_fresh(
        request.getfixturevalue(model_path_fixture),
        is_recurrent=is_recurrent,
        is_hybrid=is_hybrid,
    )


@pytest.mark.parametrize(
    ("model_path_fixture", "is_recurrent", "is_hybrid"), RESTORED_CACHE_CASES
)
def test_loaded_exact_cached_prompt_reuse_matches_fresh(
    request,
    model_path_fixture,
    is_recurrent,
    is_hybrid,
):
    _assert_loaded_exact_cached_prompt_reuse_matches_fresh(
        request.getfixturevalue(model_path_fixture),
        is_recurrent=is_recurrent,
        is_hybrid=is_hybrid,
    )


@pytest.mark.parametrize(
    ("model_path_fixture", "is_recurrent", "is_hybrid"), RESTORED_CACHE_CASES
)
def test_ram_cache_exact_prompt_hit_matches_fresh(
    request,
    model_path_fixture,
    is_recurrent,
    is_hybrid,
):
    _assert_ram_cache_exact_prompt_hit_matches_fresh(
        request.getfixturevalue(model_path_fixture),
        is_recurrent=is_recurrent,
        is_hybrid=is_hybrid,
    )


@pytest.mark.parametrize(
    ("model_path_fixture", "is_recurrent", "is_hybrid"), MODEL_CACHE_CASES
)
def test_shorter_prompt_prefix_reuse_matches_fresh(
    request,
    model_path_fixture,
    is_recurrent,
    is_hybrid,
):
    _assert_shorter_prompt_prefix_reuse_matches_fresh(
        request.getfixturevalue(model_path_fixture),
        is_recurrent=is_recurrent,
        is_hybrid=is_hybrid,
    )


def test_real_llama_embeddings(llama_cpp_embedding_model_path):
    model = llama_cpp.Llama(
        llama_cpp_embedding_model_path,
        n_ctx=32,
        n_batch=32,
        n_ubatch=32,
        n_threads=multiprocessing.cpu_count(),
        n_threads_batch=multiprocessing.cpu_count(),
        logits_all=False,
        flash_attn=True,
        embedding=True,
        # peer copy: mean pooling asked for (1, LLAMA_POOLING_TYPE_MEAN): bge-small's GGUF declares
        # its pooling, SmolLM2's (an LLM) declares none, which gives a vector per token.
        pooling_type=1,
    )
    embedding = model.embed("Hello World")
    assert len(embedding) > 0

    prompts = ["Hello World", "A different prompt"]
    individual_embeddings = [model.embed(prompt) for prompt in prompts]
    batched_embeddings = model.embed(prompts)

    assert len(batched_embeddings) == len(prompts)
    for individual, batched in zip(individual_embeddings, batched_embeddings):
        np.testing.assert_allclose(batched, individual, rtol=1e-4, atol=1e-4)

    repeated_embeddings = model.embed(list(reversed(prompts)))
    assert len(repeated_embeddings) == len(prompts)
    assert all(len(repeated) == len(embedding) for repeated in repeated_embeddings)
