"""vocab_only models: llama.cpp's vocabulary files (GGUFs without tensors) load for the
tokenizer; a context on them is a clear error.

The file is the one llama-cpp-python's own tests use (tests/peer/data/README.md); the expected
ids are those its test_llama.py asserts for the SentencePiece Llama vocabulary."""
from __future__ import annotations

from pathlib import Path

import pytest

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:  # the library is not built
    pytest.skip(str(e), allow_module_level=True)

from innerq._ffi import ffi, lib  # noqa: E402
from innerq._native import ContextHandle, ModelHandle, check, read_sized  # noqa: E402

SPM = Path(__file__).resolve().parent / "peer" / "data" / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def spm():
    return ModelHandle.load(SPM, vocab_only=True)


def tokenize(m, text: bytes, add_bos=True, special=False):
    toks, n = ffi.new("innerq_token[]", 64), ffi.new("int32_t *")
    check(lib.innerq_tokenize(m.ptr, text, len(text), add_bos, special, toks, 64, n))
    return list(ffi.unpack(toks, n[0]))


def detokenize(m, ids, special=False):
    arr = ffi.new("innerq_token[]", ids)
    return read_sized(lambda buf, size, n: lib.innerq_detokenize(m.ptr, arr, len(ids), special, buf, size, n))


def piece(m, token):
    return read_sized(lambda buf, size, n: lib.innerq_token_to_piece(m.ptr, token, False, buf, size, n))


def test_spm_vocab_tokenizes_as_llama_cpp(spm):
    assert tokenize(spm, b"Hello World") == [1, 15043, 2787]
    assert tokenize(spm, b"Hello World", add_bos=False) == [15043, 2787]
    assert tokenize(spm, b"Hello World</s>") == [1, 15043, 2787, 829, 29879, 29958]
    assert tokenize(spm, b"Hello World</s>", special=True) == [1, 15043, 2787, 2]
    assert tokenize(spm, b"") == [1]
    assert detokenize(spm, [1, 15043, 2787]) == b"Hello World"
    # the pieces keep SentencePiece's space ("▁Hello"); llama-cpp-python's detokenize joins
    # pieces and drops the first space only after BOS, which is why its test expects
    # detokenize([15043, 2787]) != "Hello World"
    assert [piece(spm, t) for t in (15043, 2787)] == [b" Hello", b" World"]


def test_spm_vocab_model_queries(spm):
    assert lib.innerq_model_n_vocab(spm.ptr) == 32000
    assert lib.innerq_token_bos(spm.ptr) == 1
    assert lib.innerq_token_eos(spm.ptr) == 2
    assert lib.innerq_model_n_embd(spm.ptr) == 4096
    assert lib.innerq_model_n_params(spm.ptr) == 0
    assert b"vocab only" in ffi.string(lib.innerq_model_desc(spm.ptr))


def test_context_on_a_vocab_only_model_is_an_error(spm):
    with pytest.raises(innerq.UnsupportedError, match="vocab_only"):
        ContextHandle.init(spm, n_ctx=64)


def test_a_vocabulary_file_without_vocab_only_is_an_error():
    with pytest.raises(innerq.FormatError, match="tensors"):
        ModelHandle.load(SPM)


def test_vocab_only_reads_no_tensors(smollm2):
    """A full model loaded vocab_only tokenizes like the full load and holds no weights."""
    full, voc = ModelHandle.load(smollm2), ModelHandle.load(smollm2, vocab_only=True)
    text = "The capital of France is <|im_start|> Paris.".encode()
    assert tokenize(voc, text, special=True) == tokenize(full, text, special=True)
    assert lib.innerq_model_size(voc.ptr) == 0 and lib.innerq_model_size(full.ptr) > 0
