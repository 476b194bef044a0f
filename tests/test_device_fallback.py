"""n_gpu_layers on a build or a machine without a GPU: the model runs on the CPU with one warning
line on stderr, as under llama.cpp and llama-cpp-python (scripts written for them pass
n_gpu_layers=-1 everywhere; tests/llama_cpp_compat_script.py does). On a machine with a GPU
tests/test_cuda_model.py covers the GPU side."""
from __future__ import annotations

import os
import subprocess

import pytest

import tiny_model
from conftest import tool_path
from tiny_model import TinyConfig

innerq = pytest.importorskip("innerq")
try:
    from innerq import _ffi  # noqa: F401
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from innerq import InvalidArgumentError, Llama  # noqa: E402

NO_GPU = (innerq.cuda_device_count() <= 0 and not os.path.exists("/dev/nvidiactl")
          and not os.path.exists("/proc/driver/nvidia/version"))
pytestmark = pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
WARNING = "innerq: warning: n_gpu_layers = {}: "


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("ngl") / "tiny.gguf",
                                       TinyConfig(head_dim=64, n_head_kv=2, n_ctx_train=128))


@pytest.mark.parametrize("ngl", [-1, 1, 99])
def test_gpu_layers_run_on_the_cpu_with_one_warning(tiny_path, capfd, ngl):
    with Llama(tiny_path, n_ctx=64, n_threads=1) as cpu:
        want = cpu.generate("the", max_tokens=8, temperature=0)
    assert capfd.readouterr().err.count("warning") == 0
    with Llama(model_path=str(tiny_path), n_ctx=64, n_threads=1, n_gpu_layers=ngl) as m:
        got = m.generate("the", max_tokens=8, temperature=0)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "warning" in ln]
    assert got == want
    assert len(lines) == 1 and lines[0].startswith(WARNING.format(ngl)), lines
    assert lines[0].endswith("; the model runs on the CPU"), lines


def test_gpu_layers_below_minus_one_stay_an_error(tiny_path):
    with pytest.raises(InvalidArgumentError, match="n_gpu_layers = -2"):
        Llama(tiny_path, n_gpu_layers=-2)


def test_the_cli_runs_with_ngl(tiny_path):
    r = subprocess.run([tool_path("innerq-cli"), "-m", str(tiny_path), "-ngl", "99", "-p", "the", "-n", "4",
                        "--temp", "0", "-t", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("innerq: warning")] == [
        "innerq: warning: n_gpu_layers = 99: this build of innerq has no CUDA backend (build with -DINNERQ_CUDA=ON); "
        "the model runs on the CPU"]
