"""Bad input from Python raises InnerQError subclasses with clear messages, never crashes, and
leaves the object usable (or cleanly closed); closed and collected objects are safe."""
from __future__ import annotations

import gc
import os
import shutil
import struct
import subprocess
import sys

import pytest

import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from innerq import (ClosedError, ContextFullError, FormatError, InnerQError, InnerQIOError,  # noqa: E402
                    InvalidArgumentError, Llama)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(head_dim=64, n_head_kv=2, n_ctx_train=128))


@pytest.fixture
def llm(tiny_path):
    with Llama(tiny_path, n_ctx=64, n_threads=1) as m:
        yield m


def still_works(llm):
    assert isinstance(llm.generate("the", max_tokens=3, temperature=0), str)


# ---- files ----

def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(InnerQIOError, match="nope.gguf") as e:
        Llama(path)
    assert isinstance(e.value, OSError) and isinstance(e.value, InnerQError)


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(InnerQError, match=str(tmp_path.name)):
        Llama(tmp_path)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all\n" * 10, b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff"])
def test_non_gguf_file(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises((FormatError, InnerQIOError)) as e:
        Llama(path)
    assert str(e.value)


def test_truncated_gguf(tmp_path, tiny_path):
    data = tiny_path.read_bytes()
    for n in (16, len(data) // 3, len(data) - 8):
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(data[:n])
        with pytest.raises((FormatError, InnerQIOError)):
            Llama(path)


def test_fifo_is_refused_without_blocking(tmp_path):
    # opening a FIFO for reading waits for a writer: the load must refuse it instead
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = "import sys; from innerq import Llama\ntry:\n    Llama(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)"
    r = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "InnerQIOError" in r.stdout and "not a regular file" in r.stdout, r.stdout + r.stderr


def test_nul_in_path_is_refused(tiny_path):
    # C would stop at the NUL and load the file before it (Python's open() refuses too)
    with pytest.raises(InvalidArgumentError, match="NUL") as e:
        Llama(str(tiny_path) + "\0junk")
    assert isinstance(e.value, ValueError)
    with pytest.raises(InvalidArgumentError, match="NUL"):
        Llama(tiny_path, kv_k="f16\0junk")


def test_absurd_block_count_is_refused_before_allocating(tmp_path, tiny_path):
    # 2^24 blocks of a 2-block file: the loader sized 45 GB of tensor structs for them
    data = bytearray(tiny_path.read_bytes())
    key = b"llama.block_count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 2)  # uint32 2
    struct.pack_into("<I", data, at + 4, 1 << 24)
    path = tmp_path / "blocks.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"block_count = 16777216 needs at least 150994946 tensors"):
        Llama(path)


# ---- context parameters ----

@pytest.mark.parametrize("window", ["kv_sink", "kv_recent"])
def test_windows_beyond_n_ctx_count_as_n_ctx(tiny_path, window):
    # a window of n_ctx already keeps every token; a larger one reserved memory for nothing
    sizes = {}
    for w in (64, 10**6):
        with Llama(tiny_path, n_ctx=64, n_threads=1, **{window: w}) as m:
            sizes[w] = innerq._ffi.lib.innerq_cache_size(m._ctx.ptr)
            still_works(m)
    assert sizes[10**6] == sizes[64]

@pytest.mark.parametrize("n_ctx", [2**31, -1, 1 << 23, 10**30])
def test_n_ctx_out_of_range(tiny_path, n_ctx):
    with pytest.raises(InvalidArgumentError, match="n_ctx"):
        Llama(tiny_path, n_ctx=n_ctx)


@pytest.mark.parametrize("kw", [{"n_batch": 0}, {"n_threads": -3}, {"n_ctx": "big"}, {"kv_group": 48},
                                {"kv_k": 3}, {"seed": "x"}])
def test_invalid_context_arguments(tiny_path, kw):
    with pytest.raises(InvalidArgumentError):
        Llama(tiny_path, **{"n_ctx": 32, **kw})


def test_unknown_cache_type(tiny_path):
    with pytest.raises(InvalidArgumentError, match="q9_9") as e:
        Llama(tiny_path, kv_type="q9_9")
    assert "f16" in str(e.value)  # the message lists the known types
    with pytest.raises(InvalidArgumentError, match="nope"):
        Llama(tiny_path, kv_k="f16", kv_v="nope")


def test_prompt_longer_than_context(llm):
    with pytest.raises(ContextFullError) as e:
        llm.generate("the " * 200, max_tokens=4)
    assert "64" in str(e.value)
    still_works(llm)
    with pytest.raises(ContextFullError):
        llm.eval(list(range(100)))
    still_works(llm)


# ---- call arguments ----

@pytest.mark.parametrize("kw", [{"temperature": "hot"}, {"top_k": 1.5}, {"top_p": None}, {"stop": 5},
                                {"stop": ["ok", 3]}, {"max_tokens": "many"}, {"seed": -5}, {"repeat_last_n": -7}])
def test_invalid_sampling_arguments(llm, kw):
    with pytest.raises(InvalidArgumentError):
        llm.generate("the", **kw)
    still_works(llm)


@pytest.mark.parametrize("call, message", [
    (lambda m: m.generate("the", stop=b"x"), "stop must be a string or a list of strings, got bytes"),
    (lambda m: m.model.is_eog(2**40), "token = 1099511627776 is out of range"),
    (lambda m: m.model.meta(5), "metadata key must be a string, got 5"),
    (lambda m: m.generate("the \ud800 end", max_tokens=2), "text is not valid Unicode: surrogates not allowed"),
    (lambda m: m.tokenize("\udcff"), "at position 0"),
    (lambda m: m.create_chat_completion([{"role": 5, "content": "hi"}]), "role must be a string, got 5"),
    (lambda m: m.create_chat_completion([{"role": "user"}]), "has no 'content'"),
    (lambda m: m.create_chat_completion([{"role": "user", "content": None}]), "has no 'content'"),
], ids=["stop-bytes", "is_eog-2**40", "meta-5", "surrogate-prompt", "surrogate-tokenize", "role-5", "no-content",
        "content-None"])
def test_misused_arguments_raise_package_errors(llm, call, message):
    with pytest.raises(InvalidArgumentError) as e:
        call(llm)
    assert message in str(e.value)
    still_works(llm)


def test_invalid_tokens(llm):
    for bad in ([-1], [llm.n_vocab()], [2**40]):
        with pytest.raises(InvalidArgumentError):
            llm.eval(bad)
    with pytest.raises(InvalidArgumentError):
        llm.eval([])
    with pytest.raises(InvalidArgumentError):
        llm.generate([5, -2])
    with pytest.raises(InvalidArgumentError):
        llm.detokenize([llm.n_vocab() + 5])
    with pytest.raises(InvalidArgumentError):
        llm.tokenize(12345)
    still_works(llm)


def test_logits_before_any_evaluation(llm):
    llm.reset()
    with pytest.raises(InvalidArgumentError, match="logits"):
        llm.logits
    llm.eval(llm.tokenize("the rain in spain"))
    with pytest.raises(InvalidArgumentError, match="logits_all"):
        llm.get_logits(-2)  # only the last row is kept without logits_all


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 5}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_invalid_messages(llm, messages):
    with pytest.raises(InvalidArgumentError):
        llm.create_chat_completion(messages, max_tokens=2)
    still_works(llm)


def test_broken_chat_template(tiny_path):
    with Llama(tiny_path, n_ctx=32, chat_template="{% for m in messages %}{{ raise_exception('no') }}{% endfor %}") as m:
        with pytest.raises(InvalidArgumentError, match="no"):
            m.create_chat_completion([{"role": "user", "content": "hi"}])
    with Llama(tiny_path, n_ctx=32, chat_template="{% if %}") as m:
        with pytest.raises(InvalidArgumentError, match="template"):
            m.chat_prompt([{"role": "user", "content": "hi"}])


# ---- lifetime ----

def test_closed_llama_raises(tiny_path):
    llm = Llama(tiny_path, n_ctx=32)
    llm.close()
    llm.close()  # twice is fine
    assert llm.closed
    for call in (lambda: llm.generate("the"), lambda: llm.tokenize("the"), lambda: llm.eval([3]),
                 lambda: llm.logits, lambda: llm.n_ctx(), lambda: llm.create_completion("x"),
                 lambda: llm.create_chat_completion([{"role": "user", "content": "x"}]), lambda: llm.reset(),
                 lambda: llm.metadata, lambda: llm.n_vocab()):
        with pytest.raises(ClosedError):
            call()
    assert "closed" in repr(llm)


def test_stream_after_close_raises(tiny_path):
    llm = Llama(tiny_path, n_ctx=64)
    stream = llm.generate("the", max_tokens=30, temperature=0, stream=True)
    llm.close()
    with pytest.raises(ClosedError):
        list(stream)


def test_superseded_stream_raises(llm):
    first = llm.generate("the", max_tokens=30, temperature=0, stream=True)
    second = llm.generate("an", max_tokens=5, temperature=0)
    with pytest.raises(InnerQError, match="superseded"):
        list(first)
    assert llm.generate("an", max_tokens=5, temperature=0) == second


def test_garbage_collection_without_close(tiny_path):
    for _ in range(3):
        llm = Llama(tiny_path, n_ctx=32)
        stream = llm.generate("the", max_tokens=5, stream=True)
        next(iter(stream), None)
        logits = llm.logits
        del llm
        gc.collect()
        assert logits.shape[0] > 0
        del stream, logits
        gc.collect()


def test_cancelled_load(tiny_path):
    with pytest.raises(InnerQError):
        Llama(tiny_path, progress=lambda f: False)

    def interrupt(fraction):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Llama(tiny_path, progress=interrupt)
    seen = []
    with Llama(tiny_path, n_ctx=32, progress=seen.append) as m:
        still_works(m)
    assert seen and seen == sorted(seen) and seen[-1] == pytest.approx(1.0)


def test_file_replaced_after_load(tmp_path, tiny_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_path, path)
    with Llama(path, n_ctx=32) as m:
        path.unlink()  # the mapping keeps the data
        still_works(m)


# ---- one validation for every face (issue 33): the C checks, called from Python ----

@pytest.mark.parametrize("kw, message", [({"kv_rot": 7}, "kv_rot = 7 is out of range"),
                                         ({"kv_layer_bits": "0:9:3"}, "kv_layer_bits")])
def test_context_arguments_the_cli_refuses_are_refused_before_loading(tmp_path, kw, message):
    """The model file does not exist: an error about it would mean it was opened first."""
    with pytest.raises(InvalidArgumentError, match=message):
        Llama(tmp_path / "absent.gguf", **kw)


@pytest.mark.parametrize("kw, message", [({"top_p": 2}, "top_p = 2 is out of range"),
                                         ({"min_p": 5}, "min_p = 5 is out of range"),
                                         ({"top_p": float("nan")}, "top_p = nan"),
                                         ({"repeat_penalty": 0}, "repeat_penalty = 0 must be > 0")])
def test_sampling_arguments_the_cli_refuses_are_refused(llm, kw, message):
    for call in (lambda: llm.generate("the", max_tokens=2, **kw),
                 lambda: llm.create_completion("the", max_tokens=2, **kw)):
        with pytest.raises(InvalidArgumentError, match=message):
            call()
    still_works(llm)


def test_kv_layer_bits_reaches_the_cache(tiny_path):
    """9f85726 took kv_layer_bits for an unknown keyword: a warning, and the types' bits."""
    with Llama(tiny_path, n_ctx=64, kv_layer_bits="0:4:3") as m:
        assert m._ctx.layer_info(0)["bits_k"] == 4 and m._ctx.layer_info(1)["bits_k"] == 3
