"""Models split over several files (llama.cpp's gguf-split: PREFIX-00001-of-0000N.gguf, the
split.no / split.count / split.tensors.count keys), written here by the gguf package's own
writer: loaded from the first file, they give the logits of the same model in one file, bit
for bit, mapped or read; the wrong file, a missing file or a foreign one is a clear error."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import tiny_model
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from innerq import Llama  # noqa: E402

CFG = TinyConfig(wtype="Q8_0", head_dim=64, n_head=4, n_head_kv=2, n_layer=3, seed=11)
N_TENSORS = 3 + 9 * CFG.n_layer  # token_embd, output_norm, output and 9 per block


def logits(path, **kw) -> np.ndarray:
    with Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, **kw) as llm:
        ids = [int(t) for t in np.random.default_rng(2).integers(3, 250, 40)]
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    whole = tiny_model.write_tiny_model(d / "whole.gguf", CFG)
    first = tiny_model.write_tiny_model(d / "m.gguf", CFG, split_max_tensors=N_TENSORS // 3 + 1)
    return whole, first


def test_the_split_files_are_what_gguf_split_writes(models):
    _, first = models
    files = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert [f.name for f in files] == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "read"])
def test_a_split_model_equals_the_whole(models, use_mmap):
    whole, first = models
    np.testing.assert_array_equal(logits(first, use_mmap=use_mmap), logits(whole))
    with Llama(str(first), n_ctx=64, n_threads=1) as a, Llama(str(whole), n_ctx=64, n_threads=1) as b:
        assert a.generate("the", max_tokens=6, temperature=0) == b.generate("the", max_tokens=6, temperature=0)


def test_a_later_file_is_refused_with_the_first_named(models):
    _, first = models
    with pytest.raises(innerq.InnerQError, match=r"file 2 of 3 of a split model: open the first"):
        Llama(str(first.with_name("m-00002-of-00003.gguf")))


def test_a_missing_or_foreign_file_is_a_clear_error(models, tmp_path):
    whole, first = models
    for f in first.parent.glob("m-*-of-*.gguf"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(innerq.InnerQError, match="m-00003-of-00003.gguf: cannot open"):
        Llama(str(tmp_path / "m-00001-of-00003.gguf"))
    shutil.copy(whole, tmp_path / "m-00003-of-00003.gguf")  # a file of no split in its place
    with pytest.raises(innerq.InnerQError, match=r"m-00003-of-00003.gguf: split.no 0 of 1 where file 3 of 3"):
        Llama(str(tmp_path / "m-00001-of-00003.gguf"))
    shutil.copy(first, tmp_path / "renamed.gguf")  # the first file under another name
    with pytest.raises(innerq.InnerQError, match="the name does not end in -00001-of-00003.gguf"):
        Llama(str(tmp_path / "renamed.gguf"))
