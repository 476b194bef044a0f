"""Shared fixtures: the built library, the real model, tiny generated models."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests"))

BUILD = Path(os.environ.get("INNERQ_BUILD", ROOT / "build"))
# The test text: Sense and Sensibility, volumes I and II (tests/data/README.md).
TEXT = ROOT / "tests" / "data" / "sense-and-sensibility.txt"


def pytest_sessionstart(session):
    """Builds the C tree into build/ (incrementally) unless INNERQ_LIB names another build."""
    if os.environ.get("INNERQ_LIB") or os.environ.get("INNERQ_NO_BUILD"):
        return
    cmake = shutil.which("cmake")
    if cmake is None:
        raise pytest.UsageError("cmake is needed to build the library under test (pip install cmake ninja)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") and not (BUILD / "Makefile").exists() else []
    steps = []
    if not (BUILD / "CMakeCache.txt").exists():
        steps.append([cmake, "-S", str(ROOT), "-B", str(BUILD), *gen, "-DCMAKE_BUILD_TYPE=Release"])
    steps.append([cmake, "--build", str(BUILD), "-j", str(os.cpu_count() or 2)])
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise pytest.UsageError(f"building the library failed: {' '.join(cmd)}\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}")


# The INNERQ_ISA levels (cpu/cpu-features.c): name -> (the feature bits of enum iq_cpu_feature
# its kernels may use, the feature the machine must have for it).
ISA_LEVELS = {"scalar": (0, 0), "avx2": (1, 1), "avx512": (15, 2), "neon": (16, 16), "dotprod": (48, 32),
              "i8mm": (112, 64)}


def isa_levels(detected: int) -> list[tuple[str, int]]:
    """(name, feature set) of each INNERQ_ISA level a machine with the features `detected` runs."""
    return [(name, bits & detected) for name, (bits, key) in ISA_LEVELS.items() if key & detected == key]


def feature_sets(detected: int) -> list[int]:
    """Every subset of the features `detected`: between them they pick every kernel row."""
    return [f for f in range(detected + 1) if f & ~detected == 0]


def lib_path() -> str:
    """The shared library under test: $INNERQ_LIB or build/libinnerq_test.so (libinnerq.so's
    objects with the internals exported, which many tests reach; tests/test_exports.py checks
    libinnerq.so itself)."""
    p = os.environ.get("INNERQ_LIB") or str(BUILD / "libinnerq_test.so")
    if not Path(p).is_file():
        pytest.skip(f"{p} not built")
    return p


def tool_path(name: str) -> str:
    """A built executable (innerq-cli, innerq-bench, ...)."""
    p = BUILD / name
    if not p.is_file():
        pytest.skip(f"{p} not built")
    return str(p)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1, pulled by the project's own tooling on first use."""
    from innerq import models

    return models.pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="module")
def Session():
    """tools/innerq_session.py's Session, on the library under test (logits through the public C API)."""
    os.environ["INNERQ_LIB"] = lib_path()
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from innerq_session import Session

    return Session
