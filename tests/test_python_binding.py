"""The cffi binding against the C header and the built library: the declarations come from
innerq.h, every declared function is exported by the library (nm is the independent witness)
and the structs have the header's fields; the pure-Python parts import without the library."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "src" / "innerq.h"


@pytest.fixture(scope="module")
def ffi_mod():
    try:
        from innerq import _ffi
    except ImportError as e:
        pytest.skip(str(e))
    return _ffi


def test_every_header_function_is_bound(ffi_mod):
    names = ffi_mod.function_names(HEADER.read_text())
    assert len(names) > 50 and "innerq_decode" in names and "innerq_kv_bytes_per_token" in names
    for name in names:
        assert callable(getattr(ffi_mod.lib, name)), name


def test_library_exports_every_declared_function(ffi_mod):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not installed")
    out = subprocess.run([nm, "-D", "--defined-only", ffi_mod.library_path()], capture_output=True, text=True,
                         check=True).stdout
    exported = {m.group(1) for m in re.finditer(r"\sT\s+(innerq_\w+)$", out, flags=re.M)}
    declared = set(ffi_mod.function_names(HEADER.read_text()))
    assert declared <= exported, declared - exported


def test_structs_match_the_header(ffi_mod):
    # Field lists as the header spells them (parsed here with a regex, not with cffi).
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    for struct in ("innerq_model_params", "innerq_context_params", "innerq_sampler_params"):
        body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, flags=re.S).group(1)
        fields = re.findall(r"(\w+)\s*(?:\)\s*\([^)]*\))?\s*;", body)
        assert [f for f, _ in ffi_mod.ffi.typeof(struct).fields] == fields


def test_models_and_paths_do_not_load_the_library():
    code = ("import sys, innerq; from innerq import models; innerq.cli_path; "
            "assert 'innerq._ffi' not in sys.modules, sorted(sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "INNERQ_LIB": "/nonexistent/libinnerq.so"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_innerq_lib_is_honoured(ffi_mod, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "INNERQ_LIB": str(tmp_path / "missing.so")}
    r = subprocess.run([sys.executable, "-c", "import innerq; innerq.Llama"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "missing.so" in r.stderr


def test_versions(ffi_mod):
    import innerq

    assert innerq.version() == innerq.__version__
    assert innerq.cpu_isa() in ("scalar", "avx2", "avx512", "neon", "dotprod", "i8mm")
    assert "f16" in innerq.kv_types()
