"""tools/make_shape_gguf.py: a random-weight model of a named shape loads and runs.

The shape (hyper-parameters, tensor shapes, parameter count) must be the named model's, the
tokenizer the source file's, and the weights must have the requested spread (checked by
dequantizing with gguf.quants, the oracle for block formats), so a forward pass stays finite.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import lib_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import make_shape_gguf  # noqa: E402


@pytest.mark.parametrize("wtype", ["Q4_0", "Q8_0"])
def test_smollm2_shape_loads_and_runs(tmp_path, smollm2, wtype):
    os.environ["INNERQ_LIB"] = lib_path()
    from innerq import Llama

    out = tmp_path / "shape.gguf"
    make_shape_gguf.write("smollm2-135m", out, smollm2, wtype, std=0.02, seed=1)

    r = gguf.GGUFReader(out)
    src = gguf.GGUFReader(smollm2)
    assert r.fields["tokenizer.ggml.tokens"].contents() == src.fields["tokenizer.ggml.tokens"].contents()
    assert r.fields["tokenizer.ggml.merges"].contents() == src.fields["tokenizer.ggml.merges"].contents()
    # the same tensors, of the same shapes, as the real SmolLM2 file
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert shapes == {t.name: tuple(int(x) for x in t.shape) for t in src.tensors}
    wq = next(t for t in r.tensors if t.name == "blk.3.attn_q.weight")
    x = gguf.quants.dequantize(wq.data, wq.tensor_type)
    assert abs(float(x.std()) - 0.02) < 0.002 and abs(float(x.mean())) < 0.003  # Q4_0 codes -8..7: mean -d/2

    with Llama(str(out), n_ctx=64, kv_type="f16") as llm:
        m = llm.model
        assert (m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.n_vocab) == (30, 576, 9, 3, 49152)
        # the copied vocabulary tokenizes as the source model's does
        with Llama(str(smollm2), n_ctx=64, kv_type="f16") as real:
            assert llm.tokenize("The capital of France is") == real.tokenize("The capital of France is")
        llm.eval(llm.tokenize("The capital of France is"))
        assert np.isfinite(llm.get_logits()).all()

def test_unknown_tokenizer_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make_shape_gguf.main(["llama3-8b", str(tmp_path / "x.gguf"), "--tokenizer", str(tmp_path / "missing.gguf")])
    assert "no such file" in capsys.readouterr().err
