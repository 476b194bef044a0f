"""ggml_innerq/iq-qcache-math.h compiles as CUDA device code (docs/DESIGN.md section 6): every
function of the header is called from a __global__ kernel (innerq_math_check.cu), so a CUDA
kernel can use the same quantizer, accessors, query preparation and softmax state as the
scalar C path. Needs nvcc (on PATH, $CUDACXX, or CUDA's default place); skipped without it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT


def nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc",
                 "/usr/local/cuda-13.0/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


def test_header_compiles_as_device_code(tmp_path):
    exe = nvcc()
    if exe is None:
        pytest.skip("no nvcc")
    src = ROOT / "tests" / "innerq_math_check.cu"
    text = src.read_text()
    # the check must call every function the header defines
    header = (ROOT / "ggml_innerq" / "iq-qcache-math.h").read_text()
    for name in re.findall(r"static inline IQ_HD [\w ]+?\b(\w+)\(", header):
        assert f"{name}(" in text, f"{name} is not exercised by {src.name}"
    r = subprocess.run([exe, "-x", "cu", "-arch=sm_90", "-Xcompiler", "-Wall", "-I", str(ROOT / "ggml_innerq"),
                        "-c", "-o", str(tmp_path / "check.o"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "warning" not in r.stderr, r.stderr[-4000:]
