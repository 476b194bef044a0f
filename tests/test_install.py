"""A program that embeds the library, built the two ways a C user would against `cmake --install`
output: pkg-config (innerq.pc) and find_package(innerq) (examples/CMakeLists.txt). Both builds of
examples/generate.c run a model and print the same greedy text."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import tiny_model
from conftest import BUILD, ROOT
from tiny_model import TinyConfig

CMAKE, CC, PKG = shutil.which("cmake"), shutil.which("cc") or shutil.which("gcc"), shutil.which("pkg-config")
pytestmark = pytest.mark.skipif(not (CMAKE and CC and (BUILD / "CMakeCache.txt").is_file()),
                                reason="needs cmake, a C compiler and build/")


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = tmp_path_factory.mktemp("prefix")
    subprocess.run([CMAKE, "--install", str(BUILD), "--prefix", str(p)], check=True, capture_output=True)
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("install") / "tiny.gguf",
                                       TinyConfig(head_dim=64, n_head_kv=2, n_ctx_train=128))


def libdir(prefix):
    return next(p.parent.parent for p in prefix.rglob("innerq.pc"))


def generate(exe, prefix, tiny) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": str(libdir(prefix))}
    r = subprocess.run([str(exe), str(tiny), "the", "8"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


@pytest.fixture(scope="module")
def with_pkg_config(prefix, tmp_path_factory):
    if PKG is None:
        pytest.skip("pkg-config not found")
    env = {**os.environ, "PKG_CONFIG_PATH": str(libdir(prefix) / "pkgconfig")}
    flags = subprocess.run([PKG, "--cflags", "--libs", "innerq"], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    exe = tmp_path_factory.mktemp("pc") / "generate"
    subprocess.run([CC, "-std=c11", str(ROOT / "examples" / "generate.c"), "-o", str(exe), *flags], check=True)
    return exe


def test_pkg_config_build_generates(with_pkg_config, prefix, tiny):
    assert len(generate(with_pkg_config, prefix, tiny)) > 1


def test_find_package_build_generates_the_same(with_pkg_config, prefix, tiny, tmp_path):
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([CMAKE, "-S", str(ROOT / "examples"), "-B", str(tmp_path), *gen, f"-DCMAKE_PREFIX_PATH={prefix}"],
                   check=True, capture_output=True)
    subprocess.run([CMAKE, "--build", str(tmp_path)], check=True, capture_output=True)
    assert generate(tmp_path / "generate", prefix, tiny) == generate(with_pkg_config, prefix, tiny)
