"""libinnerq.so exports its public API only (src/innerq.map): the internal names (gguf_*,
vocab_*, ...) bind inside the library, so a process that loaded another library with the same
names first (ggml's libggml-base.so exports its own gguf_find_tensor, with another signature)
still runs a model with innerq."""
from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_model
from conftest import BUILD, ROOT
from tiny_model import TinyConfig

LIB = BUILD / "libinnerq.so"
pytestmark = pytest.mark.skipif(not LIB.is_file() or sys.platform != "linux", reason="needs build/libinnerq.so (Linux)")

# Loads the libraries named in argv[2:] with RTLD_GLOBAL, then innerq (argv[1] is a model).
RUN = """
import ctypes, sys
for p in sys.argv[2:]:
    ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
from innerq import Llama
with Llama(sys.argv[1], n_ctx=64, n_threads=1) as m:
    print(repr(m.generate("the", max_tokens=6, temperature=0)))
"""


def exported(path) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()]


def test_only_the_public_api_is_exported():
    names = exported(LIB)
    assert names and all(n.startswith("innerq_") for n in names), [n for n in names if not n.startswith("innerq_")]
    header = (ROOT / "src" / "innerq.h").read_text()
    declared = set(re.findall(r"\b(innerq_[a-z0-9_]+)\s*\(", header))
    assert set(names) <= declared, set(names) - declared


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("exports") / "tiny.gguf",
                                       TinyConfig(head_dim=64, n_head_kv=2, n_ctx_train=128))


def run(tiny, *preload) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "INNERQ_LIB": str(LIB)}
    r = subprocess.run([sys.executable, "-c", RUN, str(tiny), *map(str, preload)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    return r.stdout


@pytest.fixture(scope="module")
def clash(tmp_path_factory):
    """A library defining every internal name of src/gguf.h and src/vocab.h as a function that
    aborts: if innerq called one of them instead of its own, the process would end."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    names = set()
    for h in ("gguf.h", "vocab.h"):
        names |= set(re.findall(r"\b((?:gguf|vocab)_[a-z0-9_]+)\s*\(", (ROOT / "src" / h).read_text()))
    d = tmp_path_factory.mktemp("clash")
    src = d / "clash.c"
    src.write_text("#include <stdlib.h>\n" + "".join(f"void {n}(void) {{ abort(); }}\n" for n in sorted(names)))
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libclash.so"), str(src)], check=True)
    return d / "libclash.so"


def test_a_library_with_the_same_internal_names_loaded_first(tiny, clash):
    assert run(tiny, clash) == run(tiny)


def test_llama_cpp_ggml_loaded_first(tiny):
    """ggml's own gguf_* (llama-cpp-python's or a system libggml-base.so), where one is found."""
    found = [p for p in (os.environ.get("GGML_BASE_LIB"), ctypes.util.find_library("ggml-base")) if p]
    try:
        import llama_cpp  # noqa: F401

        found += [str(p) for p in Path(llama_cpp.__file__).parent.rglob("libggml-base.so*")]
    except ImportError:
        pass
    if not found:
        pytest.skip("no libggml-base.so here (set GGML_BASE_LIB)")
    assert run(tiny, found[0]) == run(tiny)


def test_a_c_program_linked_against_both(tiny, clash, tmp_path):
    """examples/generate.c linked against the clashing library (first) and libinnerq.so."""
    cc = shutil.which("cc") or shutil.which("gcc")
    exe = tmp_path / "generate"
    subprocess.run([cc, "-std=c11", str(ROOT / "examples" / "generate.c"), "-o", str(exe), f"-I{ROOT / 'src'}",
                    "-Wl,--no-as-needed", str(clash), f"-L{BUILD}", "-linnerq"], check=True)
    libs = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout if shutil.which("ldd") else ""
    assert "libclash.so" in libs or not libs, libs
    env = {**os.environ, "LD_LIBRARY_PATH": f"{clash.parent}:{BUILD}"}
    r = subprocess.run([str(exe), str(tiny), "the", "6"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout.strip()
