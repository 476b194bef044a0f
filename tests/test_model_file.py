"""Model files at load (src/model.c, src/gguf.c): the fingerprint a saved state carries covers
every byte of the file, the metadata's block count is checked against the tensors, and a file
cut short while it loads is an error, not SIGBUS."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

import tiny_model
from conftest import ROOT
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
from innerq._native import ContextHandle, ModelHandle  # noqa: E402

CFG = TinyConfig(head_dim=32, n_head_kv=2, n_layer=2, seed=5)
KW = dict(n_ctx=128, n_batch=32, n_threads=1)


def flip_byte_inside(path, name: str, at: int) -> None:
    """Changes byte `at` of tensor `name`'s data (past the first 32 bytes 9f85726 hashed)."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    assert t.n_bytes > at >= 32
    with open(path, "r+b") as f:
        f.seek(t.data_offset + at)
        b = f.read(1)
        f.seek(t.data_offset + at)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_state_names_every_byte_of_its_model(tmp_path):
    """A state of a model does not load into a copy with one weight byte changed (a fine-tune
    that kept the first bytes of every tensor loaded on 9f85726), and loads into an exact copy
    elsewhere (the fingerprint is the file's content, not its place)."""
    a = tiny_model.write_tiny_model(tmp_path / "a.gguf", CFG)
    (tmp_path / "copy").mkdir()
    same = shutil.copy(a, tmp_path / "copy" / "a.gguf")
    other = shutil.copy(a, tmp_path / "b.gguf")
    flip_byte_inside(other, "blk.1.ffn_down.weight", 1000)
    ma = ModelHandle.load(a)
    ctx = ContextHandle.init(ma, **KW)
    ctx.decode([5, 6, 7, 8])
    state = ctx.save_state()
    mb, mc = ModelHandle.load(other), ModelHandle.load(same)
    with pytest.raises(innerq.StateMismatchError):
        ContextHandle.init(mb, **KW).load_state(state)
    back = ContextHandle.init(mc, **KW)
    back.load_state(state)
    np.testing.assert_array_equal(back.logits(), ctx.logits())
    fingerprint = innerq._ffi.lib.innerq_model_fingerprint
    assert fingerprint(mb.ptr) != fingerprint(ma.ptr) == fingerprint(mc.ptr) != 0


def set_block_count(path, n: int) -> None:
    """Rewrites llama.block_count (a UINT32) in place."""
    field = gguf.GGUFReader(path).fields["llama.block_count"]
    offset = field.offset + sum(p.nbytes for p in field.parts[:-1])  # key length, key, type, then the value
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.uint32(n).tobytes())
    assert int(gguf.GGUFReader(path).fields["llama.block_count"].parts[-1][0]) == n


def test_fewer_layers_in_the_metadata_than_in_the_file_is_an_error(tmp_path):
    path = tiny_model.write_tiny_model(tmp_path / "m.gguf", TinyConfig(n_layer=3, seed=2))
    set_block_count(path, 2)
    with pytest.raises(innerq.FormatError, match=r"'blk\.2\.[a-z_]+\.weight' is in block 2, but llama.block_count = 2"):
        ModelHandle.load(path)
    set_block_count(path, 4)  # more: the tensors of block 3 are missing
    with pytest.raises(innerq.FormatError, match="block_count = 4 needs at least 38 tensors"):
        ModelHandle.load(path)


TRUNCATE_WHILE_LOADING = """
import os, sys
from innerq import Llama
path = sys.argv[1]
def cut(fraction):
    # the first call past the start (9f85726: only the last one, 1.0, once everything is loaded)
    if fraction > 0 and os.path.getsize(path) > 1000:
        os.truncate(path, 1000)
try:
    llm = Llama(path, n_ctx=64, progress=cut)
    print("loaded:", llm.generate("Hello", max_tokens=4, temperature=0))
except innerq.InnerQError as e:
    print(type(e).__name__, e)
""".replace("from innerq import Llama", "import innerq; from innerq import Llama")


def test_a_model_file_cut_short_while_it_loads_is_an_error(smollm2, tmp_path):
    """The file is mapped when it is cut: reading the mapping past the new end would raise
    SIGBUS (9f85726: the process died in the first decode)."""
    path = shutil.copy(smollm2, tmp_path / "cut.gguf")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_LOADING, str(path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.startswith("FormatError") and "cut short while loading" in r.stdout, r.stdout
